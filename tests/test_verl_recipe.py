"""The recipe's configuration as a test: the verl overrides of the Ascend Qwen3-235B RL recipe (docs/design.md, "The
workload we were built from"; each flag's handling in docs/verl.md, "The recipe's flags") on a tiny Qwen3-MoE built
the way verl builds it (vanilla mbridge, grouped-GEMM experts), on CPU ranks.

The flags (:func:`recipe_overrides`): MoE zero-memory with grouped-GEMM experts (``moe_grouped_gemm``,
``hdp.zero_memory``), fused log-probs (``model.use_fused_kernels``), Megatron's distributed optimizer for actor and
reference, ``expert_tensor_parallel_size=1``, the fusion flags of RMSNorm / SwiGLU / RoPE (Megatron's
``apply_rope_fusion`` / ``bias_activation_fusion`` and MindSpeed's ``use_fused_rotary_pos_emb`` / ``use_fused_swiglu``
/ ``use_fused_rmsnorm``, as the NPU example passes them), ``use_remove_padding``, dynamic batch sizes and the token
budgets (``ppo_max_token_len_per_gpu``, ``log_prob_max_token_len_per_gpu``); layout PP 2 x EP 2 (4 ranks, a domain
of 2 per stage).

* fast: every flag of the recipe and of both example scripts is classified (honoured by hdp, by Megatron as verl
  passes it, or a documented no-op where its device kernel does not exist); Megatron-LM's names are refused;
* dist: verl's ``ActorRolloutRefWorker`` (EP 2 x a domain of 2 on 2 ranks; slow: PP 2 x EP 2 on 4) builds actor
  and reference with the recipe's flags and the NPU example's MindSpeed-only keys (before: ``TransformerConfig``
  refused them, and ``apply_rope_fusion`` without TransformerEngine), and runs the reference and old log-probs and
  an update; CPU stand-ins of the fused RoPE and SwiGLU kernels are registered and must be called by hdp's RoPE
  and the zero-memory experts; everything equals the HF model (fp32; tolerances of tests/test_verl_worker_path.py:
  log-probs and entropies 2e-5 absolute, loss 1e-5 relative, grad norm 1e-4 relative);
* slow: ``main_ppo`` with ``model_engine=hdp``, two steps, equal to stock verl's Megatron engine running the flags
  stock runs on CPU.

The fused kernels of NPUs and GPUs are not run on hardware here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")

from dist_helper import run_distributed  # noqa: E402

BUDGET = 64
OTC = "+actor_rollout_ref.actor.megatron.override_transformer_config"
FUSION_FLAGS = ("apply_rope_fusion", "bias_activation_fusion", "use_fused_rotary_pos_emb", "use_fused_swiglu",
                "use_fused_rmsnorm")
"""The recipe's fusion flags: Megatron's two, then MindSpeed's three (the NPU example's keys)."""


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


# ---- fast: every flag classified ---------------------------------------------------------------------------------


def _override_keys(overrides: list[str]) -> dict[str, str]:
    return {m.group(1): m.group(2) for o in overrides
            if (m := re.match(r"\+?actor_rollout_ref\.actor\.megatron\.override_transformer_config\.(\w+)=(.*)", o))}


def test_every_recipe_and_example_override_is_a_megatron_field_or_a_classified_flag() -> None:
    """Each ``override_transformer_config`` key of the recipe and of both example scripts is a field of megatron-core's
    ``TransformerConfig`` (verl hands it to Megatron) or a fusion flag of ``hdp.integrations.verl.fusions.FLAGS``;
    the recipe's fusion flags resolve to hdp's fused RoPE and SwiGLU, with MindSpeed's keys out of Megatron's
    config where MindSpeed is absent and kept for it where it runs."""
    from test_verl_examples import EXAMPLES, _overrides

    from hdp.integrations.verl.fusions import FLAGS, Handling, resolve
    from hdp.megatron_compat import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    sources = {"recipe": recipe_overrides(), **{p.name: _overrides(p) for p in sorted(EXAMPLES.glob("*.sh"))}}
    for name, overrides in sources.items():
        keys = _override_keys(overrides)
        unknown = sorted(k for k in keys if k not in fields and k not in FLAGS)
        assert not unknown, f"{name}: override keys neither Megatron's nor classified: {unknown}"
        for k in keys:
            if k in FLAGS:
                assert FLAGS[k].mindspeed == (k not in fields), k  # MindSpeed's keys are exactly the non-fields
    # the NPU example's MindSpeed-only keys are among the flags the worker test builds verl's worker with
    npu = _override_keys(sources["qwen3_moe_grpo_npu.sh"])
    mindspeed_keys = {k for k in npu if k not in fields}
    assert mindspeed_keys and mindspeed_keys <= set(FUSION_FLAGS), mindspeed_keys
    keys = {k: v == "True" for k, v in _override_keys(recipe_overrides()).items()}
    assert set(FUSION_FLAGS) <= set(keys) and all(keys[f] for f in FUSION_FLAGS)
    here = resolve(keys, mindspeed=False, key="k")
    assert here.rope and here.swiglu and here.flags == FUSION_FLAGS
    assert set(here.megatron_overrides) == {"moe_grouped_gemm", "bias_activation_fusion"}
    assert here.dropped == ("use_fused_rmsnorm",)
    on_npu = resolve(keys, mindspeed=True, key="k")
    assert set(on_npu.megatron_overrides) == set(keys) - {"apply_rope_fusion"} and on_npu.dropped == ()
    assert {k for k, f in FLAGS.items() if f.handling is Handling.MEGATRON} == {"use_fused_rmsnorm"}
    # each flag names the kernel a device runs for it
    assert all("npu" in f.device_path for f in FLAGS.values())


@pytest.mark.parametrize("name, field", [("bias_swiglu_fusion", "bias_activation_fusion"),
                                         ("bias_gelu_fusion", "bias_activation_fusion")])
def test_megatron_lm_names_are_refused_naming_the_field(name: str, field: str) -> None:
    from hdp.integrations.verl.fusions import resolve

    key = "actor_rollout_ref.actor.megatron.override_transformer_config"
    with pytest.raises(ValueError, match=rf"{key}\.{name}=True: .*set {key}\.{field} instead"):
        resolve({name: True}, mindspeed=False, key=key)


def test_examples_run_grouped_gemm_experts_with_zero_memory() -> None:
    """Both examples: grouped-GEMM experts with zero-memory, expert TP 1, the fusion flags of their device."""
    from test_verl_examples import EXAMPLES, _overrides

    for path in sorted(EXAMPLES.glob("*.sh")):
        overrides = _overrides(path)
        keys = _override_keys(overrides)
        assert keys.get("moe_grouped_gemm") == "True", path.name
        assert any(re.match(r"actor_rollout_ref\.actor\.hdp\.zero_memory=level[01]$", o) for o in overrides), path.name
        assert "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1" in overrides, path.name
        assert "actor_rollout_ref.model.use_fused_kernels=True" in overrides, path.name
        assert keys.get("bias_activation_fusion") == "True", path.name
        fused = ("use_fused_rotary_pos_emb", "use_fused_swiglu", "use_fused_rmsnorm") if "npu" in path.name \
            else ("apply_rope_fusion",)
        assert all(keys.get(k) == "True" for k in fused), (path.name, keys)


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

    from test_verl_worker_path import ENTROPY_COEFF, LENGTHS, _hf_reference
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


def test_recipe_flags_through_verls_worker_equal_hf_and_take_the_fused_kernels(tmp_path) -> None:
    """The recipe's flags (and the NPU example's MindSpeed keys) through verl's worker on EP 2 x a domain of 2
    (2 ranks): built, the fused-kernel stand-ins called by hdp's RoPE and the zero-memory experts on every rank,
    log-probs, entropies, the reference's log-probs, loss and grad norm equal to HF's."""
    _check_recipe_worker(1, tmp_path)


@pytest.mark.slow
def test_recipe_flags_under_pp2_through_verls_worker_equal_hf(tmp_path) -> None:
    """As above on PP 2 x EP 2 (4 ranks): every stage rotates q/k and runs zero-memory experts."""
    _check_recipe_worker(2, tmp_path)


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


# ---- slow: main_ppo, two steps, hdp against stock verl's Megatron engine (PP 2 x EP 2, 4 ranks) -----------------

PPO_STEPS = 2
COMPARED = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/grad_norm", "actor/entropy",
            "actor/ppo_kl", "actor/pg_clipfrac",
            "critic/score/mean", "critic/advantages/mean", "response_length/mean", "prompt_length/mean")
"""verl's own step metrics both engines report: the update (losses, grad norm, entropy), the rollouts and rewards."""


