"""verl's ``actor_rollout_ref.model.use_fused_kernels=True`` on the hdp engine: hdp's fused log-prob path
(`hdp.fused_logprobs`: log-probs, entropies and Σp² from the last hidden states and the output weight, never
the [T, V/TP] logits), driven by verl's own ``ActorRolloutRefWorker`` under TP 2 (sequence parallel) x a
domain of 2 whose plan puts a sample on a CP group.

Reference: the HF ``transformers`` model (float32) on the same checkpoint, every sample whole in one process,
and verl's ``ppo_loss`` with ``dp_size = 1`` (tests/distributed/verl/test_verl_worker_path.py
tests/slow/verl/test_verl_worker_path_slow.py's ``_hf_reference``).
Tolerances as there: log-probs, entropies and Σp² 2e-5 absolute, loss 1e-5 relative, grad norm 1e-4 relative.
Also here: each of verl's ``fused_kernel_options`` honoured or refused by name.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")


@pytest.mark.parametrize(("options", "needle"), [
    ({"impl_backend": "triton"}, "actor_rollout_ref.model.fused_kernel_options.impl_backend='triton'"),
    ({"impl_backend": "liger"}, "impl_backend='liger'"),
    ({"chunk_size": 512}, "actor_rollout_ref.model.fused_kernel_options.chunk_size=512"),
])
def test_fused_kernel_options_are_honoured_or_refused_by_name(options, needle) -> None:
    """What verl's worker hands the engine: the model config's ``use_fused_kernels`` and ``fused_kernel_options``
    (the engine checks them at construction, before any collective)."""
    from types import SimpleNamespace

    from hdp.integrations.verl.checks import check_model_features

    engine = SimpleNamespace(use_fused_kernels=True, override_transformer_config={}, forward_only=False, role=None)
    for fine in ({}, {"impl_backend": "torch"}, {"impl_backend": None}):
        check_model_features(SimpleNamespace(fused_kernel_options=fine, mtp=None, hf_config=None), engine)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        check_model_features(SimpleNamespace(fused_kernel_options=options, mtp=None, hf_config=None), engine)
    off = SimpleNamespace(use_fused_kernels=False, override_transformer_config={}, forward_only=False, role=None)
    check_model_features(SimpleNamespace(fused_kernel_options=options, mtp=None, hf_config=None), off)  # inert when off
