"""Token log-probs and entropy from logits in vocabulary chunks (no extra [T, V] tensors).

Legend: T tokens of this rank's round, V vocabulary, C chunk width (columns of V per step).

The naive path (``log_softmax(logits.float() / t)``, then ``exp`` and a product for the entropy)
materialises three or four fp32 [T, V] tensors beyond the logits Megatron returns: at V = 151,936
and T = 16K tokens each is ~10 GB, which the planner's token budget would have to absorb.  Here
the forward streams over V in chunks of C columns with an online log-sum-exp (running max m,
scaled sum s, and for the entropy the scaled first moment w):

    x    = logits[:, c] · (1 / t)                         [T, C]   chunk of temperature-scaled logits
    m'   = max(m, max_c x);  s = s·e^(m-m') + Σ_c e^(x-m');  w = w·e^(m-m') + Σ_c e^(x-m')·x
    lse  = m + log s;   logp = x_target - lse;   H = lse - w / s      (H = -Σ p·log p)

so the memory beyond the logits is O(T·C) (C is fixed: O(1) per token in V).  The backward
recomputes each chunk's probabilities and writes d logits chunk by chunk into the one [T, V]
gradient Megatron's output layer needs anyway:

    d logits[:, c] = (1/t) · ( g_logp · (onehot - p)  -  g_H · p · (x - E_p[x]) ),  E_p[x] = w / s

The entropy is computed only when asked for (``entropy=False`` skips w and returns None).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["token_logprobs_entropy", "tp_logprobs_entropy"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 logits (exact checks), else float32 (as verl's path)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scan(logits: torch.Tensor, inv_t: torch.Tensor, chunk: int, entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Online (m + log s) = lse [T] and E_p[x] [T] (or None) over vocab chunks; fp32."""
    t_len, vocab = logits.shape
    acc = _acc(logits.dtype)
    m = torch.full((t_len,), float("-inf"), dtype=acc, device=logits.device)  # [T]
    s = torch.zeros(t_len, dtype=acc, device=logits.device)  # [T]
    w = torch.zeros(t_len, dtype=acc, device=logits.device) if entropy else None  # [T]
    for c0 in range(0, vocab, chunk):
        x = logits[:, c0 : c0 + chunk].to(acc) * inv_t[:, None]  # [T, C]
        m_new = torch.maximum(m, x.max(dim=-1).values)  # [T]
        scale = torch.exp(m - m_new)  # [T]; exp(-inf) = 0 on the first chunk
        e = torch.exp(x - m_new[:, None])  # [T, C]
        s = s * scale + e.sum(-1)
        if w is not None:
            w = w * scale + (e * x).sum(-1)
        m = m_new
    lse = m + torch.log(s)  # [T]
    mean_x = w / s if w is not None else None  # [T]  E_p[x]
    return lse, s, mean_x


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor, chunk: int, entropy: bool) -> Any:
        lse, _, mean_x = _scan(logits, inv_t, chunk, entropy)
        x_tgt = logits.gather(-1, targets[:, None])[:, 0].to(lse.dtype) * inv_t  # [T]
        logp = x_tgt - lse  # [T]
        ent = lse - mean_x if mean_x is not None else None  # [T]
        ctx.save_for_backward(logits, targets, inv_t, lse, mean_x if mean_x is not None else lse.new_empty(0))
        ctx.chunk, ctx.entropy = chunk, entropy
        if ent is None:
            return logp, None
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> Any:
        logits, targets, inv_t, lse, mean_x = ctx.saved_tensors
        t_len, vocab = logits.shape
        grad = torch.empty_like(logits)  # [T, V] the one full-size tensor: d logits for the output layer
        acc = _acc(logits.dtype)
        g_lp = g_logp.to(acc) if g_logp is not None else None  # [T]
        g_h = g_ent.to(acc) if (g_ent is not None and ctx.entropy) else None  # [T]
        rows = torch.arange(t_len, device=logits.device)
        for c0 in range(0, vocab, ctx.chunk):
            c1 = min(c0 + ctx.chunk, vocab)
            x = logits[:, c0:c1].to(acc) * inv_t[:, None]  # [T, C]
            p = torch.exp(x - lse[:, None])  # [T, C]
            d = torch.zeros_like(p)  # [T, C]
            if g_lp is not None:
                d -= g_lp[:, None] * p
                hit = (targets >= c0) & (targets < c1)
                d[rows[hit], targets[hit] - c0] += g_lp[hit]
            if g_h is not None:
                d -= g_h[:, None] * p * (x - mean_x[:, None])
            grad[:, c0:c1] = (d * inv_t[:, None]).to(grad.dtype)
        return grad, None, None, None, None


