"""Loaded by ``import verl`` in every process of a CPU ``main_ppo`` test run (``VERL_USE_EXTERNAL_MODULES``).

verl imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` inside ``verl/__init__`` (driver,
TaskRunner, workers, servers alike), so this is where the CPU platform, the Megatron/mbridge CPU
shims and the ``hf_cpu`` test rollout get registered in each of them, and, with ``HDP_VERL_STOCK_MEGATRON=1`` (the
differential ``main_ppo`` tests), verl's stock Megatron engine for the CPU platform
(``hdp.integrations.verl.scaffolding.stock_megatron``).  Not on the engine's runtime path.
"""

import os

from hdp.integrations.verl.scaffolding import install

install()
# registers itself when its import completes (a Ray actor of HFServer imports it first, then verl,
# which imports this module while hf_rollout is still half-initialised)
import hdp.integrations.verl.scaffolding.hf_rollout  # noqa: E402,F401

if os.environ.get("HDP_VERL_STOCK_MEGATRON") == "1":
    from hdp.integrations.verl.scaffolding import stock_megatron

    stock_megatron.install()
