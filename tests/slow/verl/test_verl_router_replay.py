"""MoE router replay under hdp plans (``actor_rollout_ref.actor.megatron.router_replay.mode``), through verl's own
``ActorRolloutRefWorker`` on a tiny Qwen3-MoE (4 experts, top-2), with a CP group in the plan (a sample longer
than the token budget, split in zigzag chunks), under EP 2 x domain 2, PP 2 x domain 2 and TP 2 (sequence
parallel) x domain 2; the EP case with hdp's MoE zero-memory level1 (the expert path recomputed in backward).

* **R3** (routes from the rollout, replayed in every pass): random routes, unlike the native ones, are given with
  the batch; ``compute_log_prob`` and ``update_actor`` must equal one process (HF ``transformers`` in float32) whose
  routers are forced to the same routes — except each sample's last token, which the rollout never routes and
  which keeps its native routing in both — log-probs to ``2e-5``, loss ``1e-5`` and grad norm ``1e-4`` relative.
  And they must differ from the native routing's (the routes were followed, not ignored).
* **R2** (routes recorded in the old-log-prob pass, replayed in the update): ``compute_log_prob`` returns
  ``routed_experts``, which must be HF's own top-2 of every token and layer (as sets); the update replaying them
  equals HF's native update.
"""

from __future__ import annotations


import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")

from helpers.dist_helper import run_distributed  # noqa: E402

LENGTHS = [(5, 9), (3, 90), (7, 12), (4, 20), (6, 4), (2, 30)]  # 93 > budget 64: a CP group
BUDGET = 64
EXPERTS, TOPK, LAYERS = 4, 2, 2
TOL = 2e-5


def _padded_routes(samples, routes, padded):
    """verl's padded ``routed_experts`` [B, P + R, layers, K] (left-padded prompts, right-padded responses)."""
    import torch

    pmax = padded["prompts"].shape[1]
    out = torch.zeros((len(samples), padded["input_ids"].shape[1], LAYERS, TOPK), dtype=torch.int16)
    for i, ((p, r), x) in enumerate(zip(samples, routes)):
        out[i, pmax - len(p): pmax + len(r)] = x
    return out


