"""Reference data movement and plan checks for the tests: every rank's chunks of a batch it holds whole
(`select_local`, `unpack_into`), and a redistribution from ranks that each hold only their own samples
(`redistribute`, one ``all_to_all_single`` over the domain group) — the tests' independent ways of placing
tokens, against which :func:`hdp.dispatch.gather_outputs` and :func:`hdp.dispatch.pack` are checked.  Neither
engine uses them (both hand every rank the whole batch), so they live here, not in the package.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hdp.checksum import _RECORD, _raise_mismatch, check_cu_seqlens, collective_device, plan_digest
from hdp.dispatch import LocalMeta, _agree, _check_domain, _check_sample_tensor, local_meta, local_metas, pack
from hdp.packing.plan import Plan

__all__ = ["LocalBatch", "local_metas", "unpack_into", "select_local", "owners_by_modulo", "redistribute", "verify_plan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class LocalBatch:
    """This rank's packed tokens of one round and their metadata."""

    meta: LocalMeta
    """Layout of ``values``."""
    values: torch.Tensor
    """[T, ...] local tokens in the canonical order (per sample: front chunk, back chunk)."""

    def __post_init__(self) -> None:
        if self.values.dim() < 1:
            raise ValueError(f"values.shape={tuple(self.values.shape)}: expected [T, ...] with tokens on dim 0")
        check_cu_seqlens(self.meta.cu_seqlens, int(self.values.shape[0]), field="meta.cu_seqlens")



