"""The slow tier (over ~20 s) of the tests tests/distributed/trainer/test_model_families.py describes: its docstring says what they check and how."""

from __future__ import annotations

import pytest

from helpers.model_families import VERL, _check

pytest.importorskip("transformers")

from helpers.dist_helper import run_distributed  # noqa: E402


def _verl(rank: int, world: int, name: str, root: str) -> dict:
    from hdp.integrations.verl.scaffolding.families import verl_door

    return verl_door(rank, world, name, root)


@pytest.mark.parametrize("name", VERL)
def test_verl_worker_path_matches_hf(name: str, tmp_path) -> None:
    pytest.importorskip("verl")
    pytest.importorskip("mbridge")
    _check(run_distributed(_verl, 2, name, str(tmp_path), timeout=300), name)
