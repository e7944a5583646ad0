"""Cross-rank plan agreement and pre-communication validation.

Invariant 3 (docs/design.md): every rank of the domain computes the same plan from the same lengths and
config (and, with TP and PP, every TP rank and pipeline stage of a domain rank runs that same
plan).  If one rank's plan differs (different lengths, config or code version), the ranks would
post different collectives and hang.  :func:`agree_step`, the one collective before every call of the
engines, catches that with one fixed-size all-reduce that every rank takes part in, so it can never hang
itself, and raises the same ``ValueError`` on every rank naming the ranks whose plan differs.

The other checks here are pure and run before any communication: local ``cu_seqlens`` against the
tensors they describe, and every group of a plan inside the domain.

Dimension legend:
    N   ranks in the domain
    W   words of the gathered digest record (fixed, ``_RECORD``)
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from hdp import device as _device
from hdp.packing.plan import Plan

__all__ = [
    "plan_digest",
    "text_digest",
    "agree_step",
    "Agreed",
    "CallMismatchError",
    "CALL_BYTES",
    "check_cu_seqlens",
    "check_plan_domain",
    "check_plan_budget",
    "collective_device",
]

logger = logging.getLogger(__name__)

# record gathered from every rank: [plan digest, num_samples, num_rounds, num_ranks, data digest]
_RECORD = 5

CALL_BYTES = 480
"""Bytes of each rank's call description gathered when the calls differ (UTF-8, cut at this length)."""


class CallMismatchError(ValueError):
    """The ranks of a job made different engine calls (another method, or other arguments) at the same
    point; raised on every rank by the call's first agreement, before anything ran."""

    def __init__(self, message: str, *, calls: dict[int, str]) -> None:
        super().__init__(message)
        self.calls = calls
        """Rank (of the agreement's group) -> the call it made (cut at :data:`CALL_BYTES`)."""


@dataclass(frozen=True)
class Agreed:
    """What :func:`agree_step` agreed on."""

    failed: list[int]
    """Ranks whose own checks failed (``[]``: none; then the plans, data and calls agree)."""
    vote: int
    """The largest ``vote`` any rank passed (a one-bit decision taken with the agreement)."""


def collective_device(group: dist.ProcessGroup, hint: torch.Tensor | None = None) -> torch.device:
    """Device for a small control tensor on ``group``: ``hint``'s device, else CPU for gloo, else the accelerator."""
    if hint is not None:
        return hint.device
    backend = str(dist.get_backend(group))
    if "gloo" in backend:  # gloo alone, or a "cpu:gloo,cuda:nccl" pair that still serves CPU tensors
        return torch.device("cpu")
    return _device.select_device()


def text_digest(text: str) -> int:
    """Signed 64-bit digest of a string (BLAKE2b): a call's description, a config's fields."""
    value = int.from_bytes(hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest(), "little")
    return value - (1 << 64) if value >= (1 << 63) else value


def plan_digest(plan: Plan) -> int:
    """The plan checksum as a signed 64-bit integer (what :func:`agree_step` compares)."""
    value = int(plan.checksum(), 16)  # 16 hex digits = 64 bits
    return value - (1 << 64) if value >= (1 << 63) else value


