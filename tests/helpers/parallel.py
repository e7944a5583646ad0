"""Definitions more than one test module needs (a test module never imports another), moved out of test_parallel.py;
used by tests/distributed/trainer/test_parallel.py, tests/slow/trainer/test_parallel_slow.py."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist

VOCAB = 128
B = 32  # token budget per rank and round
# on a domain of 2 ranks: sample 0 needs a CP2 group, the rest run on single ranks; >= 4 rounds
LENGTHS = [60, 30, 20, 12, 25, 9, 40, 16, 7, 33]
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
PARAM_TOL = 2e-6
LOSS_RTOL = 1e-5
LOGP_TOL = 1e-5


def init_param(name: str, p: torch.Tensor) -> None:
    """Rank- and layout-independent weights keyed by the global parameter name (full tensors)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    val = torch.randn(p.shape, generator=g, dtype=torch.float32)
    p.copy_(1.0 + 0.1 * val if p.dim() == 1 else 0.05 * val)


def _model_cfg(**kw: object):
    from hdp.trainer.model import ModelConfig

    base = dict(vocab_size=VOCAB, hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
                max_sequence_length=256)
    return ModelConfig(**{**base, **kw})


def _engine_cfg(parallel: dict, model_kw: dict | None = None, **planning: object):
    from hdp.packing import cost_model
    from hdp.trainer.config import EngineConfig, ParallelConfig, PlanningConfig
    from hdp.trainer.model import OptimConfig

    return EngineConfig(
        model=_model_cfg(**(model_kw or {})),
        optim=OptimConfig(lr=1e-3, adam_eps=1e-3, clip_grad=1.0),
        planning=PlanningConfig(max_tokens_per_rank=B, cost_model=cost_model("deepseek-v3", "h100-nvlink"), **planning),
        parallel=ParallelConfig(**parallel),
    )


