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
            assert a.dtype == b.dtype and torch.equal(a.offsets(), b.offsets()), where
            assert getattr(a, "_ragged_idx", 1) == getattr(b, "_ragged_idx", 1), where
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def test_sample_rows_select_what_verl_selects() -> None:
    from verl.utils import tensordict_utils as tu

    from benchmarks.verl.bench import verl_update_batch
    from hdp.integrations.verl.batch import SampleRows

    lengths = [(5, 9), (3, 15), (7, 12), (4, 20), (6, 4), (2, 10)]
    data = verl_update_batch(lengths, 0, max_token_len_per_gpu=64)
    tu.assign_non_tensor(data, batch_num_tokens=57, dp_size=1)  # what the engine adds before its rounds
    data["uid"] = tu.get_tensordict({}, non_tensor_dict={"uid": [f"u{i}" for i in range(len(lengths))]})["uid"]
    # a nested field ragged in its second dimension (multi-modal rope positions [3, L_i], verl's ragged_idx 2)
    data["mrope_position_ids"] = tu.nested_tensor_from_tensor_list(
        [torch.arange(3 * (p + r)).reshape(3, p + r) for p, r in lengths], ragged_idx=2)
    # a nested per-response field (a critic's ``values``: its padded width is the longest selected sample's)
    data["values"] = torch.nested.as_nested_tensor([torch.rand(r) for _, r in lengths], layout=torch.jagged)
    rows = SampleRows(data)
    for samples in ([3], [5, 0, 2], [1, 4, 3, 0], list(range(len(lengths)))):
        want = tu.index_select_tensor_dict(data, samples)
        got = rows.select(samples)
        assert got.batch_size == want.batch_size and got.device == want.device
        assert set(got.keys()) == set(want.keys())
        for key in want.keys():
            _same(want[key], got[key], f"samples {samples}, field {key}")
        # what verl's losses do with the rows (``data.select(...).to_padded_tensor()``): the same padding
        keys = ["values", "response_mask", "old_log_probs", "input_ids"]
        padded_want, padded_got = want.select(*keys).to_padded_tensor(), got.select(*keys).to_padded_tensor()
        for key in keys:
            _same(padded_want[key], padded_got[key], f"samples {samples}, field {key} padded")


def test_nested_from_flat_pads_as_as_nested_does() -> None:
    """verl pads the outputs hdp hands back (``to_padded_tensor`` of a TensorDict): the nested tensor made
    from flat rows pads to its longest sample, as ``as_nested_tensor`` of the samples does."""
    from tensordict import TensorDict

    from hdp.integrations.verl import compat

    lengths = [5, 16, 9]
    flat = torch.randn(sum(lengths), 2)  # [Σ L_i, C]
    want = TensorDict({"x": compat.as_nested(list(flat[:, 1].split(lengths)))}, batch_size=[3]).to_padded_tensor()
    got = TensorDict({"x": compat.nested_from_flat(flat[:, 1], lengths)}, batch_size=[3]).to_padded_tensor()
    assert want["x"].shape == (3, 16) and torch.equal(want["x"], got["x"])


def test_same_rows_kept_across_batches_follow_each_batch() -> None:
    """The engine keeps verl's batch-wide settings at each sub-batch size across steps (`SameRows`): a
    later batch with another ``batch_num_tokens`` (verl's normaliser, new every step) selects its own."""
    from verl.utils import tensordict_utils as tu

    from hdp.integrations.verl.batch import SameRows, SampleRows
    from benchmarks.verl.bench import verl_update_batch

    lengths = [(5, 9), (3, 15), (7, 12), (4, 20)]
    same = SameRows()
    kept = []
    for tokens, scale in ((56, 1.0), (41, 0.5), (56, 1.0)):
        data = verl_update_batch(lengths, 0, max_token_len_per_gpu=64)
        tu.assign_non_tensor(data, batch_num_tokens=tokens, dp_size=1, loss_scale=scale)
        got = SampleRows(data, same=same).select([2, 0])
        want = tu.index_select_tensor_dict(data, [2, 0])
        for key in ("batch_num_tokens", "dp_size", "loss_scale", "temperature", "global_batch_size"):
            assert tu.get_non_tensor_data(got, key, None) == tu.get_non_tensor_data(want, key, None), (tokens, key)
        assert tu.get_non_tensor_data(got, "batch_num_tokens", None) == tokens
        assert type(tu.get_non_tensor_data(got, "loss_scale", None)) is float
        kept.append(len(same._made))
    assert kept[0] < kept[1] == kept[2]  # new values made anew, a batch like the first reuses its settings


