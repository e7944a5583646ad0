"""Fault injection: every fault raises on every surviving rank within the collective
timeout, with parameters and optimizer state bit-identical to before the failed call.

The scenarios live in ``benchmarks.faults`` (``python -m benchmarks faults --json``, outside the wheel); these tests run
them and assert on the report.  Each spawn has its own timeout, so a hang fails the test instead
of CI.
"""

from __future__ import annotations

import tempfile

import pytest
from helpers.cli_helper import bench_json

TIMEOUT_S = 8.0


def _assert_report(report: dict, expect_faults: set[str]) -> None:
    rows = {r["fault"]: r for r in report["faults"]}
    assert set(rows) == expect_faults, sorted(rows)
    for name, r in rows.items():
        survivors = [k for k in range(r["ranks"]) if k not in r["ranks_died"]]
        assert r["ranks_raised"] == survivors, (name, r)
        assert r["state_unchanged"], (name, r)
        assert r["seconds_to_exit"] <= TIMEOUT_S + 15.0, (name, r)
        assert r["ok"], (name, r)
    for name, ok in report["checks"].items():
        assert ok, (name, report["checks"])


def test_in_process_faults_checkpoints_and_another_world(tmp_path) -> None:
    from benchmarks.faults import run_faults

    report = run_faults(timeout_s=TIMEOUT_S, only=("in-process", "other-world"), workdir=str(tmp_path))
    _assert_report(report, {
        "loss-fn-raises", "loss-fn-detached", "loss-fn-nan", "validation-runtime-error", "different-token-ids",
        "nan-gradient-finite-loss", "rank-calls-save-others-train", "rank-calls-forward-others-train",
        "save-format-differs", "ctrl-c-in-validation", "consecutive-skips-raise", "per-rank-truncated", "per-rank-corrupted", "dist-truncated", "dist-corrupted",
        "other-model-per-rank", "other-model-dist", "other-model-forged-manifest", "other-world-per-rank",
    })
    rows = {r["fault"]: r for r in report["faults"]}
    # the errors name the failed rank and the original error on every rank
    for name, needle in (("loss-fn-raises", "injected: loss_fn bug on rank 1"),
                         ("validation-runtime-error", "injected: validation crashed on rank 1"),
                         ("loss-fn-detached", "does not require grad"),
                         ("different-token-ids", "batch data mismatch"),
                         ("dist-corrupted", "is corrupted"), ("per-rank-truncated", "truncated"),
                         ("other-model-dist", "does not fit this engine"),
                         ("other-model-per-rank", "entry 'model.model.embedding.word_embeddings.weight'"),
                         ("other-model-forged-manifest", "does not fit this engine"),
                         ("other-world-per-rank", "saved with layout"),
                         ("nan-gradient-finite-loss", "the gradient is not finite"),
                         ("rank-calls-save-others-train", "world rank 0 called save_checkpoint"),
                         ("rank-calls-forward-others-train", "world rank 0 called forward"),
                         ("save-format-differs", "format='dist'"),
                         ("consecutive-skips-raise", "3 updates in a row were skipped")):
        assert all(needle in (e or "") for e in rows[name]["errors"].values()), (name, rows[name]["errors"])
    # one agreement each: every rank raised within seconds, naming what it must
    for name in ("nan-gradient-finite-loss", "rank-calls-save-others-train", "rank-calls-forward-others-train",
                 "save-format-differs", "ctrl-c-in-validation", "other-model-per-rank", "other-model-dist",
                 "other-model-forged-manifest", "consecutive-skips-raise"):
        assert rows[name]["seconds_to_exit"] <= 5.0, rows[name]
    # a run of skipped updates ends the run on every rank, naming the first skip's cause, nothing applied since
    runs = rows["consecutive-skips-raise"]
    assert runs["names_first_cause"] and runs["unchanged_since_first_skip"], runs
    # Ctrl-C on rank 1 during validation, its process alive: it raises its KeyboardInterrupt, the others name it,
    # and then every rank saves (the engine stayed in step)
    ctrl_c = rows["ctrl-c-in-validation"]
    assert ctrl_c["interrupted_rank_error"].startswith("KeyboardInterrupt"), ctrl_c
    assert ctrl_c["peers_name_rank_1"] and ctrl_c["save_after_on_every_rank"], ctrl_c
    assert report["checks"] == {"dist-4-to-2-ranks": True}