def token_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    *,
    chunk: int = 2048,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) [T], entropy [T] or None) of ``softmax(logits / temperature)``, differentiable.

    Accumulates in float32 (float64 for float64 logits).

    ``logits`` [T, V] (any float dtype; not modified), ``targets`` [T] int64, ``temperature`` [T] (> 0).
    ``chunk``: vocabulary columns per step (verl's ``entropy_from_logits_chunk_size``).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits.shape={tuple(logits.shape)}: expected [T, V]")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r}: pass a positive number of vocabulary columns (e.g. 2048)")
    inv_t = 1.0 / temperature.to(device=logits.device, dtype=_acc(logits.dtype))  # [T]
    logp, ent = _ChunkedLogprobEntropy.apply(logits, targets.to(logits.device), inv_t, chunk, bool(entropy))
    return logp, ent


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy [T] of softmax over the full vocabulary from this TP rank's shard z [T, Vl], differentiable.

    Forward: m = max_v z (MAX over TP), s = Σ e^(z-m), w = Σ e^(z-m)·z (SUM over TP), H = log s + m − w/s.
    Backward (no communication: each TP rank writes its own columns): dH/dz_v = −p_v (log p_v + H).
    """

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        m = z.max(dim=-1).values  # [T]
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(z - m[:, None])  # [T, Vl]
        sw = torch.stack([e.sum(-1), (e * z).sum(-1)])  # [2, T]
        dist.all_reduce(sw, op=dist.ReduceOp.SUM, group=group)
        lse = m + torch.log(sw[0])  # [T]
        ent = lse - sw[1] / sw[0]  # [T]
        ctx.save_for_backward(z, lse, ent)
        return ent

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:  # type: ignore[override]
        z, lse, ent = ctx.saved_tensors
        logp = z - lse[:, None]  # [T, Vl]
        return -g[:, None] * logp.exp() * (logp + ent[:, None]), None


def tp_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    tp_group: dist.ProcessGroup,
    *,
    chunk: int = 2048,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs_entropy` for logits sharded over the vocabulary by tensor parallelism.

    ``logits`` [T, V/TP] is this TP rank's shard (Megatron's output layer), ``targets`` [T] global ids,
    ``tp_group`` the TP group (explicit).  TP = 1: the chunked path above.  TP > 1: log-probs through
    :func:`hdp.trainer.model.vocab_parallel_logprobs` on the temperature-scaled float32 shard (one [T, V/TP]
    tensor) and the entropy through a vocab-parallel autograd function; every TP rank gets the same values.
    """
    if tp_group is None:
        raise ValueError("tp_logprobs_entropy: tp_group=None; pass the tensor-parallel group explicitly")
    if dist.get_world_size(tp_group) == 1:
        return token_logprobs_entropy(logits, targets, temperature, chunk=chunk, entropy=entropy)
    from hdp.trainer.model import vocab_parallel_logprobs

    inv_t = 1.0 / temperature.to(device=logits.device, dtype=torch.float32)  # [T]
    z = logits.float() * inv_t[:, None]  # [T, V/TP]
    logp = vocab_parallel_logprobs(z, targets.to(logits.device), tp_group)  # [T]
    ent = _VocabParallelEntropy.apply(z, tp_group) if entropy else None  # [T]
    return logp, ent
