"""Definitions more than one test module needs (a test module never imports another), moved out of
test_verl_recipe.py; used by tests/distributed/verl/test_verl_recipe_dist.py,
tests/slow/verl/test_verl_recipe_slow.py, tests/unit/verl/test_verl_recipe.py."""

from __future__ import annotations

import os

from helpers.dist_helper import run_distributed  # noqa: E402

BUDGET = 64
OTC = "+actor_rollout_ref.actor.megatron.override_transformer_config"
FUSION_FLAGS = ("apply_rope_fusion", "bias_activation_fusion", "use_fused_rotary_pos_emb", "use_fused_swiglu",
                "use_fused_rmsnorm")


def recipe_overrides(*, budget: int = BUDGET, pp: int = 2, ep: int = 2, zero_memory: str = "level1") -> list[str]:
    """The recipe's verl overrides for a tiny model on CPU (the examples' keys at this scale)."""
    out = [
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.use_fused_kernels=True",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={budget}",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
        f"actor_rollout_ref.actor.hdp.zero_memory={zero_memory}",
    ]
    for role in ("actor", "ref"):
        out += [f"actor_rollout_ref.{role}.megatron.{k}" for k in (
            "tensor_model_parallel_size=1", f"pipeline_model_parallel_size={pp}", f"expert_model_parallel_size={ep}",
            "expert_tensor_parallel_size=1", "use_distributed_optimizer=True")]
    out += [f"{OTC}.moe_grouped_gemm=True", *(f"{OTC}.{flag}=True" for flag in FUSION_FLAGS)]
    return out


# ---- dist: verl's worker with the recipe's flags (PP 2 x EP 2, 4 ranks) ------------------------------------------


class _StandIn:
    """A CPU stand-in of a fused kernel (hdp.kernels.fusions): the plain form by other ops, calls counted."""

    def __init__(self, fusion) -> None:
        from hdp.kernels import fusions

        self.calls = 0
        self.rotary = fusion is fusions.Fusion.ROTARY
        self.kernel = fusions.FusedKernel(fusion, f"test stand-in ({fusion.value})", self)

    def __call__(self, *args):
        import torch
        import torch.nn.functional as F

        self.calls += 1
        if self.rotary:
            x, cos, sin = args
            half = x.shape[-1] // 2
            c, s = cos[..., :half], sin[..., :half]
            return torch.cat([x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s], dim=-1)
        a, b = args[0].chunk(2, dim=-1)
        return F.silu(a) * b