def _hf(model_path, samples, routes=None, r3=True):
    """fp32 HF Qwen3-MoE; ``routes`` S x [L_i, layers, K]: every router forced to them (R3: but each sample's last
    token).  Returns the model (its routers forced while ``_hf.current`` names a sample) and a runner."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    state = {"sample": None}
    native: dict[tuple[int, int], torch.Tensor] = {}

    def forced(layer, gate):
        def forward(hidden):
            h = hidden.reshape(-1, gate.hidden_dim)
            logits = F.linear(h, gate.weight)  # [L, E]
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            top, idx = torch.topk(probs, gate.top_k, dim=-1)
            native[(state["sample"], layer)] = idx.detach()
            if routes is not None:
                want = routes[state["sample"]][:, layer].to(torch.int64)  # [L, K]
                keep = torch.ones(h.shape[0], dtype=torch.bool)
                if r3:
                    keep[-1] = False  # the rollout never routed the last token
                idx = torch.where(keep[:, None], want, idx)
                top = probs.gather(1, idx)
            if gate.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx
        return forward

    for layer, block in enumerate(model.model.layers):
        block.mlp.gate.forward = forced(layer, block.mlp.gate)
    return model, state, native


def _hf_reference(model_path, samples, padded, extra, actor_cfg, routes=None, r3=True):
    """(log-probs S x [L_i], loss, grad norm, native top-k {(sample, layer): [L_i, K]}) of HF with forced routes."""
    from functools import partial

    import torch

    from verl.workers.utils.losses import ppo_loss
    from hdp.integrations.verl.scaffolding import batches as B

    model, state, native = _hf(model_path, samples, routes, r3)
    logps = []
    for i, (p, r) in enumerate(samples):
        state["sample"] = i
        ids = torch.tensor(p + r)[None]
        full = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        lp = full[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        logps.append(torch.cat([lp, lp.new_zeros(1)]))
    data = B.update_batch(padded, extra, mini_batch_size=len(samples))
    loss, _ = B.whole_batch_loss(partial(ppo_loss, config=actor_cfg), data, log_probs=logps)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return [x.detach() for x in logps], float(loss), float(norm), native


def _worker(rank: int, world: int, tp: int, pp: int, ep: int, zero: str, tmp: str) -> None:
    from hdp.integrations.verl.scaffolding.worker import actor_worker, compose, prepare_rank

    model_path = prepare_rank(rank, world, tmp, moe=True, layers=LAYERS)
    import torch
    import torch.distributed as dist

    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.metric.utils import reduce_metrics as verl_reduce_metrics
    from verl.workers.utils.padding import no_padding_2_padding
    from hdp.integrations.verl.batch import sample_lengths
    from hdp.integrations.verl.scaffolding import batches as B
    from hdp.integrations.verl.scaffolding.tiny import VOCAB

    samples = B.random_samples(LENGTHS, VOCAB, seed=1)
    padded = B.padded_batch(samples, pad_id=0)
    g = torch.Generator().manual_seed(7)  # random routes: top-2 of a random permutation per token and layer
    routes = [torch.stack([torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(LAYERS)])
                           for _ in range(len(p) + len(r))]).to(torch.int16) for p, r in samples]  # S x [L_i, layers, K]
    adv = torch.randn(padded["responses"].shape, generator=torch.Generator().manual_seed(3)) * padded["response_mask"]

    def worker(mode: str):
        cfg = compose(model_path, budget=BUDGET, records=None, overrides=[
            f"actor_rollout_ref.actor.megatron.router_replay.mode={mode}",
            f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
            f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
            f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}",
            f"actor_rollout_ref.actor.hdp.zero_memory={zero}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={len(LENGTHS)}", "actor_rollout_ref.actor.optim.lr=1e-2",
            "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo", "actor_rollout_ref.actor.hdp.auto_calibrate=false",
        ])
        return actor_worker(cfg), omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)

    def broadcast(x, src):
        objs = [x]
        dist.broadcast_object_list(objs, src=src, group=dist.group.WORLD)
        return objs[0]

    def update(act, extra, src):
        out = act.update_actor(B.update_batch(padded, extra, mini_batch_size=len(LENGTHS)))
        m = verl_reduce_metrics(tu.get(out, "metrics")) if rank == src else None
        return broadcast(None if m is None else (m["loss"], m["grad_norm"]), src)

    # ---- R3: the rollout's routes, replayed in every pass ----
    act, actor_cfg = worker("R3")
    engine = act.actor.engine
    flags = [None] * world
    dist.all_gather_object(flags, bool(engine.is_mp_src_rank_with_outputs()), group=dist.group.WORLD)
    src = flags.index(True)
    probe = B.ref_batch(padded)
    assert max(engine.planner.plan(sample_lengths(probe)).group_size) > 1, "the batch must put a sample on a CP group"
    batch = B.old_logp_batch(padded)
    native_out = act.compute_log_prob(batch)  # no routes: native routing
    padded_routes = _padded_routes(samples, routes, padded)
    with_routes = B._td({**padded, "routed_experts": padded_routes}, calculate_entropy=True, compute_loss=False)
    out = act.compute_log_prob(with_routes)
    lp = broadcast(no_padding_2_padding(tu.get(out, "log_probs"), probe).float() if rank == src else None, src)
    extra = {"old_log_probs": lp, "advantages": adv, "routed_experts": padded_routes}
    hf_lp, hf_loss, hf_norm, _ = _hf_reference(model_path, samples, padded, {k: v for k, v in extra.items()
                                                                              if k != "routed_experts"}, actor_cfg, routes)
    if rank == src:
        got, nat = list(tu.get(out, "log_probs").unbind()), list(tu.get(native_out, "log_probs").unbind())
        for i, (a, b) in enumerate(zip(got, hf_lp)):
            torch.testing.assert_close(a[:-1].float(), b[:-1], atol=TOL, rtol=0, msg=lambda m, i=i: f"R3 sample {i}: {m}")
        moved = max(float((a - b).abs().max()) for a, b in zip(got, nat))
        assert moved > 1e-3, f"replayed routes changed the log-probs by only {moved}"
    loss, norm = update(act, extra, src)
    assert abs(loss - hf_loss) <= 1e-5 * max(1.0, abs(hf_loss)), (loss, hf_loss)
    assert abs(norm - hf_norm) <= 1e-4 * hf_norm, (norm, hf_norm)

    # ---- R2: routes recorded in the old-log-prob pass, replayed in the update ----
    act2, _ = worker("R2")
    out2 = act2.compute_log_prob(B.old_logp_batch(padded))
    recorded = broadcast(list(tu.get(out2, "routed_experts").unbind()) if rank == src else None, src)
    lp2 = broadcast(no_padding_2_padding(tu.get(out2, "log_probs"), probe).float() if rank == src else None, src)
    hf_lp2, hf_loss2, hf_norm2, native = _hf_reference(model_path, samples, padded,
                                                       {"old_log_probs": lp2, "advantages": adv}, actor_cfg)
    for i, rec in enumerate(recorded):
        assert rec.shape == (len(samples[i][0]) + len(samples[i][1]), LAYERS, TOPK), rec.shape
        for layer in range(LAYERS):
            want = native[(i, layer)].sort(dim=-1).values
            assert torch.equal(rec[:, layer].to(torch.int64).sort(dim=-1).values, want), (i, layer)
    padded_rec = _padded_routes(samples, recorded, padded)
    loss2, norm2 = update(act2, {"old_log_probs": lp2, "advantages": adv, "routed_experts": padded_rec}, src)
    assert abs(loss2 - hf_loss2) <= 1e-5 * max(1.0, abs(hf_loss2)), (loss2, hf_loss2)
    assert abs(norm2 - hf_norm2) <= 1e-4 * hf_norm2, (norm2, hf_norm2)


# (TP, PP, EP, zero-memory): EP 2 with hdp's MoE zero-memory level1 (the expert path recomputed in backward)
CASES = {"ep2-level1": (1, 1, 2, "level1"), "pp2": (1, 2, 1, "none"), "tp2-sp": (2, 1, 1, "none")}


@pytest.mark.parametrize("case", list(CASES))
def test_router_replay_follows_tokens_through_hdp_packing(case: str, tmp_path) -> None:
    tp, pp, ep, zero = CASES[case]
    run_distributed(_worker, 2 * tp * pp, tp, pp, ep, zero, str(tmp_path), timeout=300)
