"""DomainGroups / RingSpec: cached aligned blocks, P2P rings, and errors that name the bad request."""

from __future__ import annotations

import pytest

from hdp.groups import DomainGroups, aligned_blocks


def test_aligned_blocks():
    assert aligned_blocks(1) == []
    assert aligned_blocks(4) == [(0, 2), (2, 2), (0, 4)]
    assert aligned_blocks(6) == [(0, 2), (2, 2), (4, 2), (0, 4)]
    assert (0, 8) in aligned_blocks(8) and (4, 4) in aligned_blocks(8) and (2, 4) not in aligned_blocks(8)


def test_build_rejects_none():
    with pytest.raises(ValueError, match="domain_group=None"):
        DomainGroups.build(None)  # type: ignore[arg-type]