def test_nested_from_flat_without_grad_is_the_public_jagged_tensor() -> None:
    """Values needing no gradient are wrapped directly (`compat._jagged_class`); the result is what torch's
    public ``nested_tensor_from_jagged`` makes (offsets, values, cached lengths, padding, unbind, ops), and
    values needing one still get a gradient through the nested tensor."""
    from tensordict import TensorDict

    from hdp.integrations.verl import compat

    assert compat._jagged_class() is not None  # torch 2.13: the direct path is the one taken
    lengths = [5, 16, 9]
    flat = torch.arange(sum(lengths))  # [Σ L_i] token ids
    got = compat.nested_from_flat(flat, lengths)
    offsets = torch.tensor([0, 5, 21, 30])
    want = torch.nested.nested_tensor_from_jagged(flat, offsets, min_seqlen=5, max_seqlen=16)
    assert type(got) is type(want) and got.is_nested and got.layout == torch.jagged
    assert torch.equal(got.offsets(), want.offsets()) and torch.equal(got.values(), want.values())
    assert got._ragged_idx == want._ragged_idx == 1 and got.dim() == want.dim() == 2
    assert got._metadata_cache.keys() == want._metadata_cache.keys()
    assert (got._min_seqlen, got._max_seqlen) == (5, 16)
    assert all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind()))
    assert torch.equal(got.to_padded_tensor(-1), want.to_padded_tensor(-1))
    assert torch.equal((got * 2).values(), flat * 2)
    padded = TensorDict({"x": got}, batch_size=[3]).to_padded_tensor()["x"]
    assert padded.shape == (3, 16) and torch.equal(padded, want.to_padded_tensor(0))
    x = torch.randn(sum(lengths), requires_grad=True)  # [Σ L_i]: kept differentiable
    (compat.nested_from_flat(x, lengths).values() * 3).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full_like(x, 3.0))


