"""The one module that patches code hdp does not own for the verl integration: every patch, behind one helper.

Each patch is a row of :data:`PATCHES` (its dotted name, when it is in place, why, and the verl change that
removes it); docs/verl.md shows the same table.  Every patch is installed by :func:`wrap` (for the rest of the
process) or :func:`wrapped` (for the duration of one call, restored after), which refuse a name the table does
not hold, mark what they install (``__hdp_patch__``) and record it.  :func:`installed` finds the patches in
place in this process by reading the imported modules themselves (not the record): any function of hdp's code
sitting in another library's module or class — marked or not — is reported, so a patch made without the helper
shows up as undocumented (tests/unit/verl/test_verl_patches.py tests/distributed/verl/test_verl_patches_dist.py, and
the worker-path test in a verl worker process).

When the patches go in (:class:`Scope`):

* ``IMPORT`` — right after verl imports the module (the plugin's post-import hooks, plugin.py), or at ``import
  verl`` for Hydra's loader;
* ``ENGINE`` — when an hdp training engine is initialised in a worker;
* ``CALL`` — for one hdp call, restored when it returns.

Not patches, and not here: the ``hdp`` engine's registration (``EngineRegistry.register``, public), hdp's engine
and config classes (subclasses of verl's), and the private names hdp reads (compat.py).  The CPU scaffolding of
the tests and the laptop demo (``scaffolding/``) and hdp's Megatron seam (``hdp/megatron_compat``) patch other
things for their own purposes and are outside this table.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
import logging
import os
import sys
import sysconfig
import types
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = [
    "Scope",
    "Patch",
    "PATCHES",
    "wrap",
    "wrapped",
    "installed",
    "used",
    "hydra_overrides",
    "validate_config",
    "balance_batch_for_stock_dp",
    "skip_redundant_old_log_prob",
    "detached_worker_handlers",
    "own_mini_batch_loop",
    "owns_mini_batches",
    "policy_losses_wrapped",
    "optimizer_state_captured",
    "HDP_OPTIONS_HINT",
]

logger = logging.getLogger(__name__)


class Scope(str, enum.Enum):
    """When a patch is in place."""

    IMPORT = "import"
    """From the import of the patched module on (the plugin's hooks), for the rest of the process."""
    ENGINE = "engine"
    """From the initialisation of an hdp training engine in the process on."""
    CALL = "call"
    """For the duration of one hdp call; the original comes back when it returns."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Patch:
    """One row of the patch table."""

    name: str
    """The patched attribute, dotted: module, class, attribute."""
    scope: Scope
    """When it is in place."""
    why: str
    """What hdp needs that the public API does not give."""
    removed_by: str
    """The verl (or Hydra) change that would remove it."""


PATCHES: tuple[Patch, ...] = (
    Patch(name="hydra._internal.config_loader_impl.ConfigLoaderImpl._apply_overrides_to_config", scope=Scope.IMPORT,
          why="an actor_rollout_ref.actor.hdp.* override on verl's stock actor config fails with Hydra's \"Key 'hdp' "
              "is not in struct\"; the wrapper re-raises it naming model_engine=hdp",
          removed_by="verl's stock actor configs accepting an hdp node, or Hydra naming the config group that adds "
                     "a missing key"),
    Patch(name="verl.utils.config.validate_config", scope=Scope.IMPORT,
          why="the driver's check before Ray starts: hdp's job-level checks (actor.strategy=hdp on verl's Megatron "
              "or FSDP-shaped actor configs, CP settings, use_dynamic_bsz of every role, the old-log-prob option, "
              "losses hdp cannot normalise, the critic's model building on verl 0.9.0) run around verl's own",
          removed_by="validate_config calling a check hook of the engine registered for each role's strategy"),
    Patch(name="verl.trainer.ppo.ray_trainer.RayPPOTrainer._balance_batch", scope=Scope.IMPORT,
          why="the trainer balances the batch for the DP size the actor's workers report; an hdp engine reports 1 "
              "(each domain rank receives the whole batch), so for this call the dispatch info reports stock "
              "verl's DP size and the batch is ordered as stock's",
          removed_by="the trainer asking the engine (or its config) for the DP size to balance for"),
    Patch(name="verl.trainer.ppo.v1.trainer_base.PPOTrainer._balance_batch", scope=Scope.IMPORT,
          why="as RayPPOTrainer._balance_batch, in verl's v1 trainer",
          removed_by="as RayPPOTrainer._balance_batch"),
    Patch(name="verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_old_log_prob", scope=Scope.IMPORT,
          why="actor.hdp.skip_old_log_prob: skip the actor's redundant old-log-prob pass on an on-policy step "
              "(verl's only shortcut, bypass mode, changes the objective); writes the NaN stand-in",
          removed_by="verl skipping the pass when the update's own forward gives the same log-probs"),
    Patch(name="verl.trainer.ppo.v1.trainer_base.PPOTrainer._update_actor", scope=Scope.IMPORT,
          why="after a skipped pass, the update's batch carries the flag that tells hdp's loss to use the "
              "update's own log-probs (for that call only)",
          removed_by="as PPOTrainer._compute_old_log_prob"),
    Patch(name="verl.experimental.separation.engine_workers.DetachActorWorker._get_strategy_handlers",
          scope=Scope.IMPORT,
          why="the separate-/fully-async worker picks its save/restore-to-host handlers by actor.strategy and "
              "raises for 'hdp'; an hdp engine's module is Megatron's, so Megatron's handlers are mapped",
          removed_by="the detached worker asking the engine for its handlers"),
    Patch(name="verl.utils.tensordict_utils.make_iterator", scope=Scope.ENGINE,
          why="TrainingWorker.train_mini_batch cuts mini-batches from the engine's DP rank and size alone (1 for "
              "hdp): inside an hdp engine's train_mode the iterator yields stock verl's mini-batches for the "
              "domain instead, announcing each next one to the planner",
          removed_by="the worker asking the engine for its mini-batches (or its DP layout for batching)"),
    Patch(name="verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY", scope=Scope.CALL,
          why="during hdp's loss call the registry hands out hdp's plan-invariant normalisation of the policy "
              "losses that are a mean of their call (loss_kinds.py)",
          removed_by="verl's policy losses taking the group's share of the mini-batch (global_batch_info) for "
                     "every loss mode"),
    Patch(name="megatron.core.optimizer.MegatronOptimizer.load_state_dict", scope=Scope.CALL,
          why="on the engine's own optimizer instance, during verl's load_checkpoint: captures the state dict "
              "verl loads, whose param-group step megatron-core 0.16.1 (no Apex/TE) overwrites with the fresh "
              "optimizer's placeholder, to restore Adam's per-parameter step",
          removed_by="megatron-core restoring torch Adam's per-parameter step from a dp_reshardable checkpoint"),
)
"""Every patch of the verl integration (docs/verl.md shows the same table)."""

_TABLE = {p.name: p for p in PATCHES}
_MARK = "__hdp_patch__"
_USED: set[str] = set()
"""Names of the patches this process installed (any scope), from :func:`wrap` / :func:`wrapped`."""


def _row(name: str) -> Patch:
    row = _TABLE.get(name)
    assert row is not None, f"{name}: not in patches.PATCHES; add a row (why, removed_by) and to docs/verl.md"
    return row


def _raw(owner: Any, attr: str) -> Any:
    """``owner.attr`` as stored (a staticmethod stays one); ``None`` where a class does not define it itself."""
    if isinstance(owner, type):
        return owner.__dict__.get(attr)
    return getattr(owner, attr, None)


def _unbind(raw: Any) -> tuple[Any, Callable[[Any], Any]]:
    """(the function inside ``raw``, how to store a replacement the way ``raw`` was stored)."""
    if isinstance(raw, staticmethod):
        return raw.__func__, staticmethod
    if isinstance(raw, classmethod):
        return raw.__func__, classmethod
    return raw, lambda f: f


def _mark(raw: Any) -> str | None:
    try:
        inner, _ = _unbind(raw)
        return inner.__dict__.get(_MARK) if hasattr(inner, "__dict__") else None
    except Exception:  # an object whose attributes are computed
        return None


def wrap(name: str, owner: Any, attr: str, make: Callable[[Any], Any]) -> bool:
    """Replace ``owner.attr`` by ``make(original)`` for the rest of the process; True if this call installed it.

    ``name``: the row of :data:`PATCHES`.  Once per process (a second call finds the mark and returns False);
    False too where ``owner`` is a class that does not define ``attr`` itself (a subclass inherits the patch of
    its base).  ``make`` gets the function inside a staticmethod/classmethod, and its result is stored the same
    way."""
    _row(name)
    raw = _raw(owner, attr)
    if raw is None:
        return False
    if _mark(raw) == name:
        return False
    orig, store = _unbind(raw)
    new = make(orig)
    setattr(new, _MARK, name)
    setattr(owner, attr, store(new))
    _USED.add(name)
    logger.debug("hdp patch installed: %s", name)
    return True


@contextlib.contextmanager
def wrapped(name: str, owner: Any, attr: str, make: Callable[[Any], Any]) -> Iterator[Any]:
    """While active, ``owner.attr`` is ``make(original)``; restored on exit (an instance attribute removed
    again).  Yields the replacement.  Nested use of the same patch on the same owner keeps the outer one."""
    _row(name)
    own = vars(owner) if hasattr(owner, "__dict__") else {}
    had = attr in own
    before = own[attr] if had else getattr(owner, attr)
    if _mark(before) == name:  # nested: already in place
        yield before
        return
    orig, store = _unbind(before)
    new = make(orig)
    setattr(new, _MARK, name)
    setattr(owner, attr, store(new))
    _USED.add(name)
    try:
        yield new
    finally:
        if had:
            setattr(owner, attr, before)
        else:
            delattr(owner, attr)


def used() -> set[str]:
    """Names of the patches this process has installed so far (any scope; from the helpers' record)."""
    return set(_USED)


# ---- what is in place: read from the modules, not from the record ---------------------------------------------


def _megatron_seam() -> set[tuple[int, str]]:
    """``(id(owner), attribute)`` of what hdp's Megatron seam replaced (``hdp.megatron_compat``'s CPU shim, which
    binds hdp's kernels into Megatron's modules on CPU): its own patches, listed there, not in this table."""
    if "hdp.megatron_compat" not in sys.modules:
        return set()
    from hdp.megatron_compat import cpu_shim_places

    return {(id(owner), name) for owner, name in cpu_shim_places()}


@functools.lru_cache(maxsize=None)
def _hdp_file(path: str) -> bool:
    """Whether the source file ``path`` is hdp's code, outside the folders whose patches are not the verl
    integration's (the CPU scaffolding, hdp's Megatron seam)."""
    import importlib.util

    import hdp

    # the four source roots, found without importing them (the verl door does not import the library door)
    roots = tuple(str(Path(importlib.util.find_spec(m).origin).resolve().parent) + os.sep  # type: ignore[arg-type]
                  for m in ("hdp", "hdp.packing", "hdp.trainer", "hdp.integrations"))
    outside = (str(Path(__file__).resolve().parent / "scaffolding") + os.sep,
               str(Path(hdp.__file__).resolve().parent / "megatron_compat") + os.sep)
    where = str(Path(path).resolve())
    return where.startswith(roots) and not where.startswith(outside)


def _of_hdp(obj: Any) -> bool:
    """Whether ``obj`` (a function, a class, or an instance of a class) is hdp's code (`_hdp_file`)."""
    try:
        inner, _ = _unbind(obj)
        if isinstance(inner, types.FunctionType):
            return _hdp_file(inner.__code__.co_filename)
        cls = inner if isinstance(inner, type) else type(inner)
        module = str(getattr(cls, "__module__", None) or "")
        if not (module == "hdp" or module.startswith("hdp.")):
            return False
        return _hdp_file(getattr(sys.modules.get(module), "__file__", None) or "")
    except Exception:  # an object whose attributes are computed
        return False


def _third_party(module: types.ModuleType) -> bool:
    """Whether ``module`` is an installed library's (site-packages), not hdp's, the tests' or the standard library's."""
    name = getattr(module, "__name__", "")
    if name == "hdp" or name.startswith("hdp."):
        return False
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and _installed_file(path)


@functools.lru_cache(maxsize=None)
def _installed_file(path: str) -> bool:
    return str(Path(path).resolve()).startswith(_SITE)


_SITE = tuple({str(Path(p).resolve()) + os.sep for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])})
"""The directories installed libraries live in."""


