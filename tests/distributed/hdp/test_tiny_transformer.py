"""A tiny 2-layer transformer under random hdp plans on 4 gloo ranks equals one process on the whole batch.

Per rank and round: select the local zigzag chunks (hdp.dispatch), packed RoPE from the plan's
position ids (hdp.rope), attention through hdp.cp.cp_attention (ring, or all-gather on aligned
power-of-two groups), per-token cross-entropy weighted by hdp.loss; gradients are summed over the
domain group.  Loss, every parameter gradient and the gathered log-probs must match the
single-process reference (plain per-sample causal attention, verl-style aggregation) for every
loss aggregation mode.  Tolerance: float64, 1e-9 absolute.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.dist_helper import run_distributed
from helpers.dispatch_reference import verify_plan
from hdp.cp import CPAlgorithm, cp_attention
from hdp.dispatch import gather_outputs, local_meta, pack
from hdp.groups import DomainGroups
from hdp.loss import LossAggregation, sample_token_weights
from helpers.loss_reference import aggregate_loss
from hdp.packing import PlannerConfig, plan as make_plan
from hdp.rope import apply_rope, rope_cos_sin
from hdp.packing.plan import Plan
from helpers.plan_factory import random_plan

# Legend: T tokens, E model dim, Hq/Hkv heads, Dh head dim, V vocab.
V, E, HQ, HKV, DH, ROT, FF, LAYERS = 13, 16, 4, 2, 6, 4, 24, 2
BASE = 1000.0
TOL = 1e-9
DT = torch.float64


def init_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic parameters (identical on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    p = {"emb": torch.randn(V, E, generator=gen, dtype=DT), "head": torch.randn(E, V, generator=gen, dtype=DT) / 4,
         "norm_f": 1 + 0.1 * torch.randn(E, generator=gen, dtype=DT)}
    for i in range(LAYERS):
        p[f"{i}.norm1"] = 1 + 0.1 * torch.randn(E, generator=gen, dtype=DT)
        p[f"{i}.wqkv"] = torch.randn(E, (HQ + 2 * HKV) * DH, generator=gen, dtype=DT) / math.sqrt(E)
        p[f"{i}.wo"] = torch.randn(HQ * DH, E, generator=gen, dtype=DT) / math.sqrt(HQ * DH)
        p[f"{i}.norm2"] = 1 + 0.1 * torch.randn(E, generator=gen, dtype=DT)
        p[f"{i}.w13"] = torch.randn(E, 2 * FF, generator=gen, dtype=DT) / math.sqrt(E)
        p[f"{i}.w2"] = torch.randn(FF, E, generator=gen, dtype=DT) / math.sqrt(FF)
    return {k: v.requires_grad_(True) for k, v in p.items()}


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def forward(params, ids, position_ids, attention) -> torch.Tensor:
    """logits [T, V] of packed tokens ``ids`` [T]; ``attention(q, k, v)`` is causal within samples."""
    t = ids.shape[0]
    cos, sin = rope_cos_sin(position_ids, ROT, base=BASE, dtype=DT)  # [T, 1, ROT], once for all layers
    h = params["emb"][ids]  # [T, E]
    for i in range(LAYERS):
        qkv = rms_norm(h, params[f"{i}.norm1"]) @ params[f"{i}.wqkv"]  # [T, (Hq + 2 Hkv) Dh]
        q, k, v = qkv.split([HQ * DH, HKV * DH, HKV * DH], dim=-1)
        q = apply_rope(q.reshape(t, HQ, DH), cos, sin)  # [T, Hq, Dh]
        k = apply_rope(k.reshape(t, HKV, DH), cos, sin)  # [T, Hkv, Dh]
        o = attention(q, k, v.reshape(t, HKV, DH))  # [T, Hq, Dh]
        h = h + o.reshape(t, HQ * DH) @ params[f"{i}.wo"]  # [T, E]
        a, b = (rms_norm(h, params[f"{i}.norm2"]) @ params[f"{i}.w13"]).chunk(2, dim=-1)  # [T, FF] each
        h = h + (F.silu(a) * b) @ params[f"{i}.w2"]
    return rms_norm(h, params["norm_f"]) @ params["head"]  # [T, V]


def naive_attention(q, k, v):
    """Causal GQA attention of one whole sample (the reference; no hdp code)."""
    n = q.shape[0]
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)  # [T, Hq, Dh]
    sc = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(DH)  # [Hq, T, T]
    sc = sc.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("hij,jhd->ihd", sc.softmax(-1), v)


def token_logprobs(logits, labels):
    """[T] log-prob of each label."""
    return torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)


def make_batch(lengths, seed):
    """ids, next-token labels and loss masks per sample (last token never has a label)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, V, (int(n),), generator=gen) for n in lengths]
    labels = [torch.cat([x[1:], x.new_zeros(1)]) for x in ids]
    masks = []
    for n in lengths:
        m = torch.rand(int(n), generator=gen) < 0.8
        m[-1] = False
        masks.append(m)
    return ids, labels, masks


