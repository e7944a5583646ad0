"""The GPU and NPU examples (examples/verl/*.sh) compose with verl's config and build hdp's configs.

Each script's ``main_ppo`` overrides are read from the file (environment defaults substituted), composed
with verl 0.9.1's ``ppo_trainer`` through Hydra, and turned into verl's actor and ref dataclasses — the
step where every combination hdp cannot run (all-gather CP with ``group_shape=any``, fused kernels,
CP > 1, ...) raises naming the verl key.  Also checked: the layout
docs/verl.md names (PP and EP), that actor and ref build the model through ``vanilla_mbridge`` (the path the CPU
tests run), and that each combination the scripts avoid is indeed rejected.  Nothing here
runs a model: the scripts are "not run on hardware".
"""

from __future__ import annotations

import os

import pytest

from helpers.verl_examples import EXAMPLES, _overrides

pytest.importorskip("verl")

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.errors import InstantiationException  # noqa: E402
from omegaconf import open_dict  # noqa: E402

import verl.trainer.config as verl_trainer_config  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402

from hdp.integrations.verl import plugin  # noqa: E402,F401  (registers, as `import verl` would)


def _configs(overrides: list[str]):
    with initialize_config_dir(config_dir=os.path.dirname(verl_trainer_config.__file__), version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    ref = cfg.actor_rollout_ref.ref.copy()
    with open_dict(ref):  # as ActorRolloutRefWorker.init_model builds the ref's dataclass
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
    return cfg, actor, omega_conf_to_dataclass(ref)


@pytest.mark.parametrize("name, pp, ep, zero_memory, algo", [
    ("qwen3_moe_grpo_gpu.sh", 8, 8, "level1", "ring"),
    ("qwen3_moe_grpo_npu.sh", 4, 16, "level0", "allgather"),
])
def test_example_composes_and_names_its_layout(name, pp, ep, zero_memory, algo):
    overrides = _overrides(EXAMPLES / name)
    cfg, actor, ref = _configs(overrides)
    eng = actor.engine
    assert (eng.tensor_model_parallel_size, eng.pipeline_model_parallel_size, eng.expert_model_parallel_size) == (1, pp, ep)
    assert eng.hdp.zero_memory.value == zero_memory and eng.hdp.cp_algorithm.value == algo
    assert ref.engine.pipeline_model_parallel_size == pp and ref.engine.expert_model_parallel_size == ep
    # the model is built by mbridge (the path the CPU tests run), not verl's default Megatron-Bridge
    assert eng.vanilla_mbridge is True and ref.engine.vanilla_mbridge is True
    assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 64
    # grouped-GEMM experts (what mbridge builds on GPUs) together with zero-memory
    assert eng.override_transformer_config["moe_grouped_gemm"] is True
    if algo == "allgather":
        bad = [o.replace("group_shape=pow2", "group_shape=any") for o in overrides]
        with pytest.raises((ValueError, InstantiationException), match=r"hdp\.cp_algorithm=allgather with .*group_shape=any"):
            _configs(bad)