def installed() -> dict[str, list[str]]:
    """The patches in place in this process: ``{name: [where, ...]}`` for marked ones, ``{"undocumented": [where,
    ...]}`` for hdp code found in an installed library's namespace without a mark, and ``{"import hook": [module,
    ...]}`` for the modules imported through the plugin's post-import hook (hdp's loader as their ``__loader__``).

    Reads every imported module of an installed library (`_third_party`): its attributes, and the attributes
    its own classes define.  ``where`` is the dotted place it was found."""
    found: dict[str, list[str]] = {}
    seam = _megatron_seam()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # attribute reads of lazy or deprecated module members
        for modname, module in list(sys.modules.items()):
            if module is None or not _third_party(module):
                continue
            for attr, value in list(vars(module).items()):
                if attr in ("__loader__", "__spec__"):
                    if attr == "__loader__" and _of_hdp(value):
                        found.setdefault("import hook", []).append(modname)
                    continue
                places = [(f"{modname}.{attr}", value)] if (id(module), attr) not in seam else []
                if isinstance(value, type) and getattr(value, "__module__", None) == modname:
                    places += [(f"{modname}.{value.__qualname__}.{a}", v) for a, v in list(vars(value).items())
                               if (id(value), a) not in seam]
                for where, obj in places:
                    mark = _mark(obj)
                    if mark is not None:
                        found.setdefault(mark, []).append(where)
                    elif _of_hdp(obj):
                        found.setdefault("undocumented", []).append(where)
    return found