def agree_step(
    plan: Plan | None,
    group: dist.ProcessGroup,
    *,
    failed: bool,
    data_digest: int = 0,
    call: str = "",
    vote: int = 0,
    device: torch.device | None = None,
    domain_size: int | None = None,
    label: str = "group rank",
) -> Agreed:
    """One collective before a call: the same call everywhere, any rank's input checks failed, all the same plan and data?

    Every rank of ``group`` calls it, with ``failed=True`` (and ``plan=None``) when its own checks
    failed.  ``call`` describes the engine call and its arguments (``"save_checkpoint(path=..., format=...)"``);
    ``plan`` may be ``None`` for a call without one (a checkpoint).  One ``all_reduce`` (MAX) of the
    fixed-size int64 record ``[failed, vote, record, −record]`` (``record``: the call's digest, then the
    plan's digest, samples, rounds and ranks, and the data digest).  When the calls differ, a diagnostic
    ``all_gather`` of every rank's call (:data:`CALL_BYTES`) names them and every rank raises
    :class:`CallMismatchError` — whatever failed on any rank: nothing ran.  Else returns
    :class:`Agreed`: the ranks that failed (a diagnostic ``all_gather`` names them, only when some did;
    the caller raises) and the largest ``vote`` (0 or 1: a decision every rank takes alike, such as
    "some rank cannot write this format"); with no failure the plan is checked (``ValueError`` on every
    rank on a mismatch, naming the ranks whose plan differs).  Never hangs: the same collectives
    on every rank whatever their inputs.  ``label`` names the ranks' numbering in messages (ranks of
    ``group``: ``"world rank"`` when it is the whole job).
    """
    if group is None:
        raise ValueError("group=None: pass the process group explicitly (None means the whole world)")
    dev = device if device is not None else collective_device(group)
    n = dist.get_world_size(group)
    rec = [text_digest(call)] + ([0] * _RECORD if plan is None else [
        plan_digest(plan), plan.num_samples, plan.num_rounds, plan.num_ranks, int(data_digest)])
    mine = torch.tensor(rec, dtype=torch.int64, device=dev)  # [1 + W]
    head = torch.tensor([1 if failed else 0, int(vote)], dtype=torch.int64, device=dev)
    both = torch.cat([head, mine, -mine])  # [2 + 2 (1 + W)]
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    host = both.cpu()  # one host read
    k = 1 + _RECORD
    hi, lo = host[2 : 2 + k], -host[2 + k :]
    if hi[0] != lo[0]:
        _raise_call_mismatch(call, group, n, label, dev)
    if int(host[0]):
        flag = head[:1].clone()
        flags = [torch.empty_like(flag) for _ in range(n)]
        dist.all_gather(flags, flag, group=group)
        return Agreed(failed=[r for r, f in enumerate(flags) if int(f.item())], vote=int(host[1]))
    if plan is not None:
        if not torch.equal(hi[1:], lo[1:]):
            _raise_mismatch(mine[1:], group, n, label)
        expect = n if domain_size is None else int(domain_size)
        if plan.num_ranks != expect:
            raise ValueError(
                f"plan.num_ranks={plan.num_ranks} but the domain has {expect} ranks; "
                f"plan with PlannerConfig(num_ranks={expect}, ...) for this domain"
            )
    return Agreed(failed=[], vote=int(host[1]))


def _raise_call_mismatch(call: str, group: dist.ProcessGroup, n: int, label: str, dev: torch.device) -> None:
    """Every rank of ``group`` knows the calls differ: gather each rank's call and name the odd ones."""
    raw = call.encode("utf-8", errors="replace")[:CALL_BYTES]
    mine = torch.frombuffer(bytearray(raw + bytes(CALL_BYTES - len(raw))), dtype=torch.uint8).to(dev)  # [CALL_BYTES]
    table = [torch.empty_like(mine) for _ in range(n)]  # n x [CALL_BYTES]
    dist.all_gather(table, mine, group=group)
    calls = {r: bytes(t.cpu().numpy()).rstrip(b"\x00").decode("utf-8", errors="replace") for r, t in enumerate(table)}
    counts = Counter(calls.values())
    best = max(counts.values())
    ref = next(c for c in calls.values() if counts[c] == best)  # the most common call; ties: the lowest rank's
    by_call: dict[str, list[int]] = {}
    for r, c in calls.items():
        by_call.setdefault(c, []).append(r)
    detail = "; ".join(f"{label}{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]} called {c}"
                       for c, rs in by_call.items())
    odd = [r for r, c in calls.items() if c != ref] or [r for r in range(n) if r != 0]
    raise CallMismatchError(
        f"call mismatch across the {n} ranks of the job: {detail}; {label}s {odd} differ from {best} rank(s). "
        "Nothing was run: every rank must make the same engine calls, in the same order and with the same "
        "arguments",
        calls=calls,
    )


def _raise_mismatch(mine: torch.Tensor, group: dist.ProcessGroup, n: int, label: str = "group rank") -> None:
    """Every rank of ``group`` knows the plans differ: gather the records and name the odd ranks."""
    records = [torch.empty_like(mine) for _ in range(n)]  # N x [W]
    dist.all_gather(records, mine, group=group)
    table = np.stack([r.cpu().numpy() for r in records])  # [N, W]
    keys = [tuple(int(x) for x in row) for row in table]
    counts = Counter(keys)
    # the reference is the most common plan; ties go to the plan of rank 0 of the group
    best = max(counts.values())
    ref = next(key for key in keys if counts[key] == best)
    bad = [r for r, key in enumerate(keys) if key != ref]
    if all(keys[r][:4] == ref[:4] for r in bad):  # same plan, different data
        raise ValueError(
            f"batch data mismatch across the {n} ranks of the group: {label}s {bad} hold different token ids, "
            f"loss masks or extras than {best} rank(s) under the same lengths and plan (data digest "
            f"{ref[4] & ((1 << 64) - 1):016x}; {'; '.join(f'{label} {r}: {keys[r][4] & ((1 << 64) - 1):016x}' for r in bad)}); "
            "every rank must pass the same batch"
        )
    detail = "; ".join(
        f"{label} {r}: digest {keys[r][0] & ((1 << 64) - 1):016x}, {keys[r][1]} samples, "
        f"{keys[r][2]} rounds, num_ranks={keys[r][3]}"
        for r in bad
    )
    raise ValueError(
        f"plan mismatch across the {n} ranks of the group: {label}s {bad} differ from the plan of "
        f"{best} rank(s) (digest {ref[0] & ((1 << 64) - 1):016x}, {ref[1]} samples, {ref[2]} rounds, "
        f"num_ranks={ref[3]}) [{detail}]; every rank must call hdp.packing.plan with the same "
        "lengths and PlannerConfig (same batch, same config, same hdp version)"
    )