def _batch(step: int, lengths: list[int] = LENGTHS):
    from hdp.trainer.engine import Batch

    g = torch.Generator().manual_seed(300 + step)
    tokens = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    masks = []
    for n in lengths:
        m = torch.zeros(n)
        m[int(torch.randint(1, n // 2 + 1, (1,), generator=g)) :] = 1.0
        masks.append(m)
    return Batch(tokens=tokens, loss_mask=masks)


def _reference(batches, steps: int, model_kw: dict | None = None, entropy_coef: float = 0.0) -> dict:
    """Loss, gradients (step 1), grad norms, parameters after each step and log-probs of batch 0, in
    one process on the whole batch (Megatron initialised TP = PP = EP = 1 for it, then torn down).
    ``entropy_coef`` c: the per-token loss is −log p − c·H (full-vocabulary entropy, naive path)."""
    from hdp import megatron_compat as mc
    from helpers.loss_reference import aggregate_loss
    from hdp.core.attention_spec import packed_seq_params
    from hdp.trainer.model import build_gpt_model, packed_logits, token_logprobs

    rt = mc.initialize_megatron(device="cpu", seed=1)
    model = build_gpt_model(_model_cfg(**(model_kw or {})), "cpu", groups=rt.groups)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init_param(name, p)

    def loss_of(batch):
        tokens = torch.cat(list(batch.tokens))
        logits = packed_logits(model, tokens, packed_seq_params(batch.lengths, tokens.device))  # [sum L, V]
        losses, masks, off = [], [], 0
        for i, t in enumerate(batch.tokens):
            n = t.numel()
            lg = logits[off : off + n - 1]
            loss = -token_logprobs(lg, t[1:])
            if entropy_coef:
                logp = torch.log_softmax(lg.float(), dim=-1)  # [n-1, V]
                loss = loss - entropy_coef * -(logp.exp() * logp).sum(-1)
            losses.append(loss)
            masks.append(batch.loss_mask[i][1:])
            off += n
        return aggregate_loss(losses, masks, "token-mean")

    out: dict = {"loss": [], "norm": [], "params": []}
    with torch.no_grad():
        lps = []
        for t in batches[0].tokens:
            lp = token_logprobs(packed_logits(model, t, packed_seq_params([t.numel()], t.device))[:-1], t[1:])
            lps.append(torch.cat([lp.new_zeros(1), lp]))
        out["logprobs"] = lps
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-3, weight_decay=0.0)
    for s in range(steps):
        opt.zero_grad()
        loss = loss_of(batches[s])
        loss.backward()
        if s == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        out["loss"].append(float(loss))
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    rt.close()
    return out


# ---- checks on an engine ----------------------------------------------------------------------------


def _named(engine) -> dict[str, torch.nn.Parameter]:
    """Global name -> this rank's parameter (its TP shard), over all its model chunks."""
    from hdp.trainer.model import global_param_names

    cfg = engine.config
    per_rank = (cfg.model.num_moe_experts or 0) // cfg.parallel.ep
    out = {}
    for chunk in engine.model_chunks:
        names = global_param_names(chunk.module, ep_rank=engine.groups.ep.rank(), experts_per_rank=per_rank)
        out.update({names[n]: p for n, p in chunk.module.named_parameters()})
    return out


def _shard(engine, full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from hdp.trainer.model import _tp_shard

    size = 1 if not getattr(p, "allreduce", True) else engine.groups.tp_size
    return _tp_shard(full, p, engine.groups.tp_rank, size)


def _check_grads(engine, batch, ref: dict, what: str, plan=None, loss_fn=None) -> None:
    """The engine's gradients of ``batch`` (phases 1–2, then all-reduced) equal the reference shards."""
    from hdp import megatron_compat as mc
    from hdp.trainer.engine import nll_loss

    prep = engine._prepare(batch, plan, loss_fn or nll_loss)()  # validation, the plan, the library's loss adapter
    core = engine.core
    core.skip_update()
    state = core.run(prep.plan, prep.tokens, prep.adapter, train=True)
    red = core.reduce(state)
    np.testing.assert_allclose(float(red[0]), ref["loss"][0], rtol=LOSS_RTOL, err_msg=f"{what} loss")
    seconds = core.round_seconds(state)
    assert len(seconds) == prep.plan.num_rounds and all(t > 0 for t in seconds)
    mc.finalize_model_grads(engine.model_chunks, None, pg_collection=engine.runtime.groups, force_all_reduce=True)
    named = _named(engine)
    assert named, what
    for name, p in named.items():
        expect = _shard(engine, ref["grads"][name], p)
        torch.testing.assert_close(p.main_grad, expect, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=lambda m, n=name: f"{what} grad {n}: {m}")
    core.skip_update()


def _check_params(engine, expect: dict, what: str, tol: float = PARAM_TOL) -> None:
    for name, p in _named(engine).items():
        torch.testing.assert_close(p.detach(), _shard(engine, expect[name], p), atol=tol, rtol=0,
                                   msg=lambda m, n=name: f"{what} {n}: {m}")


def _check_forward(engine, batch, ref: dict, what: str) -> None:
    out = engine.forward(batch)  # every rank, every stage: the caller's order
    assert [x.shape[0] for x in out.logprobs] == batch.lengths
    for i, lp in enumerate(ref["logprobs"]):
        torch.testing.assert_close(out.logprobs[i], lp, atol=LOGP_TOL, rtol=0, msg=lambda m, i=i: f"{what} {i}: {m}")
        assert bool((out.entropies[i][1:] > 0).all()) and out.entropies[i][0] == 0


def _check_stage_mismatch(engine, batch, plan) -> None:
    """The last pipeline stage holds another plan: every rank of the job raises, nothing runs."""
    from hdp.packing import PlannerConfig
    from hdp.packing import plan as make_plan
    from hdp.trainer.engine import nll_loss

    other = make_plan(batch.lengths, PlannerConfig(num_ranks=plan.num_ranks, max_tokens_per_rank=B,
                                                   policy="static-cp"))
    assert other.checksum() != plan.checksum()
    mine = other if engine.groups.is_last_stage else plan
    with pytest.raises(ValueError, match="plan mismatch"):
        engine.train_step(batch, nll_loss, plan=mine)


def _layout_run(parallel: dict, ref: dict, batches, what: str, *, ckpt: str | None = None, model_kw=None,
                forward: bool = True, mismatch: bool = False, **kw: object) -> None:
    """Gradients, ``train_step`` losses / norms / parameters, forward log-probs, checkpoint resume."""
    from hdp.trainer.engine import HdpEngine, nll_loss

    engine = HdpEngine.build(_engine_cfg(parallel, model_kw, **kw), dist.group.WORLD, init_fn=init_param)
    plan = engine.plan(batches[0])
    assert 2 in plan.stats.cp_degree_hist and plan.num_rounds >= 3, plan.to_dict()  # a CP2 ring, a pipeline
    if mismatch:
        _check_stage_mismatch(engine, batches[0], plan)
    _check_grads(engine, batches[0], ref, what)
    if forward:
        _check_forward(engine, batches[0], ref, what)
    steps = len(ref["loss"])
    for s in range(steps):
        m = engine.train_step(batches[s], nll_loss)
        np.testing.assert_allclose(m["loss"], ref["loss"][s], rtol=LOSS_RTOL, err_msg=f"{what} loss {s}")
        np.testing.assert_allclose(m["grad_norm"], ref["norm"][s], rtol=LOSS_RTOL, err_msg=f"{what} norm {s}")
        _check_params(engine, ref["params"][s], f"{what} step {s + 1}", tol=PARAM_TOL * (s + 1))
        if s == 0 and ckpt is not None:
            engine.save_checkpoint(ckpt)
    if ckpt is not None:
        uninterrupted = {n: p.detach().clone() for n, p in _named(engine).items()}
        resumed = HdpEngine.build(_engine_cfg(parallel, model_kw, **kw), dist.group.WORLD)  # default init
        resumed.load_checkpoint(ckpt)
        assert resumed.step == 1
        for s in range(1, steps):
            resumed.train_step(batches[s], nll_loss)
        for n, p in _named(resumed).items():
            assert torch.equal(p.detach(), uninterrupted[n]), f"{what}: checkpoint resume differs at {n}"
        resumed.close()
    engine.close()
