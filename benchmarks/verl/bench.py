"""``python -m benchmarks verl`` (this project's CI; outside the wheel): tokens/s of hdp's verl engine against verl's stock scheduling (static CP + dynamic bsz), and the verl door against the library door.

Both paths run side by side in one run, alternating step by step, through **the same step**
(:meth:`HdpMegatronEngine.train_batch`: agreement, rounds, reduce, Megatron's distributed-optimizer
step, calibration, collect) on the same tiny Megatron GPT (:mod:`hdp.trainer.model`, fp32, CPU,
gloo), the same weights and optimizer and the same verl update batch (the TensorDict verl's
trainer sends: ``left_right_2_no_padding`` of a padded batch), with verl's real ``ppo_loss``.  They
differ only in the policy the engine's planner (`hdp.core.planning.DomainPlanner`) runs:

* **hdp**: the ``hdp`` policy;
* **baseline**: verl's stock Megatron scheduling as a planner policy (:data:`BASELINE`): ``verl-kk``
  with ``static_cp_size`` = N — every micro-batch one CP group of all N ranks, the micro-batches
  verl's dynamic batch size (Karmarkar–Karp on verl's workload, the fewest within the token
  budget).  verl 0.9.1's own ``MegatronEngine`` cannot run here: Megatron's CP exists only in
  TransformerEngine's attention (``DotProductAttention`` asserts ``context_parallel_size == 1`` and
  refuses the packed sequences verl's no-padding forward passes), and TransformerEngine does not
  install on CPU.  ``verl_micro_batches`` reports how many micro-batches verl's own
  ``prepare_micro_batches`` cuts the batch into, beside the rounds the baseline ran.

The JSON reports the plans that ran — from each step's own metrics (``hdp/plan_id``, ``hdp/rounds``,
``hdp/cp_degree_hist/*``, tokens per rank) — and ``plans_differ``; the result fails (``passed``
false, the command exits 1) when the two paths ran the same plan, or when their gradients on the
same batch differ (``grad_match``: after DDP's all-reduce, ``rtol = 1e-4``, ``atol = 1e-6``
relative to the largest entry).  ``phases``: each path's median ``hdp/time/*`` (`hdp.core.phases`).

``doors``: the library door (`hdp.trainer.engine.HdpEngine.train_step` with :func:`library_ppo_loss`,
verl's policy loss written as a library loss) and the verl door (``train_batch`` with verl's
``ppo_loss``) on **one** model and optimizer (the verl engine wraps the library engine's chunks)
and the same plan (``same_plan``, from every door's ``hdp/plan_id``; ``loss_match``: their losses on
the same weights), each door first in turn, ``--doors-steps`` steps per leg (default 20: the doors
differ by a few percent, and one step's ratio to the library step beside it spreads by about ±15% on a
shared 2-core VM); ``verl_over_library`` is the ratio of their median steps
(wall clock, the slowest rank), ``verl_over_library_cpu`` of their CPU seconds (all ranks: what other
work on a shared machine distorts least), ``verl_over_library_paired`` / ``_cpu_paired`` the median
over steps of each step's ratio to the library's step beside it (what drift during the run moves
least), ``verl_over_library_paired_ci95`` a 95% bootstrap interval of it (`median_ci95`);
``verl_minus_library_ms_per_round`` (wall) and ``verl_minus_library_cpu_ms_per_round_rank`` (CPU, per
rank) put the gap per round of the plan: verl's loss API (a TensorDict sub-batch, nested
tensors and verl's loss on whole samples, once per group and round) grows with a group's samples and
tokens, not with the model's layers or width, so the ratio shrinks as the model's step grows.  The
same figures with the prefix ``verl_tokens`` time a third leg: the verl door with
:func:`verl_token_ppo_loss`, the same loss value as verl's ``ppo_loss`` computed on the response
tokens only, as the library's loss does — the door's own cost, apart from what verl's ``ppo_loss``
spends on its padded [samples, response width] tensors.  ``speedup_cpu_time``: the paths' ratio of
CPU seconds.

The batch is short-tailed (long-tail in the usual sense): most samples fit one rank's budget, a
few need every rank.  Usage: ``python -m benchmarks verl --ranks 4 --json``.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hdp.core.phases import median_phases

__all__ = [
    "BASELINE",
    "tiny_model_config",
    "short_tail_lengths",
    "verl_update_batch",
    "actor_config",
    "build_engines",
    "doors_engines",
    "static_cp_dynamic_bsz_plan",
    "library_ppo_loss",
    "library_batch",
    "plan_that_ran",
    "main_grads",
    "reference_step",
    "bench_verl",
]

logger = logging.getLogger(__name__)

BASELINE = (
    "verl's stock Megatron scheduling run by the engine's planner: policy verl-kk with static_cp_size = N "
    "(static CP over all ranks: every micro-batch one CP group of all N ranks, hdp's ring attention) and verl's "
    "dynamic-bsz micro-batching (Karmarkar-Karp on verl's workload 24576 L + L^2, the fewest micro-batches within "
    "the token budget), with verl's CP loss handling (every CP rank gathers the micro-batch's log-probs over its CP "
    "group and runs the loss on the whole micro-batch, verl's postprocess_packed_seqs: StockCPLoss), through the same "
    "HdpMegatronEngine.train_batch, model, optimizer and verl ppo_loss; verl's own MegatronEngine needs "
    "TransformerEngine attention for CP and does not run on CPU"
)
VOCAB = 128
PAD = 0
COST_MODEL = "cpu-tiny@cpu-gloo"
BASELINE_POLICY = "verl-kk"
"""The baseline's planner policy (with ``static_cp_size`` = N): verl's stock scheduling."""
"""Both paths' and both doors' cost model (no auto-calibration: the plans stay those of the first step)."""


def tiny_model_config() -> Any:
    """The bench's Megatron GPT: 2 layers, hidden 64, 4 query / 2 kv heads, vocab 128, fp32."""
    from hdp.trainer.model import ModelConfig

    return ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2)


