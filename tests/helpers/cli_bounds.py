"""Definitions more than one test module needs (a test module never imports another), moved out of
test_cli_bounds.py; used by tests/distributed/trainer/test_cli_bounds_dist.py,
tests/unit/trainer/test_cli_bounds.py."""

from __future__ import annotations


# ------------------------------------------------------------------------------------------ layouts

QWEN, DENSE = "qwen3-235b-a22b", "dense-8b"  # 94 layers, 128 experts; 32 layers, dense
LAYOUTS = [
    (DENSE, "tp1,pp7", ("pp=7", "32 layers", "choose pp in 1, 2, 3, 4, 8, 11, 16, 17, 32")),
    (QWEN, "tp1,pp8,ep32", ("ep=32", "do not divide the 16 ranks", "choose ep x etp dividing 16")),
    (DENSE, "tp1,pp8,ep16", ("dense", "ep=16", "set ep=1")),
    (DENSE, "tp1,pp1,vpp2", ("vpp=2 with pp=1", "set pp >= 2, or vpp=1")),
    (DENSE, "tp1,pp8,vpp3", ("pp=8 x vpp=3 = 24 virtual stages", "32 layers", "choose pp x vpp dividing 32")),
    (QWEN, "tp1,pp8,etp3", ("etp=3", "ep x etp = 3", "choose ep x etp dividing 16")),
    (QWEN, "tp1,tp8,pp8", ("tp is given twice (tp1 and tp8)", "give each key once")),
]
