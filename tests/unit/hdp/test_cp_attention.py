"""cp_attention (ring and all-gather) on 4 gloo ranks against single-process float64 causal attention.

Tolerances: float64 1e-10 absolute; float32 1e-5 and bfloat16 3e-2 relative (to the largest
reference magnitude, at least 1).
"""

from __future__ import annotations

import math

import pytest
import torch

from hdp.cp import cp_attention
from hdp.cp.metadata import positions, rank_layout

from helpers.cp_attention import D, HKV, HQ, naive_causal


def test_cp_attention_single_rank_and_validation():
    """k_group == 1 is the plain local kernel; bad inputs raise ValueError before any communication."""
    lengths = [6, 1, 9]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(16, HQ, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(16, HKV, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(16, HKV, D, generator=gen, dtype=torch.float64, requires_grad=True)
    out = cp_attention(q, k, v, lengths, 1)
    torch.testing.assert_close(out, naive_causal(q, k, v, lengths, 1 / math.sqrt(D)), rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match=r"q has 16 tokens but group_lengths=\[6, 1, 8\]"):
        cp_attention(q, k, v, [6, 1, 8], 1)
    with pytest.raises(ValueError, match=r"cu_seqlens=\[0, 6, 7, 15\] does not match the local layout"):
        cp_attention(q, k, v, lengths, 1, cu_seqlens=torch.tensor([0, 6, 7, 15]))
    assert cp_attention(q, k, v, lengths, 1, cu_seqlens=torch.tensor([0, 6, 7, 16])).shape == q.shape
    with pytest.raises(ValueError, match="ring=None"):
        cp_attention(q, k, v, lengths, 2)
    with pytest.raises(ValueError, match="algo='tree'"):
        cp_attention(q, k, v, lengths, 1, algo="tree")
    with pytest.raises(ValueError, match="multiple of Hkv"):
        cp_attention(q[:, :3], k, v, lengths, 1)


@pytest.mark.parametrize("k_group", [1, 2, 3, 4, 5])
def test_metadata_covers_every_token_once(k_group):
    """Pure metadata: positions of all ranks cover each sample exactly; cu/front/back indices agree."""
    from hdp.cp.metadata import StepCase, allgather_index, ring_schedule

    lengths = [0, 1, 2, 7, 8, 9, 31]
    seen = {s: [] for s in range(len(lengths))}
    for j in range(k_group):
        lay = rank_layout(lengths, k_group, j)
        pos = positions(lengths, k_group, j)
        assert pos.numel() == lay.num_tokens == int(lay.cu_seqlens[-1])
        assert lay.front_tokens + lay.back_tokens == lay.num_tokens
        both = torch.cat([lay.front_index, lay.back_index])
        assert torch.equal(torch.sort(both).values, torch.arange(lay.num_tokens))
        cu = lay.cu_seqlens.tolist()
        for s in range(len(lengths)):
            seen[s] += pos[cu[s] : cu[s + 1]].tolist()
            assert lay.front[s][1] <= lay.back[s][0] or lay.back[s][0] == lay.back[s][1]
        steps = ring_schedule(k_group, j)
        assert [st.source for st in steps] == [(j - s) % k_group for s in range(k_group)]
        assert steps[0].case is StepCase.LOCAL_CAUSAL
        assert all((st.case is StepCase.FRONT_KEYS) == (st.source < j) for st in steps[1:])
        idx = allgather_index(lengths, k_group, j)
        assert int(idx.cu_k[-1]) == idx.key_index.numel()
        # each chunk's key prefix ends where the chunk ends in its sample
        ends = [e for f, b in zip(lay.front, lay.back) for e in (f[1], b[1])]
        assert torch.diff(idx.cu_k.long()).tolist() == ends
    for s, n in enumerate(lengths):
        assert sorted(seen[s]) == list(range(n)), (s, n)