def short_tail_lengths(num_ranks: int, budget: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) lengths of a short-tail batch: ~90% fit one rank, a few need every rank.

    Sums to about 4 · N · budget tokens (about four micro-batches / rounds).
    """
    g = np.random.default_rng(seed)
    out: list[tuple[int, int]] = []
    total, target = 0, 4 * num_ranks * budget
    n_long = 2
    for _ in range(n_long):  # the tail: longer than N-1 ranks hold, shorter than N
        length = int(g.integers(int((num_ranks - 0.7) * budget), int((num_ranks - 0.2) * budget)))
        p = int(g.integers(8, 32))
        out.append((p, length - p))
        total += length
    while total < target:
        length = int(g.integers(budget // 16, budget // 3))
        p = int(g.integers(4, min(32, length - 2)))
        out.append((p, length - p))
        total += length
    order = g.permutation(len(out))
    return [out[i] for i in order]


def verl_update_batch(
    lengths: Sequence[tuple[int, int]],
    seed: int = 0,
    *,
    temperature: float = 1.0,
    max_token_len_per_gpu: int | None = None,
    calculate_entropy: bool = False,
) -> Any:
    """The TensorDict verl's trainer sends to ``update_actor`` for (prompt, response) ``lengths``.

    Built like ``RayPPOTrainer._update_actor``: a left/right padded batch (``prompts`` left-padded,
    ``responses`` right-padded, ``attention_mask``, ``position_ids``, ``response_mask``,
    ``old_log_probs``, ``advantages``) through verl's ``left_right_2_no_padding`` (nested
    ``input_ids``/``position_ids``, ``loss_mask``), then the worker's non-tensor fields.
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    from hdp.integrations.verl.scaffolding import padding

    padding.install()  # this CPU harness on verl 0.9.0, which unpads through flash-attn only
    g = torch.Generator().manual_seed(seed)
    bs = len(lengths)
    pmax = max(p for p, _ in lengths)
    rmax = max(r for _, r in lengths)
    prompts = torch.full((bs, pmax), PAD, dtype=torch.int64)
    responses = torch.full((bs, rmax), PAD, dtype=torch.int64)
    attn = torch.zeros((bs, pmax + rmax), dtype=torch.int64)
    resp_mask = torch.zeros((bs, rmax), dtype=torch.int64)
    for i, (p, r) in enumerate(lengths):
        prompts[i, pmax - p :] = torch.randint(1, VOCAB, (p,), generator=g)
        responses[i, :r] = torch.randint(1, VOCAB, (r,), generator=g)
        attn[i, pmax - p : pmax + r] = 1
        m = (torch.rand(r, generator=g) > 0.15).to(torch.int64)  # tool-output tokens are masked out
        m[0] = 1
        resp_mask[i, :r] = m
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = (attn.cumsum(-1) - 1).clamp_min(0)
    old = -torch.rand((bs, rmax), generator=g) * 2.0 * resp_mask
    adv = torch.randn((bs, rmax), generator=g) * resp_mask
    td = tu.get_tensordict(
        tensor_dict={
            "prompts": prompts,
            "responses": responses,
            "input_ids": input_ids,
            "attention_mask": attn,
            "position_ids": position_ids,
            "response_mask": resp_mask,
            "old_log_probs": old,
            "advantages": adv,
        },
        non_tensor_dict={"temperature": temperature},
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td,
        global_batch_size=bs,
        mini_batch_size=bs,
        calculate_entropy=calculate_entropy,
        compute_loss=True,
        use_dynamic_bsz=True,
        use_remove_padding=True,
        use_fused_kernels=False,
    )
    if max_token_len_per_gpu is not None:
        tu.assign_non_tensor(td, max_token_len_per_gpu=max_token_len_per_gpu)
    return td


