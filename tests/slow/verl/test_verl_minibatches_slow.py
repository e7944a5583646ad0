"""The slow tier (over ~20 s) of the tests tests/unit/verl/test_verl_minibatches.py describes: its docstring says what they check and how."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402


# ---- hdp against stock verl's engine through verl's worker (2 CPU ranks) ----------------------------

SAMPLES = [(5, 9), (3, 30), (7, 12), (4, 20), (6, 4), (2, 26), (5, 15), (3, 8)]  # (prompt, response)
MINI = 4  # two mini-batches of 4: stock DP rank r trains 2 of its part per mini-batch
STOCK_FSDP = [  # verl's own FSDP2 engine on CPU: padded (no flash-attn), torch SDPA, fp32 compute
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.model.use_remove_padding=False",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
]


def _update_worker(rank: int, world: int, model_path: str, engine: str, extra_path: str) -> list[float]:
    """One ``update_actor`` of two mini-batches by verl's ``ActorRolloutRefWorker`` on ``engine`` (``hdp`` or
    stock ``fsdp``); returns each mini-batch's grad norm.  Stock ranks receive their contiguous half of the
    batch (verl's dispatch at DP 2); hdp ranks the whole batch (DP 1)."""
    from hdp.integrations.verl.scaffolding import install, worker as W

    W.environment_for_rank(rank, world)
    install()
    import logging

    from hydra import compose, initialize_config_dir

    import verl.trainer.config as vtc
    from verl.utils import tensordict_utils as tu
    from hdp.integrations.verl.scaffolding import batches as B
    from hdp.integrations.verl.scaffolding.tiny import VOCAB

    logging.getLogger("verl").setLevel(logging.ERROR)
    common = [f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI}", "actor_rollout_ref.actor.use_kl_loss=true",
              "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.optim.lr=1e-6",
              "actor_rollout_ref.actor.optim.weight_decay=0.0"]
    if engine == "hdp":
        cfg = W.compose(model_path, budget=64, records=None, overrides=[
            *common, "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo", "actor_rollout_ref.actor.hdp.auto_calibrate=false"])
    else:
        os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # verl registers its FSDP engine for cuda; it runs on CPU
        with initialize_config_dir(config_dir=os.path.dirname(vtc.__file__), version_base=None):
            cfg = compose("ppo_trainer", overrides=[
                "algorithm.adv_estimator=grpo", f"actor_rollout_ref.model.path={model_path}", *STOCK_FSDP, *common,
                "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=64",
                "actor_rollout_ref.actor.optim.total_training_steps=100"])
    act = W.actor_worker(cfg)
    samples = B.random_samples(SAMPLES, VOCAB, seed=1)
    extra = torch.load(extra_path)
    rows = slice(None) if engine == "hdp" else slice(rank * len(SAMPLES) // world, (rank + 1) * len(SAMPLES) // world)
    padded = B.padded_batch(samples, pad_id=0)
    width = padded["responses"].shape[1]
    mine = {k: v[rows] for k, v in padded.items()}
    mine_extra = {k: v[rows, :width] for k, v in extra.items()}
    out = act.update_actor(B.update_batch(mine, mine_extra, mini_batch_size=MINI, calculate_entropy=True))
    if out is None:
        return []
    return [float(g) for g in tu.get(out, "metrics")["grad_norm"]]


def _hf_grad_norms(model_path: str, extra: dict, groups: list[list[int]]) -> list[float]:
    """fp32 HF + verl's ppo_loss, each mini-batch of ``groups`` whole in one process, no optimizer step:
    the grad norm of the first mini-batch of each grouping."""
    from functools import partial

    from transformers import AutoModelForCausalLM

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss
    from hdp.integrations.verl.scaffolding import batches as B, worker as W
    from hdp.integrations.verl.scaffolding.tiny import VOCAB

    cfg = W.compose(model_path, budget=64, records=None, overrides=[
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01"])
    actor_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    samples = B.random_samples(SAMPLES, VOCAB, seed=1)
    out = []
    for group in groups:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        sub = [samples[i] for i in group]
        padded = B.padded_batch(samples, pad_id=0)
        width = padded["responses"].shape[1]
        padded = {k: v[group] for k, v in padded.items()}
        data = B.update_batch(padded, {k: v[group, :width] for k, v in extra.items()}, mini_batch_size=len(group),
                              calculate_entropy=True)
        logps, ents = [], []
        for p, r in sub:
            ids = torch.tensor(p + r)[None]
            full = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            lp = full[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            logps.append(torch.cat([lp, lp.new_zeros(1)]))
            ents.append(-(full.exp() * full).sum(-1))
        loss, _ = B.whole_batch_loss(partial(ppo_loss, config=actor_cfg), data, log_probs=logps, entropy=ents)
        loss.backward()
        out.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                                if p.grad is not None]))))
    return out


def test_hdp_trains_stock_verls_minibatches_through_the_worker(tmp_path):
    """verl's ``ActorRolloutRefWorker.update_actor`` on 2 ranks, two mini-batches: stock verl's FSDP engine
    (DP 2) and the hdp engine (DP 1 to verl, a domain of 2) train the same mini-batches — each
    mini-batch's grad norm equal to fp32 round-off (1e-4 relative, the worker-path test's tolerance for
    HF against hdp).  The first mini-batch contiguous (verl's loop at DP 1) has another grad norm."""
    pytest.importorskip("mbridge")
    from helpers.dist_helper import run_distributed
    from hdp.integrations.verl.scaffolding import batches as B
    from hdp.integrations.verl.scaffolding.tiny import VOCAB, build_tiny

    model = str(build_tiny(tmp_path / "model"))
    padded = B.padded_batch(B.random_samples(SAMPLES, VOCAB, seed=1), pad_id=0)
    g = torch.Generator().manual_seed(3)
    shape = padded["responses"].shape
    old = -torch.rand(shape, generator=g) * padded["response_mask"]
    extra = {"old_log_probs": old, "advantages": torch.randn(shape, generator=g) * padded["response_mask"],
             "ref_log_prob": old - 0.1 * torch.rand(shape, generator=g)}
    torch.save(extra, tmp_path / "extra.pt")
    stock = [x for x in run_distributed(_update_worker, 2, model, "fsdp", str(tmp_path / "extra.pt"), timeout=600) if x][0]
    hdp = [x for x in run_distributed(_update_worker, 2, model, "hdp", str(tmp_path / "extra.pt"), timeout=600) if x][0]
    assert len(stock) == len(hdp) == 2, (stock, hdp)
    for a, b in zip(stock, hdp):
        assert abs(a - b) <= 1e-4 * a, (stock, hdp)
    # stock's first mini-batch is rank 0's first 2 samples and rank 1's first 2; at DP 1 it would be samples 0-3
    ref_stock, ref_contiguous = _hf_grad_norms(model, extra, [[0, 1, 4, 5], [0, 1, 2, 3]])
    assert abs(ref_stock - stock[0]) <= 1e-4 * ref_stock, (ref_stock, stock)
    assert abs(ref_contiguous - hdp[0]) > 1e-2 * ref_contiguous, (ref_contiguous, hdp)
    print(f"grad norms: stock {stock}, hdp {hdp}, HF stock's first {ref_stock}, HF contiguous first {ref_contiguous}")