def test_killed_and_hung_ranks_through_the_cli(tmp_path, monkeypatch) -> None:
    """``python -m benchmarks faults --json`` (the CI's command, `tests/helpers/cli_helper.py`): SIGKILL and SIGSTOP of one
    rank mid-step."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # the next gettempdir() reads TMPDIR
    report = bench_json("faults", "--json", "--only", "sigkill-mid-step,sigstop-mid-step",
                      "--timeout", str(TIMEOUT_S))
    _assert_report(report, {"sigkill-mid-step", "sigstop-mid-step"})
    rows = {r["fault"]: r for r in report["faults"]}
    for name in rows:
        assert rows[name]["next_call_refused"], rows[name]  # the broken engine refuses at once
        assert all("step 2, phase 'rounds'" in e for e in rows[name]["errors"].values()), rows[name]["errors"]
    # a hung rank is noticed no sooner than the timeout, and not much later
    assert TIMEOUT_S - 1 <= rows["sigstop-mid-step"]["seconds_to_exit"] <= TIMEOUT_S + 15.0


def test_killed_during_save_keeps_the_previous_checkpoint_and_leaves_no_writer(tmp_path) -> None:
    from benchmarks.faults import run_faults

    report = run_faults(timeout_s=TIMEOUT_S, only=("sigkill-during-save",), workdir=str(tmp_path))
    _assert_report(report, {"sigkill-during-save-per-rank", "sigkill-during-save-dist"})
    assert report["checks"] == {"previous-checkpoint-loads-after-killed-save": True, "no-orphan-writers": True}


def test_verl_engine_faults_through_the_cli() -> None:
    """``python -m benchmarks faults --only verl --json``: one rank of verl's own worker fails (planning RuntimeError, a
    raising loss function, a loss that does not require grad, an error inside a round with its process alive) or its loss is NaN,
    or a checkpoint of the other role is loaded (the actor's into the critic and back); every rank raises (NaN: every
    rank skips the update, grad_norm NaN; the third NaN in a row raises), the state is unchanged, within 5 s.
    Rollout correction keeps the old-log-prob pass and its update applies; an update that read a skipped pass's
    stand-ins is refused on every rank."""
    pytest.importorskip("verl")
    pytest.importorskip("mbridge")
    report = bench_json("faults", "--only", "verl", "--json", "--timeout", str(TIMEOUT_S))
    rows = {r["fault"]: r for r in report["faults"]}
    assert set(rows) == {"verl-planning-runtime-error", "verl-loss-fn-raises", "verl-loss-fn-detached", "verl-nan-loss",
                         "verl-nan-gradient", "verl-actor-checkpoint-into-critic", "verl-critic-checkpoint-into-actor",
                         "verl-consecutive-skips-raise", "verl-rollout-correction-keeps-pass",
                         "verl-skipped-pass-read-by-driver", "verl-own-error-in-round"}, rows
    for name, row in rows.items():
        applied = name == "verl-rollout-correction-keeps-pass"  # the one row whose update must apply
        assert row["ok"] and row["state_unchanged"] is not applied and row["seconds_to_exit"] <= 5.0, row
    # a run of NaN losses: skipped as verl's until max_consecutive_skips in a row, then every rank raises
    runs = rows["verl-consecutive-skips-raise"]
    assert runs["ranks_raised"] == [0, 1] and runs["names_count_and_first_cause"] and runs["usable_after"], runs
    # rollout correction keeps the old-log-prob pass and trains; an update that read the stand-ins is refused
    kept = rows["verl-rollout-correction-keeps-pass"]
    assert kept["pass_kept"] and kept["applied_with_finite_grad_norm"] and kept["ranks_raised"] == [], kept
    read = rows["verl-skipped-pass-read-by-driver"]
    assert read["ranks_raised"] == [0, 1] and read["names_option"], read
    for name in ("verl-nan-loss", "verl-nan-gradient"):  # a finite loss with a NaN gradient: skipped alike
        r = rows[name]
        assert r["skipped_with_nan_grad_norm"] and r["nonfinite_skipped_metric"] and r["usable_after"], r
        assert r["ranks_raised"] == [], r
    assert rows["verl-loss-fn-raises"]["ranks_raised"] == [0, 1]
    # a loss that does not require grad on the rank that runs verl's loss: every rank raises, naming it
    detached = rows["verl-loss-fn-detached"]
    assert detached["ranks_raised"] == [0, 1], detached
    assert all("verl's loss function returned a tensor that does not require grad" in (e or "")
               for e in detached["errors"].values()), detached["errors"]
    # a rank's own error inside a round, its process alive (a Ray actor): every rank raises naming it and its
    # error within seconds (the peer waits in a CP ring on hdp's copy of the domain, which the failing rank
    # frees; before that copy it waited the collective timeout on Megatron's group, which verl's model holds)
    own = rows["verl-own-error-in-round"]
    assert own["ranks_raised"] == [0, 1] and own["names_rank_and_error"]
    # a checkpoint of the other role: refused on every rank before any write, naming the tensor; usable after
    for name in ("verl-actor-checkpoint-into-critic", "verl-critic-checkpoint-into-actor"):
        r = rows[name]
        assert r["ranks_raised"] == [0, 1] and r["names_tensor"] and r["usable_after"], r


def test_own_errors_interrupts_a_stopped_peer_and_a_full_disk(tmp_path) -> None:
    """A rank's own RuntimeError in a round's forward and in a CP backward (collective timeout 300 s): every
    rank raises within 5 s naming the rank and its error; SIGINT on one rank while it is blocked inside the
    first collective of a dist save and of a dist load (the peers enter it 1 s late; the interrupted rank
    lives on): the interrupted rank raises KeyboardInterrupt once the collective returns, every rank exits
    within the timeout + 15 s and the previous checkpoint loads bit for bit; a peer stopped during the
    validation agreement: DomainUnreachableError naming the phase, later calls refused; calibration records
    on a full disk: a row of its own, the step succeeds on every rank and the metric reports the failed write
    on every rank."""
    from benchmarks.faults import PEERS_LATE_S, SIGNAL_AFTER_S, run_faults

    report = run_faults(timeout_s=TIMEOUT_S, only=("own-error-in-round", "sigint-during-dist-checkpoint",
                                                   "sigstop-during-validation", "calibration-log-full-disk"),
                        workdir=str(tmp_path))
    rows = {r["fault"]: r for r in report["faults"]}
    assert set(rows) == {"own-error-in-round-forward", "own-error-in-round-cp-backward", "sigint-during-dist-save",
                         "sigint-during-dist-load", "sigstop-during-validation", "calibration-log-full-disk"}, sorted(rows)
    for name in ("own-error-in-round-forward", "own-error-in-round-cp-backward"):
        r = rows[name]
        assert r["ok"] and r["seconds_to_exit"] <= 5.0 and r["names_rank_and_error"] and r["next_call_refused"], r
        assert r["ranks_raised"] == [0, 1, 2, 3] and r["state_unchanged"], r
    for name in ("sigint-during-dist-save", "sigint-during-dist-load"):
        r = rows[name]
        # ok: every rank left within the timeout + 15 s (since the release fix they leave within seconds: the
        # interrupted rank frees its groups, which ends its peers' blocked collectives; docs/results.md)
        assert r["ok"] and r["ranks_raised"] == [0, 1, 2] and r["ranks_died"] == [], r
        # the signal reached rank 1 inside one of the checkpoint's collectives, and Python ran its handler only
        # when that call returned: when the late peers arrived, not at once and not at the timeout
        assert r["blocked_when_signalled"] and r["interrupted_in"], r
        assert 0.5 * (PEERS_LATE_S - SIGNAL_AFTER_S) <= r["seconds_blocked_after_signal"] < TIMEOUT_S, r
        assert r["interrupted_rank_error"].startswith("KeyboardInterrupt"), r
        assert r["previous_checkpoint_intact"] and r["state_unchanged"], r
    r = rows["sigstop-during-validation"]
    assert r["ok"] and r["names_phase"] and r["next_call_refused"] and r["raises_domain_unreachable"], r
    assert all(e.startswith("DomainUnreachableError:") for e in r["errors"].values()), r
    r = rows["calibration-log-full-disk"]
    assert r["ok"] and r["ranks_raised"] == [] and r["step_succeeded"] == {"0": True, "1": True}, r
    assert r["write_failed"] == {"0": 1.0, "1": 1.0}, r
    assert report["checks"] == {} and report["ok"], report["checks"]