def actor_config(loss_agg_mode: str = "token-mean") -> Any:
    """verl's ``ActorConfig`` for ``ppo_loss`` (vanilla PPO clip, no KL / entropy terms)."""
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="hdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=loss_agg_mode)


def static_cp_dynamic_bsz_plan(data: Any, num_ranks: int, max_token_len_per_gpu: int) -> Any:
    """verl's own stock Megatron micro-batches as an hdp ``Plan``: one micro-batch per round, CP group = all
    ranks (a cross-check of the baseline policy's rounds; the engine does not run this plan).

    Micro-batches come from verl's own ``prepare_micro_batches`` (dynamic bsz, token budget
    ``max_token_len_per_gpu · CP``, KK-balanced), exactly as ``MegatronEngine.forward_backward_batch``
    calls it with ``sp_size = CP = N`` and a one-rank DP group.
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    from hdp.integrations.verl.batch import sample_lengths
    from hdp.packing import Plan

    lengths = np.asarray(sample_lengths(data), dtype=np.int64)
    probe = data.select("input_ids")
    tu.assign_non_tensor(probe, use_dynamic_bsz=True, sp_size=num_ranks, max_token_len_per_gpu=max_token_len_per_gpu)
    # verl's micro-batching only; it runs no collective here: dp_group is read only to equalise
    # micro-batch counts across DP ranks (same_micro_num_in_dp), and the stock path's DP group is
    # one rank (CP = every rank), so there is nothing to equalise
    _, idx = prepare_micro_batches(probe, dp_group=None, same_micro_num_in_dp=False)
    round_of = np.full(lengths.size, -1, dtype=np.int64)
    for r, members in enumerate(idx):
        round_of[np.asarray(list(members), dtype=np.int64)] = r
    assert (round_of >= 0).all(), "verl's micro-batches must cover every sample"
    return Plan.from_columns(
        num_ranks=num_ranks,
        max_tokens_per_rank=max_token_len_per_gpu,
        policy="verl-dynamic-bsz+static-cp",
        lengths=lengths,
        round_of=round_of,
        group_start=np.zeros(lengths.size, dtype=np.int64),
        group_size=np.full(lengths.size, num_ranks, dtype=np.int64),
    )


def _build_ddp(cfg: Any, distributed_optimizer: bool) -> tuple[Any, Any]:
    """Megatron DDP over the world (averaging, as Megatron-Bridge's CP = 1 config) + optional optimizer."""
    from megatron.core.distributed import finalize_model_grads

    from hdp import megatron_compat as mc
    from hdp.trainer.model import OptimConfig, build_gpt_model, build_optimizer

    torch.manual_seed(0)  # identical initial weights on every rank and in the reference
    model = build_gpt_model(cfg, "cpu", groups=mc.megatron_groups())
    # verl's Megatron-Bridge config with CP = 1: per-micro-batch loss, DDP averages over DP
    model.config.calculate_per_token_loss = False
    ddp_cfg = mc.DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_grad=False,
        average_in_collective=False,
    )
    ddp = mc.DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)
    model.config.finalize_model_grads_func = finalize_model_grads  # as verl's register_megatron_training_hooks
    optimizer = build_optimizer(ddp, OptimConfig(lr=1e-3), groups=mc.megatron_groups()) if distributed_optimizer else None
    return ddp, optimizer


