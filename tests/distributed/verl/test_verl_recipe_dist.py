"""The distributed tier (other processes) of the tests tests/unit/verl/test_verl_recipe.py describes: its docstring says what they check and how."""

from __future__ import annotations

import pytest

from helpers.verl_recipe import _check_recipe_worker

pytest.importorskip("verl")
pytest.importorskip("mbridge")

"""The recipe's fusion flags: Megatron's two, then MindSpeed's three (the NPU example's keys)."""


def test_recipe_flags_through_verls_worker_equal_hf_and_take_the_fused_kernels(tmp_path) -> None:
    """The recipe's flags (and the NPU example's MindSpeed keys) through verl's worker on EP 2 x a domain of 2
    (2 ranks): built, the fused-kernel stand-ins called by hdp's RoPE and the zero-memory experts on every rank,
    log-probs, entropies, the reference's log-probs, loss and grad norm equal to HF's."""
    _check_recipe_worker(1, tmp_path)


"""verl's own step metrics both engines report: the update (losses, grad norm, entropy), the rollouts and rewards."""
