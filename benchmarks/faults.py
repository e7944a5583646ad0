"""``python -m benchmarks faults``: inject faults into running engines on local gloo ranks; report how every rank ended.

The failure contract's check, runnable by anyone (``python -m benchmarks faults --json``; the tests in
``tests/slow/trainer/test_faults.py`` call the same scenarios).  Every fault is injected on one rank of a tiny
GPT trained by :class:`hdp.trainer.engine.HdpEngine` through its public API; for each the report
lists::

    {"fault", "ranks", "ranks_raised", "ranks_died", "seconds_to_exit", "state_unchanged",
     "errors": {rank: first line}, "ok"}

``ranks_raised``: ranks whose call raised; ``ranks_died``: ranks the fault killed;
``seconds_to_exit``: the slowest surviving rank, from the injection (the call, or the kill) to its
exception; ``state_unchanged``: on every surviving rank, a sha256 of the parameters and the
optimizer state (moments, Adam's step) equals the one taken before the failed call; ``ok``: every surviving
rank raised, the state is unchanged and every rank exited within the collective timeout (plus a
few seconds of slack).  ``checks`` holds what must *work*: a previous checkpoint loads after a
save killed half-way (bit for bit), a ``dist`` checkpoint of 4 ranks loads on 2, and no
checkpoint-writer process outlives a killed rank.

Scenarios (each one spawn of local processes): ``in-process`` (4 ranks: loss_fn raising /
detached / NaN on one rank, a RuntimeError in validation on one rank, different token ids under
the same lengths on one rank, a finite loss with a NaN gradient on one rank (skipped on every rank:
``NonFiniteGradientError``), one rank calling ``save_checkpoint`` or ``forward`` while the others train
and a save whose ``format`` differs on one rank (every rank names the calls: ``CallMismatchError``), a
real SIGINT on one rank during validation with its process alive (every rank raises within seconds, the
interrupted one its ``KeyboardInterrupt``, and then every rank saves: ``save_after_on_every_rank``), a run of
NaN losses on one rank (``consecutive-skips-raise``: the ``PlanningConfig.max_consecutive_skips``-th skip in a
row raises ``SkippedUpdatesError`` on every rank naming the first skip's cause, ``names_first_cause``, with
nothing applied since the first, ``unchanged_since_first_skip``) — these rows also need ``seconds_to_exit`` <= 5
and the error named on every rank —, truncated and corrupted checkpoint files in both formats, a
checkpoint of another model in both formats, and with a forged manifest (the model-config digest rewritten): refused
by the one fit check before anything is written (``hdp.core.checkpoint.check_fit``: the first differing tensor
named with both shapes, on every rank within 5 s, nothing applied, the engine trains on); ``other-world`` (2 ranks load the
4-rank checkpoints); ``sigkill-mid-step``, ``sigstop-mid-step`` (3 ranks); ``sigkill-during-save``
(3 ranks, both formats, then a fresh job loads the previous checkpoint); ``verl`` (2 ranks of verl's
own worker on the hdp engine: planning RuntimeError, a raising loss function, a NaN loss on one rank, a run
of them that raises, rollout correction keeping the old-log-prob pass, an update that read its skipped
pass's stand-ins;
in `benchmarks.verl.faults`; skipped, with a
check saying so, where verl is not installed); ``own-error-in-round`` (4 ranks, collective timeout
300 s); ``sigint-during-dist-checkpoint`` (3 ranks: SIGINT reaches rank 1 while it is blocked inside
the first collective of Megatron's dist save / load, and lives on until the others have left; the row
adds ``interrupted_in``, ``blocked_when_signalled``, ``seconds_blocked_after_signal``: how long Python
deferred the handler, until the collective returned, ``interrupted_rank_error``,
``within_collective_timeout`` and ``previous_checkpoint_intact``);
``sigstop-during-validation`` (3 ranks; adds ``raises_domain_unreachable``, ``names_phase``,
``next_call_refused``); ``calibration-log-full-disk`` (2 ranks, records on ``/dev/full``: a row whose
``ok`` means no rank raised, ``step_succeeded`` and ``write_failed`` = 1.0 on every rank).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["SCENARIOS", "run_faults"]

SCENARIOS = ("in-process", "other-world", "sigkill-mid-step", "sigstop-mid-step", "sigkill-during-save",
             "own-error-in-round", "sigint-during-dist-checkpoint", "sigstop-during-validation",
             "calibration-log-full-disk", "verl")
_AGREED_AT_ONCE = {
    "nan-gradient-finite-loss": "the gradient is not finite",
    "rank-calls-save-others-train": "call mismatch",
    "rank-calls-forward-others-train": "call mismatch",
    "save-format-differs": "call mismatch",
    "ctrl-c-in-validation": "",
    "other-model-per-rank": "does not fit this engine: state entry 'model.model.embedding.word_embeddings.weight'",
    "other-model-dist": "does not fit this engine: state entry 'embedding.word_embeddings.weight'",
    "other-model-forged-manifest": "does not fit this engine: state entry 'embedding.word_embeddings.weight'",
    "consecutive-skips-raise": "updates in a row were skipped",
}
"""In-process rows that must end on every rank within 5 s (one agreement), and what every error names."""
OWN_ERROR_TIMEOUT_S = 300.0
"""The collective timeout of the own-error rows: every rank must raise within seconds, long before it."""
SLACK_S = 15.0
"""Seconds allowed beyond the collective timeout for a rank to notice and raise (process start-up excluded)."""
_B = 32
_LENGTHS = [40, 30, 20, 12, 25, 9, 16, 7]


# ---- the model and the data (rank- and layout-independent) ----------------------------------------


def _config(timeout_s: float, hidden: int = 32):
    from hdp.trainer.config import EngineConfig, PlanningConfig
    from hdp.trainer.model import ModelConfig

    return EngineConfig(
        model=ModelConfig(vocab_size=64, hidden_size=hidden, num_layers=2, num_attention_heads=4,
                          max_sequence_length=512),
        planning=PlanningConfig(max_tokens_per_rank=_B, auto_calibrate=False, collective_timeout_s=timeout_s),
    )


def _init(name: str, p: torch.Tensor) -> None:
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    val = torch.randn(p.shape, generator=g, dtype=torch.float32)
    p.copy_(1.0 + 0.1 * val if p.dim() == 1 else 0.05 * val)


def _batch(step: int):
    from hdp.trainer.engine import Batch

    g = torch.Generator().manual_seed(100 + step)
    return Batch(tokens=[torch.randint(0, 64, (n,), generator=g) for n in _LENGTHS])


def state_tensors(modules: Any, optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of ``modules`` and every state tensor of Megatron's ``optimizer``, by name (the step
    counter is not part of it: a step whose loss fails or is not finite still counts as attempted).  Held by
    the caller, they can be read after a failed step released the engine's groups and dropped its model."""
    out = []
    for module in modules:
        out += [(name, p) for name, p in module.named_parameters()]
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for i, entry in enumerate(opt.optimizer.state.values()):
            out += [(f"{i}.{key}", v) for key, v in sorted(entry.items()) if isinstance(v, torch.Tensor)]
    return out


