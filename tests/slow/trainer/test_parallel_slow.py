"""HdpEngine under TP / PP / EP layouts on gloo: every layout against one process on the whole batch.

World = TP × PP × domain.  Each layout runs the same batch under an hdp plan on the domain (a CP2
ring and single-rank groups) and is compared with a plain one-process Megatron GPT on the whole
batch (same weights, set by global parameter name so every layout starts identically):

* gradients after the rounds (the engine's phases 1–2, then Megatron's ``finalize_model_grads``
  with an all-reduce instead of the reduce-scatter, so every rank holds whole gradients) equal
  the reference's TP shard of each parameter: fp32 round-off, ``rtol=1e-4, atol=1e-6``;
* losses (1e-5 relative), grad norms (1e-5 relative) and parameters after Adam steps through
  ``train_step`` (2e-6 absolute, as in tests/distributed/trainer/test_engine.py);
* forward log-probs in the caller's order (1e-5 absolute) on every rank, whatever its stage;
* checkpoint save -> load -> step equals the uninterrupted run bit for bit.

Spawned runs are shared among checks to keep the suite short: one 4-rank run for PP (1F1B,
interleaved, MoE EP 2 with zero-memory, bad layouts), one for TP, one 8-rank run for TP × PP.
"""

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