# ---- the patches -------------------------------------------------------------------------------------------------

HDP_OPTIONS_HINT = (
    "{key}: this config has no hdp options. actor_rollout_ref.actor.strategy=hdp on verl's ppo_trainer "
    "keeps verl's FSDP-shaped actor config, which has no 'hdp' key (the engine then uses hdp's defaults). "
    "Add the override model_engine=hdp, which adds actor_rollout_ref.actor.hdp.* (and every "
    "actor_rollout_ref.actor.megatron.* option), or use --config-name hdp_ppo_trainer"
)
"""The error for an ``actor_rollout_ref.(actor|ref).hdp.*`` override on a config without hdp's options."""


def hydra_overrides() -> bool:
    """Make a failed ``actor_rollout_ref.actor.hdp.*`` override say to add ``model_engine=hdp``; True if patched.

    Hydra applies command-line overrides in ``ConfigLoaderImpl._apply_overrides_to_config`` (a private static
    method, hydra-core 1.3) and reports a key missing from the config as "Could not override ... Key 'hdp' is not
    in struct".  When an override under ``actor_rollout_ref.actor.hdp`` / ``actor_rollout_ref.ref.hdp`` fails on
    a config whose actor has no ``hdp`` node, the wrapper raises Hydra's own ``ConfigCompositionException`` with
    :data:`HDP_OPTIONS_HINT` (the original chained); anything else is untouched."""
    import re

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    pattern = re.compile(r"^actor_rollout_ref\.(actor|ref)\.hdp(\.|$)")

    def make(orig: Any) -> Any:
        @functools.wraps(orig)
        def _apply_overrides_to_config(overrides: Any, cfg: Any) -> None:
            try:
                orig(overrides, cfg)
            except ConfigCompositionException as exc:
                bad = [o.input_line for o in overrides if pattern.match(str(o.key_or_group or ""))]
                has_hdp = OmegaConf.select(cfg, "actor_rollout_ref.actor.hdp", throw_on_missing=False) is not None
                if bad and not has_hdp:
                    raise ConfigCompositionException(HDP_OPTIONS_HINT.format(key=bad[0])) from exc
                raise

        return _apply_overrides_to_config

    return wrap("hydra._internal.config_loader_impl.ConfigLoaderImpl._apply_overrides_to_config",
                ConfigLoaderImpl, "_apply_overrides_to_config", make)


