"""What `hdp.trainer.launch`'s fork server imports once, so that workers forked from it start at once.

Imports only (no thread pool, device, or process group is created): torch, torch.distributed and,
where installed, Megatron-core through `hdp.megatron_compat`, with the known third-party warnings
silenced (`hdp.trainer.launch.quiet_third_party_warnings`).  A module that is not installed is
skipped: a worker imports what it needs itself, as a spawned process would.
"""

from __future__ import annotations

import importlib

from hdp.trainer.launch import quiet_third_party_warnings

quiet_third_party_warnings()

for _name in ("torch.distributed", "hdp.trainer.engine"):  # the engine imports Megatron-core (hdp.megatron_compat)
    try:
        importlib.import_module(_name)
    except ImportError:  # optional: Megatron-core may be absent
        pass