def check_cu_seqlens(
    cu_seqlens: torch.Tensor | Sequence[int],
    num_tokens: int,
    *,
    lengths: Sequence[int] | None = None,
    field: str = "cu_seqlens",
) -> None:
    """Raise ``ValueError`` unless ``cu_seqlens`` starts at 0, never decreases and ends at ``num_tokens``.

    With ``lengths`` (the per-sequence local token counts) the differences must equal them too.
    Pure: call it before any communication.
    """
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if not cu or cu[0] != 0:
        raise ValueError(f"{field}={cu}: must start with 0 (one entry per sequence boundary); prepend 0")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{field}={cu}: must be non-decreasing; pass cumulative sequence lengths")
    if cu[-1] != num_tokens:
        raise ValueError(
            f"{field}={cu}: ends at {cu[-1]} but the tensor holds {num_tokens} tokens; "
            "build cu_seqlens from the same local layout as the tensor (hdp.dispatch.local_meta)"
        )
    if lengths is not None:
        diffs = [b - a for a, b in zip(cu, cu[1:])]
        if diffs != [int(x) for x in lengths]:
            raise ValueError(
                f"{field}={cu}: sequence lengths {diffs} differ from the expected {list(lengths)}; "
                "build cu_seqlens from the same local layout as the tensor"
            )


def check_plan_domain(plan: Plan, domain_size: int) -> None:
    """Raise ``ValueError`` unless the plan is for ``domain_size`` ranks and every group lies inside the domain.

    Pure: call it before any communication.
    """
    if plan.num_ranks != domain_size:
        raise ValueError(
            f"plan.num_ranks={plan.num_ranks} but the domain has {domain_size} ranks; "
            f"plan with PlannerConfig(num_ranks={domain_size}, ...)"
        )
    if plan.num_samples == 0:
        return
    start, size = plan.group_start, plan.group_size
    bad = np.flatnonzero((size < 1) | (start < 0) | (start + size > domain_size))
    if bad.size:
        s = int(bad[0])
        raise ValueError(
            f"plan.group_start[{s}]={int(start[s])}, plan.group_size[{s}]={int(size[s])}: the group of sample {s} "
            f"spans ranks outside the domain [0, {domain_size}); re-plan with num_ranks={domain_size}"
        )
    bad_round = np.flatnonzero((plan.round_of < 0) | (plan.round_of >= plan.num_rounds))
    if bad_round.size:
        s = int(bad_round[0])
        raise ValueError(
            f"plan.round_of[{s}]={int(plan.round_of[s])}: outside [0, {plan.num_rounds}); every sample "
            "needs a round (build plans with Plan.from_columns or hdp.packing.plan)"
        )


def check_plan_budget(plan: Plan) -> None:
    """Raise ``ValueError`` when a rank of the plan holds more than ``plan.max_tokens_per_rank`` tokens.

    Pure: every rank holds the same (verified) plan, so every rank raises the same error before
    the round's first collective.  Names the round, the rank, the group and its samples.
    """
    tokens = plan.tokens_per_rank()  # [R, N] exact zigzag counts
    if tokens.size == 0 or int(tokens.max()) <= plan.max_tokens_per_rank:
        return
    r, n = (int(x) for x in np.unravel_index(int(np.argmax(tokens)), tokens.shape))
    group = plan.rounds[r].group_of(n)
    assert group is not None, "a rank with tokens belongs to a group"
    biggest = int(np.argmax(group.lengths))
    need = -(-group.tokens // group.size)
    raise ValueError(
        f"plan round {r}: rank {n} holds {int(tokens[r, n])} tokens > max_tokens_per_rank="
        f"{plan.max_tokens_per_rank} (group ranks {group.start}..{group.start + group.size - 1}, "
        f"samples {list(group.samples)}, longest lengths[{group.samples[biggest]}]="
        f"{group.lengths[biggest]}); give the group at least {need} tokens per rank of budget, "
        "or re-plan with hdp.packing.plan so every sample gets enough ranks"
    )
