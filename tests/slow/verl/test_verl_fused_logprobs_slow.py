"""The slow tier (over ~20 s) of the tests tests/unit/verl/test_verl_fused_logprobs.py describes: its docstring says what they check and how."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")

from helpers.dist_helper import run_distributed  # noqa: E402

TEMPERATURE = 0.7


def _worker(rank: int, world: int, tmp: str) -> None:
    import logging

    import torch
    import torch.distributed as dist

    from hdp.integrations.verl.scaffolding import install
    from hdp.integrations.verl.scaffolding.worker import actor_worker, environment_for_rank

    environment_for_rank(rank, world)
    install()
    from helpers.verl_worker_path import BUDGET, LENGTHS, _compose, _hf_reference
    from helpers.verl_loss_worker import _hf

    from hdp.integrations.verl.batch import sample_lengths
    from hdp.integrations.verl.scaffolding import batches as B
    from hdp.integrations.verl.scaffolding.tiny import VOCAB, build_tiny
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.metric.utils import reduce_metrics as verl_reduce_metrics
    from verl.workers.utils.padding import no_padding_2_padding

    logging.getLogger("verl").setLevel(logging.ERROR)
    model_path = os.path.join(tmp, "model")
    if rank == 0:
        build_tiny(model_path)
    dist.barrier(group=dist.group.WORLD)
    cfg = _compose(model_path, moe=False, ckpt_dir=tmp, tp=2)
    cfg.actor_rollout_ref.model.use_fused_kernels = True  # verl's key; impl_backend stays verl's default, torch
    assert cfg.actor_rollout_ref.model.fused_kernel_options.impl_backend == "torch"
    act = actor_worker(cfg, role="actor")
    engine = act.actor.engine
    assert engine.engine_config.use_fused_kernels is True
    assert engine.core.fused_logprobs is True
    last = engine.module[-1]
    while hasattr(last, "module"):
        last = last.module
    assert not hasattr(last, "forward_backup"), "verl's own fused forward must not be installed"
    if last.post_process:  # hdp's head replaces the output layer's forward during the engine's rounds only
        assert "forward" not in last.output_layer.__dict__
    src = [None] * world
    dist.all_gather_object(src, bool(engine.is_mp_src_rank_with_outputs()), group=dist.group.WORLD)
    src = src.index(True)

    samples = B.random_samples(LENGTHS, VOCAB, seed=1)
    padded = B.padded_batch(samples, pad_id=0)
    probe = B.ref_batch(padded)
    assert max(engine.planner.plan(sample_lengths(probe)).group_size) > 1, "the batch must put a sample on a CP group"
    asked = B._td(padded, temperature=TEMPERATURE, calculate_entropy=True, calculate_sum_pi_squared=True,
                  compute_loss=False)
    hot = act.compute_log_prob(asked)  # at temperature 0.7, with Σp²
    old_out = act.compute_log_prob(B.old_logp_batch(padded))  # at temperature 1, the update's old log-probs
    objs = [None]
    if rank == src:
        objs = [no_padding_2_padding(tu.get(old_out, "log_probs"), probe).float()]
    dist.broadcast_object_list(objs, src=src, group=dist.group.WORLD)
    old_lp = objs[0]
    adv = torch.randn(padded["responses"].shape, generator=torch.Generator().manual_seed(3)) * padded["response_mask"]
    extra = {"old_log_probs": old_lp, "advantages": adv, "ref_log_prob": old_lp}
    out = act.update_actor(B.update_batch(padded, extra, mini_batch_size=len(LENGTHS), calculate_entropy=True))
    assert not last.post_process or "forward" not in last.output_layer.__dict__, "the head must be removed after a run"
    if rank != src:
        assert out is None
        return
    _, hot_lp, hot_ent, hot_sq = _hf(model_path, samples, TEMPERATURE)
    for i, (a, e, q, b, f, r) in enumerate(zip(tu.get(hot, "log_probs").unbind(), tu.get(hot, "entropy").unbind(),
                                               tu.get(hot, "sum_pi_squared").unbind(), hot_lp, hot_ent, hot_sq)):
        torch.testing.assert_close(a[:-1].float(), b[:-1].detach(), atol=2e-5, rtol=0, msg=lambda m, i=i: f"logp {i}: {m}")
        torch.testing.assert_close(e[:-1].float(), f[:-1].detach(), atol=2e-5, rtol=0, msg=lambda m, i=i: f"entropy {i}: {m}")
        torch.testing.assert_close(q.float(), r, atol=2e-5, rtol=0, msg=lambda m, i=i: f"sum_pi_squared {i}: {m}")
    actor_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    hf_logp, hf_ent, hf_loss, hf_norm = _hf_reference(model_path, samples, padded, extra, actor_cfg)
    for i, (a, e, c, h) in enumerate(zip(tu.get(old_out, "log_probs").unbind(), tu.get(old_out, "entropy").unbind(),
                                         hf_logp, hf_ent)):
        torch.testing.assert_close(a[:-1].float(), c[:-1], atol=2e-5, rtol=0, msg=lambda m, i=i: f"old logp {i}: {m}")
        torch.testing.assert_close(e[:-1].float(), h[:-1], atol=2e-5, rtol=0, msg=lambda m, i=i: f"old entropy {i}: {m}")
    m = verl_reduce_metrics(tu.get(out, "metrics"))
    assert m["hdp/rounds"] > 1, m["hdp/rounds"]
    assert abs(m["loss"] - hf_loss) <= 1e-5 * max(1.0, abs(hf_loss)), (m["loss"], hf_loss)
    assert abs(m["grad_norm"] - hf_norm) <= 1e-4 * hf_norm, (m["grad_norm"], hf_norm)


def test_use_fused_kernels_runs_hdps_fused_path_equal_to_hf(tmp_path) -> None:
    run_distributed(_worker, 4, str(tmp_path), timeout=900)
