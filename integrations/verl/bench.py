"""``hdp bench verl`` (entry point ``hdp.benchmarks:verl``): tokens/s of verl's stock Megatron path (dynamic bsz + static CP) against hdp's engine.

Both paths run side by side in one run, alternating step by step, on the same tiny Megatron GPT
(:mod:`hdp.trainer.model`, fp32, CPU, gloo), the same weights and the same verl update batch (the
TensorDict verl's trainer sends: ``left_right_2_no_padding`` of a padded batch), with verl's real
``ppo_loss`` (``verl.trainer.ppo.core_algos`` policy loss and ``agg_loss``).  One step is
:meth:`HdpMegatronEngine.forward_backward_batch` (forward, backward, DDP gradient all-reduce).

* **hdp**: :class:`hdp.integrations.verl.engine.HdpMegatronEngine` with the ``hdp`` policy.
* **baseline**: verl's stock ``MegatronEngine`` cannot run on CPU (it builds the model through
  Megatron-Bridge and TransformerEngine attention), so the stock path is *emulated* with the same
  model and engine round loop: verl's own dynamic-batch-size micro-batching
  (``verl.workers.engine.utils.prepare_micro_batches`` → ``verl.utils.seqlen_balancing``, token
  budget ``max_token_len_per_gpu · CP``) and static CP over all N ranks — every micro-batch is one
  CP group of all N ranks, zigzag-split and run with hdp's ring attention (what Megatron's CP does,
  without its padding of each sample to a multiple of 2·CP).  The output says so in ``baseline``.

``grad_match``: the gradients (after DDP's all-reduce) of the two paths on the same batch agree
within fp32 tolerance (``rtol = 1e-4``, ``atol = 1e-6`` relative to the largest gradient entry:
the paths sum tokens in different orders and splits).

The batch is short-tailed (long-tail in the usual sense): most samples fit one rank's budget, a
few need every rank.  Usage: ``hdp bench verl --ranks 4 --json``.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "BASELINE",
    "tiny_model_config",
    "short_tail_lengths",
    "verl_update_batch",
    "actor_config",
    "build_engines",
    "static_cp_dynamic_bsz_plan",
    "main_grads",
    "reference_step",
    "bench_verl",
]

logger = logging.getLogger(__name__)

BASELINE = (
    "emulated stock verl Megatron path: verl's dynamic-bsz micro-batching "
    "(verl.workers.engine.utils.prepare_micro_batches / verl.utils.seqlen_balancing, "
    "max_token_len_per_gpu x CP per micro-batch) + static CP over all ranks via hdp ring attention "
    "(static-cp plans, one CP group of all N ranks per micro-batch), same Megatron GPT and verl ppo_loss; "
    "verl's MegatronEngine itself needs Megatron-Bridge/TransformerEngine and does not run on CPU"
)
VOCAB = 128
PAD = 0


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
    """verl's stock Megatron micro-batches as an hdp ``Plan``: one micro-batch per round, CP group = all ranks.

    Micro-batches come from verl's own ``prepare_micro_batches`` (dynamic bsz, token budget
    ``max_token_len_per_gpu · CP``, KK-balanced), exactly as ``MegatronEngine.forward_backward_batch``
    calls it with ``sp_size = CP = N`` and a one-rank DP group.
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    from hdp.integrations.verl.data import sample_lengths
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


def _stock_engine_class() -> type:
    from hdp.integrations.verl.engine import HdpMegatronEngine

    class StockDynamicBszStaticCP(HdpMegatronEngine):
        """The emulated stock path: :func:`static_cp_dynamic_bsz_plan` instead of an hdp plan."""

        def _make_plan(self, data: Any, train: bool = True) -> Any:
            from verl.utils import tensordict_utils as tu

            budget = int(tu.get_non_tensor_data(data, key="max_token_len_per_gpu", default=None))
            return static_cp_dynamic_bsz_plan(data, self.domain.size, budget)

    return StockDynamicBszStaticCP


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
    stock: bool = False,
    distributed_optimizer: bool = False,
    model: Any = None,
) -> tuple[Any, Any]:
    """(engine, model chunk) on this rank: the hdp engine (or the emulated stock path) on a tiny GPT.

    Megatron must be initialised (:func:`hdp.megatron_compat.initialize_megatron`).  Pass ``model``
    (a DDP chunk from an earlier call) to share the weights between engines.
    """
    from hdp.integrations.verl.config import HdpEngineConfig, HdpOptions
    from hdp.integrations.verl.engine import HdpMegatronEngine

    optimizer = None
    if model is None:
        model, optimizer = _build_ddp(tiny_model_config(), distributed_optimizer)
    opts = HdpOptions(max_tokens_per_rank=budget, policy=policy, cost_model="cpu-tiny@cpu-gloo", auto_calibrate=False,
                      calibration_path=None)
    cls = _stock_engine_class() if stock else HdpMegatronEngine
    engine = cls.from_modules(
        module=[model],
        optimizer=optimizer,
        engine_config=HdpEngineConfig(hdp=opts),
        pad_token_id=PAD,
        domain_group=dist.group.WORLD,
    )
    return engine, model


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

    from hdp.integrations.verl.data import sample_lengths
    from hdp.trainer.attention_spec import packed_seq_params
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