def validate_config(config_module: types.ModuleType) -> bool:
    """Make verl's ``validate_config`` (the driver's check, before Ray starts) run hdp's job-level checks; True if
    patched.  Before verl's own: :func:`hdp.integrations.verl.checks.check_job_actor` (``actor.strategy=hdp`` on a
    verl actor config hdp's classes never see) and `check_job_layout` (settings spread over the actor's, the ref's
    and the critic's configs); after it: `check_job_batching` (every role's ``use_dynamic_bsz``, the old-log-prob
    option), :func:`hdp.integrations.verl.loss_kinds.check_job_config` (losses that are not additive over samples,
    or run a collective) and, last, `check_job_critic` (the critic's model building on this verl).  Wraps the
    module attribute right after the module executed, so every ``from verl.utils.config import validate_config``
    binds the wrapper."""

    def make(orig: Any) -> Any:
        @functools.wraps(orig)
        def validate_config(config: Any, use_reference_policy: bool, use_critic: bool, *args: Any,
                            **kwargs: Any) -> Any:
            from hdp.integrations.verl import verl_version
            from hdp.integrations.verl.checks import (check_job_actor, check_job_batching, check_job_critic,
                                                      check_job_layout)
            from hdp.integrations.verl.loss_kinds import check_job_config

            # pure and quick: before verl's own, which builds the roles' configs
            check_job_actor(config)
            check_job_layout(config, ref=bool(use_reference_policy), critic=bool(use_critic))
            out = orig(config, use_reference_policy, use_critic, *args, **kwargs)
            check_job_batching(config, ref=bool(use_reference_policy), critic=bool(use_critic))
            check_job_config(config, critic=bool(use_critic))  # losses whose value would depend on hdp's plan
            check_job_critic(config, critic=bool(use_critic), verl_version=verl_version())  # this verl, last
            return out

        return validate_config

    return wrap("verl.utils.config.validate_config", config_module, "validate_config", make)


