"""The slow tier (over ~20 s) of the tests tests/distributed/trainer/test_parallel.py describes: its docstring says what they check and how."""

from __future__ import annotations

import os

from helpers.dist_helper import run_distributed

from helpers.parallel import _batch, _layout_run, _reference


# ---- TP 2 x PP 2 x domain 2 (8 ranks) -------------------------------------------------------------------


def _tp_pp(rank: int, world: int, tmp: str) -> None:
    batches = [_batch(0), _batch(1)]
    ref = _reference(batches, 2)
    _layout_run(dict(tp=2, pp=2), ref, batches, "tp2 pp2", ckpt=os.path.join(tmp, "tp2pp2"))


def test_tp2_pp2_domain2_on_8_ranks(tmp_path) -> None:
    """TP 2 (sequence parallel) x PP 2 x domain 2 on 8 gloo ranks (+ forward log-probs, checkpoint resume)."""
    run_distributed(_tp_pp, 8, str(tmp_path), timeout=900)