def _main_ppo_overrides(engine: str) -> list[str]:
    """The recipe's flags at the demo's scale for ``engine``: stock verl gets the ones its Megatron engine runs on CPU
    (grouped-GEMM experts, the distributed optimizer, expert TP 1, Megatron's fused SwiGLU, packing, dynamic batch
    sizes and the token budgets); hdp gets all of them (plus zero-memory, fused log-probs, the fused RoPE and
    MindSpeed's keys, which stock cannot run here: TransformerEngine, verl's triton fused forward, MindSpeed)."""
    hdp_only = ("use_fused_kernels", "hdp.zero_memory", "apply_rope_fusion", "use_fused_rotary_pos_emb",
                "use_fused_swiglu", "use_fused_rmsnorm")
    common = [o for o in recipe_overrides(budget=256) if not any(k in o for k in hdp_only)]
    common += [
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.optim.lr=1e-2",  # large: step 2's rollouts come from visibly updated weights
        "actor_rollout_ref.rollout.calculate_log_probs=True",
    ]
    if engine == "megatron":
        return common
    return [*common, *(o for o in recipe_overrides(budget=256) if o not in common),
            "actor_rollout_ref.actor.hdp.max_tokens_per_rank=24",  # hdp's budget: long samples get a CP group
            "actor_rollout_ref.actor.hdp.skip_old_log_prob=false",  # stock runs the pass: so does hdp
            "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo"]