def balance_batch_for_stock_dp(trainer_cls: type) -> bool:
    """Make ``trainer_cls._balance_batch`` balance for stock verl's DP size when the actor runs on hdp; True if
    this call patched.

    verl's trainers read the DP size to balance for from the actor's dispatch info (``trainer/ppo/v1/
    trainer_base.py`` ``_balance_batch``, ``trainer/ppo/ray_trainer.py`` ``_get_dp_size``), and an hdp engine
    reports 1, so the batch would be balanced for one part: other samples would train together than under stock
    verl at the same world size.  For the call only, the actor's dispatch info reports
    :func:`hdp.integrations.verl.minibatches.trainer_dp_size` ranks (`compat.dispatch_dp_size`); the batch is then
    ordered as stock's, part after part, and the hdp worker's loop (`own_mini_batch_loop`) cuts the same
    mini-batches from it."""
    from hdp.integrations.verl import compat

    def make(orig: Any) -> Any:
        @functools.wraps(orig)
        def _balance_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            from hdp.integrations.verl.minibatches import trainer_dp_size

            wg = self.actor_rollout_wg
            dp = trainer_dp_size(self.config, int(wg.world_size))
            if dp is None:
                return orig(self, batch, *args, **kwargs)
            with compat.dispatch_dp_size(wg, "actor", dp):
                return orig(self, batch, *args, **kwargs)

        return _balance_batch

    name = f"{trainer_cls.__module__}.{trainer_cls.__qualname__}._balance_batch"
    return wrap(name, trainer_cls, "_balance_batch", make)