def reference(params, ids, labels, masks):
    """Single process, whole batch: per-mode (loss, grads) and per-sample log-probs."""
    lps = [token_logprobs(forward(params, x, torch.arange(x.numel()), naive_attention), y) for x, y in zip(ids, labels)]
    out = {}
    names = list(params)
    for mode in LossAggregation:
        loss = aggregate_loss([-lp for lp in lps], masks, mode)
        grads = torch.autograd.grad(loss, [params[n] for n in names], retain_graph=True)
        out[mode] = (loss.detach(), dict(zip(names, grads)))
    return out, [lp.detach() for lp in lps]


def plans():
    rng = np.random.default_rng(5)
    ps = [random_plan(rng, 4, s, max_k=4, max_len=20, max_rounds=2) for s in (6, 5, 9)]
    # CP3 groups (ring only) next to CP1, and an idle rank
    ps.append(Plan.from_columns(
        num_ranks=4, max_tokens_per_rank=20, policy="cp3", lengths=np.array([17, 5, 2, 11, 9, 1]),
        round_of=np.array([0, 0, 0, 1, 1, 1]), group_start=np.array([0, 0, 3, 1, 1, 0]),
        group_size=np.array([3, 3, 1, 3, 3, 1]),
    ))
    ps.append(make_plan(rng.integers(2, 40, size=8), PlannerConfig(num_ranks=4, max_tokens_per_rank=24)))
    return ps


def _worker(rank, world_size):
    domain = dist.new_group(list(range(world_size)))
    groups = DomainGroups.build(domain)
    params = init_params()
    names = list(params)
    for case, plan in enumerate(plans()):
        verify_plan(plan, domain)
        ids, labels, masks = make_batch(plan.lengths, case)
        ref, ref_lps = reference(params, ids, labels, masks)
        weights = {m: sample_token_weights(masks, m, dtype=DT) for m in LossAggregation}
        loss = {m: torch.zeros((), dtype=DT) for m in LossAggregation}
        grads = {m: {n: torch.zeros_like(p) for n, p in params.items()} for m in LossAggregation}
        local_lps = []
        for r in range(plan.num_rounds):
            meta = local_meta(plan, rank, r)
            aligned = meta.k > 1 and meta.k & (meta.k - 1) == 0 and meta.group_start % meta.k == 0
            algo = CPAlgorithm.ALLGATHER if aligned and (case + r) % 2 == 0 else CPAlgorithm.RING
            ring = groups.ring(meta.group_start, meta.k) if meta.k > 1 else None

            def attention(q, k, v):
                return cp_attention(q, k, v, meta.group_lengths, meta.k, ring=ring, groups=groups, algo=algo,
                                    cu_seqlens=meta.cu_seqlens)

            logits = forward(params, pack(meta, ids), meta.position_ids, attention)  # [T, V]
            lp = token_logprobs(logits, pack(meta, labels))  # [T]
            local_lps.append(lp.detach())
            for mode in LossAggregation:  # same order on every rank: backward rings line up
                local = (-lp * pack(meta, weights[mode])).sum()
                g = torch.autograd.grad(local, [params[n] for n in names], retain_graph=True, allow_unused=True,
                                        materialize_grads=True)
                loss[mode] += local.detach()
                for n, gi in zip(names, g):
                    grads[mode][n] += gi
        for mode in LossAggregation:
            dist.all_reduce(loss[mode], op=dist.ReduceOp.SUM, group=domain)
            want_loss, want_grads = ref[mode]
            where = f"plan {case} ({plan.to_dict()['rounds']}) mode {mode.value} rank {rank}"
            assert abs(float(loss[mode] - want_loss)) <= TOL, f"{where}: loss {float(loss[mode])} vs {float(want_loss)}"
            for n in names:
                dist.all_reduce(grads[mode][n], op=dist.ReduceOp.SUM, group=domain)
                err = float((grads[mode][n] - want_grads[n]).abs().max())
                assert err <= TOL, f"{where}: grad {n} max abs err {err:.3e}"
        full = gather_outputs(plan, rank, local_lps, domain)
        for i, (got, want) in enumerate(zip(full, ref_lps)):
            err = float((got - want).abs().max()) if want.numel() else 0.0
            assert err <= TOL, f"plan {case} sample {i}: log-prob err {err:.3e}"
    dist.barrier(group=domain)


def test_tiny_transformer_matches_single_process():
    run_distributed(_worker, 4, timeout=150)
