"""Token log-probs and entropies from (vocabulary-sharded) logits, in vocabulary chunks, differentiable.

The one implementation both engines use: the library engine for ``loss_fn``'s log-probs,
:meth:`hdp.trainer.engine.LocalTensors.entropy` and :meth:`~hdp.trainer.engine.HdpEngine.forward`,
the verl engine for verl's ``log_probs`` / ``entropy``.

Legend: T tokens of this rank's round, V vocabulary, TP tensor-parallel size, Vl = V / TP the columns
of this TP rank's shard, C chunk width (columns per step).

The naive path (``log_softmax(logits.float() / t)``, then ``exp`` and a product for the entropy)
materialises three or four fp32 [T, V] tensors beyond the logits Megatron returns: at V = 151,936
and T = 16K tokens each is ~10 GB.  Here the forward streams over this shard's columns in chunks
of C with an online log-sum-exp (running max m, scaled sum s and, for the entropy, the scaled first
moment w), then combines the shards' (m, s, w) over the TP group:

    x    = logits[:, c] · (1 / t)                                   [T, C] a chunk, temperature-scaled
    m'   = max(m, max_c x);  s = s·e^(m-m') + Σ_c e^(x-m');  w = w·e^(m-m') + Σ_c e^(x-m')·x
    TP:  M = max over ranks of m (MAX);  s, w ·= e^(m-M), summed over ranks (SUM);  x_target summed
         over ranks (only the rank whose columns hold the target contributes)
    lse  = M + log s;   logp = x_target − lse;   H = lse − w / s      (H = −Σ p·log p, E_p[x] = w / s)

so the memory beyond the logits is O(T·C).  The backward needs no communication (every TP rank
holds the same upstream gradients, since the loss is computed alike on all of them): each rank
recomputes its chunks' probabilities and writes its own columns of the one [T, Vl] gradient that
Megatron's output layer needs anyway:

    d logits[:, c] = (1/t) · ( g_logp · (onehot − p)  −  g_H · p · (x − E_p[x]) )

The entropy is computed only when asked for (``entropy=False`` skips w and returns ``None``).
Accumulation is float32 (float64 for float64 logits).

`sum_pi_squared` (verl's optimal-token-baseline estimators read it from the log-prob pass: the path-variance
proxy ``1 − 2·p_t + Σ_v p_v²``) streams the same chunks forward only, with a second moment
q = Σ_c e^(2(x−m')) (rescaled by e^(2(m−m')) as m grows) and, over TP, q·e^(2(m−M)) summed: Σ p² = q / s².
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["logprobs_entropy", "sum_pi_squared", "DEFAULT_CHUNK"]

DEFAULT_CHUNK = 4096
"""Vocabulary columns per step: a [T, 4096] fp32 chunk is 256 MB at T = 16K."""


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 logits (exact checks), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scan(logits: torch.Tensor, inv_t: torch.Tensor, chunk: int, entropy: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This shard's online (m [T], s [T], w [T] or None) over its column chunks."""
    t_len, cols = logits.shape
    acc = _acc(logits.dtype)
    m = torch.full((t_len,), float("-inf"), dtype=acc, device=logits.device)  # [T]
    s = torch.zeros(t_len, dtype=acc, device=logits.device)  # [T]
    w = torch.zeros(t_len, dtype=acc, device=logits.device) if entropy else None  # [T]
    for c0 in range(0, cols, chunk):
        x = logits[:, c0 : c0 + chunk].to(acc) * inv_t[:, None]  # [T, C]
        m_new = torch.maximum(m, x.max(dim=-1).values)  # [T]
        scale = torch.exp(m - m_new)  # [T]; exp(-inf) = 0 on the first chunk
        e = torch.exp(x - m_new[:, None])  # [T, C]
        s = s * scale + e.sum(-1)
        if w is not None:
            w = w * scale + (e * x).sum(-1)
        m = m_new
    return m, s, w


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor, chunk: int,  # type: ignore[override]
                entropy: bool, group: dist.ProcessGroup, offset: int) -> Any:
        m, s, w = _scan(logits, inv_t, chunk, entropy)
        cols = logits.shape[1]
        local = (targets >= offset) & (targets < offset + cols)  # [T] the target is in this shard
        idx = (targets - offset).clamp(0, cols - 1)
        x_tgt = logits.gather(-1, idx[:, None])[:, 0].to(m.dtype) * inv_t * local  # [T]
        if dist.get_world_size(group) > 1:
            big = m.clone()
            dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
            scale = torch.exp(m - big)  # [T]
            parts = [s * scale, x_tgt] + ([w * scale] if w is not None else [])
            red = torch.stack(parts)  # [2 or 3, T]
            dist.all_reduce(red, op=dist.ReduceOp.SUM, group=group)
            m, s, x_tgt = big, red[0], red[1]
            w = red[2] if w is not None else None
        lse = m + torch.log(s)  # [T]
        logp = x_tgt - lse  # [T]
        mean_x = w / s if w is not None else None  # [T] E_p[x]
        ent = lse - mean_x if mean_x is not None else None  # [T]
        ctx.save_for_backward(logits, targets, inv_t, lse, mean_x if mean_x is not None else lse.new_empty(0))
        ctx.chunk, ctx.entropy, ctx.offset = chunk, entropy, offset
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> Any:  # type: ignore[override]
        logits, targets, inv_t, lse, mean_x = ctx.saved_tensors
        t_len, cols = logits.shape
        grad = torch.empty_like(logits)  # [T, Vl] the one full-size tensor: d logits for the output layer
        acc = lse.dtype
        g_lp = g_logp.to(acc) if g_logp is not None else None  # [T]
        g_h = g_ent.to(acc) if (g_ent is not None and ctx.entropy) else None  # [T]
        rows = torch.arange(t_len, device=logits.device)
        local_t = targets - ctx.offset  # [T] target column in this shard (outside [0, Vl) elsewhere)
        for c0 in range(0, cols, ctx.chunk):
            c1 = min(c0 + ctx.chunk, cols)
            x = logits[:, c0:c1].to(acc) * inv_t[:, None]  # [T, C]
            p = torch.exp(x - lse[:, None])  # [T, C]
            d = torch.zeros_like(p)  # [T, C]
            if g_lp is not None:
                d -= g_lp[:, None] * p
                hit = (local_t >= c0) & (local_t < c1)
                d[rows[hit], local_t[hit] - c0] += g_lp[hit]
            if g_h is not None:
                d -= g_h[:, None] * p * (x - mean_x[:, None])
            grad[:, c0:c1] = (d * inv_t[:, None]).to(grad.dtype)
        return grad, None, None, None, None, None, None


def logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup,
    *,
    temperature: torch.Tensor | float | None = None,
    entropy: bool = False,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) [T], entropy [T] or ``None``) of ``softmax(logits / temperature)`` over the full
    vocabulary, differentiable in both outputs.

    ``logits`` [T, Vl]: this TP rank's vocabulary shard (columns ``[rank·Vl, (rank+1)·Vl)``, Megatron's
    output layer; the whole vocabulary without TP); not modified.  ``targets`` [T] global token ids.
    ``tp_group``: the tensor-parallel group the vocabulary is sharded over (explicit; a one-rank group
    without TP) — collective over it, every TP rank gets the same values.  ``temperature``: a scalar or
    [T] (> 0); ``None`` is 1.  ``chunk``: columns per step (verl's ``entropy_from_logits_chunk_size``).
    """
    if tp_group is None:
        raise ValueError("logprobs_entropy: tp_group=None; pass the tensor-parallel group explicitly")
    if logits.dim() != 2:
        raise ValueError(f"logprobs_entropy: logits.shape={tuple(logits.shape)}: expected [T, V/TP]")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"logprobs_entropy: chunk={chunk!r}: pass a positive number of vocabulary columns (e.g. 4096)")
    acc = _acc(logits.dtype)
    t_len = logits.shape[0]
    if temperature is None:
        inv_t = torch.ones(t_len, dtype=acc, device=logits.device)  # [T]
    else:
        temp = torch.as_tensor(temperature, dtype=acc, device=logits.device)
        inv_t = (1.0 / temp).expand(t_len).contiguous() if temp.dim() == 0 else 1.0 / temp  # [T]
    offset = dist.get_rank(tp_group) * logits.shape[1] if dist.get_world_size(tp_group) > 1 else 0
    targets = targets.to(device=logits.device, dtype=torch.int64)
    return _LogprobEntropy.apply(logits, targets, inv_t, chunk, bool(entropy), tp_group, offset)


@torch.no_grad()
def sum_pi_squared(
    logits: torch.Tensor,
    tp_group: dist.ProcessGroup,
    *,
    temperature: torch.Tensor | float | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Σ_v p_v² [T] of ``softmax(logits / temperature)`` over the full vocabulary, not differentiable (verl's
    ``vocab_parallel_sum_pi_squared``, which the log-prob pass computes for its optimal-token-baseline
    estimators), in vocabulary chunks: memory O(T·C) beyond the logits.  Arguments as `logprobs_entropy`;
    collective over ``tp_group``."""
    if tp_group is None:
        raise ValueError("sum_pi_squared: tp_group=None; pass the tensor-parallel group explicitly")
    if logits.dim() != 2:
        raise ValueError(f"sum_pi_squared: logits.shape={tuple(logits.shape)}: expected [T, V/TP]")
    acc = _acc(logits.dtype)
    t_len, cols = logits.shape
    if temperature is None:
        inv_t = torch.ones(t_len, dtype=acc, device=logits.device)  # [T]
    else:
        temp = torch.as_tensor(temperature, dtype=acc, device=logits.device)
        inv_t = (1.0 / temp).expand(t_len) if temp.dim() == 0 else 1.0 / temp  # [T]
    m = torch.full((t_len,), float("-inf"), dtype=acc, device=logits.device)  # [T]
    s = torch.zeros(t_len, dtype=acc, device=logits.device)  # [T] Σ e^(x-m)
    q = torch.zeros(t_len, dtype=acc, device=logits.device)  # [T] Σ e^(2(x-m))
    for c0 in range(0, cols, chunk):
        x = logits[:, c0 : c0 + chunk].to(acc) * inv_t[:, None]  # [T, C]
        m_new = torch.maximum(m, x.max(dim=-1).values)  # [T]
        scale = torch.exp(m - m_new)  # [T]
        e = torch.exp(x - m_new[:, None])  # [T, C]
        s = s * scale + e.sum(-1)
        q = q * scale * scale + (e * e).sum(-1)
        m = m_new
    if dist.get_world_size(tp_group) > 1:
        big = m.clone()
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=tp_group)
        scale = torch.exp(m - big)  # [T]
        red = torch.stack([s * scale, q * scale * scale])  # [2, T]
        dist.all_reduce(red, op=dist.ReduceOp.SUM, group=tp_group)
        s, q = red[0], red[1]
    return q / (s * s)  # [T]
