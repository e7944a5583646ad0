"""The kinds of verl's losses (`hdp.integrations.verl.loss_kinds`), read from the losses themselves.

hdp runs verl's loss once per CP group and adds the groups, which is the mini-batch's loss exactly for losses
additive over samples.  These tests hold the classification to verl's own registry: every policy loss verl
registers, under every aggregation mode verl validates, has a verdict here (a new upstream loss fails
`test_every_registered_policy_loss_has_a_verdict` until someone decides), and hdp's normalisation of a loss that
is a plain mean of its call makes the groups' sum the whole batch's loss (values and gradients, float64: 1e-12).
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402

from hdp.integrations.verl import compat, loss_kinds as K, verl_version  # noqa: E402

VERL_090 = verl_version().split("+")[0].startswith("0.9.0")
"""verl 0.9.0 (the other supported release differs in one loss: its GSPO aggregates with seq-mean-token-mean)."""

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

REFUSED = "refused"
from helpers.verl_options import VERDICTS  # noqa: E402  (loss_mode -> its verdict: one table, tests/helpers/verl_options.py)


def _config(mode: str, agg: str, factor: float | None = None, **correction):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    extra = {"rollout_correction": RolloutCorrectionConfig(bypass_mode=True, **correction)} if correction else {}
    policy = PolicyLossConfig(loss_mode=mode, dro_beta=0.1 if mode == "dro" else None, **extra)
    return ActorConfig(strategy="hdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=agg,
                       loss_scale_factor=factor, policy_loss=policy)


def _verdict(mode: str, agg: str, factor: float | None = None, **correction) -> str:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    try:
        return K.policy_loss_kind(mode, get_policy_loss_fn(mode), _config(mode, agg, factor, **correction)).value
    except K.LossNotAdditiveError:
        return REFUSED


def _expected(mode: str, agg: str, factor: float | None) -> str:
    want = VERDICTS[mode]
    if want == "additive-any-width":
        return "additive"
    if want == "additive" and agg == "seq-mean-token-sum-norm" and factor is None:
        return REFUSED
    return str(want)


def test_every_registered_policy_loss_has_a_verdict():
    """The table above covers verl's registry exactly: a loss verl adds (or drops) fails here until classified."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    assert set(POLICY_LOSS_REGISTRY) == set(VERDICTS), sorted(set(POLICY_LOSS_REGISTRY) ^ set(VERDICTS))