def _steps(root: Path, engine: str) -> list[dict[str, float]]:
    """``main_ppo`` (``hdp demo --verl``'s run: 4 prompts x 2 samples per step, the ``hf_cpu`` rollout) of the tiny
    Qwen3-MoE on 4 CPU ranks with ``engine``; each step's metrics."""
    from test_verl_main_ppo import _step_metrics

    from hdp.integrations.verl.demo import run

    tail: list[str] = []
    code, lines = run(root, steps=PPO_STEPS, ranks=4, moe=True, engine=engine, overrides=_main_ppo_overrides(engine),
                      timeout=1500, tail=tail)
    assert code == 0 and len(lines) == PPO_STEPS, (engine, code, "\n".join(tail[-80:]))
    return [_step_metrics(line) for line in lines]


@pytest.mark.slow
def test_main_ppo_two_steps_with_the_recipe_flags_equal_stock_megatron(tmp_path) -> None:
    """``python -m verl.trainer.main_ppo``, GRPO, two steps of the tiny Qwen3-MoE on PP 2 x EP 2 (4 CPU ranks): the
    hdp engine with every recipe flag (``model_engine=hdp``) and stock verl's Megatron engine with the ones it runs
    on CPU (``model_engine=megatron``, `hdp.integrations.verl.scaffolding.stock_megatron`) report the same update
    and rollout metrics at both steps (step 2's rollouts come from each engine's step-1 weights, synced to the
    rollout).  Tolerance: 1e-4 relative plus 1e-6 absolute (fp32; the engines sum in different orders: packed CP
    chunks, DP 2 micro-batches, grouped GEMMs inside or outside zero-memory)."""
    pytest.importorskip("hdp.integrations.verl.scaffolding.stock_megatron",
                        reason="needs verl's stock Megatron engine on CPU: hdp.integrations.verl.scaffolding.stock_megatron, "
                               "the conformance suite's scaffolding, is not in this tree")
    stock = _steps(tmp_path / "stock", "megatron")
    hdp = _steps(tmp_path / "hdp", "hdp")
    worst: dict[str, float] = {}
    for step, (h, s) in enumerate(zip(hdp, stock), start=1):
        assert h["actor/hdp/rounds"] >= 1 and "actor/hdp/rounds" not in s  # each engine is the one asked for
        for key in COMPARED:
            assert key in h and key in s, (step, key, sorted(h), sorted(s))
            diff = abs(h[key] - s[key])
            worst[key] = max(worst.get(key, 0.0), diff)
            assert diff <= 1e-4 * abs(s[key]) + 1e-6, (step, key, h[key], s[key])
    assert any(abs(m["actor/grad_norm"]) > 0 for m in stock), "a step must train (non-zero advantages)"
    print("main_ppo hdp vs stock, max |diff| over both steps: " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