def _recipe_worker(rank: int, world: int, tmp: str, pp: int) -> dict:
    import logging

    from hdp.integrations.verl.scaffolding import install
    from hdp.integrations.verl.scaffolding.worker import actor_worker, compose, environment_for_rank

    environment_for_rank(rank, world)
    install()
    import torch
    import torch.distributed as dist

    from helpers.verl_worker_path import ENTROPY_COEFF, LENGTHS, _hf_reference
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.metric.utils import reduce_metrics as verl_reduce_metrics
    from verl.workers.utils.padding import no_padding_2_padding

    from hdp.integrations.verl.engine import HdpMegatronEngine
    from hdp.integrations.verl.scaffolding import batches as B
    from hdp.integrations.verl.scaffolding.tiny import VOCAB, build_tiny
    from hdp.kernels import fusions
    from hdp.moe import ZeroMemoryMoELayer
    from hdp.moe.zero_memory import ExpertKind

    logging.getLogger("verl").setLevel(logging.ERROR)
    lines: list[str] = []

    class _Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("hdp.integrations.verl.engine").addHandler(_Lines(level=logging.WARNING))
    rotary, swiglu = _StandIn(fusions.Fusion.ROTARY), _StandIn(fusions.Fusion.SWIGLU)
    fusions.register(rotary.kernel, "cpu")
    fusions.register(swiglu.kernel, "cpu")
    model_path = os.path.join(tmp, "model")
    if rank == 0:
        build_tiny(model_path, moe=True, layers=2)
    dist.barrier(group=dist.group.WORLD)
    cfg = compose(model_path, budget=BUDGET, records=None, overrides=[
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.1",
        f"actor_rollout_ref.actor.entropy_coeff={ENTROPY_COEFF}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={len(LENGTHS)}",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo",
        "actor_rollout_ref.actor.hdp.auto_calibrate=false",
        *recipe_overrides(pp=pp),
    ])
    ref = actor_worker(cfg, role="ref")
    act = actor_worker(cfg, role="actor")
    for engine in (ref.ref.engine, act.actor.engine):
        assert type(engine) is HdpMegatronEngine, type(engine)
        assert engine.fusions.rope and engine.fusions.swiglu, engine.fusions
        tf = engine.tf_config
        # hdp took its flags and MindSpeed's keys out of what Megatron builds; Megatron keeps its own
        assert not tf.apply_rope_fusion and tf.bias_activation_fusion and tf.moe_grouped_gemm
        assert not any(hasattr(tf, k) for k in ("use_fused_rotary_pos_emb", "use_fused_swiglu", "use_fused_rmsnorm"))
        assert tf.expert_tensor_parallel_size == 1 and engine.domain.layout.pp_size == pp and engine.domain.size == 2
        chunk = engine.module[0]
        attn = [m for m in chunk.modules() if type(m).__name__ == "HdpCoreAttention"]
        zm = [m for m in chunk.modules() if isinstance(m, ZeroMemoryMoELayer)]
        assert len(attn) == 2 // pp and all(m.rope_fused for m in attn)  # this stage's layers
        assert len(zm) == 2 // pp and all(m.fused_swiglu and m.zero_memory_level.value == "level1" for m in zm)
        assert all(ExpertKind.of(m.experts) is ExpertKind.TE_GROUPED for m in zm)
    engine = act.actor.engine
    assert engine.core.fused_logprobs is True  # use_fused_kernels: hdp's fused log-prob path
    opts = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    assert all(type(o).__name__ == "DistributedOptimizer" for o in opts), [type(o).__name__ for o in opts]
    if rank == 0:  # each flag's line (once per role, on the job's first rank), naming what runs here and the device path
        for flag in FUSION_FLAGS:
            for role in ("actor", "ref"):
                key = f"actor_rollout_ref.{role}.megatron.override_transformer_config"
                found = [line for line in lines if line.startswith(f"hdp engine: {key}.{flag}=True: ")]
                assert len(found) == 1 and "device path: " in found[0], (flag, role, lines)
        assert any("use_fused_rmsnorm=True" in line and "a no-op here: MindSpeed is not installed" in line
                   and "npu_rms_norm" in line for line in lines), lines
        assert any("apply_rope_fusion=True" in line and "runs test stand-in (rotary)" in line for line in lines), lines
    else:
        assert not lines, lines

    flags = [None] * world
    dist.all_gather_object(flags, bool(engine.is_mp_src_rank_with_outputs()), group=dist.group.WORLD)
    src = flags.index(True)
    samples = B.random_samples(LENGTHS, VOCAB, seed=1)
    padded = B.padded_batch(samples, pad_id=0)
    probe = B.ref_batch(padded)
    ref_out = ref.compute_ref_log_prob(B.ref_batch(padded))
    old_out = act.compute_log_prob(B.old_logp_batch(padded))
    objs = [None, None]
    if rank == src:
        objs = [no_padding_2_padding(tu.get(x, "log_probs"), probe).float() for x in (ref_out, old_out)]
    dist.broadcast_object_list(objs, src=src, group=dist.group.WORLD)
    ref_lp, old_lp = objs
    adv = torch.randn(padded["responses"].shape, generator=torch.Generator().manual_seed(3)) * padded["response_mask"]
    extra = {"old_log_probs": old_lp, "advantages": adv, "ref_log_prob": ref_lp}
    out = act.update_actor(B.update_batch(padded, extra, mini_batch_size=len(LENGTHS), calculate_entropy=True))
    calls = {"rotary": rotary.calls, "swiglu": swiglu.calls}
    if rank != src:
        return {"calls": calls}
    actor_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    hf_logp, hf_ent, hf_loss, hf_norm = _hf_reference(model_path, samples, padded, extra, actor_cfg)
    diffs = {"logp": 0.0, "entropy": 0.0, "ref_logp": 0.0}
    for i, (a, e, b, c, h) in enumerate(zip(tu.get(old_out, "log_probs").unbind(), tu.get(old_out, "entropy").unbind(),
                                            tu.get(ref_out, "log_probs").unbind(), hf_logp, hf_ent)):
        for name, got, want in (("logp", a, c), ("entropy", e, h), ("ref_logp", b, c)):
            diffs[name] = max(diffs[name], float((got[:-1].float() - want[:-1]).abs().max()))
    m = verl_reduce_metrics(tu.get(out, "metrics"))
    assert m["hdp/rounds"] > 1, m["hdp/rounds"]
    return {"calls": calls, "diffs": diffs, "loss": (m["loss"], hf_loss), "grad_norm": (m["grad_norm"], hf_norm)}


def _check_recipe_worker(pp: int, tmp_path) -> None:
    res = run_distributed(_recipe_worker, 2 * pp, str(tmp_path), pp, timeout=600)
    for r in res:  # every stage rotates q/k and runs zero-memory experts
        assert r["calls"]["rotary"] > 0 and r["calls"]["swiglu"] > 0, r["calls"]
    (src,) = [r for r in res if "diffs" in r]
    print(f"recipe worker (PP {pp} x EP 2) vs HF: max |diff| {src['diffs']}, loss {src['loss']}, grad norm {src['grad_norm']}")
    assert all(d <= 2e-5 for d in src["diffs"].values()), src["diffs"]
    loss, hf_loss = src["loss"]
    assert abs(loss - hf_loss) <= 1e-5 * max(1.0, abs(hf_loss)), src["loss"]
    norm, hf_norm = src["grad_norm"]
    assert abs(norm - hf_norm) <= 1e-4 * hf_norm, src["grad_norm"]
