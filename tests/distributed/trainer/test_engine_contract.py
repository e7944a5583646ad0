"""The failure contract of HdpEngine through its public door (2 gloo ranks): a NaN/inf gradient under a
finite loss is skipped on every rank; calls and configs that differ between ranks are named on every rank
before anything runs; Ctrl-C in validation is agreed and leaves the engine usable; engines sharing one
process; a missing or ``None`` loss; calls after ``close()``; inputs and checkpoints that used to fail with
opaque errors.

Each scenario asserts on every rank: the exception type, that its message names the rank / field / value,
the seconds from the call to the exception (well below the collective timeout, ``TIMEOUT_S``), and, where
nothing may be applied, that every parameter and optimizer-state tensor is bit-identical to before.
"""

from __future__ import annotations

import dataclasses
import signal
import time
import zlib

import torch
import torch.distributed as dist

from helpers.dist_helper import run_distributed

VOCAB = 64
TIMEOUT_S = 60.0
"""Collective timeout of these engines: every error below must come long before it."""
FAST_S = 10.0
"""Seconds within which every rank must have raised (loaded 2-core CI machine; typically < 1 s)."""
LENGTHS = [40, 30, 20, 12, 25, 9]


def _config(**kw: object):
    from hdp.trainer.config import EngineConfig, ParallelConfig, PlanningConfig
    from hdp.trainer.model import ModelConfig, OptimConfig

    model = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, max_sequence_length=256)
    model.update(kw.pop("model", {}))
    optim = dict(lr=1e-3)
    optim.update(kw.pop("optim", {}))
    return EngineConfig(model=ModelConfig(**model), optim=OptimConfig(**optim),
                        parallel=ParallelConfig(**kw.pop("parallel", {})),
                        planning=PlanningConfig(max_tokens_per_rank=32, auto_calibrate=False,
                                                collective_timeout_s=TIMEOUT_S), **kw)