def _state_tensors(engine) -> list[tuple[str, torch.Tensor]]:
    return state_tensors([c.module for c in engine.model_chunks], engine.optimizer)


def digest_of(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 of (name, bytes) of ``tensors``."""
    h = hashlib.sha256()
    for name, v in tensors:
        h.update(name.encode())
        h.update(v.detach().cpu().contiguous().reshape(-1).numpy().tobytes())
    return h.hexdigest()


class _InterruptedTokens(list):
    """Sample tensors whose iteration raises a real SIGINT (Python's handler turns it into KeyboardInterrupt)."""

    def __iter__(self):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C, even where the launching
        signal.raise_signal(signal.SIGINT)  # shell left SIGINT ignored (a background job's ranks inherit that)
        return super().__iter__()


def _Interrupting(batch):
    """``batch`` whose tokens are read under a Ctrl-C (the engine's validation reads them first)."""
    from hdp.trainer.engine import Batch

    return Batch(tokens=_InterruptedTokens(batch.tokens), loss_mask=batch.loss_mask, extras=batch.extras)


def _state_digest(engine) -> str:
    """sha256 of `_state_tensors`."""
    return digest_of(_state_tensors(engine))


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model_chunks[0].module.named_parameters()}


def _first_line(exc: BaseException | None) -> str | None:
    if exc is None:
        return None
    text = f"{type(exc).__name__}: {exc}"
    return text.splitlines()[0][:300]


def _attempt(engine, fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` on this rank: did it raise, how fast, and is the engine's state unchanged?"""
    held = _state_tensors(engine)
    before = digest_of(held)
    t0 = time.time()
    err: BaseException | None = None
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the report names every type
        err = exc
    return {"raised": err is not None, "error": _first_line(err), "seconds": time.time() - t0,
            "unchanged": digest_of(held) == before}


# ---- in-process faults (4 ranks) ---------------------------------------------------------------------


def _in_process(rank: int, world: int, workdir: str, timeout_s: float) -> dict[str, Any]:
    from hdp import megatron_compat as mc
    from hdp.core.checkpoint import read_manifest
    from hdp.trainer.checkpointer import model_digest
    from hdp.trainer.engine import HdpEngine, nll_loss

    WORLD = dist.group.WORLD
    root = Path(workdir)
    out: dict[str, Any] = {}
    engine = HdpEngine.build(_config(timeout_s), WORLD, init_fn=_init)
    engine.train_step(_batch(0), nll_loss)  # the optimizer holds state from here on

    def bad_loss(kind: str):
        def fn(local, logprobs, weights):
            loss = -(weights * logprobs).sum()
            if rank != 1:
                return loss
            if kind == "raises":
                raise RuntimeError("injected: loss_fn bug on rank 1")
            if kind == "detached":
                return loss.detach()
            return loss * float("nan")
        return fn

    for kind in ("raises", "detached", "nan"):
        out[f"loss-fn-{kind}"] = _attempt(engine, lambda k=kind: engine.train_step(_batch(1), bad_loss(k)))

    def validation_error():
        if rank == 1:
            def broken(batch):
                raise RuntimeError("injected: validation crashed on rank 1")
            engine._validate = broken  # the injection: one rank's validation code fails
        try:
            engine.train_step(_batch(1), nll_loss)
        finally:
            engine.__dict__.pop("_validate", None)

    out["validation-runtime-error"] = _attempt(engine, validation_error)

    def other_tokens():
        b = _batch(1)
        if rank == 1:
            b.tokens[0] = (b.tokens[0] + 1) % 64  # same lengths, other token ids
        engine.train_step(b, nll_loss)

    out["different-token-ids"] = _attempt(engine, other_tokens)

    def sqrt_at_zero(local, logprobs, weights):  # a finite loss (+ 0) whose gradient is NaN (d sqrt/dx = inf at 0)
        loss = -(weights * logprobs).sum()
        return loss + torch.sqrt(logprobs.sum() * 0.0) if rank == 1 else loss

    out["nan-gradient-finite-loss"] = _attempt(engine, lambda: engine.train_step(_batch(1), sqrt_at_zero))
    # one rank calls another method, or the same with other arguments, while the others train
    train = lambda: engine.train_step(_batch(1), nll_loss)  # noqa: E731
    out["rank-calls-save-others-train"] = _attempt(
        engine, (lambda: engine.save_checkpoint(root / "lone", format="per-rank")) if rank == 0 else train)
    out["rank-calls-forward-others-train"] = _attempt(engine, (lambda: engine.forward(_batch(1))) if rank == 0 else train)
    out["save-format-differs"] = _attempt(
        engine, lambda: engine.save_checkpoint(root / "fmt", format="dist" if rank == 0 else "per-rank"))

    def ctrl_c_in_validation():  # a real SIGINT on rank 1 while its validation reads the batch
        b = _batch(1)
        engine.train_step(_Interrupting(b) if rank == 1 else b, nll_loss)

    out["ctrl-c-in-validation"] = _attempt(engine, ctrl_c_in_validation)
    # the trainer caught it and saves on every rank: the engine is still in step
    out["ctrl-c-in-validation"]["save_after"] = _first_line(
        _error_of(lambda: engine.save_checkpoint(root / "after-ctrl-c", format="per-rank")))
    engine.train_step(_batch(1), nll_loss)  # the engine is still in step after every fault above

    # a run of NaN losses (PlanningConfig.max_consecutive_skips, 3 by default): the first ones skip as above,
    # the last raises SkippedUpdatesError on every rank, naming the count and the first skip's cause
    held = _state_tensors(engine)
    start = digest_of(held)
    for _ in range(_config(timeout_s).planning.max_consecutive_skips - 1):
        _error_of(lambda: engine.train_step(_batch(1), bad_loss("nan")))
    out["consecutive-skips-raise"] = _attempt(engine, lambda: engine.train_step(_batch(1), bad_loss("nan")))
    out["consecutive-skips-raise"]["unchanged_since_first_skip"] = digest_of(held) == start
    engine.train_step(_batch(1), nll_loss)  # an applied update ends the run

    # checkpoints: save both formats at this step, train on, then load damaged copies
    for fmt in ("per-rank", "dist"):
        engine.save_checkpoint(root / fmt, format=fmt)
    if rank == 0:
        torch.save(_params(engine), root / "saved_params.pt")
    engine.train_step(_batch(2), nll_loss)  # the engine's state now differs from the checkpoints

    def damaged(fmt: str, how: str) -> Callable[[], None]:
        def fn():
            man = read_manifest(root / fmt)
            name = sorted(man.files, key=lambda n: (-man.files[n]["bytes"], n))[0]  # the biggest file
            target = root / fmt / man.slot / name
            original = target.read_bytes() if rank == 0 else b""
            dist.barrier(group=WORLD)
            if rank == 0:
                if how == "truncated":
                    target.write_bytes(original[: len(original) // 2])
                else:
                    raw = bytearray(original)
                    mid = len(raw) // 2
                    raw[mid:mid + 64] = bytes(b ^ 0xFF for b in raw[mid:mid + 64])
                    target.write_bytes(bytes(raw))
            dist.barrier(group=WORLD)
            try:
                engine.load_checkpoint(root / fmt)
            finally:
                dist.barrier(group=WORLD)
                if rank == 0:
                    target.write_bytes(original)
                dist.barrier(group=WORLD)
        return fn

    for fmt in ("per-rank", "dist"):
        for how in ("truncated", "corrupted"):
            out[f"{fmt}-{how}"] = _attempt(engine, damaged(fmt, how))
    engine.train_step(_batch(3), nll_loss)
    mc.destroy_megatron()

    # another model: a wider engine refuses both checkpoints before any write, naming the first differing tensor
    # (the fit check reads their metadata), also when the manifest's model-config digest is forged to match
    wide = HdpEngine.build(_config(timeout_s, hidden=48), WORLD, init_fn=_init)
    wide.train_step(_batch(0), nll_loss)
    for fmt in ("per-rank", "dist"):
        out[f"other-model-{fmt}"] = _attempt(wide, lambda f=fmt: wide.load_checkpoint(root / f))

    def forged():
        path = root / "dist" / "manifest.json"
        original = path.read_text()
        dist.barrier(group=WORLD)
        if rank == 0:
            doc = json.loads(original)
            doc["meta"]["model_config"] = model_digest(wide.config.model)
            path.write_text(json.dumps(doc))
        dist.barrier(group=WORLD)
        try:
            wide.load_checkpoint(root / "dist")
        finally:
            dist.barrier(group=WORLD)
            if rank == 0:
                path.write_text(original)
            dist.barrier(group=WORLD)

    out["other-model-forged-manifest"] = _attempt(wide, forged)
    wide.train_step(_batch(1), nll_loss)  # still usable and in step
    mc.destroy_megatron()
    return out


def _other_world(rank: int, world: int, workdir: str, timeout_s: float) -> dict[str, Any]:
    """2 ranks: the 4-rank per-rank checkpoint is refused; the 4-rank dist checkpoint loads (reshards)."""
    from hdp import megatron_compat as mc
    from hdp.trainer.engine import HdpEngine, nll_loss

    root = Path(workdir)
    engine = HdpEngine.build(_config(timeout_s), dist.group.WORLD, init_fn=_init)
    engine.train_step(_batch(0), nll_loss)
    out: dict[str, Any] = {"other-world-per-rank": _attempt(engine, lambda: engine.load_checkpoint(root / "per-rank"))}
    engine.load_checkpoint(root / "dist")
    saved = torch.load(root / "saved_params.pt")
    got = _params(engine)
    out["dist-4-to-2-ranks"] = {"equal": all(torch.equal(got[k], saved[k]) for k in saved), "step": engine.step}
    engine.train_step(_batch(3), nll_loss)
    mc.destroy_megatron()
    return out


# ---- kills (3 ranks) --------------------------------------------------------------------------------------


def _mark(workdir: str, name: str, value: Any) -> None:
    Path(workdir, name).write_text(json.dumps(value))


def _killer_loss(workdir: str, sig: int):
    """A loss_fn that, on rank 2, records the time and its pid, then sends itself ``sig``."""
    def fn(local, logprobs, weights):
        if dist.get_rank() == 2:
            _mark(workdir, "injected", {"t": time.time(), "pid": os.getpid()})
            os.kill(os.getpid(), sig)
            time.sleep(60)  # SIGSTOP: never reached until continued
        return -(weights * logprobs).sum()
    return fn


def _mid_step(rank: int, world: int, workdir: str, timeout_s: float, sig: int) -> dict[str, Any]:
    from hdp.trainer.engine import HdpEngine, nll_loss

    engine = HdpEngine.build(_config(timeout_s), dist.group.WORLD, init_fn=_init)
    engine.train_step(_batch(0), nll_loss)
    res = _attempt(engine, lambda: engine.train_step(_batch(1), _killer_loss(workdir, sig)))
    res["t_exit"] = time.time()
    if sig == signal.SIGSTOP and rank == 0:  # the hung rank never exits by itself
        pid = json.loads(Path(workdir, "injected").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
    res["next_call"] = _first_line(_error_of(lambda: engine.train_step(_batch(2), nll_loss)))
    return res


def _error_of(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def _save_then_die(rank: int, world: int, workdir: str, timeout_s: float, fmt: str) -> dict[str, Any]:
    """Save a checkpoint at step 1; at step 2 rank 1 is killed in the middle of writing the next one."""
    from hdp.trainer.engine import HdpEngine, nll_loss

    root = Path(workdir)
    engine = HdpEngine.build(_config(timeout_s), dist.group.WORLD, init_fn=_init)
    engine.train_step(_batch(0), nll_loss)
    engine.save_checkpoint(root / fmt, format=fmt)
    if rank == 0:
        torch.save(_params(engine), root / f"{fmt}_step1.pt")
    engine.train_step(_batch(1), nll_loss)
    if rank == 1:
        _arm_kill_during_write(workdir, fmt)
    res = _attempt(engine, lambda: engine.save_checkpoint(root / fmt, format=fmt))
    res["t_exit"] = time.time()
    return res


def _arm_kill_during_write(workdir: str, fmt: str) -> None:
    """Make this rank die half-way through its checkpoint write (per-rank: half a file on disk;
    dist: while Megatron's forked writer processes run, recording their pids)."""
    if fmt == "per-rank":
        real = torch.save

        def half_then_die(obj, f, *a, **k):
            import io

            buf = io.BytesIO()
            real(obj, buf, *a, **k)
            data = buf.getvalue()
            with open(f, "wb") as fh:
                fh.write(data[: len(data) // 2])
                fh.flush()
                os.fsync(fh.fileno())
            _mark(workdir, "injected", {"t": time.time(), "pid": os.getpid(), "children": []})
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = half_then_die
        return
    import psutil

    from hdp.megatron_compat import dist_checkpointing

    real_save = dist_checkpointing.save
    me = psutil.Process()

    def watch(known: set[int]) -> None:  # kill this rank as soon as a writer process starts
        while True:
            kids = [c.pid for c in me.children(recursive=True)]
            if set(kids) - known:
                _mark(workdir, "injected", {"t": time.time(), "pid": os.getpid(), "children": kids})
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.005)

    def save_and_die(*a, **k):
        known = {c.pid for c in me.children(recursive=True)}  # e.g. the writer's result-queue server
        threading.Thread(target=watch, args=(known,), daemon=True).start()
        real_save(*a, **k)
        # no writer process was forked (a synchronous writer): die after writing, before the commit
        _mark(workdir, "injected", {"t": time.time(), "pid": os.getpid(),
                                    "children": [c.pid for c in me.children(recursive=True)]})
        os.kill(os.getpid(), signal.SIGKILL)

    dist_checkpointing.save = save_and_die


def _load_previous_dist(rank: int, world: int, workdir: str, timeout_s: float) -> dict[str, Any]:
    """A fresh job loads the dist checkpoint an interrupted save or load left: step 1, bit for bit."""
    from hdp.trainer.engine import HdpEngine, nll_loss

    root = Path(workdir)
    engine = HdpEngine.build(_config(timeout_s), dist.group.WORLD)
    engine.load_checkpoint(root / "ckpt")
    saved = torch.load(root / "step1.pt")
    got = _params(engine)
    out = {"equal": all(torch.equal(got[k], saved[k]) for k in saved), "step": engine.step}
    engine.train_step(_batch(1), nll_loss)
    engine.close()
    return out


def _load_previous(rank: int, world: int, workdir: str, timeout_s: float) -> dict[str, Any]:
    """A fresh job loads what the killed saves left: the step-1 checkpoints, bit for bit."""
    from hdp import megatron_compat as mc
    from hdp.trainer.engine import HdpEngine, nll_loss

    root = Path(workdir)
    out = {}
    engine = HdpEngine.build(_config(timeout_s), dist.group.WORLD)
    for fmt in ("per-rank", "dist"):
        engine.load_checkpoint(root / fmt)
        saved = torch.load(root / f"{fmt}_step1.pt")
        got = _params(engine)
        out[fmt] = {"equal": all(torch.equal(got[k], saved[k]) for k in saved), "step": engine.step}
    engine.train_step(_batch(1), nll_loss)
    mc.destroy_megatron()
    return out


# ---- a rank's own error inside the rounds, interrupts in checkpoints, a stopped peer, a full disk ----------


def _own_error(rank: int, world: int, workdir: str, timeout_s: float, where: str) -> dict[str, Any]:
    """Rank 1 raises RuntimeError in round 2's forward (the shape an out-of-memory takes) or in a CP
    backward and its process stays alive until the others have left; the collective timeout is
    OWN_ERROR_TIMEOUT_S, so only the alarm and the released groups make this fast."""
    from hdp.trainer.engine import HdpEngine, nll_loss

    engine = HdpEngine.build(_config(OWN_ERROR_TIMEOUT_S), dist.group.WORLD, init_fn=_init)
    engine.train_step(_batch(0), nll_loss)
    if rank == 1 and where == "forward":
        calls = {"n": 0}

        def hook(module: Any, args: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected: out of memory in the forward of round 2 on rank 1")

        engine.model_chunks[0].module.decoder.layers[1].register_forward_pre_hook(hook)
    if rank == 1 and where == "cp-backward":
        import hdp.cp.ring as ring

        def broken(*a: Any, **k: Any) -> Any:
            raise RuntimeError("injected: CP ring backward failed on rank 1")

        ring.ring_backward = broken
    res = _attempt(engine, lambda: engine.train_step(_batch(1), nll_loss))
    res["t_exit"] = time.time()
    res["next_call"] = _first_line(_error_of(lambda: engine.train_step(_batch(2), nll_loss)))
    # the failed rank's process lives on (a Ray actor, a trainer that catches the error) until every
    # peer has left: its exit must not be what releases them
    root = Path(workdir)
    (root / f"left-{rank}").write_text(str(res["t_exit"]))
    deadline = time.time() + OWN_ERROR_TIMEOUT_S + 30.0
    while rank == 1 and time.time() < deadline and not all((root / f"left-{r}").exists() for r in range(world)):
        time.sleep(0.05)
    return res


_CHECKPOINT_COLLECTIVES = ("barrier", "gather_object", "all_gather_object", "broadcast_object_list", "all_reduce",
                           "all_gather", "broadcast", "scatter_object_list")
"""The ``torch.distributed`` functions Megatron's (and torch's) dist checkpoint code calls, by module attribute."""
SIGNAL_AFTER_S = 0.2
"""How long the interrupted rank is inside the checkpoint's first collective when SIGINT reaches it."""
PEERS_LATE_S = 1.0
"""How late the other ranks enter that collective, so that the interrupted rank is blocked in it then."""


@contextlib.contextmanager
def _first_checkpoint_collective(on_enter: Callable[[str], None], seen: dict[str, Any]) -> Iterator[None]:
    """While active, the first call of a :data:`_CHECKPOINT_COLLECTIVES` function runs ``on_enter(name)``
    just before entering it; ``seen`` gets its name and the times it was entered, returned or raised."""
    real = {name: getattr(dist, name) for name in _CHECKPOINT_COLLECTIVES}

    def wrap(name: str) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            if "collective" in seen:
                return real[name](*a, **k)
            seen["collective"] = name
            on_enter(name)
            seen["t_enter"] = time.time()
            try:
                out = real[name](*a, **k)
            except BaseException as exc:  # noqa: BLE001 - recorded, re-raised
                seen["t_raised"], seen["raised"] = time.time(), type(exc).__name__
                raise
            seen["t_returned"] = time.time()
            return out
        return call

    for name in _CHECKPOINT_COLLECTIVES:
        setattr(dist, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _interrupt_checkpoint(rank: int, world: int, workdir: str, timeout_s: float, op: str) -> dict[str, Any]:
    """Rank 1 gets SIGINT while it is blocked inside the first collective of Megatron's dist save (or load).

    The other ranks enter that collective :data:`PEERS_LATE_S` late, and a timer thread on rank 1 sends
    SIGINT to its own process :data:`SIGNAL_AFTER_S` after rank 1 entered it, so the signal arrives while
    rank 1's main thread waits inside the C++ collective.  Python runs its handler only when that call
    returns (here: when the late peers arrive; a collective that never completes returns at the group's
    timeout); then ``KeyboardInterrupt`` aborts the save's group and publishes the alarm.  Rank 1 then lives
    on until the peers have left, so its exit (which closes its gloo connections) does not release them: on
    gloo an abort does not end a collective already blocked, on this rank or on the peers, so they leave at
    their collective timeouts.  The previous checkpoint must stay loadable."""
    from hdp.megatron_compat import dist_checkpointing
    from hdp.trainer.engine import HdpEngine, nll_loss

    root = Path(workdir)
    engine = HdpEngine.build(_config(timeout_s), dist.group.WORLD, init_fn=_init)
    engine.train_step(_batch(0), nll_loss)
    engine.save_checkpoint(root / "ckpt", format="dist")
    if rank == 0:
        torch.save(_params(engine), root / "step1.pt")
    engine.train_step(_batch(1), nll_loss)
    seen: dict[str, Any] = {}

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as under a terminal, even from a background job

    def on_enter(name: str) -> None:
        if rank != 1:
            time.sleep(PEERS_LATE_S)
            return

        def fire() -> None:
            seen["t_signal"] = time.time()
            _mark(workdir, "injected", {"t": seen["t_signal"], "pid": os.getpid(), "collective": name})
            os.kill(os.getpid(), signal.SIGINT)

        threading.Timer(SIGNAL_AFTER_S, fire).start()

    name = "save" if op == "save" else "load"
    real = getattr(dist_checkpointing, name)

    def interrupted(*a: Any, **k: Any) -> Any:  # only Megatron's checkpoint code runs inside
        with _first_checkpoint_collective(on_enter, seen):
            return real(*a, **k)

    setattr(dist_checkpointing, name, interrupted)
    call = (lambda: engine.save_checkpoint(root / "ckpt", format="dist")) if op == "save" else (
        lambda: engine.load_checkpoint(root / "ckpt"))
    res = _attempt(engine, call)
    res["t_exit"] = time.time()
    res["collective"] = seen
    if rank != 1:
        _mark(workdir, f"exited-{rank}", res["t_exit"])
    else:  # lives on (as a process that catches KeyboardInterrupt does) until the peers have left, so that its
        # exit, which closes its gloo connections, is not what releases them
        deadline = time.time() + 3 * timeout_s + SLACK_S
        while time.time() < deadline and not all(Path(workdir, f"exited-{r}").exists() for r in range(world) if r != 1):
            time.sleep(0.1)
    return res


def _stopped_in_validation(rank: int, world: int, workdir: str, timeout_s: float) -> dict[str, Any]:
    """Rank 2 stops (SIGSTOP) in its validation, before the agreement; rank 0 kills it afterwards."""
    from hdp.trainer.engine import HdpEngine, nll_loss

    engine = HdpEngine.build(_config(timeout_s), dist.group.WORLD, init_fn=_init)
    engine.train_step(_batch(0), nll_loss)
    if rank == 2:
        real = engine._validate

        def stop(batch: Any) -> None:
            _mark(workdir, "injected", {"t": time.time(), "pid": os.getpid()})
            os.kill(os.getpid(), signal.SIGSTOP)
            real(batch)

        engine._validate = stop
    res = _attempt(engine, lambda: engine.train_step(_batch(1), nll_loss))
    res["t_exit"] = time.time()
    if rank == 0:
        os.kill(json.loads(Path(workdir, "injected").read_text())["pid"], signal.SIGKILL)
    res["next_call"] = _first_line(_error_of(lambda: engine.train_step(_batch(2), nll_loss)))
    return res


def _full_disk(rank: int, world: int, workdir: str, timeout_s: float) -> dict[str, Any]:
    """Calibration records to /dev/full (every write fails with ENOSPC) with auto-calibration off."""
    import dataclasses

    from hdp.trainer.engine import HdpEngine, nll_loss

    base = _config(timeout_s)
    cfg = dataclasses.replace(base, planning=dataclasses.replace(base.planning, calibration_path="/dev/full"))
    engine = HdpEngine.build(cfg, dist.group.WORLD, init_fn=_init)
    before = _state_digest(engine)
    metrics: dict[str, Any] = {}
    error = _error_of(lambda: metrics.update(engine.train_step(_batch(0), nll_loss)))
    return {"error": _first_line(error), "finite_loss": bool(np.isfinite(metrics.get("loss", math.nan))),
            "write_failed": metrics.get("hdp/records_write_failed"), "applied": _state_digest(engine) != before,
            "step": engine.step}


# ---- the report -------------------------------------------------------------------------------------------


def fault_row(fault: str, world: int, per_rank: dict[int, dict[str, Any]], died: list[int], timeout_s: float,
         t_inject: float | None = None) -> dict[str, Any]:
    survivors = [r for r in range(world) if r not in died]
    got = {r: per_rank.get(r) for r in survivors}
    raised = sorted(r for r, v in got.items() if v and v["raised"])
    if t_inject is None:
        secs = max((v["seconds"] for v in got.values() if v), default=float("nan"))
    else:
        secs = max((v["t_exit"] - t_inject for v in got.values() if v), default=float("nan"))
    unchanged = all(v is not None and v["unchanged"] for v in got.values())
    row = {
        "fault": fault, "ranks": world, "ranks_raised": raised, "ranks_died": died,
        "seconds_to_exit": round(float(secs), 3), "state_unchanged": unchanged,
        "errors": {str(r): (v or {}).get("error") for r, v in got.items()},
    }
    row["ok"] = bool(raised == survivors and unchanged and secs <= timeout_s + SLACK_S)
    return row


def run_faults(*, timeout_s: float = 10.0, only: tuple[str, ...] | None = None, workdir: str | None = None) -> dict[str, Any]:
    """Run the fault scenarios (all, or ``only``) and return the report (see the module docstring)."""
    from hdp.trainer.launch import spawn

    chosen = tuple(only) if only else SCENARIOS
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"faults: scenario(s) {unknown} unknown; choose from {', '.join(SCENARIOS)}")
    if "other-world" in chosen and "in-process" not in chosen:
        chosen = ("in-process", *chosen)  # other-world loads the checkpoints in-process writes
    work = Path(workdir or tempfile.mkdtemp(prefix="hdp-faults-"))
    rows: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    limit = 300.0 + 4 * timeout_s
    if "in-process" in chosen:
        d = work / "in-process"
        d.mkdir(parents=True, exist_ok=True)
        res = spawn(_in_process, 4, str(d), timeout_s, timeout=limit)
        for fault in res[0]:
            rows.append(fault_row(fault, 4, {r: res[r][fault] for r in range(4)}, [], timeout_s))
            errors = [res[r][fault]["error"] or "" for r in range(4)]
            if fault in _AGREED_AT_ONCE:  # agreed in the call's first collective or the step's reduce: seconds
                rows[-1]["names"] = all(_AGREED_AT_ONCE[fault] in e for e in errors)
                rows[-1]["ok"] = bool(rows[-1]["ok"] and rows[-1]["names"] and rows[-1]["seconds_to_exit"] <= 5.0)
            if fault == "ctrl-c-in-validation":
                rows[-1]["interrupted_rank_error"] = errors[1]
                rows[-1]["peers_name_rank_1"] = all("world ranks [1]" in e and "KeyboardInterrupt" in e
                                                    for r, e in enumerate(errors) if r != 1)
                rows[-1]["save_after_on_every_rank"] = all(res[r][fault]["save_after"] is None for r in range(4))
                rows[-1]["ok"] = bool(rows[-1]["ok"] and errors[1].startswith("KeyboardInterrupt")
                                      and rows[-1]["peers_name_rank_1"] and rows[-1]["save_after_on_every_rank"])
            if fault == "consecutive-skips-raise":
                rows[-1]["names_first_cause"] = all(e.startswith("SkippedUpdatesError") and "The first skip, at step"
                                                    in e and "the loss is not finite" in e for e in errors)
                rows[-1]["unchanged_since_first_skip"] = all(res[r][fault]["unchanged_since_first_skip"]
                                                             for r in range(4))
                rows[-1]["ok"] = bool(rows[-1]["ok"] and rows[-1]["names_first_cause"]
                                      and rows[-1]["unchanged_since_first_skip"])
        if "other-world" in chosen:
            res2 = spawn(_other_world, 2, str(d), timeout_s, timeout=limit)
            rows.append(fault_row("other-world-per-rank", 2, {r: res2[r]["other-world-per-rank"] for r in range(2)}, [], timeout_s))
            checks["dist-4-to-2-ranks"] = all(res2[r]["dist-4-to-2-ranks"]["equal"] for r in range(2))
    for name, sig in (("sigkill-mid-step", signal.SIGKILL), ("sigstop-mid-step", signal.SIGSTOP)):
        if name not in chosen:
            continue
        d = work / name
        d.mkdir(parents=True, exist_ok=True)
        outcomes = spawn(_mid_step, 3, str(d), timeout_s, int(sig), timeout=limit, collect=True)
        inj = json.loads((d / "injected").read_text())
        per = {o.rank: o.value for o in outcomes if o.ok}
        rows.append(fault_row(name, 3, per, [2], timeout_s, t_inject=inj["t"]))
        # the survivors' engines refuse the next call at once (no collective, no hang)
        rows[-1]["next_call_refused"] = all("unusable" in ((per.get(r) or {}).get("next_call") or "") for r in (0, 1))
    if "sigkill-during-save" in chosen:
        import psutil

        d = work / "save"
        d.mkdir(parents=True, exist_ok=True)
        orphans: list[int] = []
        for fmt in ("per-rank", "dist"):
            marker = d / "injected"
            marker.unlink(missing_ok=True)
            outcomes = spawn(_save_then_die, 3, str(d), timeout_s, fmt, timeout=limit, collect=True)
            inj = json.loads(marker.read_text())
            per = {o.rank: o.value for o in outcomes if o.ok}
            rows.append(fault_row(f"sigkill-during-save-{fmt}", 3, per, [1], timeout_s, t_inject=inj["t"]))
            deadline = time.time() + 10.0
            alive = list(inj["children"])
            while alive and time.time() < deadline:
                alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
                time.sleep(0.2)
            orphans += alive
        loaded = spawn(_load_previous, 3, str(d), timeout_s, timeout=limit)
        checks["previous-checkpoint-loads-after-killed-save"] = all(
            v[f]["equal"] and v[f]["step"] == 1 for v in loaded for f in ("per-rank", "dist"))
        checks["no-orphan-writers"] = not orphans
    if "own-error-in-round" in chosen:
        for where in ("forward", "cp-backward"):
            d = work / f"own-{where}"
            d.mkdir(parents=True, exist_ok=True)
            res = spawn(_own_error, 4, str(d), timeout_s, where, timeout=limit)
            row = fault_row(f"own-error-in-round-{where}", 4, dict(enumerate(res)), [], OWN_ERROR_TIMEOUT_S)
            row["collective_timeout_s"] = OWN_ERROR_TIMEOUT_S
            row["names_rank_and_error"] = all("world rank 1" in (v["error"] or "") and "injected" in (v["error"] or "")
                                              for v in res)
            row["next_call_refused"] = all("unusable" in (v.get("next_call") or "") for v in res)
            row["ok"] = bool(row["ok"] and row["seconds_to_exit"] <= 5.0 and row["names_rank_and_error"])
            rows.append(row)
    if "sigint-during-dist-checkpoint" in chosen:
        for op in ("save", "load"):
            d = work / f"sigint-{op}"
            d.mkdir(parents=True, exist_ok=True)
            outcomes = spawn(_interrupt_checkpoint, 3, str(d), timeout_s, op, timeout=limit, collect=True)
            inj = json.loads((d / "injected").read_text())
            per = {o.rank: o.value for o in outcomes if o.ok}
            died = [o.rank for o in outcomes if not o.ok]
            row = fault_row(f"sigint-during-dist-{op}", 3, per, died, timeout_s, t_inject=inj["t"])
            seen = (per.get(1) or {}).get("collective") or {}
            left = seen.get("t_returned", seen.get("t_raised", float("nan")))
            # the signal reached rank 1 inside the C++ collective; its handler ran once the call returned
            row["interrupted_in"] = seen.get("collective")
            row["blocked_when_signalled"] = bool(seen.get("t_enter", math.inf) <= seen.get("t_signal", -math.inf) < left)
            row["seconds_blocked_after_signal"] = round(left - seen.get("t_signal", math.nan), 3)
            row["interrupted_rank_error"] = row["errors"].get("1")
            row["within_collective_timeout"] = bool(row["seconds_to_exit"] <= timeout_s)
            loaded = spawn(_load_previous_dist, 3, str(d), timeout_s, timeout=limit)
            row["previous_checkpoint_intact"] = all(v["equal"] and v["step"] == 1 for v in loaded)
            row["ok"] = bool(row["ok"] and row["blocked_when_signalled"] and row["previous_checkpoint_intact"]
                             and (row["interrupted_rank_error"] or "").startswith("KeyboardInterrupt"))
            rows.append(row)
    if "sigstop-during-validation" in chosen:
        d = work / "sigstop-validation"
        d.mkdir(parents=True, exist_ok=True)
        outcomes = spawn(_stopped_in_validation, 3, str(d), timeout_s, timeout=limit, collect=True)
        inj = json.loads((d / "injected").read_text())
        per = {o.rank: o.value for o in outcomes if o.ok}
        row = fault_row("sigstop-during-validation", 3, per, [2], timeout_s, t_inject=inj["t"])
        row["next_call_refused"] = all("unusable" in ((per.get(r) or {}).get("next_call") or "") for r in (0, 1))
        row["names_phase"] = all("phase 'validate'" in ((per.get(r) or {}).get("error") or "") for r in (0, 1))
        row["raises_domain_unreachable"] = all(((per.get(r) or {}).get("error") or "").startswith("DomainUnreachableError:")
                                               for r in (0, 1))
        row["ok"] = bool(row["ok"] and row["next_call_refused"] and row["names_phase"] and row["raises_domain_unreachable"])
        rows.append(row)
    if "calibration-log-full-disk" in chosen:
        res = spawn(_full_disk, 2, str(work), timeout_s, timeout=limit)
        row = {"fault": "calibration-log-full-disk", "ranks": 2, "ranks_died": [],
               "ranks_raised": [r for r, v in enumerate(res) if v["error"]],
               "errors": {str(r): v["error"] for r, v in enumerate(res)},
               "step_succeeded": {str(r): bool(v["error"] is None and v["finite_loss"] and v["applied"] and v["step"] == 1)
                                  for r, v in enumerate(res)},
               "write_failed": {str(r): v["write_failed"] for r, v in enumerate(res)}}
        row["ok"] = bool(all(row["step_succeeded"].values()) and all(v == 1.0 for v in row["write_failed"].values()))
        rows.append(row)
    if "verl" in chosen:
        import importlib.util

        run_verl = None
        if importlib.util.find_spec("verl") is not None:
            from benchmarks.verl.faults import verl_faults as run_verl
        if run_verl is None:
            checks["verl-rows-skipped-verl-not-installed"] = True
        else:
            rows += run_verl(timeout_s=timeout_s, workdir=str(work / "verl"))
    return {
        "collective_timeout_s": timeout_s,
        "faults": rows,
        "checks": checks,
        "ok": all(r["ok"] for r in rows) and all(checks.values()),
    }
