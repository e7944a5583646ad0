"""The option table (tests/helpers/verl_options.py) against verl itself, and the conformance suite's fast slice.

Generated from verl, so it grows with verl: every field of verl's actor / reference / critic config dataclasses and
of its algorithm config (read with ``dataclasses.fields``, recursively) and every value of the registries and
choice lists verl validates (read from verl: the policy-loss and advantage-estimator registries, the rejection-
sampling options, and the literal choice lists in verl's own code) must have an entry in the table; a verl upgrade
that adds one fails here until someone classifies it.  Each entry is then held to what it says: covered entries
name cases of the suite, refusals raise at config time naming the key, ``not-read`` fields appear nowhere in verl's
Megatron worker path, referenced tests exist.

The fast slice (`test_loss_matches_stock_accounting`, one process, no model): every update case of the suite at
the loss level — verl's loss function on synthetic outputs as stock's Megatron engine accounts for it (micro-
batches per DP rank, DP average) against hdp's (once per CP group, hdp's normalisation), values and gradients in
float64.  The engines themselves are compared in tests/distributed/verl/test_verl_conformance.py (dist / slow).
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing

import pytest

pytest.importorskip("verl")

import helpers.verl_conformance as V  # noqa: E402
import helpers.verl_options as T  # noqa: E402

ROOTS = ("McoreActorConfig", "McoreCriticConfig", "AlgoConfig")
"""verl's config classes of the actor and reference (one class), the critic, and the algorithm."""


def _owner(cls: type, name: str) -> str:
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return klass.__name__
    return cls.__name__


def verl_fields() -> dict[str, list[str]]:
    """``Class.field`` -> the dotted paths it is reached at, for every leaf field of `ROOTS` (recursively: a field
    holding a config dataclass is walked, not listed)."""
    from verl.trainer.config import AlgoConfig
    from verl.workers.config import McoreActorConfig, McoreCriticConfig

    out: dict[str, list[str]] = {}

    def walk(cls: type, prefix: str, stack: frozenset) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kinds = typing.get_args(hints.get(f.name, f.type)) or (hints.get(f.name, f.type),)
            sub = [k for k in kinds if dataclasses.is_dataclass(k)]
            if sub and sub[0] not in stack:
                walk(sub[0], f"{prefix}{f.name}.", stack | {sub[0]})
            else:
                out.setdefault(f"{_owner(cls, f.name)}.{f.name}", []).append(prefix + f.name)

    for root, name in ((McoreActorConfig, "actor"), (McoreCriticConfig, "critic"), (AlgoConfig, "algorithm")):
        walk(root, f"{name}.", frozenset({root}))
    return out


def _entries() -> list[tuple[str, T.Entry]]:
    return ([(k, e) for k, e in T.FIELDS.items()]
            + [(f"{reg}={v}", e) for reg, (_, values) in T.VALUES.items() for v, e in values.items()]
            + list(T.CONDITIONAL_REFUSALS.items()))


def test_every_config_field_verl_has_is_classified():
    """A field verl adds to its actor, reference, critic or algorithm config fails here until classified; a field it
    drops, until its entry goes."""
    from hdp.integrations.verl import verl_version

    fields, table = verl_fields(), T.fields_for(verl_version())
    missing = sorted(set(fields) - set(table))
    stale = sorted(set(table) - set(fields))
    assert not missing, "verl config fields with no entry in tests/helpers/verl_options.py FIELDS:\n" + "\n".join(
        f"  {k}  (at {', '.join(fields[k][:2])})" for k in missing)
    assert not stale, f"entries for fields verl no longer has: {stale}"


@pytest.mark.parametrize("registry", sorted(T.VALUES))
def test_every_value_verl_accepts_is_classified(registry):
    """The values read from verl (its registries and choice lists) are exactly the table's."""
    read, listed = T.VALUES[registry]
    got = set(read())
    assert got, f"{registry}: nothing read from verl (the reader {read.__name__} no longer finds its source)"
    assert got == set(listed), f"{registry}: verl has {sorted(got - set(listed))} unclassified, table has {sorted(set(listed) - got)} stale"


def test_the_loss_kind_verdicts_cover_the_same_registry():
    assert set(T.VERDICTS) == set(T.VALUES["policy_loss.loss_mode"][1])
    for mode, verdict in T.VERDICTS.items():
        assert (verdict == "refused") == isinstance(T.VALUES["policy_loss.loss_mode"][1][mode], T.Refused), mode


