"""Token log-probs, entropies and Σp² from the last hidden states and the output layer's weight, never
holding the logits [T, V/TP]: the *fused* log-prob path of both engines.

:mod:`hdp.logprobs` streams over logits Megatron's output layer already built: [T, V/TP] in the model's
dtype, and in backward their gradient of the same size (at T = 16K tokens and V = 151,936 that is ~4.9 GB
of bf16 logits plus ~4.9 GB of gradient per rank).  Here the output layer's matrix product is part of the
chunked computation: per token chunk × vocabulary chunk the logits are computed on the fly from the
hidden states and this TP rank's weight rows, folded into the same online log-sum-exp, and dropped.

Legend: T tokens of this rank's round, H hidden size, V vocabulary, TP tensor-parallel size, Vl = V / TP
the weight rows of this TP rank's shard (columns ``[rank·Vl, (rank+1)·Vl)`` of the logits), Tc tokens and
C vocabulary columns per chunk.

Forward, per vocabulary chunk c and token chunk i (the same online (m, s, w) as `hdp.logprobs`):

    x    = (h[i] @ W[c]ᵀ) · (1 / t[i])                       [Tc, C] logits of the chunk, temperature-scaled
                                                              (the product in the model's dtype, as the
                                                              output layer's, then float32 / float64)
    m'   = max(m, max_c x);  s = s·e^(m−m') + Σ_c e^(x−m');  w = w·e^(m−m') + Σ_c e^(x−m')·x
    x_target taken from the chunk whose columns hold the target
    TP:  M = max over ranks of m (MAX);  s, w ·= e^(m−M) summed (SUM);  x_target summed (SUM)
    lse  = M + log s;   logp = x_target − lse;   H = lse − w / s

Backward (no communication: every TP rank holds the same upstream gradients), recomputing each chunk:

    p    = e^(x − lse)                                        [Tc, C]
    d    = (1/t) · ( g_logp · (onehot − p)  −  g_H · p · (x − E_p[x]) )     = d logits[i, c]
    dh[i] += d @ W[c]        (float32 accumulator [T, H]: this shard's part of the hidden states' gradient)
    dW[c] += dᵀ @ h[i]       (float32 accumulator [C, H], written once per vocabulary chunk)

``dh`` is this TP rank's partial sum over its vocabulary shard; the sum over the TP group is the output
layer's usual input-gradient reduction, which the caller's TP mapping does in its backward (Megatron's
``copy_to_tensor_model_parallel_region`` all-reduces it, ``gather_from_sequence_parallel_region``
reduce-scatters it to the sequence-parallel rows: `hdp.megatron_compat.head`).  Memory beyond the inputs:
O(Tc · C) per chunk, the [T] statistics, and in backward the [T, H] and [C, H] float32 accumulators —
nothing of T · Vl elements, forward or backward.  The matrix products run twice per chunk in backward
(the recomputed logits, then dh and dW): about 4/3 of the logits path's output-layer FLOPs for a training
round, the same for a log-prob pass.

`fused_sum_pi_squared` is `hdp.logprobs.sum_pi_squared` on the same chunks (forward only).

`LastHidden` is what the round core hands a loss adapter on this path (the hidden states and the weight
shard), and `token_logprobs_entropy` / `token_sum_pi_squared` take either it or logits, so an adapter
has one call for both paths.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hdp.logprobs import DEFAULT_CHUNK, logprobs_entropy, sum_pi_squared

__all__ = ["FusedLogprobs", "LastHidden", "fused_logprobs_entropy", "fused_sum_pi_squared", "token_logprobs_entropy",
           "token_sum_pi_squared", "DEFAULT_TOKEN_CHUNK", "DEFAULT_CHUNK"]

DEFAULT_TOKEN_CHUNK = 4096
"""Tokens per chunk: with ``DEFAULT_CHUNK`` columns a float32 chunk is 64 MB."""


class FusedLogprobs(enum.Enum):
    """Which log-prob path a door runs: ``auto`` (the fused path wherever the model's output layer allows it
    exactly), ``on`` (the fused path; an output layer it cannot replace exactly is an error), ``off`` (the
    logits path, `hdp.logprobs`)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    @classmethod
    def parse(cls, value: Any, field_name: str) -> "FusedLogprobs":
        """``value`` (a member, its name, or a bool: True = on, False = off) as a member; ValueError naming
        ``field_name``, the value and the choices."""
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            return cls.ON if value else cls.OFF
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{field_name}={value!r} is unknown; choose one of: auto, on, off (or True / False)") from None