def skip_redundant_old_log_prob(trainer_cls: type) -> bool:
    """Make verl's v1 trainer (``trainer_cls``: ``PPOTrainer``) skip the actor's old-log-prob pass when the job
    says so (:func:`hdp.integrations.verl.old_log_prob.resolve`, decided once per trainer) and the step does not
    need it after all (`old_log_prob.needed_at_step`); True if this call patched.

    Wraps ``_compute_old_log_prob`` (skipped: `old_log_prob.skip_step` writes the NaN stand-in; either way
    ``actor/hdp/old_log_prob_skipped`` says which ran) and ``_update_actor`` (after a skipped pass the update's
    batch carries `old_log_prob.SKIP_FLAG`, for that call only).  Subclasses that call them through ``super()``
    get the same."""
    from hdp.integrations.verl import old_log_prob

    def skips(self: Any) -> bool:
        if getattr(self, "_hdp_skip_old", None) is None:
            self._hdp_skip_old = old_log_prob.resolve(self.config)
        return self._hdp_skip_old

    def make_old(orig_old: Any) -> Any:
        @functools.wraps(orig_old)
        def _compute_old_log_prob(self: Any, batch: Any, metrics: dict, *args: Any, **kwargs: Any) -> Any:
            on_hdp = str(self.config.actor_rollout_ref.actor.get("strategy", "")) == "hdp"
            self._hdp_skipped_pass = False
            if skips(self):
                kept = old_log_prob.skip_step(batch, self.config, int(getattr(self, "global_steps", 0)))
                if not kept:
                    metrics["actor/hdp/old_log_prob_skipped"] = 1.0
                    self._hdp_skipped_pass = True
                    return batch
                seen = self.__dict__.setdefault("_hdp_kept_for", set())
                for why in kept:
                    if why.split(" (", 1)[0] not in seen:  # once per kind of reason
                        seen.add(why.split(" (", 1)[0])
                        logger.info("hdp: the old-log-prob pass runs on this step: %s", why)
            if on_hdp:
                metrics["actor/hdp/old_log_prob_skipped"] = 0.0
            return orig_old(self, batch, metrics, *args, **kwargs)

        return _compute_old_log_prob

    def make_update(orig_update: Any) -> Any:
        @functools.wraps(orig_update)
        def _update_actor(self: Any, batch: Any, metrics: dict, *args: Any, **kwargs: Any) -> Any:
            if not getattr(self, "_hdp_skipped_pass", False):
                return orig_update(self, batch, metrics, *args, **kwargs)
            self._hdp_skipped_pass = False  # this step's update only
            batch.extra_info[old_log_prob.SKIP_FLAG] = True
            try:
                return orig_update(self, batch, metrics, *args, **kwargs)
            finally:
                batch.extra_info.pop(old_log_prob.SKIP_FLAG, None)

        return _update_actor

    prefix = f"{trainer_cls.__module__}.{trainer_cls.__qualname__}"
    if _raw(trainer_cls, "_compute_old_log_prob") is None or _raw(trainer_cls, "_update_actor") is None:
        return False
    a = wrap(f"{prefix}._compute_old_log_prob", trainer_cls, "_compute_old_log_prob", make_old)
    b = wrap(f"{prefix}._update_actor", trainer_cls, "_update_actor", make_update)
    return a or b


def detached_worker_handlers(worker_cls: type) -> bool:
    """Give verl's detached actor worker (``worker_cls``: ``DetachActorWorker`` of its separate- and fully-async
    trainers) Megatron's save/restore handlers when the actor runs on hdp; True if this call patched.

    verl picks the handlers that keep the start-of-cycle policy on the host for the old-log-prob pass by
    ``actor.strategy`` (``experimental/separation/engine_workers.py`` ``_get_strategy_handlers``) and raises
    ``NotImplementedError`` for anything but fsdp, fsdp2, veomni and megatron.  An hdp engine's ``module`` is
    Megatron's list of DDP chunks, so Megatron's own handlers
    (``verl.utils.megatron_utils.copy_megatron_model_to_cpu`` / ``restore_megatron_model_from_cpu``) are the right
    ones: they are mapped, not copied."""

    def make(orig: Any) -> Any:
        @functools.wraps(orig)
        def _get_strategy_handlers(self: Any) -> Any:
            if getattr(self, "_strategy_handlers", None) is None and self.config.actor.strategy == "hdp":
                from verl.utils import megatron_utils

                self._strategy_handlers = (megatron_utils.copy_megatron_model_to_cpu,
                                           megatron_utils.restore_megatron_model_from_cpu)
            return orig(self)

        return _get_strategy_handlers

    name = f"{worker_cls.__module__}.{worker_cls.__qualname__}._get_strategy_handlers"
    return wrap(name, worker_cls, "_get_strategy_handlers", make)