def test_every_aggregation_mode_verl_validates_is_probed():
    """The aggregation modes come from verl's own check (``ActorConfig`` refuses any other)."""
    from verl.workers.config import ActorConfig

    for agg in AGG_MODES:
        _config("vanilla", agg)
    with pytest.raises(Exception):
        ActorConfig(strategy="hdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode="not-a-mode")


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("factor", [None, 16.0])
def test_policy_loss_verdicts(agg, factor):
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    got = {mode: _verdict(mode, agg, factor, **({"rollout_is": "token"} if mode == "bypass_mode" else {}))
           for mode in POLICY_LOSS_REGISTRY}
    want = {mode: _expected(mode, agg, factor) for mode in POLICY_LOSS_REGISTRY}
    assert got == want


@pytest.mark.parametrize(("correction", "verdict"), [
    ({"rollout_is": "token"}, "additive"),
    ({"rollout_is": "sequence"}, "additive"),
    ({"rollout_is": "token", "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_1.5"}, "additive"),
    ({"rollout_is": "sequence", "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.5_1.5"}, "additive"),
    ({"rollout_is": "token", "loss_type": "reinforce"}, "additive"),
    # in one process the batch normalisation is a mean over the call: not additive once the weights are applied
    ({"rollout_is": "token", "loss_type": "reinforce", "rollout_is_batch_normalize": True}, REFUSED),
])
def test_bypass_mode_verdicts(correction, verdict):
    assert _verdict("bypass_mode", "token-mean", None, **correction) == verdict


def test_refusals_name_the_keys_and_the_fix():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    with pytest.raises(K.LossNotAdditiveError, match=r"actor_rollout_ref\.actor\.policy_loss\.loss_mode=kl_cov"):
        K.policy_loss_kind("kl_cov", get_policy_loss_fn("kl_cov"), _config("kl_cov", "token-mean"))
    with pytest.raises(K.LossNotAdditiveError, match=r"loss_agg_mode=seq-mean-token-sum-norm.*Set actor_rollout_ref\.actor\.loss_scale_factor"):
        K.policy_loss_kind("vanilla", get_policy_loss_fn("vanilla"), _config("vanilla", "seq-mean-token-sum-norm"))
    with pytest.raises(K.LossNotAdditiveError, match=r"critic\.loss_agg_mode=seq-mean-token-sum-norm.*critic\.loss_scale_factor"):
        K.aggregation_kind("seq-mean-token-sum-norm", None, key="critic")
    for agg in AGG_MODES[:4]:
        assert K.aggregation_kind(agg, None, key="critic") is K.Kind.ADDITIVE
    assert K.aggregation_kind("seq-mean-token-sum-norm", 8.0, key="critic") is K.Kind.ADDITIVE


def test_the_probe_leaves_the_configs_batch_information_as_it_was():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    cfg = _config("geo_mean", "token-mean", 3.0)
    cfg.global_batch_info.update(dp_size=7, batch_num_tokens=11, global_batch_size=5, loss_scale_factor=3.0)
    before = dict(cfg.global_batch_info)
    K._KINDS.clear()
    assert K.policy_loss_kind("geo_mean", get_policy_loss_fn("geo_mean"), cfg) is K.Kind.SAMPLE_MEAN
    assert cfg.global_batch_info == before


# ---- the normalisation on verl's real ppo_loss ---------------------------------------------------------------

V = 13


def _batch(seed: int = 0):
    """verl's no-padding update batch of 7 samples (nested fields), and per-sample input-aligned log-probs."""
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    nest = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    ids, prompts, resps, masks, old, adv = [], [], [], [], [], []
    for r in (1, 3, 20, 9, 14, 2, 25):
        p = int(torch.randint(2, 6, (1,), generator=g))
        prompts.append(torch.randint(0, V, (p,), generator=g))
        resps.append(torch.randint(0, V, (r,), generator=g))
        ids.append(torch.cat([prompts[-1], resps[-1]]))
        m = (torch.rand(r, generator=g) > 0.2).to(torch.int64)
        m[0] = 1
        masks.append(m)
        old.append(-torch.rand(r, generator=g, dtype=torch.float64) * 3)
        adv.append(torch.full((r,), float(torch.randn(1, generator=g)), dtype=torch.float64))
    td = TensorDict({"input_ids": nest(ids), "prompts": nest(prompts), "responses": nest(resps),
                     "response_mask": nest(masks), "old_log_probs": nest(old), "advantages": nest(adv)},
                    batch_size=len(ids))
    n_tok = int(sum(int(m.sum()) for m in masks))
    tu.assign_non_tensor(td, global_batch_size=len(ids), dp_size=1, batch_num_tokens=n_tok)
    logps = [(-torch.rand(len(x), generator=g, dtype=torch.float64) * 3) for x in ids]
    return td, logps


def _loss(cfg, data, logps, samples, normalised: bool):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    sub = tu.index_select_tensor_dict(data, list(samples))
    leaves = [logps[i] for i in samples]
    out = {"log_probs": torch.nested.as_nested_tensor(leaves, layout=torch.jagged)}
    if not normalised:
        return ppo_loss(cfg, out, sub)[0]
    with compat.policy_losses_wrapped(K.normalised_policy_losses):
        return ppo_loss(cfg, out, sub)[0]


@pytest.mark.parametrize("mode", ["geo_mean", "vanilla", "gspo"])
def test_groups_add_up_to_the_whole_batch_loss(mode):
    """verl's ppo_loss on a partition of the batch (as hdp's groups call it), normalised, sums to the loss of the
    whole batch in one call: values and gradients (float64, 1e-12).  For geo_mean the plain sum of the groups'
    losses (hdp before its normalisation) is another loss."""
    cfg = _config(mode, "token-mean")
    data, logps = _batch()
    leaves = [x.clone().requires_grad_() for x in logps]
    whole = _loss(cfg, data, leaves, range(7), normalised=True)
    whole_grad = torch.autograd.grad(whole, leaves)
    groups = [[0, 4], [1], [2, 5, 6], [3]]
    total = sum(_loss(cfg, data, leaves, g, normalised=True) for g in groups)
    total_grad = torch.autograd.grad(total, leaves)
    assert abs(float(total - whole)) <= 1e-12 * max(1.0, abs(float(whole))), (float(total), float(whole))
    for a, b in zip(total_grad, whole_grad):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    plain = sum(_loss(cfg, data, leaves, g, normalised=False) for g in groups)
    if mode == "geo_mean":
        assert abs(float(plain - whole)) > 1e-3 * abs(float(whole)), (float(plain), float(whole))
        # the whole batch in one call: hdp's definition is verl's own loss of the mini-batch in one call
        assert abs(float(whole - _loss(cfg, data, leaves, range(7), normalised=False))) <= 1e-12
    else:
        assert abs(float(plain - whole)) <= 1e-12 * max(1.0, abs(float(whole)))


def test_the_registry_is_restored_after_the_wrap():
    from verl.trainer.ppo import core_algos

    original = core_algos.POLICY_LOSS_REGISTRY
    with compat.policy_losses_wrapped(K.normalised_policy_losses):
        assert core_algos.POLICY_LOSS_REGISTRY is not original
        assert isinstance(core_algos.get_policy_loss_fn("geo_mean"), K._Normalised)
    assert core_algos.POLICY_LOSS_REGISTRY is original
    assert not isinstance(core_algos.get_policy_loss_fn("geo_mean"), K._Normalised)


# ---- the whole-loss check on a batch's own samples ------------------------------------------------------------


def _run(loss_fn):
    def run(samples, outputs):
        return loss_fn(samples, outputs)
    return run


def test_check_additive_accepts_a_sum_and_refuses_batch_statistics():
    lengths, response = [5, 9, 3, 7], [2, 6, 1, 4]

    def token_sum(samples, outputs):  # additive
        return (outputs[:, 0] ** 2).sum() / 24.0

    def centred(samples, outputs):  # a batch statistic: centring over the call
        x = outputs[:, 0]
        return ((x - x.mean()) ** 2).sum()

    K.check_additive(token_sum, lengths, response, 1, what="t", keys="k")
    with pytest.raises(K.LossNotAdditiveError, match=r"samples 2 and 1.*Keys: actor\.x=1"):
        K.check_additive(centred, lengths, response, 1, what="verl's loss", keys="actor.x=1")


# ---- a loss that runs a collective ------------------------------------------------------------------------------


@pytest.fixture()
def one_rank_world(tmp_path):
    """A one-rank gloo world (verl's losses take their collective paths only when torch.distributed is up)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_loss_running_a_collective_is_refused_naming_the_option(one_rank_world):
    """bypass mode with batch-normalised IS weights all-reduces over the world group inside the loss (verl's
    ``distributed_masked_mean``); hdp's group leaders would enter it different numbers of times.  The probe sees
    the collective before any message leaves the process and names the option."""
    import torch.distributed as dist

    with pytest.raises(K.LossCollectiveError, match=r"rollout_is_batch_normalize=True.*allreduce.*refused"):
        _verdict_or_raise("bypass_mode", rollout_is="token", rollout_is_batch_normalize=True)
    assert _verdict("bypass_mode", "token-mean", None, rollout_is="token") == "additive"
    with pytest.raises(K.LossCollectiveError, match="allgather"):
        with K.collectives_refused():
            dist.all_gather([torch.zeros(2)], torch.ones(2), group=dist.group.WORLD)


def _verdict_or_raise(mode: str, **correction):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    return K.policy_loss_kind(mode, get_policy_loss_fn(mode), _config(mode, "token-mean", None, **correction))


def test_a_loss_that_is_not_finite_is_not_judged():
    """A NaN loss (a bad batch, a fault) is the step's non-finite rules' to handle (skip, then raise after
    ``max_consecutive_skips``), not a refusal of the loss's kind."""
    def nan_loss(samples, outputs):
        return outputs[:, 0].sum() * float("nan")

    assert K.check_additive(nan_loss, [5, 9, 3], [2, 6, 1], 1, what="t", keys="k") is False
