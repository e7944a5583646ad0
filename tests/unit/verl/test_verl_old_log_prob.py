"""The actor's old-log-prob pass skipped on an on-policy step (``actor_rollout_ref.actor.hdp.skip_old_log_prob``).

Decision (driver side, `hdp.integrations.verl.old_log_prob.resolve` on verl's composed config): ``auto`` skips
exactly when the step is on-policy and nothing reads the old log-probs before the update — rollout correction of
any kind keeps the pass, and so does an estimator whose function in verl's registry takes the pass's outputs;
``true`` on a step that needs the pass names the keys; ``false`` never skips; ``1``/``0`` are ``true``/``false``
for the option's check and the driver alike.  What only a step knows (the rollout's log-probs in the batch, a
critic-warmup step) keeps it too.  Every reader of the pass's outputs in verl's driver is classified, checked
against verl's source.  Update (worker side, through verl's own
``ActorRolloutRefWorker`` on 2 gloo ranks with a CP group in the plan): the update given the NaN stand-in and
the skip flag equals the update given the pass's real old log-probs — ``actor/pg_loss``, ``actor/kl_loss``,
``actor/entropy`` (from the pass there, from the update here), ``grad_norm`` to ``1e-6`` relative (two
forwards against one) — and the weights after both updates (two actors from the same checkpoint) agree to ``1e-6``;
an update flagged as skipped whose batch carries what the driver derived from the NaN stand-ins
(``rollout_is_weights``, NaN advantages) is refused on every rank naming the option, nothing applied.  The whole trainer with the
pass skipped: ``tests/slow/verl/test_verl_main_ppo.py``; the two runs side by side: ``hdp bench verl-old-logprob``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")


def _cfg(overrides: list[str]):
    import verl.trainer.config as vtc
    from hydra import compose, initialize_config_dir

    import hdp.integrations.verl.plugin  # noqa: F401 - hdp's configs on Hydra's search path

    base = ["model_engine=hdp", "algorithm.adv_estimator=grpo", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.calculate_log_probs=false"]
    with initialize_config_dir(config_dir=os.path.dirname(vtc.__file__), version_base=None):
        return compose("ppo_trainer", overrides=[*base, *overrides])


@pytest.mark.parametrize(("overrides", "skips", "reason"), [
    ([], True, None),
    (["actor_rollout_ref.actor.hdp.skip_old_log_prob=false"], False, None),
    (["actor_rollout_ref.actor.hdp.skip_old_log_prob=0"], False, None),  # read as false, never as auto
    (["actor_rollout_ref.actor.hdp.skip_old_log_prob=1"], True, None),
    (["actor_rollout_ref.actor.ppo_epochs=2"], False, "ppo_epochs=2"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4"], False, "ppo_mini_batch_size=4 < data.train_batch_size=8"),
    (["algorithm.use_kl_in_reward=true"], False, "use_kl_in_reward"),
    (["actor_rollout_ref.rollout.calculate_log_probs=true"], False, "calculate_log_probs"),
    (["algorithm.rollout_correction.bypass_mode=true"], False, "bypass_mode"),
    # rollout correction of any kind reads the old log-probs (its weights, its rejection mask)
    (["algorithm.rollout_correction.rollout_is=token"], False, "rollout_is=token (its importance weights"),
    (["algorithm.rollout_correction.rollout_is=sequence"], False, "rollout_is=sequence"),
    (["algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"],
     False, "rollout_rs=token_k1 (its rejection mask"),
    # estimators, read off verl's registry: what their functions take
    (["algorithm.adv_estimator=optimal_token_baseline"], False, "optimal_token_baseline (its function "
     "compute_optimal_token_baseline_advantage takes old_log_probs"),
    (["algorithm.adv_estimator=tir_optimal_token_baseline"], False, "takes old_log_probs, rollout_is_weights, sum_pi_squared"),
    (["algorithm.adv_estimator=gdpo"], False, "gdpo (its function compute_gdpo_outcome_advantage takes the whole batch"),
    (["algorithm.adv_estimator=my_own"], False, "not in verl's advantage-estimator"),
    (["algorithm.adv_estimator=rloo"], True, None),
    (["algorithm.adv_estimator=reinforce_plus_plus"], True, None),
    (["trainer.v1.trainer_mode=separate_async"], False, "trainer_mode=separate_async"),
])
def test_auto_skips_exactly_on_policy_steps(overrides, skips, reason):
    from hdp.integrations.verl import old_log_prob

    cfg = _cfg(overrides)
    assert old_log_prob.resolve(cfg) is skips
    if reason is not None:
        assert any(reason in r for r in old_log_prob.needed_by(cfg)), old_log_prob.needed_by(cfg)
        for insist in ("true", "1", "True"):
            with pytest.raises(ValueError, match=r"skip_old_log_prob=true, but this job needs the old-log-prob pass"):
                old_log_prob.resolve(_cfg([*overrides, f"actor_rollout_ref.actor.hdp.skip_old_log_prob={insist}"]))
    with pytest.raises(ValueError, match=r"skip_old_log_prob='maybe': pass auto, true or false"):
        from hdp.integrations.verl.config import HdpOptions

        HdpOptions(skip_old_log_prob="maybe")


@pytest.mark.parametrize(("value", "read"), [("auto", "auto"), ("AUTO", "auto"), (True, "true"), (False, "false"),
                                             (1, "true"), (0, "false"), ("1", "true"), ("0", "false"),
                                             ("true", "true"), ("False", "false")])
def test_one_parser_reads_the_option_for_its_check_and_for_the_driver(value, read):
    """The option's check (HdpOptions, in every worker) and the driver's decision read every spelling alike:
    ``0`` was accepted by the check as False and read by the driver as ``auto`` (it skipped)."""
    from omegaconf import OmegaConf

    from hdp.integrations.verl import old_log_prob
    from hdp.integrations.verl.config import HdpOptions

    assert HdpOptions(skip_old_log_prob=value).skip_old_log_prob.value == read
    cfg = _cfg(["actor_rollout_ref.actor.ppo_epochs=2"])  # a job that needs the pass
    OmegaConf.update(cfg, old_log_prob.OPTION, value, force_add=True)
    if read == "true":
        with pytest.raises(ValueError, match=r"skip_old_log_prob=true, but this job needs"):
            old_log_prob.resolve(cfg)
    else:
        assert old_log_prob.resolve(cfg) is False
    OmegaConf.update(cfg, "actor_rollout_ref.actor.ppo_epochs", 1)
    assert old_log_prob.resolve(cfg) is (read != "false")
    for bad in ("yes", 2, 0.5):
        with pytest.raises(ValueError, match=r"skip_old_log_prob=.*: pass auto, true or false"):
            HdpOptions(skip_old_log_prob=bad)
        OmegaConf.update(cfg, old_log_prob.OPTION, bad, force_add=True)
        with pytest.raises(ValueError, match=r"skip_old_log_prob=.*: pass auto, true or false"):
            old_log_prob.resolve(cfg)


def test_a_step_keeps_the_pass_when_the_rollout_returned_log_probs_or_it_trains_no_actor():
    """What only the step knows (`needed_at_step`, asked by the driver before each skipped pass): verl's
    ``_compute_advantage`` computes rollout correction (``rollout_corr/*`` metrics at least) whenever the
    rollout's log-probs are in the batch, outside bypass mode; a critic-warmup step reports ``actor/entropy``
    from the pass (no update runs to report it)."""
    from hdp.integrations.verl import old_log_prob

    cfg = _cfg(["trainer.critic_warmup=2"])
    assert old_log_prob.resolve(cfg) is True
    fields = {"response_mask", "responses"}
    assert any("critic_warmup=2 (step 1 trains no actor" in r for r in old_log_prob.needed_at_step(cfg, fields, 1))
    assert old_log_prob.needed_at_step(cfg, fields, 2) == []  # 2 <= 2: verl updates the actor
    kept = old_log_prob.needed_at_step(cfg, {*fields, "rollout_log_probs"}, 2)
    assert len(kept) == 1 and "rollout_log_probs" in kept[0], kept
    # in bypass mode verl computes no correction from them (and the job keeps its pass for other reasons)
    assert old_log_prob.needed_at_step(_cfg(["algorithm.rollout_correction.bypass_mode=true"]),
                                       {*fields, "rollout_log_probs"}, 2) == []


def _readers() -> dict[str, set[str]]:
    """Every function of verl's ``trainer`` and ``utils`` packages that names a field of the pass's outputs or
    of what is derived from them (a string constant or a parameter): ``module:function`` -> fields."""
    import ast
    import pathlib

    import verl
    from hdp.integrations.verl import old_log_prob

    names = {*old_log_prob.PASS_OUTPUTS, *old_log_prob.DERIVED}
    root = pathlib.Path(verl.__file__).parent
    found: dict[str, set[str]] = {}
    for sub in ("trainer", "utils"):
        for path in sorted((root / sub).rglob("*.py")):
            module = ".".join(("verl", *path.relative_to(root).with_suffix("").parts))
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    hits = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in names}
                    hits |= {n.arg for n in ast.walk(node) if isinstance(n, ast.arg) and n.arg in names}
                    if hits:
                        found[f"{module}:{node.name}"] = hits
    return found


def test_every_reader_of_the_pass_in_verls_driver_is_classified():
    """The decision is read off verl's code, not kept beside it: every function of verl's trainer and utils that
    reads the old log-probs (or what the pass or rollout correction derive from them) is listed in
    `old_log_prob.VERL_READERS` with the rule that keeps the pass for it, and every entry still names a reader.
    A new reader in a verl upgrade fails here until someone classifies it."""
    from hdp.integrations.verl import old_log_prob

    found = _readers()
    listed = old_log_prob.VERL_READERS

    def covered(name: str) -> bool:
        return name in listed or name.split(":", 1)[0] in listed

    assert sorted(n for n in found if not covered(n)) == [], "unclassified readers of the pass's outputs in verl"
    stale = [k for k in listed if not any(n == k or n.split(":", 1)[0] == k for n in found)]
    assert stale == [], stale
    # the estimators that read them are exactly those the registry rule keeps the pass for
    from verl.trainer.ppo import core_algos

    reading = {name for name in core_algos.ADV_ESTIMATOR_REGISTRY if old_log_prob.estimator_reads_pass(name)}
    assert {"optimal_token_baseline", "tir_optimal_token_baseline", "gdpo"} == reading, reading
