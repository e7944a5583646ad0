"""Input the ``hdp`` command cannot honour is refused at once, with exit 2 and one line naming the flag, the
value and the fix: lengths files past their caps, impossible layouts, counts of zero or below.  Run as users
run it, in a subprocess."""

from __future__ import annotations

import pytest

from hdp.packing.memory import MemoryLayout, model_for

from helpers.cli_bounds import DENSE, LAYOUTS, QWEN


"""Benches of this project's CI, outside the wheel: ``python -m benchmarks NAME`` from the checkout's root."""


def test_layout_checks_belong_to_the_layout_so_every_door_has_them() -> None:
    """The library door (`MemoryLayout` / `MemoryModel`, as the engines build them) refuses the same layouts."""
    for shape, layout, needles in LAYOUTS:
        with pytest.raises(ValueError) as err:
            model_for(shape, MemoryLayout.parse(layout, domain=16))
        assert all(n in str(err.value) for n in needles), (layout, str(err.value))
    with pytest.raises(ValueError, match="vpp=2 with pp=1"):
        MemoryLayout(vpp=2)
    with pytest.raises(ValueError, match="do not divide the 4 ranks"):
        MemoryLayout(tp=2, domain=2, ep=8)
    # what Megatron splits stays accepted: 94 layers on PP 8 (11, 12 x 6, 11), PP 2, EP over the stage's TP x domain
    assert [model_for(QWEN, MemoryLayout.parse("tp1,pp8,ep16", domain=16)).layers(s) for s in range(8)] == \
        [11, 12, 12, 12, 12, 12, 12, 11]
    model_for(QWEN, MemoryLayout.parse("tp2,pp2,ep16", domain=8))
    model_for(DENSE, MemoryLayout.parse("tp2,pp4,vpp2", domain=8))
