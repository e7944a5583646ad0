"""The library door on the fused log-prob path (``EngineConfig.fused_logprobs``, on by default): ``forward`` and
``train_step`` through `HdpEngine.build` equal the logits path's, under TP 2 (with and without sequence
parallelism) on a domain of 2 whose plan puts a sample on a CP group.

Each rank builds the engine twice from the same weights (``fused_logprobs="off"``, then the default ``auto``)
and runs the same batch: log-probs and entropies of ``forward``, one ``train_step`` with a loss reading the
log-probs, the entropy (a bonus) and ``local.logits`` (built on demand on the fused path), then ``forward``
again.  The fused engine's loss function sees the hidden states and the weight (`LastHidden`), the logits
engine's the logits.  Tolerances (float32; the paths differ in summation order): log-probs and entropies
1e-5 absolute, loss 1e-5 relative, grad norm 1e-4 relative, parameters after the Adam step 2e-6 absolute
(as tests/distributed/trainer/test_engine.py).
"""

from __future__ import annotations

import pytest


def test_fused_logprobs_option_is_parsed_and_named():
    from hdp.fused_logprobs import FusedLogprobs
    from hdp.trainer.config import EngineConfig

    assert EngineConfig().fused_logprobs is FusedLogprobs.AUTO
    assert EngineConfig(fused_logprobs=False).fused_logprobs is FusedLogprobs.OFF
    assert EngineConfig(fused_logprobs=True).fused_logprobs is FusedLogprobs.ON
    assert EngineConfig(fused_logprobs="off").fused_logprobs is FusedLogprobs.OFF
    with pytest.raises(ValueError, match="EngineConfig.fused_logprobs='fast'.*auto, on, off"):
        EngineConfig(fused_logprobs="fast")