def _init(name: str, p: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    val = torch.randn(p.shape, generator=g, dtype=torch.float32)
    p.copy_(1.0 + 0.1 * val if p.dim() == 1 else 0.05 * val)


def _batch(step: int, lengths=LENGTHS):
    from hdp.trainer.engine import Batch

    g = torch.Generator().manual_seed(100 + step)
    return Batch(tokens=[torch.randint(0, VOCAB, (n,), generator=g) for n in lengths])


def _state(engine) -> list[torch.Tensor]:
    """Copies of every parameter and every optimizer-state tensor (moments, Adam's step)."""
    from benchmarks.faults import state_tensors

    return [v.detach().clone() for _, v in state_tensors([c.module for c in engine.model_chunks], engine.optimizer)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _raises(fn, exc_type, *needles: str) -> tuple[BaseException, float]:
    """Run ``fn``; it must raise ``exc_type`` naming every needle.  Returns (exception, seconds)."""
    t0 = time.monotonic()
    try:
        fn()
    except exc_type as exc:
        secs = time.monotonic() - t0
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in: {exc}"
        assert secs < FAST_S, (secs, exc)
        return exc, secs
    raise AssertionError(f"no {exc_type.__name__} (expected one naming {needles})")


def _groups() -> int:
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


# ---- (1) a NaN gradient under a finite loss ------------------------------------------------------------


def _nan_gradient(rank: int, world: int) -> dict:
    from hdp.trainer.engine import HdpEngine, NonFiniteGradientError, NonFiniteLossError, nll_loss

    def sqrt_at_zero(local, logprobs, weights):  # finite value 0, gradient NaN (d sqrt / dx = inf at 0, times 0)
        loss = -(weights * logprobs).sum()
        return loss + torch.sqrt(logprobs.sum() * 0.0) if rank == 1 else loss

    seconds = {}
    for clip in (0.0, 1.0):
        engine = HdpEngine.build(_config(optim=dict(clip_grad=clip)), dist.group.WORLD, init_fn=_init)
        engine.train_step(_batch(0), nll_loss)  # Adam holds moments from here on
        before = _state(engine)
        exc, secs = _raises(lambda: engine.train_step(_batch(1), sqrt_at_zero), NonFiniteGradientError,
                            "the gradient is not finite on world ranks [", "is finite", "skipped on every rank")
        # rank 1's NaN reaches rank 0's gradient through the CP rings of the samples they share
        assert isinstance(exc, NonFiniteLossError) and 1 in exc.ranks and exc.step == 2
        assert _same(_state(engine), before), f"clip_grad={clip}: the skipped step changed the state"
        m = engine.train_step(_batch(2), nll_loss)  # trains normally afterwards
        assert torch.isfinite(torch.tensor(m["loss"])) and m["hdp/step"] == 3
        after = _state(engine)
        assert not _same(after, before) and all(torch.isfinite(t).all() for t in after)
        seconds[clip] = secs
        engine.close()
    return seconds


def test_a_nan_gradient_under_a_finite_loss_is_skipped_on_every_rank_with_clip_0_and_1() -> None:
    """Before: the update was applied and every parameter became NaN (the gradient norm is never checked)."""
    run_distributed(_nan_gradient, 2, timeout=400)


def _consecutive_skips(rank: int, world: int) -> None:
    from hdp.trainer.engine import HdpEngine, NonFiniteLossError, SkippedUpdatesError, nll_loss

    def nan_on_rank_1(local, logprobs, weights):
        loss = -(weights * logprobs).sum()
        return loss * float("nan") if rank == 1 else loss

    engine = HdpEngine.build(_config(), dist.group.WORLD, init_fn=_init)  # max_consecutive_skips: the default, 3
    engine.train_step(_batch(0), nll_loss)
    before = _state(engine)
    for _ in range(2):  # one skip, two: each its own error, as before
        exc, _ = _raises(lambda: engine.train_step(_batch(1), nan_on_rank_1), NonFiniteLossError, "not finite")
        assert not isinstance(exc, SkippedUpdatesError)
    # the third in a row: every rank raises, naming the count, the option and the first skip's cause
    exc, _ = _raises(lambda: engine.train_step(_batch(1), nan_on_rank_1), SkippedUpdatesError,
                     "step 4: 3 updates in a row were skipped", "PlanningConfig.max_consecutive_skips=3",
                     "The first skip, at step 2: step 2: the loss is not finite on domain ranks [")
    assert not isinstance(exc, NonFiniteLossError)  # a handler that skips bad batches does not swallow it
    assert isinstance(exc.__cause__, NonFiniteLossError) and exc.__cause__.step == 2 and exc.last.step == 4
    _raises(lambda: engine.train_step(_batch(1), nan_on_rank_1), SkippedUpdatesError, "4 updates in a row")
    assert _same(_state(engine), before)  # nothing applied
    m = engine.train_step(_batch(2), nll_loss)  # an applied update ends the run of skips
    assert torch.isfinite(torch.tensor(m["loss"]))
    _raises(lambda: engine.train_step(_batch(1), nan_on_rank_1), NonFiniteLossError, "step 7: the loss is not finite")
    engine.close()
    planning = dataclasses.replace(_config().planning, max_consecutive_skips=None)  # never
    engine = HdpEngine.build(dataclasses.replace(_config(), planning=planning), dist.group.WORLD, init_fn=_init)
    for _ in range(4):
        exc, _ = _raises(lambda: engine.train_step(_batch(1), nan_on_rank_1), NonFiniteLossError, "not finite")
        assert not isinstance(exc, SkippedUpdatesError)
    engine.close()


def test_a_run_of_skipped_updates_raises_on_every_rank_naming_the_first_cause() -> None:
    """Before: every step skipped its update (a NaN loss each) and raised NonFiniteLossError, which a trainer
    that skips bad batches catches: the run went on without training for ever."""
    run_distributed(_consecutive_skips, 2, timeout=400)


# ---- (2) calls and configs that differ between ranks ---------------------------------------------------


def _divergent_calls(rank: int, world: int, tmp: str) -> None:
    from hdp.checksum import CallMismatchError
    from hdp.trainer.engine import HdpEngine, nll_loss

    engine = HdpEngine.build(_config(), dist.group.WORLD, init_fn=_init)
    engine.train_step(_batch(0), nll_loss)
    before = _state(engine)
    other = "train_step(step=2"
    cases = {  # what rank 0 calls; rank 1 calls train_step (or the second form)
        "save": (lambda: engine.save_checkpoint(f"{tmp}/c", format="per-rank"), "save_checkpoint(step=1"),
        "forward": (lambda: engine.forward(_batch(1)), "forward(step=1"),
        "load": (lambda: engine.load_checkpoint(f"{tmp}/c"), "load_checkpoint(step=1"),
    }
    for name, (call0, needle) in cases.items():
        fn = call0 if rank == 0 else (lambda: engine.train_step(_batch(1), nll_loss))
        exc, _ = _raises(fn, CallMismatchError, f"world rank 0 called {needle}", f"world rank 1 called {other}",
                         "Nothing was run")
        assert set(exc.calls) == {0, 1}, name
        assert _same(_state(engine), before), name
    # the same method with other arguments
    _raises(lambda: engine.save_checkpoint(f"{tmp}/c", format="dist" if rank == 0 else "per-rank"),
            CallMismatchError, "format='dist'", "format='per-rank'")
    _raises(lambda: engine.save_checkpoint(f"{tmp}/c{rank}"), CallMismatchError, f"{tmp}/c0", f"{tmp}/c1")
    _raises(lambda: engine.train_step(_batch(1), nll_loss, plan=engine.plan(_batch(1)) if rank else None),
            CallMismatchError, "plan=None", "plan=given")
    _raises(lambda: engine.train_steps([_batch(1), _batch(2)] + ([_batch(3)] if rank else [])),
            CallMismatchError, "train_steps[1/2]", "train_steps[1/3]")
    assert _same(_state(engine), before)
    engine.train_step(_batch(1), nll_loss)  # still in step on every rank
    engine.save_checkpoint(f"{tmp}/c", format="per-rank")
    engine.close()


def _divergent_configs(rank: int, world: int) -> None:
    from hdp.trainer.engine import HdpEngine

    base = _groups()
    for kw, needle in (
        (dict(optim=dict(lr=1e-3 if rank == 0 else 2e-3)),
         "EngineConfig.optim.lr: 0.001 on world rank 0, 0.002 on world rank 1"),
        (dict(model=dict(hidden_size=32 if rank == 0 else 48)),
         "EngineConfig.model.hidden_size: 32 on world rank 0, 48 on world rank 1"),
        (dict(loss_aggregation="token-mean" if rank == 0 else "seq-mean-token-mean"),
         "EngineConfig.loss_aggregation: <LossAggregation.TOKEN_MEAN"),
    ):
        _raises(lambda: HdpEngine.build(_config(**kw), dist.group.WORLD), ValueError, needle, "nothing was built")
        assert _groups() == base  # the failed build left no group behind
    HdpEngine.build(_config(), dist.group.WORLD).close()  # the same config builds


def _divergent_topology(rank: int, world: int) -> None:
    import os

    from hdp.trainer.engine import HdpEngine

    base = _groups()
    big = str(10**30)
    for env, needles in (
        ({"LOCAL_WORLD_SIZE": "2" if rank == 0 else "1"},
         ("the launcher's topology differs across the job", "LOCAL_WORLD_SIZE: '2' on world rank 0, '1' on world rank 1")),
        ({"LOCAL_WORLD_SIZE": "2" if rank == 0 else big},  # bad on one rank only: named on both, no broken collective
         ("LOCAL_WORLD_SIZE: '2' on world rank 0, '1000000000000000000000000000000' on world rank 1",)),
        ({"RAY_LOCAL_WORLD_SIZE": "two"} if rank == 1 else {},
         ("RAY_LOCAL_WORLD_SIZE: unset on world rank 0, 'two' on world rank 1",)),
        ({"LOCAL_WORLD_SIZE": big},  # bad on every rank: the same error everywhere, naming the variable
         (f"LOCAL_WORLD_SIZE='{big}': the launcher's ranks per node must be an integer in [1, 65536]",)),
        ({"LOCAL_WORLD_SIZE": "0"}, ("LOCAL_WORLD_SIZE='0'", "[1, 65536]")),
    ):
        saved = {k: os.environ.pop(k, None) for k in ("LOCAL_WORLD_SIZE", "RAY_LOCAL_WORLD_SIZE")}
        os.environ.update(env)
        try:
            _raises(lambda: HdpEngine.build(_config(), dist.group.WORLD), ValueError, *needles, "nothing was built")
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v
        assert _groups() == base  # the failed build left no group behind
    # verl's worker writes LOCAL_WORLD_SIZE itself under Ray: not read (RAY_LOCAL_WORLD_SIZE wins), so it may differ
    os.environ.update(RAY_LOCAL_WORLD_SIZE="2", LOCAL_WORLD_SIZE=str(rank + 1))
    try:
        HdpEngine.build(_config(), dist.group.WORLD).close()
    finally:
        for k in ("LOCAL_WORLD_SIZE", "RAY_LOCAL_WORLD_SIZE"):
            os.environ.pop(k, None)


def test_launcher_topology_that_differs_or_is_bad_is_named_at_build() -> None:
    """Before: LOCAL_WORLD_SIZE=10**30 was an OverflowError naming no variable (and on one rank only, a gloo
    "Connection closed by peer" on the other); ranks with different values failed later with a plan mismatch
    naming no variable."""
    run_distributed(_divergent_topology, 2, timeout=300)


def test_calls_that_differ_between_ranks_are_named_on_every_rank_and_nothing_runs(tmp_path) -> None:
    """Before: rank 0 alone saving died of SIGABRT (gloo size mismatch); forward against train_step, another
    format or a lone load waited the whole collective timeout."""
    run_distributed(_divergent_calls, 2, str(tmp_path), timeout=400)


def test_configs_that_differ_between_ranks_are_named_at_build() -> None:
    """Before: another lr or loss aggregation trained silently with mixed settings; another hidden size
    aborted rank 0 (SIGABRT) in step 1."""
    run_distributed(_divergent_configs, 2, timeout=300)


# ---- (4) Ctrl-C during validation ----------------------------------------------------------------------


class _InterruptedTokens(list):
    """Sample tensors whose iteration is interrupted by a real SIGINT (Python's handler: KeyboardInterrupt)."""

    def __iter__(self):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C, even where the launching
        signal.raise_signal(signal.SIGINT)  # shell left SIGINT ignored (a background job's ranks inherit that)
        return super().__iter__()


def _ctrl_c(rank: int, world: int, tmp: str) -> None:
    from hdp.checksum import CallMismatchError
    from hdp.guard import DomainStepError
    from hdp.trainer.engine import Batch, HdpEngine, nll_loss

    engine = HdpEngine.build(_config(), dist.group.WORLD, init_fn=_init)
    engine.train_step(_batch(0), nll_loss)
    before = _state(engine)
    batch = _batch(1)
    interrupted = Batch(tokens=_InterruptedTokens(batch.tokens)) if rank == 1 else batch
    if rank == 1:
        _raises(lambda: engine.train_step(interrupted, nll_loss), KeyboardInterrupt)
    else:
        _raises(lambda: engine.train_step(interrupted, nll_loss), DomainStepError, "world ranks [1]",
                "KeyboardInterrupt")
    assert _same(_state(engine), before)
    # a trainer that catches the interrupt and saves: on every rank it works (the engine is still in step) ...
    engine.save_checkpoint(f"{tmp}/after-ctrl-c", format="per-rank")
    # ... and when only the interrupted rank saves while its peer goes on training: a clear error, no SIGABRT
    fn = (lambda: engine.save_checkpoint(f"{tmp}/x", format="per-rank")) if rank == 1 else \
        (lambda: engine.train_step(batch, nll_loss))
    _raises(fn, CallMismatchError, "world rank 1 called save_checkpoint", "world rank 0 called train_step")
    engine.train_step(batch, nll_loss)
    engine.load_checkpoint(f"{tmp}/after-ctrl-c")
    assert _same(_state(engine), before) and engine.step == 1
    engine.close()


def test_ctrl_c_in_validation_is_agreed_and_the_engine_stays_usable(tmp_path) -> None:
    """Before: the interrupt escaped the agreement, the peer waited the whole timeout without naming it, and the
    interrupted rank's save then aborted the process (SIGABRT)."""
    run_distributed(_ctrl_c, 2, str(tmp_path), timeout=400)


# ---- (5) two engines in one process ----------------------------------------------------------------------


def _two_engines(rank: int, world: int, tmp: str) -> None:
    from hdp.guard import RankFailedError
    from hdp.trainer.engine import EngineClosedError, HdpEngine, nll_loss

    base = _groups()
    for first_closed in ("a", "b"):
        a = HdpEngine.build(_config(), dist.group.WORLD, init_fn=_init)
        b = HdpEngine.build(_config(seed=7, optim=dict(lr=2e-3)), dist.group.WORLD, init_fn=_init)
        for s in range(2):
            a.train_step(_batch(s), nll_loss)
            b.train_step(_batch(s), nll_loss)
        # another layout while they are open: refused before any collective, naming the fix
        _raises(lambda: HdpEngine.build(_config(parallel=dict(pp=2)), dist.group.WORLD), ValueError,
                "2 open engine(s)", "pp=1", "pp=2", "close()")
        gone, kept = (a, b) if first_closed == "a" else (b, a)
        gone.close()
        kept.train_step(_batch(2), nll_loss)  # the other engine is unaffected
        kept.save_checkpoint(f"{tmp}/{first_closed}", format="dist")
        kept.load_checkpoint(f"{tmp}/{first_closed}")
        _raises(lambda: gone.train_step(_batch(2), nll_loss), EngineClosedError, "closed")
        kept.close()
        assert _groups() == base, first_closed  # every group went with the last engine
    # one engine's own error inside its rounds releases its groups only: the other goes on
    a = HdpEngine.build(_config(), dist.group.WORLD, init_fn=_init)
    b = HdpEngine.build(_config(), dist.group.WORLD, init_fn=_init)

    if rank == 1:  # a rank's own error in the middle of A's rounds (the shape an out-of-memory takes)
        hook = a.model_chunks[0].module.decoder.layers[1].register_forward_pre_hook(
            lambda m, args: (_ for _ in ()).throw(RuntimeError("injected: out of memory on rank 1")))
    _raises(lambda: a.train_step(_batch(0), nll_loss), RankFailedError, "world rank 1", "injected")
    if rank == 1:
        hook.remove()
    b.train_step(_batch(0), nll_loss)
    b.train_step(_batch(1), nll_loss)
    b.close()
    assert _groups() == base


def test_two_engines_in_one_process_share_megatron_and_leave_each_other_working(tmp_path) -> None:
    """Before: A.close() broke B ('Group ... not registered'), B.close() broke A ('TP group not initialized'),
    and a failure of A freed B's groups."""
    run_distributed(_two_engines, 2, str(tmp_path), timeout=500)


# ---- (6, 7, 10) a missing loss, calls after close, opaque input and checkpoint errors ---------------------


def _loss_none_and_inputs(rank: int, world: int, tmp: str) -> None:
    from hdp.guard import DomainStepError
    from hdp.trainer.engine import Batch, EngineClosedError, HdpEngine, nll_loss

    engine = HdpEngine.build(_config(), dist.group.WORLD, init_fn=_init)
    engine.train_step(_batch(0), nll_loss)
    before = _state(engine)
    _raises(lambda: engine.train_step(_batch(1), None), TypeError, "loss_fn=None", "pass a callable")
    _raises(lambda: engine.train_step(_batch(1), lambda local, lp, w: None), DomainStepError,
            "TypeError: loss_fn returned None")
    good = _batch(1)
    _raises(lambda: engine.train_step(Batch(tokens=[good.tokens[0].to(torch.complex64), *good.tokens[1:]])),
            TypeError, "Batch.tokens[0]", "complex64")
    _raises(lambda: engine.train_step(Batch(tokens=good.tokens, extras={3: [t.float() for t in good.tokens]})),
            TypeError, "Batch.extras has the key 3 (int)", "str keys")
    for value in (2.0, -1.0):
        masks = [torch.ones(len(t)) for t in good.tokens]
        masks[2][5] = value
        _raises(lambda: engine.train_step(Batch(tokens=good.tokens, loss_mask=masks)), ValueError,
                f"Batch.loss_mask[2] holds {value!r} at token 5", "0 or 1")
    assert _same(_state(engine), before)  # nothing was applied (Adam's momentum moved the weights before)
    engine.save_checkpoint(f"{tmp}/dist", format="dist")
    engine.close()
    closed = {
        "plan": lambda: engine.plan(good), "train_step": lambda: engine.train_step(good),
        "train_steps": lambda: engine.train_steps([good]), "forward": lambda: engine.forward(good),
        "save_checkpoint": lambda: engine.save_checkpoint(f"{tmp}/y"),
        "load_checkpoint": lambda: engine.load_checkpoint(f"{tmp}/dist"), "state_dict": engine.state_dict,
        "plan_ahead": lambda: engine.plan_ahead([good]), "model": lambda: engine.model,
        "model_chunks": lambda: engine.model_chunks, "optimizer": lambda: engine.optimizer,
        "groups": lambda: engine.groups, "planner": lambda: engine.planner, "core": lambda: engine.core,
    }
    for name, fn in closed.items():
        _raises(fn, EngineClosedError, f"HdpEngine.{name}: the engine is closed")
    # a dist checkpoint loaded with the pipeline changed: the layout is named, from what to what
    piped = HdpEngine.build(_config(parallel=dict(pp=2)), dist.group.WORLD)
    _raises(lambda: piped.load_checkpoint(f"{tmp}/dist"), ValueError, "CheckpointError", "TP 1 x PP 1", "TP 1 x PP 2",
            "PP 1 -> 2")
    piped.train_step(_batch(1, [30, 20, 12]), nll_loss)  # still usable
    piped.close()


def test_a_missing_loss_closed_engine_and_bad_inputs_raise_clear_errors(tmp_path) -> None:
    """Before: loss_fn=None (or returning None) trained silently (Adam moved the weights on a zero loss); after
    close() plan() raised AttributeError and state_dict() returned {'step'}; complex tokens, an int extras key,
    mask values 2 / -1 and a dist checkpoint under another PP failed with opaque messages or not at all."""
    run_distributed(_loss_none_and_inputs, 2, str(tmp_path), timeout=400)


# ---- a checkpoint that does not fit the engine -------------------------------------------------------


def _other_model_checkpoint(rank: int, world: int, tmp: str) -> None:
    from hdp.core.checkpoint import CheckpointError
    from hdp.trainer.engine import HdpEngine, nll_loss

    saver = HdpEngine.build(_config(), dist.group.WORLD, init_fn=_init)
    saver.train_step(_batch(0), nll_loss)
    for fmt in ("per-rank", "dist"):
        saver.save_checkpoint(f"{tmp}/{fmt}", format=fmt)
    saver.close()
    wide = HdpEngine.build(_config(model=dict(hidden_size=48)), dist.group.WORLD, init_fn=_init)
    wide.train_step(_batch(0), nll_loss)  # Adam holds moments
    first = {"per-rank": "'model.model.embedding.word_embeddings.weight'", "dist": "'embedding.word_embeddings.weight'"}
    for step, fmt in enumerate(("per-rank", "dist"), start=2):
        before = _state(wide)
        exc, _ = _raises(lambda: wide.load_checkpoint(f"{tmp}/{fmt}"), ValueError, "does not fit this engine",
                         f"entry {first[fmt]}: checkpoint [64, 32] float32, this engine [64, 48] float32",
                         "model_config: checkpoint '", "Nothing was loaded")
        assert isinstance(exc.__cause__, CheckpointError) or "CheckpointError" in str(exc), exc
        assert _same(_state(wide), before), f"{fmt}: a refused load changed the state"
        m = wide.train_step(_batch(step), nll_loss)  # usable and in step afterwards
        assert torch.isfinite(torch.tensor(m["loss"])) and m["hdp/step"] == step
        assert not _same(_state(wide), before)
    wide.close()


def test_a_checkpoint_of_another_model_is_refused_before_any_write_naming_the_first_differing_tensor(tmp_path) -> None:
    """Both formats, through ``HdpEngine.build`` / ``save_checkpoint`` / ``load_checkpoint``: a wider engine refuses
    the checkpoint on every rank, naming the first differing tensor with both shapes and dtypes (the check reads
    metadata only); nothing changed and the engine trains on.  Before: the error said only that the model-config
    digests differed."""
    run_distributed(_other_model_checkpoint, 2, str(tmp_path), timeout=400)
