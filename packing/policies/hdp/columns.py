"""`Columns`: the plan as the hdp pipeline sees it -- the one type every pass takes and returns.

A *column* is one group of ``width`` contiguous ranks starting at rank ``start`` in round
``round``, running a packed set of samples (width 1 is a plain data-parallel rank); its *height*
is the per-rank time of that set (`Problem.heights`).  Columns are per-column arrays plus the
column of every sample, in the caller's order; a sample not planned yet has column -1 (the
construction pass plans those).  Columns are frozen and their arrays read-only: a pass builds a
new `Columns` and never changes its input.

Shapes: n samples, C columns, R rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hdp.packing.policies.common import Assignment, left_starts

__all__ = ["Columns"]


def _frozen(a: np.ndarray) -> np.ndarray:
    out = np.array(a, dtype=np.int64, copy=True)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class Columns:
    """Per-sample column (-1: not planned yet) and per-column round, first rank and width."""

    col_of: np.ndarray
    """[n] column of every sample, -1 when the sample is not planned yet."""
    round: np.ndarray
    """[C] round of every column."""
    start: np.ndarray
    """[C] first rank of every column's group."""
    width: np.ndarray
    """[C] ranks of every column's group (its samples' CP degree)."""

    def __post_init__(self) -> None:
        for name in ("col_of", "round", "start", "width"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        assert self.round.shape == self.start.shape == self.width.shape
        assert self.col_of.size == 0 or int(self.col_of.max()) < self.round.size

    # ------------------------------------------------------------------------------ build

    @classmethod
    def empty(cls, n: int) -> Columns:
        """n samples, none planned."""
        z = np.zeros(0, dtype=np.int64)
        return cls(col_of=np.full(n, -1, dtype=np.int64), round=z, start=z, width=z)

    @classmethod
    def from_assignment(cls, a: Assignment, num_ranks: int) -> Columns:
        """Columns of a per-sample assignment (round, group start, group size)."""
        key = np.asarray(a.round_of, dtype=np.int64) * (num_ranks + 1) + np.asarray(a.group_start)
        gid, col_of = np.unique(key, return_inverse=True)
        width = np.zeros(gid.size, dtype=np.int64)
        width[col_of] = a.group_size
        return cls(col_of=col_of, round=gid // (num_ranks + 1), start=gid % (num_ranks + 1), width=width)

    @classmethod
    def from_groups(cls, col_of: np.ndarray, round_: np.ndarray, width: np.ndarray) -> Columns:
        """Columns laid out from the left of each round, wider groups first (`left_starts`)."""
        round_, width = np.asarray(round_, dtype=np.int64), np.asarray(width, dtype=np.int64)
        return cls(col_of=col_of, round=round_, start=left_starts(round_, width), width=width)

    # ------------------------------------------------------------------------------ views

    @property
    def n_samples(self) -> int:
        """Samples (planned or not)."""
        return int(self.col_of.size)

    @property
    def n_columns(self) -> int:
        """Columns, empty ones included."""
        return int(self.round.size)

    @property
    def planned(self) -> np.ndarray:
        """[n] True where the sample has a column."""
        return self.col_of >= 0

    @property
    def complete(self) -> bool:
        """Every sample planned."""
        return bool(np.all(self.col_of >= 0))

    def used(self) -> np.ndarray:
        """[C] True for columns holding at least one sample."""
        out = np.zeros(self.n_columns, dtype=bool)
        out[self.col_of[self.col_of >= 0]] = True
        return out

    @property
    def num_rounds(self) -> int:
        """Rounds up to the last one holding a sample (0 when nothing is planned)."""
        used = self.used()
        return int(self.round[used].max()) + 1 if used.any() else 0

    def sample_width(self) -> np.ndarray:
        """[n] group size of every sample (0 where not planned)."""
        return np.where(self.col_of >= 0, self.width[np.maximum(self.col_of, 0)], 0) if self.n_columns else \
            np.zeros(self.n_samples, dtype=np.int64)

    # ------------------------------------------------------------------------------ transform

    def compact(self) -> Columns:
        """Empty columns dropped, rounds without a sample dropped and renumbered in order."""
        used = self.used()
        if used.all() and (self.n_columns == 0 or np.array_equal(np.unique(self.round), np.arange(self.num_rounds))):
            return self
        keep = np.flatnonzero(used)
        remap = np.full(self.n_columns, -1, dtype=np.int64)
        remap[keep] = np.arange(keep.size)
        rounds = np.unique(self.round[keep])
        renum = np.zeros(int(self.round.max(initial=0)) + 1, dtype=np.int64)
        renum[rounds] = np.arange(rounds.size)
        col_of = np.where(self.col_of >= 0, remap[np.maximum(self.col_of, 0)], -1)
        return Columns(col_of=col_of, round=renum[self.round[keep]], start=self.start[keep], width=self.width[keep])

    def relaid(self) -> Columns:
        """The same groups, laid out from rank 0 of each round, wider first (aligned power-of-two
        blocks stay aligned); empty columns and rounds dropped."""
        c = self.compact()
        return Columns(col_of=c.col_of, round=c.round, start=left_starts(c.round, c.width), width=c.width)

    def plus(self, other: Columns, samples: np.ndarray) -> Columns:
        """These columns plus ``other``'s, which plans the given ``samples`` (in their order), in
        rounds after these."""
        base, shift = self.n_columns, self.num_rounds
        col_of = self.col_of.copy()
        col_of[samples] = np.where(other.col_of >= 0, other.col_of + base, -1)
        return Columns(
            col_of=col_of,
            round=np.concatenate([self.round, other.round + shift]),
            start=np.concatenate([self.start, other.start]),
            width=np.concatenate([self.width, other.width]),
        )

    def assignment(self) -> Assignment:
        """Per-sample (round, group start, group size) of a complete plan, rounds renumbered."""
        assert self.complete, "every sample must be planned"
        c = self.compact()
        return Assignment(
            round_of=c.round[c.col_of].copy(), group_start=c.start[c.col_of].copy(), group_size=c.width[c.col_of].copy()
        )

    def valid_layout(self, num_ranks: int, pow2: bool = False) -> bool:
        """Groups of every round disjoint and inside the domain (aligned blocks under ``pow2``)."""
        c = self.compact()
        if c.n_columns == 0:
            return True
        if np.any(c.start < 0) or np.any(c.start + c.width > num_ranks) or np.any(c.width < 1):
            return False
        if pow2 and (np.any(c.width & (c.width - 1)) or np.any(c.start % c.width)):
            return False
        order = np.lexsort((c.start, c.round))
        r, s, w = c.round[order], c.start[order], c.width[order]
        same = r[1:] == r[:-1]
        return bool(np.all(s[:-1][same] + w[:-1][same] <= s[1:][same]))
