"""`hdp.integrations.verl.batch.SampleRows`: a group's rows of verl's batch, as verl's own
``index_select_tensor_dict`` gives them (every field, nested, dense, non-tensor data and stacks)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.is_nested == b.is_nested, where
        if a.is_nested:
            assert len(a.unbind()) == len(b.unbind()) and all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind())), where
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def test_sample_rows_select_what_verl_selects() -> None:
    from verl.utils import tensordict_utils as tu

    from hdp.integrations.verl.bench import verl_update_batch
    from hdp.integrations.verl.batch import SampleRows

    lengths = [(5, 9), (3, 15), (7, 12), (4, 20), (6, 4), (2, 10)]
    data = verl_update_batch(lengths, 0, max_token_len_per_gpu=64)
    tu.assign_non_tensor(data, batch_num_tokens=57, dp_size=1)  # what the engine adds before its rounds
    data["uid"] = tu.get_tensordict({}, non_tensor_dict={"uid": [f"u{i}" for i in range(len(lengths))]})["uid"]
    rows = SampleRows(data)
    for samples in ([3], [5, 0, 2], [1, 4, 3, 0], list(range(len(lengths)))):
        want = tu.index_select_tensor_dict(data, samples)
        got = rows.select(samples)
        assert got.batch_size == want.batch_size
        assert set(got.keys()) == set(want.keys())
        for key in want.keys():
            _same(want[key], got[key], f"samples {samples}, field {key}")