def test_covered_entries_name_cases_of_the_suite_and_every_case_is_named():
    cases = V.cases()
    named = set()
    for key, entry in _entries():
        if isinstance(entry, T.Covered):
            assert entry.cases, key
            unknown = [c for c in entry.cases if c not in cases]
            assert not unknown, f"{key}: no such case {unknown}"
            named |= set(entry.cases)
    # cases generated per value are named by their values; the rest must be named by some entry
    orphans = sorted(set(cases) - named - {"logprob-temperature", "temperature", "bypass-v1", "rollout-rs-reject-all",
                                           "epochs-minibatches", "ref", "critic-value-clip"})
    assert not orphans, f"cases no entry names: {orphans}"


def test_entry_kinds_are_known_and_referenced_tests_exist():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
    for key, entry in _entries():
        test = getattr(entry, "test", "")
        if isinstance(entry, T.NoEffect):
            assert entry.kind in T.KINDS and entry.why, key
        if isinstance(entry, T.Refused):
            assert entry.overrides or entry.test, f"{key}: a refusal needs overrides (the driver) or a test"
        if test:
            path, _, name = test.partition("::")
            with open(os.path.join(root, path)) as f:
                src = f.read()
            assert not name or re.search(rf"^def {re.escape(name)}\(", src, re.M), f"{key}: {test} not found"


def _worker_source() -> str:
    import verl

    base = os.path.dirname(verl.__file__)
    text = []
    for rel in T.WORKER_SOURCES:
        path = os.path.join(base, rel)
        files = [path] if path.endswith(".py") else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                                                    if f.endswith(".py")]
        assert files and all(os.path.exists(f) for f in files), f"verl source {rel} is gone: update WORKER_SOURCES"
        for f in files:
            with open(f) as fh:
                text.append(fh.read())
    return "\n".join(text)


def test_not_read_fields_appear_nowhere_in_verls_megatron_worker_path():
    """A ``not-read`` field that verl starts reading in its Megatron worker path fails here until reclassified."""
    src = _worker_source()
    read = [k for k, e in T.FIELDS.items() if isinstance(e, T.NoEffect) and e.kind == "not-read"
            and re.search(rf"\b{re.escape(k.split('.', 1)[1])}\b", src)]
    assert not read, f"fields classified not-read that verl's Megatron worker path reads: {read}"


def _refusals() -> list:
    seen, out = set(), []
    for key, entry in _entries():
        if isinstance(entry, T.Refused) and entry.overrides and entry.overrides not in seen:
            seen.add(entry.overrides)
            out.append(pytest.param(entry, id=key))
    return out


@pytest.fixture(scope="module")
def driver_job(tmp_path_factory):
    """The suite's hdp job on a tiny checkpoint (the driver instantiates the critic's model config, which reads it)."""
    from hdp.integrations.verl.scaffolding.tiny import build_tiny
    from hdp.integrations.verl.scaffolding.worker import compose

    path = str(build_tiny(tmp_path_factory.mktemp("tiny") / "model"))
    return compose(path, budget=V.HDP_BUDGET, records=None, overrides=[
        *V.COMMON, "data.train_batch_size=8", "actor_rollout_ref.rollout.n=1", "trainer.n_gpus_per_node=2",
        f"critic.model.path={path}", "critic.ppo_mini_batch_size=8"])


@pytest.mark.parametrize("entry", _refusals())
def test_refusals_raise_in_the_driver_naming_the_key(entry, driver_job):
    """verl's own ``validate_config`` (as verl's trainer entry point calls it, before Ray starts; no process started) on the suite's hdp job with the
    entry's overrides raises the entry's error; the same job without them validates."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from hdp.integrations.verl import plugin  # noqa: F401  (registers hdp, as `import verl` would)

    def run(overrides):
        cfg = V.with_overrides(driver_job, overrides)
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))

    from hdp.integrations.verl import verl_version

    with pytest.raises(ValueError, match=entry.match):
        run(entry.overrides)
    rest = [o for o in entry.overrides if o.startswith(("algorithm.adv_estimator", "trainer."))]
    if verl_version().split("+")[0] == "0.9.0" and need_critic(V.with_overrides(driver_job, rest)):
        with pytest.raises(ValueError, match="vanilla_mbridge=True with verl 0.9.0"):  # its critic: refused, last
            run(rest)
    else:
        run(rest)


def _loss_cases() -> list[str]:
    return [c.id for c in V.cases().values() if c.kind == "update" and not c.nonfinite]


@pytest.mark.parametrize("case", _loss_cases())
def test_loss_matches_stock_accounting(case):
    bad = [str(c) for c in V.loss_level(V.cases()[case]) if not c.ok]
    assert not bad, "\n".join(bad)
