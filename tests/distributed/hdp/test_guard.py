"""StepGuard: an error of any type on one rank raises on every rank; a dead or hung rank is named, bounded."""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from helpers.dist_helper import run_distributed
from hdp.guard import DomainStepError, DomainUnreachableError, StepGuard


class _Fatal(BaseException):
    """Not an Exception: like Megatron's CheckpointException, ``except Exception`` misses it."""


def _guard(rank: int, world: int, group=None) -> StepGuard:
    return StepGuard(group=group or dist.group.WORLD, rank=rank, size=world, device=torch.device("cpu"), timeout_s=3.0)


def _check_in_step(world: int) -> None:
    x = torch.ones(1)
    dist.all_reduce(x, group=dist.group.WORLD)  # the domain is still in step after the agreement
    assert x.item() == world


def _worker_errors(rank: int, world: int) -> None:
    guard = _guard(rank, world)
    with guard.phase("validate", step=1):
        pass  # no error: no raise

    failing = {"rounds": (1, RuntimeError("element 0 of tensors does not require grad")),
               "load": (2, _Fatal("truncated shard")),
               "optimizer": (0, KeyError("exp_avg"))}
    for phase, (bad_rank, exc) in failing.items():
        with pytest.raises(DomainStepError) as info:
            with guard.phase(phase, step=1):
                if rank == bad_rank:
                    raise exc
        err = info.value
        assert err.phase == phase and err.step == 1 and err.ranks == (bad_rank,)
        assert type(exc).__name__ in err.messages[bad_rank]
        text = str(err)
        assert phase in text and type(exc).__name__ in text
        if rank == bad_rank:
            assert err.__cause__ is exc and f"domain rank {rank}" in text
        else:
            assert f"ranks [{bad_rank}]" in text
        _check_in_step(world)

    # a deferred error (caught where collectives must go on) raises at the end of the phase
    with pytest.raises(DomainStepError, match="loss_fn returned a detached tensor"):
        with guard.phase("rounds", step=2) as g:
            if rank == world - 1:
                g.defer(ValueError("loss_fn returned a detached tensor"))
            y = torch.ones(1)
            dist.all_reduce(y, group=dist.group.WORLD)  # the phase's collectives still line up
    _check_in_step(world)

    # two ranks fail: both named everywhere, long messages cut, not lost
    with pytest.raises(DomainStepError) as info:
        with guard.phase("validate", step=3):
            if rank in (0, 2):
                raise ValueError("x" * 2000)
    assert info.value.ranks == (0, 2)


def test_error_of_any_type_on_one_rank_raises_on_every_rank():
    run_distributed(_worker_errors, 3, timeout=120)


def _worker_dead_or_hung(rank: int, world: int, mode: str) -> float | str:
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=3))
    guard = _guard(rank, world, group)
    if rank == 1:
        if mode == "dead":
            os._exit(17)  # no goodbye
        if mode == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(12)  # hung past the others' timeout
        return "woke"
    t0 = time.monotonic()
    with pytest.raises(DomainUnreachableError) as info:
        with guard.phase("rounds", step=5):
            pass
    text = str(info.value)
    assert "step 5" in text and "'rounds'" in text and "timeout 3 s" in text, text
    return time.monotonic() - t0


def test_hung_rank_makes_the_others_raise_within_the_timeout():
    waited = run_distributed(_worker_dead_or_hung, 3, "hung", timeout=60)
    assert waited[1] == "woke"
    assert all(2.5 < w < 10 for w in (waited[0], waited[2])), waited


@pytest.mark.parametrize("mode, how", [("dead", "exit code 17"), ("killed", "killed by SIGKILL")])
def test_dead_rank_makes_the_others_raise_and_the_launcher_names_it(mode, how):
    from hdp.trainer.launch import WorkerError

    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=rf"rank 1 \({how}\) died without a report") as info:
        run_distributed(_worker_dead_or_hung, 3, mode, timeout=60)
    assert time.monotonic() - t0 < 45
    assert "ranks [0, 2] failed after it" not in str(info.value)  # the survivors raised, asserted and returned


def test_collect_mode_keeps_the_survivors_results():
    from hdp.trainer.launch import spawn

    out = spawn(_worker_dead_or_hung, 3, "killed", timeout=60, collect=True)
    assert not out[1].ok and out[1].exitcode == -signal.SIGKILL and "without a report" in out[1].error
    for r in (0, 2):
        assert out[r].ok and out[r].value < 10, out[r]  # they raised DomainUnreachableError, quickly