def _step(engine: Any, model: Any, data: Any, loss_fn: Any) -> float:
    """One timed forward/backward/all-reduce step; the slowest rank's wall time."""
    model.zero_grad_buffer()
    dist.barrier(group=dist.group.WORLD)
    t0 = time.perf_counter()
    engine.forward_backward_batch(data.clone(recurse=False), loss_fn)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
    return float(dt)


def _bench_worker(rank: int, world: int, steps: int, budget: int, seed: int) -> dict[str, Any]:
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    from hdp import megatron_compat as mc

    logging.getLogger("verl").setLevel(logging.ERROR)
    mc.initialize_megatron(device="cpu", seed=1234)
    lengths = short_tail_lengths(world, budget, seed)
    data = verl_update_batch(lengths, seed, max_token_len_per_gpu=budget)
    loss_fn = partial(ppo_loss, actor_config("token-mean"))
    hdp_engine, model = build_engines(budget=budget)
    stock_engine, _ = build_engines(budget=budget, stock=True, model=model)

    # gradients of both paths on the same batch and weights
    _step(hdp_engine, model, data, loss_fn)
    g_hdp = main_grads(model)
    _step(stock_engine, model, data, loss_fn)
    g_stock = main_grads(model)
    match, worst = grads_close(g_hdp, g_stock)

    times: dict[str, list[float]] = {"hdp": [], "baseline": []}
    for i in range(steps):  # alternate, starting with a different path each step
        order = (("hdp", hdp_engine), ("baseline", stock_engine))
        for name, eng in order if i % 2 == 0 else order[::-1]:
            times[name].append(_step(eng, model, data, loss_fn))
    hdp_plan = hdp_engine._make_plan(data)
    stock_plan = stock_engine._make_plan(data)
    mc.destroy_megatron()
    if rank != 0:
        return {}
    tokens = int(sum(p + r for p, r in lengths))
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens / v for k, v in med.items()}
    return {
        "speedup": tps["hdp"] / tps["baseline"],
        "grad_match": bool(match),
        "grad_max_abs_diff": worst,
        "tokens_per_s": tps,
        "step_s_median": med,
        "step_s_all": times,
        "ranks": world,
        "steps": steps,
        "tokens": tokens,
        "samples": len(lengths),
        "longest": max(p + r for p, r in lengths),
        "max_tokens_per_rank": budget,
        "rounds": {"hdp": hdp_plan.num_rounds, "baseline": stock_plan.num_rounds},
        "cp_degree_hist_hdp": {str(k): int(v) for k, v in sorted(_hist(hdp_plan.group_size).items())},
        "model": "Megatron GPTModel, 2 layers, hidden 64, 4 q / 2 kv heads, vocab 128, fp32, CPU",
        "loss": "verl.workers.utils.losses.ppo_loss (core_algos vanilla policy loss, agg_loss token-mean)",
        "baseline": BASELINE,
        "hdp": "hdp.integrations.verl.HdpMegatronEngine.forward_backward_batch, policy hdp",
        "timing": "median over steps of the slowest rank's forward+backward+grad all-reduce, alternating paths",
    }


def _hist(sizes: np.ndarray) -> dict[int, int]:
    vals, counts = np.unique(np.asarray(sizes), return_counts=True)
    return {int(v): int(c) for v, c in zip(vals, counts)}


def bench_verl(ranks: int = 4, steps: int = 5, budget: int = 512, seed: int = 0) -> dict[str, Any]:
    """Run the benchmark on ``ranks`` gloo processes; returns rank 0's result dict (see module doc)."""
    if ranks not in (2, 4):
        raise ValueError(f"ranks={ranks}: choose 2 or 4")
    if steps < 1:
        raise ValueError(f"steps={steps}: must be >= 1")
    from hdp.trainer.launch import spawn

    return spawn(_bench_worker, ranks, steps, budget, seed, timeout=900)[0]


def add_arguments(parser: Any) -> None:
    """The flags of ``hdp bench verl`` (`bench_verl`'s keyword arguments; the CLI adds ``--json``)."""
    from hdp.trainer.cli.common import positive_int

    parser.add_argument("--ranks", type=positive_int, default=4, choices=(2, 4), help="gloo ranks: 2 or 4 (default 4)")
    parser.add_argument("--steps", type=positive_int, default=5, help="steps per path, the first untimed (default 5)")