def build_engines(
    *,
    budget: int,
    policy: str = "hdp",
    static_cp_size: int | None = None,
    distributed_optimizer: bool = False,
    model: Any = None,
    optimizer: Any = None,
    stock: bool = False,
) -> tuple[Any, Any]:
    """(engine, model chunk) on this rank: the hdp engine on a tiny GPT, planning with ``policy``.

    ``policy="verl-kk", static_cp_size=N, stock=True`` is the stock path (:data:`BASELINE`): the same engine
    and step, whose planner runs verl's scheduling and whose loss handles CP groups as verl's stock engine
    does (`StockCPLoss`).  Megatron must be initialised
    (:func:`hdp.megatron_compat.initialize_megatron`).  Pass ``model`` and ``optimizer`` (from an earlier
    call: ``engine.optimizer``) to share the weights and the optimizer between engines.
    """
    from hdp.integrations.verl.config import HdpEngineConfig, HdpOptions
    from hdp.integrations.verl.engine import HdpMegatronEngine

    if model is None:
        model, optimizer = _build_ddp(tiny_model_config(), distributed_optimizer)
    opts = HdpOptions(max_tokens_per_rank=budget, policy=policy, static_cp_size=static_cp_size,
                      cost_model=COST_MODEL, auto_calibrate=False, calibration_path=None)
    engine_class = _stock_engine_class() if stock else HdpMegatronEngine
    engine = engine_class.from_modules(
        module=[model],
        optimizer=optimizer,
        engine_config=HdpEngineConfig(hdp=opts),
        pad_token_id=PAD,
        domain_group=dist.group.WORLD,
    )
    return engine, model


def _stock_engine_class() -> type:
    """The verl engine with verl's stock CP loss handling (`StockCPLoss`), for the bench's stock path."""
    from hdp.dispatch import group_samples_flat
    from hdp.integrations.verl.engine import HdpMegatronEngine
    from hdp.integrations.verl.loss import VerlLoss

    class StockCPLoss(VerlLoss):
        """verl's stock Megatron engine's loss on a CP group: every CP rank gathers the group's log-probs
        (``postprocess_packed_seqs``: an all-gather over the CP group, the own chunk differentiable) and
        runs the loss on the whole micro-batch, k times per group of k ranks; hdp's door runs it once, on
        the group's first rank (`hdp.integrations.verl.loss.VerlLoss`).  The same gradient."""

        def _round_share(self, rnd: Any, local: torch.Tensor) -> torch.Tensor:
            meta = rnd.meta
            with self.engine.core.phases.phase("exchange"):
                full = group_samples_flat(self.plan, meta, local, self.engine.domain.layout.domain)  # [ΣL_i, C]
            if meta.j == 0:
                self.whole[rnd.index] = full.detach()
            loss = self._group_loss(meta, full)
            return loss if meta.j == 0 else loss - loss.detach()  # the group's loss counted once, as the door's

    class StockMegatronEngine(HdpMegatronEngine):
        """`HdpMegatronEngine` with verl's stock CP loss handling."""

        loss_class = StockCPLoss

    return StockMegatronEngine


def main_grads(model: Any) -> list[torch.Tensor]:
    """Copies of every parameter's reduced gradient (Megatron DDP's ``main_grad``), in parameter order."""
    return [p.main_grad.detach().clone() for p in model.parameters()]


def reference_step(data: Any, loss_agg_mode: str) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """Single-process reference on the whole batch: (parameter grads, per-sample log-probs, loss).

    The same GPT (same seed, no DDP), every sample whole (k = 1), input-aligned log-probs with the
    batch's temperature, verl's ``ppo_loss`` with ``dp_size = 1``.
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from hdp.integrations.verl.batch import sample_lengths
    from hdp.core.attention_spec import packed_seq_params
    from hdp import megatron_compat as mc
    from hdp.trainer.model import build_gpt_model, packed_logits

    torch.manual_seed(0)
    model = build_gpt_model(tiny_model_config(), "cpu", groups=mc.megatron_groups())
    samples = list(data["input_ids"].unbind())  # S x [L_i]
    lengths = sample_lengths(data)
    temp = float(tu.get_non_tensor_data(data, key="temperature", default=1.0))
    logits = packed_logits(model, torch.cat(samples), packed_seq_params(lengths, torch.device("cpu")))  # [T, V]
    logp_all = torch.log_softmax(logits.float() / temp, dim=-1)  # [T, V]
    targets = torch.cat([torch.cat([s[1:], s.new_full((1,), PAD)]) for s in samples])  # [T]
    logp = logp_all.gather(-1, targets[:, None])[:, 0]  # [T]
    per_sample = list(logp.split(lengths))  # S x [L_i]
    ref = data.clone(recurse=False)
    loss_mask = data["loss_mask"]
    n_tok = int(loss_mask.values().sum()) if loss_mask.is_nested else int(loss_mask.sum())
    tu.assign_non_tensor(ref, dp_size=1, batch_num_tokens=n_tok)
    out = {"log_probs": torch.nested.as_nested_tensor(per_sample, layout=torch.jagged)}
    loss, _ = ppo_loss(actor_config(loss_agg_mode), out, ref)
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()], [x.detach() for x in per_sample], float(loss)


def grads_close(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], rtol: float = 1e-4, atol_rel: float = 1e-6) -> tuple[bool, float]:
    """Whether two gradient lists agree in fp32 (atol relative to the largest entry); also the max abs diff."""
    scale = max(float(x.abs().max()) for x in b) or 1.0
    worst = max(float((x - y).abs().max()) for x, y in zip(a, b))
    ok = all(torch.allclose(x, y, rtol=rtol, atol=atol_rel * scale) for x, y in zip(a, b))
    return ok, worst


def ppo_token_losses(logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, clip: float = 0.2,
                     clip_c: float = 3.0) -> torch.Tensor:
    """[T] verl's vanilla PPO policy loss per token (``core_algos.compute_policy_loss_vanilla``: clipped
    ratio, dual clip for negative advantages) from [T] log-probs, old log-probs and advantages."""
    ratio = torch.exp(torch.clamp(logprobs - old, -20.0, 20.0))
    clipped = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip))
    return torch.where(adv < 0, torch.minimum(-adv * clip_c, clipped), clipped)


def library_ppo_loss(local: Any, logprobs: torch.Tensor, weights: torch.Tensor, clip: float = 0.2,
                     clip_c: float = 3.0) -> torch.Tensor:
    """verl's vanilla PPO policy loss as a library loss function: Σ weights · ℓ_t (token-mean weights)."""
    old, adv = local.extras["old_log_probs"], local.extras["advantages"]
    return (weights * ppo_token_losses(logprobs, old, adv, clip, clip_c)).sum()