def test_nested_from_flat_with_grad_hands_back_its_flat_values() -> None:
    """A differentiable nested tensor's ``values()`` is the flat tensor it views (no nested-tensor view op in
    the backward): the same data and storage, and the gradients through ``values()``, through other nested
    ops, through both, and of verl's ``ppo_loss`` equal those through torch's own nested tensor."""
    import functools

    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from hdp.integrations.verl import compat
    from benchmarks.verl.bench import actor_config, verl_update_batch

    lengths = [5, 16, 9]
    offsets = torch.tensor([0, 5, 21, 30])
    base = torch.randn(sum(lengths), 2)  # [Σ L_i, C]: a column, as the verl adapter passes it
    uses = {"values": lambda n: (n.values() * torch.arange(30.0)).sum(),
            "padded": lambda n: (n.to_padded_tensor(0.0) ** 2).sum(),
            "both": lambda n: n.values().sum() + sum((x ** 3).sum() for x in n.unbind())}
    for name, use in uses.items():
        x, y = base.clone().requires_grad_(), base.clone().requires_grad_()
        got = compat.nested_from_flat(x[:, 1], lengths)
        want = torch.nested.nested_tensor_from_jagged(y[:, 1].contiguous(), offsets, min_seqlen=5, max_seqlen=16)
        assert torch.equal(got.values(), want.values()) and got.values().data_ptr() == got._values.data_ptr()
        assert "Nested" not in type(got.values().grad_fn).__name__  # not the nested tensor's view op
        use(got).backward()
        use(want).backward()
        assert torch.equal(x.grad, y.grad), name
        assert x.grad[:, 0].abs().sum() == 0 and x.grad[:, 1].abs().sum() > 0, name
    pairs = [(5, 9), (3, 15), (7, 12)]
    data = verl_update_batch(pairs, 0, max_token_len_per_gpu=64)
    tu.assign_non_tensor(data, batch_num_tokens=30, dp_size=1)
    loss_fn = functools.partial(ppo_loss, actor_config("token-mean"))
    total = [p + r for p, r in pairs]
    flat = -torch.rand(sum(total))  # [Σ L_i] log-probs
    grads = []
    for make in (lambda v: compat.nested_from_flat(v, total),
                 lambda v: torch.nested.nested_tensor_from_jagged(v, torch.tensor([0, 14, 32, 51]))):
        leaf = flat.clone().requires_grad_()
        loss, _ = loss_fn(model_output={"log_probs": make(leaf)}, data=data, dp_group=None)
        grads.append(torch.autograd.grad(loss, leaf)[0])
    assert grads[0].abs().sum() > 0 and torch.equal(grads[0], grads[1])


def test_token_ppo_loss_is_verls_ppo_loss() -> None:
    """The doors row's third leg (`verl_token_ppo_loss`): the value and the log-prob gradient of verl's own
    ``ppo_loss`` (token-mean), computed on the response tokens only."""
    import functools

    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from hdp.integrations.verl import compat
    from benchmarks.verl.bench import actor_config, verl_token_ppo_loss, verl_update_batch

    lengths = [(5, 9), (3, 15), (7, 12), (4, 20), (6, 1)]
    data = verl_update_batch(lengths, 3, max_token_len_per_gpu=64)
    tu.assign_non_tensor(data, batch_num_tokens=int(data["response_mask"].sum()), dp_size=1)
    sub = tu.index_select_tensor_dict(data, [3, 0, 4])  # a group's rows, as the door hands them over
    total = sum(p + r for p, r in (lengths[3], lengths[0], lengths[4]))
    grads = []
    for fn in (functools.partial(ppo_loss, actor_config("token-mean")), verl_token_ppo_loss):
        flat = (-torch.rand(total, dtype=torch.float32, generator=torch.Generator().manual_seed(7))).requires_grad_()
        out = {"log_probs": compat.nested_from_flat(flat, [p + r for p, r in (lengths[3], lengths[0], lengths[4])])}
        loss, _ = fn(model_output=out, data=sub, dp_group=None)
        loss.backward()
        grads.append((float(loss), flat.grad.clone()))
    (want, g_want), (got, g_got) = grads
    assert want != 0.0 and got == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert g_want.abs().sum() > 0 and torch.allclose(g_got, g_want, rtol=1e-5, atol=1e-9)


def test_median_ci95_brackets_the_median_and_narrows_with_steps() -> None:
    """The doors row's interval (`median_ci95`): a point for equal ratios, around the median otherwise, and
    narrower with four times the steps (same spread)."""
    import numpy as np

    from benchmarks.verl.bench import median_ci95

    assert median_ci95([1.03] * 7) == [1.03, 1.03]
    g = np.random.default_rng(1)
    few, many = 1.0 + 0.15 * g.standard_normal(20), 1.0 + 0.15 * g.standard_normal(80)
    (lo_few, hi_few), (lo_many, hi_many) = median_ci95(list(few)), median_ci95(list(many))
    assert lo_few <= float(np.median(few)) <= hi_few and lo_many <= float(np.median(many)) <= hi_many
    assert hi_many - lo_many < 0.75 * (hi_few - lo_few)