_TRAINING: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""hdp training engines of this process whose mini-batch loop hdp runs (`own_mini_batch_loop`)."""
_OWNER: "contextvars.ContextVar[Any]" = contextvars.ContextVar("hdp_mini_batch_owner", default=None)
"""The hdp engine whose ``train_mode`` is active (None: verl's own mini-batches)."""
_WARNED: set[tuple[int, int, int]] = set()


def own_mini_batch_loop(engine: Any) -> None:
    """Make verl's mini-batch loop (``TrainingWorker.train_mini_batch``, the only caller of
    ``tensordict_utils.make_iterator``) of a worker whose engine is ``engine``:

    * iterate **stock verl's mini-batches** for ``engine``'s domain of D ranks
      (:mod:`hdp.integrations.verl.minibatches`: the loop sees a DP size of 1 and would otherwise cut
      contiguous slices of the whole batch), and
    * announce each next mini-batch to ``engine`` before handing out the current one, so hdp plans it on a
      background thread while the current one trains (`hdp.core.plan_ahead`; one mini-batch ahead).

    verl forms the mini-batches in the worker from the engine's DP rank and size alone
    (``workers/engine_workers.py``, ``train_mini_batch``), calling ``make_iterator`` just before it enters the
    engine's ``train_mode`` and iterating inside it.  While any hdp training engine lives in the process, the
    wrapped ``make_iterator`` returns an iterable that decides when iterated: inside `owns_mini_batches` of an
    engine registered here (the hdp engine's ``train_mode``) it yields stock's mini-batches, anywhere else verl's.
    Installed once per process; engines are held weakly."""
    _TRAINING.add(engine)
    from hdp.integrations.verl import compat

    def make(orig: Any) -> Any:
        @functools.wraps(orig)
        def make_iterator(tensordict: Any, mini_batch_size: int, epochs: int, seed: Any = None,
                          dataloader_kwargs: Any = None) -> Any:
            if not _TRAINING:  # no hdp training engine in this process: verl's own, made now
                return orig(tensordict, mini_batch_size, epochs, seed=seed, dataloader_kwargs=dataloader_kwargs)
            return _Deferred(orig, tensordict, mini_batch_size, epochs, seed, dataloader_kwargs)

        return make_iterator

    wrap("verl.utils.tensordict_utils.make_iterator", compat.tensordict_utils(), "make_iterator", make)


@contextlib.contextmanager
def owns_mini_batches(engine: Any) -> Iterator[None]:
    """While active, mini-batch iterators made by verl's ``make_iterator`` (`own_mini_batch_loop`) and first
    iterated here are ``engine``'s stock mini-batches, when ``engine`` is registered; the hdp engine's
    ``train_mode`` enters it."""
    token = _OWNER.set(engine if engine in _TRAINING else None)
    try:
        yield
    finally:
        _OWNER.reset(token)


class _Deferred:
    """verl's ``make_iterator(...)``, decided when iterated: the active hdp engine's stock mini-batches, else
    verl's own iterator (made then, from the same arguments)."""

    def __init__(self, orig: Any, data: Any, mini_batch_size: int, epochs: int, seed: Any,
                 dataloader_kwargs: Any) -> None:
        self._args = (orig, data, mini_batch_size, epochs, seed, dataloader_kwargs)

    def __iter__(self) -> Iterator[Any]:
        orig, data, mini_batch_size, epochs, seed, dataloader_kwargs = self._args
        owner = _OWNER.get()
        if owner is None:
            return iter(orig(data, mini_batch_size, epochs, seed=seed, dataloader_kwargs=dataloader_kwargs))
        return _one_ahead(_stock_iterator(owner, orig, data, mini_batch_size, epochs, seed, dataloader_kwargs), owner)


def _stock_iterator(engine: Any, make_iterator: Any, data: Any, mini_batch_size: int, epochs: int, seed: Any,
                    dataloader_kwargs: Any) -> Iterator[Any]:
    from hdp.integrations.verl import compat, minibatches, old_log_prob

    old_log_prob.check_update(data, mini_batch_size, epochs)  # a skipped pass: one update, nothing read its stand-in
    dp = int(engine.domain.size)
    n = int(data.batch_size[0])
    idx = minibatches.stock_minibatch_indices(n, dp, int(mini_batch_size), int(epochs), seed, dataloader_kwargs,
                                              make_iterator)
    if idx is None:
        if dp > 1 and (n, int(mini_batch_size), dp) not in _WARNED:
            _WARNED.add((n, int(mini_batch_size), dp))
            logger.warning(
                "hdp engine: a batch of %d samples in mini-batches of %d does not split over the %d data-parallel "
                "ranks stock verl would use (its worker asserts); training contiguous mini-batches of the batch",
                n, mini_batch_size, dp)
        return iter(make_iterator(data, mini_batch_size, epochs, seed=seed, dataloader_kwargs=dataloader_kwargs))
    return minibatches.stock_minibatches(data, idx, compat.tensordict_utils().index_select_tensor_dict)


def _one_ahead(it: Any, engine: Any) -> Iterator[Any]:
    it = iter(it)
    cur = next(it, None)
    if cur is None:
        return
    engine.announce([cur])
    for nxt in it:
        engine.announce([nxt], extend=True)
        yield cur
        cur = nxt
    yield cur


class _WrappedRegistry(dict):
    """verl's ``POLICY_LOSS_REGISTRY`` whose lookups hand back ``wrap(name, fn)`` (`policy_losses_wrapped`)."""

    def __init__(self, original: dict[str, Any], wrap: Any) -> None:
        super().__init__(original)
        self._wrap = wrap
        self._made: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        made = self._made.get(name)
        if made is None:
            made = self._made[name] = self._wrap(name, super().__getitem__(name))
        return made


_WRAPPED: dict[tuple[int, int], _WrappedRegistry] = {}
"""One wrapped registry per (registry, wrap) pair, made once (its wrapped functions keep their caches)."""


@contextlib.contextmanager
def policy_losses_wrapped(wrap_fn: Any) -> Iterator[None]:
    """While active, verl's ``get_policy_loss_fn(name)`` (``trainer/ppo/core_algos.py``, the one lookup of its
    policy-loss registry that ``ppo_loss`` and the distillation losses make) returns ``wrap_fn(name, fn)``: hdp's
    plan-invariant normalisation of the policy losses that are a mean of their call
    (:mod:`hdp.integrations.verl.loss_kinds`).  The module global ``POLICY_LOSS_REGISTRY`` is a wrapped copy for
    the duration of hdp's loss call; losses registered meanwhile land in the copy."""
    from verl.trainer.ppo import core_algos

    def make(original: dict[str, Any]) -> _WrappedRegistry:
        slot = (id(original), id(wrap_fn))
        made = _WRAPPED.get(slot)
        if made is None or dict.keys(made) != original.keys():
            made = _WRAPPED[slot] = _WrappedRegistry(original, wrap_fn)
        return made

    with wrapped("verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY", core_algos, "POLICY_LOSS_REGISTRY", make):
        yield


@contextlib.contextmanager
def optimizer_state_captured(optimizer: Any) -> Iterator[list[Any]]:
    """While active, every state dict loaded into ``optimizer`` (the engine's Megatron optimizer: this instance
    only) is appended to the yielded list before it loads; used around verl's ``load_checkpoint``, whose
    checkpoint manager calls ``optimizer.load_state_dict`` (:func:`hdp.core.optim_state.restore_adam_steps`
    needs the step it carries)."""
    loaded: list[Any] = []

    def make(orig: Any) -> Any:
        def load_state_dict(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
            loaded.append(state_dict)
            return orig(state_dict, *args, **kwargs)

        return load_state_dict

    with wrapped("megatron.core.optimizer.MegatronOptimizer.load_state_dict", optimizer, "load_state_dict", make):
        yield loaded
