"""Loaded by ``import verl`` in every process of a CPU ``main_ppo`` run on verl's *stock* Megatron engine (the
conformance tests: ``VERL_USE_EXTERNAL_MODULES``): what :mod:`~hdp.integrations.verl.scaffolding.autoload` loads,
and verl's stock Megatron engines registered for the CPU platform
(:mod:`~hdp.integrations.verl.scaffolding.stock_megatron`).  Not on any runtime path."""

import hdp.integrations.verl.scaffolding.autoload  # noqa: F401  (the CPU platform, shims, the hf_cpu rollout)
from hdp.integrations.verl.scaffolding import stock_megatron

stock_megatron.install()