@dataclass(frozen=True, eq=False)
class LastHidden:
    """The last pipeline stage's output on the fused path: what the output layer would multiply.

    ``hidden`` [T, H]: the final hidden states of this rank's tokens, whole on every TP rank (gathered over
    the sequence-parallel rows), differentiable; ``weight`` [Vl, H]: this TP rank's rows of the output layer's
    weight (the embedding's under tied embeddings), the parameter itself.  Its logits are
    ``hidden @ weight.T`` [T, Vl], which `logits` builds on demand."""

    hidden: torch.Tensor
    weight: torch.Tensor

    def __getitem__(self, rows: slice) -> "LastHidden":
        """The same head on the rows ``rows`` of the hidden states (``out[: real]``)."""
        return LastHidden(self.hidden[rows], self.weight)

    @property
    def shape(self) -> tuple[int, int]:
        """(T, Vl): the shape of the logits this stands for."""
        return int(self.hidden.shape[0]), int(self.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def logits(self) -> torch.Tensor:
        """[T, Vl] the logits, materialised and differentiable (the memory the fused path avoids)."""
        return self.hidden @ self.weight.t()


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs (exact checks), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _inv_temperature(temperature: torch.Tensor | float | None, t_len: int, acc: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """[T] 1 / temperature (a scalar or [T]; ``None`` is 1)."""
    if temperature is None:
        return torch.ones(t_len, dtype=acc, device=device)
    temp = torch.as_tensor(temperature, dtype=acc, device=device)
    return (1.0 / temp).expand(t_len).contiguous() if temp.dim() == 0 else 1.0 / temp


def _check(hidden: torch.Tensor, weight: torch.Tensor, tp_group: Any, chunk: Any, token_chunk: Any, what: str) -> None:
    if tp_group is None:
        raise ValueError(f"{what}: tp_group=None; pass the tensor-parallel group explicitly")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{what}: hidden.shape={tuple(hidden.shape)}, weight.shape={tuple(weight.shape)}: expected "
                         "hidden [T, H] and weight [V/TP, H]")
    for name, value in (("chunk", chunk), ("token_chunk", token_chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what}: {name}={value!r}: pass a positive integer (e.g. 4096)")


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _logits(h: torch.Tensor, w: torch.Tensor, inv_t: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """[Tc, C] x = (h @ wᵀ) · inv_t in ``acc``: the product in the inputs' dtype, as the output layer's, then
    one multiplication by the ``acc`` [Tc] column, which promotes it (one pass over the chunk)."""
    assert inv_t.dtype == acc
    return (h @ w.t()) * inv_t[:, None]


def _tp_combine(m: torch.Tensor, parts: list[torch.Tensor], scaled: list[bool], group: dist.ProcessGroup
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The shards' online statistics combined over the TP group: M = max over ranks of m, and each [T] part
    summed over ranks, first rescaled by e^(m−M) where ``scaled`` says so (sums of e^(x−m)), as is otherwise
    (the target logit, non-zero on one rank only)."""
    if dist.get_world_size(group) == 1:
        return m, parts
    big = m.clone()
    dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
    scale = torch.exp(m - big)  # [T]
    red = torch.stack([p * scale if sc else p for p, sc in zip(parts, scaled)])  # [k, T]
    dist.all_reduce(red, op=dist.ReduceOp.SUM, group=group)
    return big, list(red.unbind(0))


class _FusedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                inv_t: torch.Tensor, chunk: int, token_chunk: int, entropy: bool, group: dist.ProcessGroup,
                offset: int) -> Any:
        ctx.set_materialize_grads(False)  # an output nobody used gets no gradient (None), not zeros
        t_len, rows = hidden.shape[0], weight.shape[0]
        acc = _acc(hidden.dtype)
        dev = hidden.device
        m = torch.full((t_len,), float("-inf"), dtype=acc, device=dev)  # [T] running max
        s = torch.zeros(t_len, dtype=acc, device=dev)  # [T] Σ e^(x−m)
        w = torch.zeros(t_len, dtype=acc, device=dev) if entropy else None  # [T] Σ e^(x−m)·x
        x_tgt = torch.zeros(t_len, dtype=acc, device=dev)  # [T] the target's logit (0 off this shard)
        local_t = targets - offset  # [T] the target's row of this shard (outside [0, Vl) elsewhere)
        for c0, c1 in _chunks(rows, chunk):
            w_c = weight[c0:c1]  # [C, H]
            for i0, i1 in _chunks(t_len, token_chunk):
                x = _logits(hidden[i0:i1], w_c, inv_t[i0:i1], acc)  # [Tc, C]
                lt = local_t[i0:i1]
                hit = (lt >= c0) & (lt < c1)  # [Tc] the target's column is in this chunk
                picked = x.gather(1, (lt - c0).clamp(0, c1 - c0 - 1)[:, None])[:, 0]  # [Tc]
                x_tgt[i0:i1] = torch.where(hit, picked, x_tgt[i0:i1])
                m_old = m[i0:i1]
                m_new = torch.maximum(m_old, x.max(dim=-1).values)  # [Tc]
                scale = torch.exp(m_old - m_new)  # [Tc]; exp(-inf) = 0 on the first chunk
                e = (x - m_new[:, None]).exp_()  # [Tc, C]
                s[i0:i1] = s[i0:i1] * scale + e.sum(-1)
                if w is not None:
                    w[i0:i1] = w[i0:i1] * scale + torch.einsum("ij,ij->i", e, x)  # Σ_c e·x, one pass
                m[i0:i1] = m_new
                del x, e
        parts = [s, x_tgt] + ([w] if w is not None else [])
        m, parts = _tp_combine(m, parts, [True, False, True], group)
        s, x_tgt = parts[0], parts[1]
        w = parts[2] if w is not None else None
        lse = m + torch.log(s)  # [T]
        logp = x_tgt - lse  # [T]
        mean_x = w / s if w is not None else None  # [T] E_p[x]
        ent = lse - mean_x if mean_x is not None else None  # [T]
        ctx.save_for_backward(hidden, weight, targets, inv_t, lse, mean_x if mean_x is not None else lse.new_empty(0))
        ctx.chunk, ctx.token_chunk, ctx.entropy, ctx.offset = chunk, token_chunk, entropy, offset
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> Any:  # type: ignore[override]
        hidden, weight, targets, inv_t, lse, mean_x = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        t_len, rows = hidden.shape[0], weight.shape[0]
        acc = lse.dtype
        g_lp = g_logp.to(acc) if g_logp is not None else None  # [T]
        g_h = g_ent.to(acc) if (g_ent is not None and ctx.entropy) else None  # [T]
        if (g_lp is None and g_h is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None, None, None
        dh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None  # [T, H]
        dw = torch.empty_like(weight) if need_w else None  # [Vl, H] the weight shard's gradient
        local_t = targets - ctx.offset  # [T]
        for c0, c1 in _chunks(rows, ctx.chunk):
            w_c = weight[c0:c1]  # [C, H]
            dw_c = torch.zeros(w_c.shape, dtype=acc, device=weight.device) if need_w else None  # [C, H]
            for i0, i1 in _chunks(t_len, ctx.token_chunk):
                h_i = hidden[i0:i1]  # [Tc, H]
                it = inv_t[i0:i1]  # [Tc]
                x = _logits(h_i, w_c, it, acc)  # [Tc, C]
                d = (x - lse[i0:i1, None]).exp_()  # [Tc, C] p
                # d logits = (1/t)·(g·onehot − p·(g + g_H·(x − E_p[x]))), the per-row factors folded in place
                if g_h is not None:
                    coef = x.sub_(mean_x[i0:i1, None]).mul_((-g_h[i0:i1] * it)[:, None])  # −(1/t)·g_H·(x − E)
                    if g_lp is not None:
                        coef.sub_((g_lp[i0:i1] * it)[:, None])  # − (1/t)·g
                    d.mul_(coef)
                    del coef
                else:
                    d.mul_((-g_lp[i0:i1] * it)[:, None])  # −(1/t)·g·p
                if g_lp is not None:
                    lt = local_t[i0:i1]
                    hit = (lt >= c0) & (lt < c1)
                    d.scatter_add_(1, (lt - c0).clamp(0, c1 - c0 - 1)[:, None],
                                   (g_lp[i0:i1] * it * hit)[:, None])  # + (1/t)·g at the target
                del x
                d = d.to(hidden.dtype)  # [Tc, C] d logits in the model's dtype
                if dh is not None:
                    dh[i0:i1] += (d @ w_c).to(acc)  # [Tc, H]
                if dw_c is not None:
                    dw_c += (d.t() @ h_i).to(acc)  # [C, H]
                del d
            if dw is not None:
                dw[c0:c1] = dw_c.to(dw.dtype)
        return (dh.to(hidden.dtype) if dh is not None else None, dw, None, None, None, None, None, None, None)


def _offset(tp_group: dist.ProcessGroup, rows: int) -> int:
    return dist.get_rank(tp_group) * rows if dist.get_world_size(tp_group) > 1 else 0


def fused_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup,
    *,
    temperature: torch.Tensor | float | None = None,
    entropy: bool = False,
    chunk: int = DEFAULT_CHUNK,
    token_chunk: int = DEFAULT_TOKEN_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) [T], entropy [T] or ``None``) of ``softmax(hidden @ weight.T / temperature)`` over the
    full vocabulary, differentiable in both outputs with respect to ``hidden`` and ``weight``, without
    building the [T, Vl] logits or their gradient.

    ``hidden`` [T, H]: the final hidden states (whole on every TP rank); ``weight`` [Vl, H]: this TP rank's
    rows of the output layer's weight (rows ``[rank·Vl, (rank+1)·Vl)`` of the vocabulary; all of it without
    TP).  ``targets`` [T] global token ids.  ``tp_group``: the tensor-parallel group the vocabulary is
    sharded over (explicit; a one-rank group without TP) — collective over it (two all-reduces), every TP
    rank gets the same values.  The gradient of ``hidden`` is this rank's part of the sum over the TP group
    (see the module docstring: the caller's TP mapping sums it).  ``temperature``: a scalar or [T] (> 0);
    ``None`` is 1.  ``chunk``: vocabulary columns per step; ``token_chunk``: tokens per step.  ``hidden`` is
    cast to the weight's dtype first (the products run in it).  Values equal `hdp.logprobs.logprobs_entropy`
    of ``hidden @ weight.T`` up to the summation order.
    """
    _check(hidden, weight, tp_group, chunk, token_chunk, "fused_logprobs_entropy")
    hidden = hidden.to(weight.dtype)  # Megatron's Float16Module hands the last stage's output over in float32
    acc = _acc(hidden.dtype)
    inv_t = _inv_temperature(temperature, hidden.shape[0], acc, hidden.device)  # [T]
    targets = targets.to(device=hidden.device, dtype=torch.int64)
    return _FusedLogprobEntropy.apply(hidden, weight, targets, inv_t, chunk, token_chunk, bool(entropy), tp_group,
                                      _offset(tp_group, weight.shape[0]))


@torch.no_grad()
def fused_sum_pi_squared(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tp_group: dist.ProcessGroup,
    *,
    temperature: torch.Tensor | float | None = None,
    chunk: int = DEFAULT_CHUNK,
    token_chunk: int = DEFAULT_TOKEN_CHUNK,
) -> torch.Tensor:
    """Σ_v p_v² [T] of ``softmax(hidden @ weight.T / temperature)`` over the full vocabulary (verl's
    ``calculate_sum_pi_squared``), not differentiable, in token × vocabulary chunks: with q = Σ e^(2(x−m))
    rescaled by e^(2(m−m')) as m grows and, over TP, q·e^(2(m−M)) summed, Σ p² = q / s².  Arguments as
    `fused_logprobs_entropy`; collective over ``tp_group``."""
    _check(hidden, weight, tp_group, chunk, token_chunk, "fused_sum_pi_squared")
    hidden = hidden.to(weight.dtype)
    t_len, rows = hidden.shape[0], weight.shape[0]
    acc = _acc(hidden.dtype)
    inv_t = _inv_temperature(temperature, t_len, acc, hidden.device)  # [T]
    m = torch.full((t_len,), float("-inf"), dtype=acc, device=hidden.device)  # [T]
    s = torch.zeros(t_len, dtype=acc, device=hidden.device)  # [T] Σ e^(x−m)
    q = torch.zeros(t_len, dtype=acc, device=hidden.device)  # [T] Σ e^(2(x−m))
    for c0, c1 in _chunks(rows, chunk):
        w_c = weight[c0:c1]  # [C, H]
        for i0, i1 in _chunks(t_len, token_chunk):
            x = _logits(hidden[i0:i1], w_c, inv_t[i0:i1], acc)  # [Tc, C]
            m_old = m[i0:i1]
            m_new = torch.maximum(m_old, x.max(dim=-1).values)  # [Tc]
            scale = torch.exp(m_old - m_new)  # [Tc]
            e = torch.exp(x - m_new[:, None])  # [Tc, C]
            s[i0:i1] = s[i0:i1] * scale + e.sum(-1)
            q[i0:i1] = q[i0:i1] * scale * scale + (e * e).sum(-1)
            m[i0:i1] = m_new
    if dist.get_world_size(tp_group) > 1:
        big = m.clone()
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=tp_group)
        scale = torch.exp(m - big)  # [T]
        red = torch.stack([s * scale, q * scale * scale])  # [2, T]
        dist.all_reduce(red, op=dist.ReduceOp.SUM, group=tp_group)
        s, q = red[0], red[1]
    return q / (s * s)  # [T]


def token_logprobs_entropy(out: torch.Tensor | LastHidden, targets: torch.Tensor, tp_group: dist.ProcessGroup, *,
                           temperature: torch.Tensor | float | None = None, entropy: bool = False,
                           chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [T], entropies [T] or ``None``) of a round's output on either path: `fused_logprobs_entropy`
    of a `LastHidden`, `hdp.logprobs.logprobs_entropy` of logits [T, Vl]."""
    if isinstance(out, LastHidden):
        return fused_logprobs_entropy(out.hidden, out.weight, targets, tp_group, temperature=temperature,
                                      entropy=entropy, chunk=chunk)
    return logprobs_entropy(out, targets, tp_group, temperature=temperature, entropy=entropy, chunk=chunk)


def token_sum_pi_squared(out: torch.Tensor | LastHidden, tp_group: dist.ProcessGroup, *,
                         temperature: torch.Tensor | float | None = None, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Σ_v p_v² [T] of a round's output on either path (`fused_sum_pi_squared` / `hdp.logprobs.sum_pi_squared`)."""
    if isinstance(out, LastHidden):
        return fused_sum_pi_squared(out.hidden, out.weight, tp_group, temperature=temperature, chunk=chunk)
    return sum_pi_squared(out, tp_group, temperature=temperature, chunk=chunk)