def verl_token_ppo_loss(model_output: Any, data: Any, dp_group: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``ppo_loss`` with ``token-mean`` (the same value) as a verl loss function that computes on the
    response tokens only, as the library's loss does: each response token's log-prob picked from the nested
    whole samples, the padded per-token inputs at the same tokens (verl's ``ppo_loss`` pads every sample's
    log-probs to the batch's response width and computes on [samples, width]).  No metrics.  The doors
    row's third leg: the verl door's own cost with the library's work in the loss."""
    values = model_output["log_probs"].values()  # [Σ L_i]
    mask = data["response_mask"].bool()  # [n, R]
    att, width = data["attention_mask"], data["prompts"].shape[1]  # [n, P + R], P
    plen, rlen = att[:, :width].sum(1), att[:, width:].sum(1)  # [n]
    start = torch.cumsum(plen + rlen, 0) - (plen + rlen)  # [n] each sample's first row
    at = (start + plen - 1)[:, None] + torch.arange(mask.shape[1])[None, :]  # [n, R] row predicting each response token
    pg = ppo_token_losses(values[at[mask]], data["old_log_probs"][mask], data["advantages"][mask])  # [T_resp]
    return pg.sum() / data["batch_num_tokens"] * data["dp_size"], {}


def library_batch(lengths: Sequence[tuple[int, int]], data: Any) -> Any:
    """The verl update batch as the library door's `hdp.trainer.engine.Batch`: the same tokens, the
    response mask as the loss mask, old log-probs and advantages per token (zero on the prompt)."""
    from hdp.trainer.engine import Batch

    tokens = list(data["input_ids"].unbind())  # S x [L_i]
    resp, old, adv = data["response_mask"], data["old_log_probs"], data["advantages"]  # [S, Rmax] each

    def per_token(x: torch.Tensor, i: int, p: int, r: int) -> torch.Tensor:
        return torch.cat([torch.zeros(p, dtype=torch.float32), x[i, :r].to(torch.float32)])  # [L_i]

    return Batch(tokens=tokens, loss_mask=[per_token(resp, i, p, r) for i, (p, r) in enumerate(lengths)],
                 extras={"old_log_probs": [per_token(old, i, p, r) for i, (p, r) in enumerate(lengths)],
                         "advantages": [per_token(adv, i, p, r) for i, (p, r) in enumerate(lengths)]})


def median_ci95(values: Sequence[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """[low, high]: a 95% bootstrap interval of the median of ``values`` (``resamples`` resamples with
    replacement, seeded): how far one run's paired ratio can be from the machine's true one."""
    g = np.random.default_rng(seed)
    x = np.asarray(values, dtype=np.float64)  # [n]
    med = np.median(x[g.integers(0, len(x), size=(resamples, len(x)))], axis=1)  # [resamples]
    return [float(np.quantile(med, 0.025)), float(np.quantile(med, 0.975))]


def _timed(fn: Callable[[Any], Any], arg: Any) -> tuple[float, float, Any]:
    """(the slowest rank's wall seconds of ``fn(arg)``, the CPU seconds of all ranks on it, its result),
    the ranks started together.  CPU time is what other work on a shared machine distorts least."""
    dist.barrier(group=dist.group.WORLD)
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(arg)
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
    return float(wall), float(cpu), out


def _scalar(metrics: dict[str, Any], key: str) -> float:
    v = metrics.get(key, math.nan)
    v = v[0] if isinstance(v, list) else v
    return float(v)


def plan_that_ran(metrics: dict[str, Any]) -> dict[str, Any]:
    """The plan a training step ran, from that step's own metrics (either door): its id (checksum bits),
    rounds, samples per CP degree, most and mean tokens per rank, planned efficiency."""
    hist = metrics.get("hdp/cp_degree_hist")
    if hist is None:  # the verl door: one metric per degree
        pre = "hdp/cp_degree_hist/"
        hist = {int(k[len(pre):]): int(_scalar(metrics, k)) for k in metrics if k.startswith(pre)}
    return {"plan_id": int(_scalar(metrics, "hdp/plan_id")), "rounds": int(_scalar(metrics, "hdp/rounds")),
            "cp_degree_hist": {str(k): int(v) for k, v in sorted(hist.items())},
            "max_tokens_per_rank": _scalar(metrics, "hdp/max_tokens_per_rank"),
            "mean_tokens_per_rank": _scalar(metrics, "hdp/mean_tokens_per_rank"),
            "efficiency_planned": _scalar(metrics, "hdp/efficiency_planned")}


def _paths_worker(world: int, steps: int, budget: int, data: Any, loss_fn: Any) -> dict[str, Any]:
    """hdp against the stock path: the same engine, model, optimizer and batch; two planner policies."""
    def pair(distributed_optimizer: bool) -> tuple[dict[str, Any], Any]:
        hdp_engine, model = build_engines(budget=budget, distributed_optimizer=distributed_optimizer)
        stock_engine, _ = build_engines(budget=budget, policy=BASELINE_POLICY, static_cp_size=world, model=model,
                                        optimizer=hdp_engine.optimizer, stock=True)
        return {"hdp": hdp_engine, "baseline": stock_engine}, model

    # both paths' gradients on the same batch and weights, all-reduced in full (no distributed optimizer,
    # whose reduce-scatter leaves each rank only its shard)
    engines, model = pair(False)
    grads = {}
    for name, eng in engines.items():
        model.zero_grad_buffer()
        eng.forward_backward_batch(data.clone(recurse=False), loss_fn)
        grads[name] = main_grads(model)
    match, worst = grads_close(grads["hdp"], grads["baseline"])
    engines, model = pair(True)  # the timed steps: Megatron's distributed optimizer, as verl's Megatron engine
    for eng in engines.values():  # one untimed step each (the optimizer's state, first calls)
        eng.train_batch(data.clone(recurse=False), loss_fn)
    times: dict[str, list[float]] = {k: [] for k in engines}
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    metrics: dict[str, list[dict[str, Any]]] = {k: [] for k in engines}
    for i in range(steps):  # alternate, starting with a different path each step
        order = list(engines.items())
        for name, eng in order if i % 2 == 0 else order[::-1]:
            dt, dc, out = _timed(lambda d, eng=eng: eng.train_batch(d, loss_fn), data.clone(recurse=False))
            times[name].append(dt)
            cpu[name].append(dc)
            metrics[name].append(out.get("metrics", {}))
    if dist.get_rank() != 0:
        return {}
    ran = {k: [plan_that_ran(m) for m in v] for k, v in metrics.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    hdp_ids = {r["plan_id"] for r in ran["hdp"]}
    return {
        "grad_match": bool(match), "grad_max_abs_diff": worst, "step_s_median": med, "step_s_all": times,
        "cpu_s_median": {k: statistics.median(v) for k, v in cpu.items()},
        "plans": {k: v[-1] for k, v in ran.items()},
        "plans_differ": not hdp_ids & {r["plan_id"] for r in ran["baseline"]},
        "phases": {k: median_phases(v) for k, v in metrics.items()},
        "verl_micro_batches": static_cp_dynamic_bsz_plan(data, world, budget).num_rounds,
    }


def doors_engines(budget: int) -> tuple[Any, Any]:
    """(library engine, verl engine) on one model and optimizer: `HdpEngine.build` of the tiny model, and
    `HdpMegatronEngine.from_modules` wrapping its model chunks and optimizer; the same token budget and
    cost model, no auto-calibration (the plans stay the first step's), the world as the domain."""
    from hdp.integrations.verl.config import HdpEngineConfig, HdpOptions
    from hdp.integrations.verl.engine import HdpMegatronEngine
    from hdp.trainer.config import EngineConfig, PlanningConfig
    from hdp.trainer.engine import HdpEngine
    from hdp.trainer.model import OptimConfig

    lib = HdpEngine.build(EngineConfig(model=tiny_model_config(), optim=OptimConfig(lr=1e-3), pad_token_id=PAD,
                                       planning=PlanningConfig(max_tokens_per_rank=budget, cost_model=COST_MODEL,
                                                               auto_calibrate=False, measure_memory=False)),
                          dist.group.WORLD)
    opts = HdpOptions(max_tokens_per_rank=budget, cost_model=COST_MODEL, auto_calibrate=False, calibration_path=None,
                      measure_memory=False)
    door = HdpMegatronEngine.from_modules(module=lib.model_chunks, optimizer=lib.optimizer,
                                          engine_config=HdpEngineConfig(hdp=opts), pad_token_id=PAD,
                                          domain_group=dist.group.WORLD)
    return lib, door


def _doors_worker(steps: int, budget: int, lengths: Sequence[tuple[int, int]], data: Any, loss_fn: Any) -> dict[str, Any]:
    """The library door (`HdpEngine.train_step`) and the verl door (`HdpMegatronEngine.train_batch`, with
    verl's ``ppo_loss`` and with `verl_token_ppo_loss`) on one model, optimizer and plan (`doors_engines`)."""
    lib, door = doors_engines(budget)
    batch = library_batch(lengths, data)
    # the same weights: the verl door's losses without an update, then the library's step (loss before its update)
    first_verl = door.forward_backward_batch(data.clone(recurse=False), loss_fn)
    first_tokens = door.forward_backward_batch(data.clone(recurse=False), verl_token_ppo_loss)
    door.optimizer_zero_grad()
    first_lib = lib.train_step(batch, library_ppo_loss)
    door.train_batch(data.clone(recurse=False), loss_fn)  # untimed, as the library's first step
    door.train_batch(data.clone(recurse=False), verl_token_ppo_loss)
    runs = {"library": (lambda b: lib.train_step(b, library_ppo_loss), lambda: batch),
            "verl": (lambda d: door.train_batch(d, loss_fn).get("metrics", {}), lambda: data.clone(recurse=False)),
            "verl_tokens": (lambda d: door.train_batch(d, verl_token_ppo_loss).get("metrics", {}),
                            lambda: data.clone(recurse=False))}
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    metrics: dict[str, list[dict[str, Any]]] = {k: [] for k in runs}
    order = list(runs.items())
    for i in range(steps):
        for name, (fn, arg) in order[i % len(order):] + order[: i % len(order)]:  # each door first in turn
            dt, dc, m = _timed(fn, arg())  # verl's batch is a fresh shallow copy each step (outside the timing)
            times[name].append(dt)
            cpu[name].append(dc)
            metrics[name].append(m)
    lib.close()
    if dist.get_rank() != 0:
        return {}
    ran = {k: [plan_that_ran(m) for m in v] for k, v in metrics.items()}
    ids = {k: {r["plan_id"] for r in v} for k, v in ran.items()}
    loss = {"library": float(first_lib["loss"]), "verl": float(first_verl["loss"][0]),
            "verl_tokens": float(first_tokens["loss"][0])}
    med = {k: statistics.median(v) for k, v in times.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    rounds = ran["verl"][-1]["rounds"]
    world = dist.get_world_size(group=dist.group.WORLD)

    def against_library(name: str) -> dict[str, float]:
        return {
            f"{name}_over_library": med[name] / med["library"],
            f"{name}_over_library_cpu": cmed[name] / cmed["library"],
            # each step's ratio to the library's step beside it, the median over steps: what the machine's
            # drift during the run (another job starting, the clock stepping down) moves least
            f"{name}_over_library_paired": statistics.median(v / l for v, l in zip(times[name], times["library"])),
            f"{name}_over_library_paired_ci95": median_ci95([v / l for v, l in zip(times[name], times["library"])]),
            f"{name}_over_library_cpu_paired": statistics.median(v / l for v, l in zip(cpu[name], cpu["library"])),
            # the gap per round of the plan: verl's loss API runs once per group and round, whatever the model's depth
            f"{name}_minus_library_ms_per_round": 1000.0 * (med[name] - med["library"]) / rounds,
            f"{name}_minus_library_cpu_ms_per_round_rank": 1000.0 * (cmed[name] - cmed["library"]) / (rounds * world),
        }

    return {
        "same_plan": len(set().union(*ids.values())) == 1 and int(_scalar(first_verl["metrics"], "hdp/plan_id"))
        in ids["library"],
        "loss_match": all(abs(v - loss["library"]) <= 1e-5 * max(1.0, abs(loss["library"])) for v in loss.values()),
        "loss": loss,
        "steps": steps, "step_s_median": med, "step_s_all": times, "cpu_s_median": cmed,
        **against_library("verl"), **against_library("verl_tokens"),
        "plans": {k: v[-1] for k, v in ran.items()},
        "phases": {k: median_phases(v) for k, v in metrics.items()},
    }


def _bench_worker(rank: int, world: int, steps: int, budget: int, seed: int, doors_steps: int) -> dict[str, Any]:
    """One rank of `bench_verl`: the two paths, then the doors row over ``doors_steps`` steps (0: no doors row)."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    from hdp import megatron_compat as mc

    logging.getLogger("verl").setLevel(logging.ERROR)
    lengths = short_tail_lengths(world, budget, seed)
    data = verl_update_batch(lengths, seed, max_token_len_per_gpu=budget)
    loss_fn = partial(ppo_loss, actor_config("token-mean"))
    mc.initialize_megatron(device="cpu", seed=1234)
    paths = _paths_worker(world, steps, budget, data, loss_fn)
    mc.destroy_megatron()
    both = _doors_worker(doors_steps, budget, lengths, data, loss_fn) if doors_steps else None
    if rank != 0:
        return {}
    tokens = int(sum(p + r for p, r in lengths))
    med = paths["step_s_median"]
    tps = {k: tokens / v for k, v in med.items()}
    result = {
        "speedup": tps["hdp"] / tps["baseline"],
        **{k: paths[k] for k in ("grad_match", "grad_max_abs_diff", "plans_differ", "plans", "phases",
                                 "verl_micro_batches")},
        "rounds": {k: v["rounds"] for k, v in paths["plans"].items()},
        "tokens_per_s": tps,
        "step_s_median": med,
        "step_s_all": paths["step_s_all"],
        "cpu_s_median": paths["cpu_s_median"],
        "speedup_cpu_time": paths["cpu_s_median"]["baseline"] / paths["cpu_s_median"]["hdp"],
        "ranks": world,
        "steps": steps,
        "tokens": tokens,
        "samples": len(lengths),
        "longest": max(p + r for p, r in lengths),
        "max_tokens_per_rank": budget,
        "model": "Megatron GPTModel, 2 layers, hidden 64, 4 q / 2 kv heads, vocab 128, fp32, CPU",
        "loss": "verl.workers.utils.losses.ppo_loss (core_algos vanilla policy loss, agg_loss token-mean)",
        "baseline": BASELINE,
        "hdp": "hdp.integrations.verl.engine.HdpMegatronEngine.train_batch, policy hdp",
        "timing": "median over steps of the slowest rank's train_batch (rounds, reduce, distributed-optimizer "
                  "step, calibration, collect), alternating paths; phases: median of the step's hdp/time/* metrics",
    }
    if both is not None:
        result["doors"] = both
    result["passed"] = bool(result["grad_match"] and result["plans_differ"]
                            and (both is None or (both["same_plan"] and both["loss_match"])))
    return result


def bench_verl(ranks: int = 4, steps: int = 5, budget: int = 512, seed: int = 0, doors: bool = True,
               doors_steps: int = 20) -> dict[str, Any]:
    """Run the benchmark on ``ranks`` gloo processes; returns rank 0's result dict (see module doc).
    ``doors``: also time the library door against the verl door on one model and plan (``doors``), over
    ``doors_steps`` steps per leg (more than the paths: the doors differ by a few percent, the paths by tens)."""
    if ranks not in (2, 4):
        raise ValueError(f"ranks={ranks}: choose 2 or 4")
    if steps < 1:
        raise ValueError(f"steps={steps}: must be >= 1")
    if doors_steps < 1:
        raise ValueError(f"doors_steps={doors_steps}: must be >= 1")
    from hdp.trainer.launch import spawn

    return spawn(_bench_worker, ranks, steps, budget, seed, doors_steps if doors else 0, timeout=900)[0]


def add_arguments(parser: Any) -> None:
    """The flags of ``python -m benchmarks verl`` (`bench_verl`'s keyword arguments; the CLI adds ``--json``)."""
    from hdp.trainer.cli.common import positive_int

    parser.add_argument("--ranks", type=positive_int, default=4, choices=(2, 4), help="gloo ranks: 2 or 4 (default 4)")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per path, after one "
                        "untimed (default 5)")
    parser.add_argument("--doors-steps", type=positive_int, default=20, help="timed steps per leg of the doors "
                        "row, after one untimed (default 20)")
    parser.add_argument("--no-doors", action="store_false", dest="doors",
                        help="skip the library door vs verl door row")
