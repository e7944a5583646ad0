"""The distributed tier (other processes) of the tests tests/unit/hdp/test_cp_attention.py describes: its docstring says what they check and how."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
import torch.distributed as dist

from helpers.dist_helper import run_distributed
from hdp.cp import CPAlgorithm, cp_attention
from hdp.cp.metadata import positions, rank_layout
from hdp.groups import DomainGroups
from hdp.kernels import AttentionKernel, KernelName, get_kernel
from hdp.kernels import reference

from helpers.cp_attention import D, HKV, HQ, naive_causal

REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # relative to max |reference|; float64: 1e-10 abs

# Each case: a partition of the 4-rank domain into contiguous groups, with the samples of each group.
# Groups of 3 and unaligned groups of 2 only support the ring.
CASES = [
    {(0, 4): [37, 5, 1, 8, 20]},
    {(0, 2): [13, 1, 7], (2, 2): [3, 2, 30]},
    {(0, 3): [25, 1, 4, 11], (3, 1): [9, 6]},
    {(0, 1): [10], (1, 3): [2, 5, 1, 19]},
    {(0, 1): [4, 4], (1, 2): [1, 3, 17], (3, 1): [1]},
    {(0, 1): [6], (1, 1): [1, 2], (2, 1): [9], (3, 1): [3, 3]},
    {(0, 4): [3, 1, 2]},  # every sample shorter than 2k = 8: many empty chunks
    {(0, 4): [1]},  # three ranks hold no token at all
    {(0, 2): [1], (2, 2): [2, 1]},
    {(0, 3): [2, 40], (3, 1): []},  # the 4th rank runs an empty micro-batch
]
# The same checks on a 2-rank domain.
CASES_2 = [
    {(0, 2): [37, 5, 1, 8, 20]},
    {(0, 1): [13, 1, 7], (1, 1): [3, 2, 30]},
    {(0, 2): [3, 1, 2]},  # samples shorter than 2k = 4
    {(0, 2): [1]},  # the second rank holds no token
]
CASE_SETS = {4: CASES, 2: CASES_2}


def local_index(lengths, k_group, j):
    """Index of every local token of position j into the packed full group tensor."""
    lay = rank_layout(lengths, k_group, j)
    offsets = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()[:-1]], dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.diff(lay.cu_seqlens.long()))
    return offsets[seq] + positions(lengths, k_group, j)


def check_group(case_id, start, size, lengths, rank, dtype, algo, kernel, groups):
    """Run one group's CP attention on this rank and compare with the reference."""
    gen = torch.Generator().manual_seed(1000 * case_id + start)
    total = sum(lengths)
    q = torch.randn(total, HQ, D, generator=gen, dtype=torch.float64)
    k = torch.randn(total, HKV, D, generator=gen, dtype=torch.float64)
    v = torch.randn(total, HKV, D, generator=gen, dtype=torch.float64)
    dout = torch.randn(total, HQ, D, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(D)
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out = naive_causal(*ref_in, lengths, scale)
    if total:
        ref_grads = torch.autograd.grad(ref_out, ref_in, dout)
    else:  # an empty micro-batch: nothing to differentiate
        ref_grads = tuple(torch.zeros_like(t) for t in ref_in)

    j = rank - start
    idx = local_index(lengths, size, j)
    lq, lk, lv = (t[idx].to(dtype).requires_grad_(True) for t in (q, k, v))
    ring = groups.ring(start, size)
    out = cp_attention(lq, lk, lv, lengths, size, ring=ring, groups=groups, algo=algo, kernel=kernel, scale=scale)
    out.backward(dout[idx].to(dtype))
    where = f"case {case_id} group (start={start}, size={size}) {algo.value} {dtype} rank {rank}"
    for name, got, want in (
        ("out", out, ref_out[idx]),
        ("dq", lq.grad, ref_grads[0][idx]),
        ("dk", lk.grad, ref_grads[1][idx]),
        ("dv", lv.grad, ref_grads[2][idx]),
    ):
        assert got is not None and got.dtype == dtype, f"{where}: {name} missing or wrong dtype"
        want = want.detach()
        if dtype == torch.float64:
            err = (got - want).abs().max().item() if got.numel() else 0.0
            assert err <= 1e-10, f"{where}: {name} max abs err {err:.3e} > 1e-10"
        else:
            err = (got.double() - want).abs().max().item() if got.numel() else 0.0
            bound = REL_TOL[dtype] * max(want.abs().max().item() if want.numel() else 0.0, 1.0)
            assert err <= bound, f"{where}: {name} max abs err {err:.3e} > {bound:.3e}"


def small_block_kernel():
    """The reference kernel with tiny blocks, so multi-block and cross-sequence blocks are exercised."""
    return AttentionKernel(
        KernelName.REFERENCE,
        functools.partial(reference.attn_fwd, block_q=4, block_k=8),
        functools.partial(reference.attn_bwd, block_q=4, block_k=8),
    )


def _cp_worker(rank, world_size, dtype_names):
    groups = DomainGroups.build(dist.group.WORLD)
    kernels = [get_kernel(torch.device("cpu")), small_block_kernel()]
    cases = CASE_SETS[world_size]
    for case_id, case in enumerate(cases):
        for dtype, kernel in itertools.product([getattr(torch, n) for n in dtype_names], kernels):
            for algo in (CPAlgorithm.RING, CPAlgorithm.ALLGATHER):
                for (start, size), lengths in case.items():
                    if not start <= rank < start + size:
                        continue
                    aligned = size > 1 and (size & (size - 1)) == 0 and start % size == 0
                    if algo is CPAlgorithm.ALLGATHER and not aligned:
                        continue
                    check_group(case_id, start, size, lengths, rank, dtype, algo, kernel, groups)

    # bf16 inputs (float32 accumulation and merges) on a CP4 and a CP2 case: plumbing of dtypes
    for case_id in (0, 1):
        for (start, size), lengths in cases[case_id].items():
            if start <= rank < start + size:
                for algo in CPAlgorithm:
                    check_group(case_id, start, size, lengths, rank, torch.bfloat16, algo, kernels[0], groups)

    # validation happens before any communication, so every rank can fail alone without a hang
    ring = groups.ring(0, world_size)
    bad = torch.randn(5, HQ, D, dtype=torch.float64)
    kv = torch.randn(5, HKV, D, dtype=torch.float64)
    try:
        cp_attention(bad, kv, kv, [40, 3], world_size, ring=ring)
    except ValueError as exc:
        assert "group_lengths=[40, 3]" in str(exc) and "tokens" in str(exc), str(exc)
    else:
        raise AssertionError("mismatched local tokens did not raise")
    try:
        cp_attention(bad, kv, kv, [10], world_size + 1, ring=ring)
    except ValueError as exc:
        assert f"k_group={world_size + 1}" in str(exc), str(exc)
    else:
        raise AssertionError("ring/k_group mismatch did not raise")
    dist.barrier(group=dist.group.WORLD)


@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_attention_matches_single_process(world_size):
    """Both dtypes, both kernels' block sizes and all cases in one spawn (process start-up dominates)."""
    run_distributed(_cp_worker, world_size, ("float64", "float32"), timeout=150)
