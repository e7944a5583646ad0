"""What the tests' fork server imports besides torch and Megatron-core when verl is installed: verl, its
engines and workers, transformers and mbridge (~3 s of imports per rank otherwise, on every rank of every
verl test).  verl picks its platform when its modules are imported, so the server selects the scaffolding's CPU
platform first (``VERL_PLATFORM=cpu``, as :func:`hdp.integrations.verl.scaffolding.install` does in each
worker); otherwise imports only: no thread, device, process group or patch (each worker applies the
scaffolding itself)."""

from __future__ import annotations

import importlib
import os

os.environ["VERL_PLATFORM"] = "cpu"

from hdp.trainer.launch import quiet_third_party_warnings

quiet_third_party_warnings()

for _name in ("verl", "hdp.integrations.verl.scaffolding.platform", "verl.workers.engine", "verl.workers.engine_workers", "transformers", "mbridge",
              "hdp.integrations.verl.engine"):
    try:
        importlib.import_module(_name)
    except ImportError:  # the verl extra is absent: a worker imports what it needs itself
        pass