def unpack_into(meta: LocalMeta, values: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    """Write local ``values`` [T, ...] into per-sample ``outputs[i]`` [L_i, ...] in place (inverse of `pack`)."""
    if values.shape[0] != meta.num_tokens:
        raise ValueError(
            f"values.shape[0]={values.shape[0]}: round {meta.round_index} of rank {meta.rank} holds "
            f"{meta.num_tokens} tokens"
        )
    cu = meta.cu_seqlens.tolist()
    for n, (s, (fs, fe), (bs, be)) in enumerate(zip(meta.samples, meta.front, meta.back)):
        off = cu[n]
        outputs[s][fs:fe] = values[off : off + fe - fs]
        outputs[s][bs:be] = values[off + fe - fs : cu[n + 1]]


def select_local(plan: Plan, rank: int, round_index: int, tensors: Sequence[torch.Tensor]) -> LocalBatch:
    """This rank's chunks of round ``round_index`` from a batch every rank holds; no communication.

    ``tensors[i]`` is caller sample i, ``[L_i, ...]`` with ``L_i == plan.lengths[i]``.  Returns the
    packed local tensor ``[T, ...]`` (per sample of the group in group order: front chunk, then
    back chunk) with its :class:`LocalMeta` (group lengths, k, j, position ids, cu_seqlens, and the
    map ``sample_index``/``position_ids`` back to (sample, token offset)).
    """
    if len(tensors) != plan.num_samples:
        raise ValueError(
            f"len(tensors)={len(tensors)}: the plan has {plan.num_samples} samples; pass one tensor per sample"
        )
    meta = local_meta(plan, rank, round_index)
    return LocalBatch(meta=meta, values=pack(meta, tensors))


def owners_by_modulo(num_samples: int, num_ranks: int) -> np.ndarray:
    """[S] owner rank of each sample when rank r holds the samples with ``i % N == r``."""
    return np.arange(num_samples, dtype=np.int64) % num_ranks



def _digest(values: np.ndarray) -> int:
    """Signed 64-bit digest of an int64 array (compared across ranks)."""
    raw = int.from_bytes(hashlib.sha256(np.ascontiguousarray(values, dtype=np.int64).tobytes()).digest()[:8], "little")
    return raw - (1 << 64) if raw >= (1 << 63) else raw





def _check_shards(
    plan: Plan, shards: Mapping[int, torch.Tensor], mine: set[int], template: torch.Tensor | None
) -> str | None:
    """The first problem with this rank's shards, or None (reported through the header, never raised alone)."""
    if set(shards) != mine:
        missing, extra = sorted(mine - set(shards)), sorted(set(shards) - mine)
        return f"shards keys differ from the samples this rank owns: missing {missing[:8]}, not owned {extra[:8]}"
    try:
        for s, t in shards.items():
            _check_sample_tensor("shards", s, t, int(plan.lengths[s]))
            if template is not None and (t.dtype != template.dtype or t.shape[1:] != template.shape[1:]):
                raise ValueError(f"shards[{s}] has dtype {t.dtype}, shape {tuple(t.shape)}; all shards must agree")
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def redistribute(
    plan: Plan,
    shards: Mapping[int, torch.Tensor],
    domain_group: dist.ProcessGroup,
    *,
    owners: Sequence[int] | np.ndarray | None = None,
    like: torch.Tensor | None = None,
) -> tuple[LocalBatch, ...]:
    """Send every rank its chunks of every round, from ranks that each hold only some samples.

    ``shards`` maps caller sample index -> ``[L_i, ...]`` for exactly the samples this rank owns;
    ``owners[i]`` is the owning domain rank of sample i (default ``i % N``).  One
    ``all_to_all_single`` over ``domain_group`` (after a fixed-size header all-gather that agrees
    on dtype and trailing shape and turns a bad input on any rank into a ``ValueError`` on every
    rank) moves all rounds at once.  ``like`` gives dtype, trailing shape and device when this rank
    owns no sample.  Returns one :class:`LocalBatch` per round, equal to :func:`select_local` on
    the full batch.  Not differentiable (data movement of inputs).

    gloo supports ``all_to_all_single`` with uneven splits on CPU in the supported torch versions,
    so no point-to-point fallback is needed.
    """
    me = _check_domain(plan, domain_group)
    n = plan.num_ranks
    own = owners_by_modulo(plan.num_samples, n) if owners is None else np.asarray(owners, dtype=np.int64)
    error: str | None = None
    if own.shape != (plan.num_samples,) or (own.size and (own.min() < 0 or own.max() >= n)):
        error = (
            f"owners: expected {plan.num_samples} domain ranks in [0, {n}); got shape {own.shape}; "
            "pass one owner per sample (or None for i % N)"
        )
        own = owners_by_modulo(plan.num_samples, n)
    mine = set(np.flatnonzero(own == me).tolist())
    first = next(iter(shards.values()), None) if shards else None
    template = first if first is not None else like
    error = error or _check_shards(plan, shards, mine, template)
    dev = collective_device(domain_group, template)
    dtype, feat = _agree("redistribute", error, template, domain_group, dev, key=_digest(own))
    width = int(np.prod(feat, dtype=np.int64))  # F

    # send side: for every destination, its rounds in order, its canonical tokens of my samples
    send_parts: list[torch.Tensor] = []
    send_sizes = []
    for d in range(n):
        count = 0
        for meta in local_metas(plan, d):
            for s, (fs, fe), (bs, be) in zip(meta.samples, meta.front, meta.back):
                if own[s] == me:
                    t = shards[s].reshape(int(plan.lengths[s]), width)  # [L_i, F]
                    send_parts += [t[fs:fe], t[bs:be]]
                    count += (fe - fs) + (be - bs)
        send_sizes.append(count)
    send = torch.cat(send_parts) if send_parts else torch.empty((0, width), dtype=dtype, device=dev)  # [sum, F]

    # receive side: my canonical tokens over all rounds, grouped by owner (stable)
    metas = local_metas(plan, me)
    sample_of = torch.cat([m.sample_index for m in metas]) if metas else torch.zeros(0, dtype=torch.int64)  # [Tr]
    owner_of = torch.from_numpy(own)[sample_of]  # [Tr]
    recv_sizes = torch.bincount(owner_of, minlength=n).tolist()
    recv = torch.empty((int(sample_of.numel()), width), dtype=dtype, device=dev)  # [Tr, F]
    dist.all_to_all_single(
        recv, send.contiguous(), output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=domain_group
    )
    order = torch.sort(owner_of, stable=True).indices.to(dev)  # [Tr] canonical position of each received row
    local = torch.empty_like(recv)  # [Tr, F]
    local[order] = recv
    out: list[LocalBatch] = []
    off = 0
    for meta in metas:
        vals = local[off : off + meta.num_tokens].reshape(meta.num_tokens, *feat)  # [T, ...]
        out.append(LocalBatch(meta=meta, values=vals))
        off += meta.num_tokens
    logger.debug("redistribute: rank %d sent %s, received %s tokens", me, send_sizes, recv_sizes)
    return tuple(out)


def verify_plan(
    plan: Plan,
    group: dist.ProcessGroup,
    *,
    device: torch.device | None = None,
    domain_size: int | None = None,
) -> None:
    """Check that every rank of ``group`` holds the same plan; raise ``ValueError`` on every rank if not.

    Call it before the first collective of a step.  ``group`` is the domain, or any group whose
    ranks must all run the same plan (the engine passes the whole TP × PP × domain job, so the
    check covers the domain, the pipeline and the TP ranks at once).  One ``all_reduce`` (MAX) of a
    fixed-size int64 record ``[digest, num_samples, num_rounds, num_ranks]`` and its negation
    (so the maximum and the minimum of every field) over the explicit ``group``; only when they
    differ does a second, diagnostic ``all_gather`` name the ranks.  Every rank takes part whatever
    its plan, so the check never hangs.  ``device`` defaults to CPU for gloo groups and the
    accelerator otherwise.  Also raises when the plan's ``num_ranks`` differs from ``domain_size``
    (default: the size of ``group``).
    """
    if group is None:
        raise ValueError("group=None: pass the process group explicitly (None means the whole world)")
    dev = device if device is not None else collective_device(group)
    n = dist.get_world_size(group)
    expect = n if domain_size is None else int(domain_size)
    mine = torch.tensor(
        [plan_digest(plan), plan.num_samples, plan.num_rounds, plan.num_ranks, 0], dtype=torch.int64, device=dev
    )  # [W]
    both = torch.cat([mine, -mine])  # [2W]: max of the fields, and minus their min
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[:_RECORD], -both[_RECORD:]
    if not torch.equal(hi, lo):
        _raise_mismatch(mine, group, n)
    if plan.num_ranks != expect:
        raise ValueError(
            f"plan.num_ranks={plan.num_ranks} but the domain has {expect} ranks; "
            f"plan with PlannerConfig(num_ranks={expect}, ...) for this domain"
        )
    logger.debug("plan %s agreed on %d ranks", plan.checksum(), n)
