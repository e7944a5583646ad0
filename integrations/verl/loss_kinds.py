"""What kind of loss verl's loss function is, read from the loss itself, and what the hdp door does with it.

The hdp door runs verl's loss once per CP group, on the group's samples whole, with the mini-batch's global
normalisers, and adds the groups' losses over the domain (:mod:`hdp.integrations.verl.loss`).  That sum is the
mini-batch's loss, whatever the plan, exactly when the loss is **additive over samples**: for disjoint sample
sets A and B, ``loss(A ∪ B) = loss(A) + loss(B)``.  verl's aggregations divide by the mini-batch's tokens or
samples, passed in (``batch_num_tokens``, ``global_batch_size``), so most of its losses are; one that is not
would train on another objective for every plan.  No hand list decides which: each loss is read from its
response to a probe.

**Policy losses** (verl's ``POLICY_LOSS_REGISTRY``; ``ppo_loss`` calls one per loss call) are classified on
synthetic padded batches (`policy_loss_kind`, cached per loss and config):

* `Kind.ADDITIVE` — a sum of per-sample terms (verl's global normalisers inside): run as is;
* `Kind.SAMPLE_MEAN` — a plain mean over the rows of the call that ignores the global information (GMPO's
  ``geo_mean``): hdp multiplies it by rows / ``global_batch_size``, so the mini-batch's loss is the mean over
  its samples;
* `Kind.TOKEN_MEAN` — a masked mean over the call's tokens: hdp multiplies it by tokens / ``batch_num_tokens``;
* anything else is refused with a `LossNotAdditiveError` (a ``ValueError`` naming the keys and the fix): batch
  statistics inside a call (``kl_cov``'s top-k, ``clip_cov``'s centring and top-k), a normaliser read from the
  call's padded width (``seq-mean-token-sum-norm`` without ``loss_scale_factor``), and a loss that runs a
  collective (`LossCollectiveError`: bypass mode's ``rollout_is_batch_normalize`` all-reduces over the world
  group inside the loss, which hdp's group leaders would enter different numbers of times).

The scaling is applied by wrapping the registry's functions while hdp runs verl's loss (`normalised_policy_losses`,
through :func:`hdp.integrations.verl.patches.policy_losses_wrapped`).  **The whole loss** (the scaled policy
term, the entropy bonus, the KL loss, the critic's value loss, any loss function a user passes) is then
checked on two of the mini-batch's own samples before any round runs (`check_additive`, called in the pass's
agreement): the loss of both together against the sum of their losses apart, values and gradients.

How these definitions relate to stock verl's (docs/verl.md, "Loss kinds"): for additive losses they are
stock's.  Stock's Megatron engine sums a SAMPLE_MEAN loss's per-micro-batch means and averages them over DP
ranks, so its objective depends on how its micro-batches fall; hdp's equals it when each DP rank trains one
micro-batch of an equal share of the mini-batch.

Legend: S rows of a probe batch, R its padded response width.
"""

from __future__ import annotations

import enum
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "Kind",
    "LossNotAdditiveError",
    "LossCollectiveError",
    "collectives_refused",
    "policy_loss_kind",
    "aggregation_kind",
    "normalised_policy_losses",
    "check_additive",
    "check_job_losses",
    "check_job_config",
    "check_kl_loss_type",
]

RTOL = 1e-6
"""Relative tolerance of the probes (float64 inputs; a loss that casts to float32 inside stays far inside it)."""
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
"""The dispatcher namespaces of torch.distributed's collectives and point-to-point ops."""
ACTOR_LOSS_KEYS = ("policy_loss.loss_mode", "loss_agg_mode", "loss_scale_factor")
"""The actor config keys that decide its loss's kind (named by the errors)."""


class Kind(enum.Enum):
    """How a loss call's value scales with the samples it is given (see the module docstring)."""

    ADDITIVE = "additive"
    SAMPLE_MEAN = "sample-mean"
    TOKEN_MEAN = "token-mean"


class LossNotAdditiveError(ValueError):
    """verl's loss under this config depends on how samples are grouped into loss calls; hdp refuses it."""


class LossCollectiveError(LossNotAdditiveError):
    """verl's loss runs a torch.distributed collective inside the call; hdp refuses it."""


# ---- collectives inside a loss ------------------------------------------------------------------------


class _NoCollectives(TorchDispatchMode):
    """A dispatch mode that raises on the first collective or point-to-point op (``c10d::*``), before any
    message leaves the process.  Reads every op of the code it wraps; it patches nothing."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "namespace", "") in _COLLECTIVE_NAMESPACES:
            raise LossCollectiveError(f"torch.distributed {func.__name__.split('.')[0]}")
        return func(*args, **(kwargs or {}))


def collectives_refused() -> _NoCollectives:
    """A context in which any torch.distributed collective raises `LossCollectiveError` (naming the op)."""
    return _NoCollectives()


# ---- probes on synthetic batches -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Probe:
    """A synthetic padded batch split into two row sets of different padded widths (``a``, ``b``)."""

    old: torch.Tensor  # [S, R] float64, 0 where padded
    logp: torch.Tensor  # [S, R] float64 leaf, 0 where padded
    adv: torch.Tensor  # [S, R] per-row advantages, 0 where padded
    weights: torch.Tensor  # [S, R] rollout IS weights, 0 where padded
    mask: torch.Tensor  # [S, R] float64 0/1
    a: tuple[int, int]  # rows [0, na), width wa
    b: tuple[int, int]  # rows [na, S), width R


def _probe_batch(seed: int = 0) -> _Probe:
    lengths = torch.tensor([2, 5, 3, 4, 7, 6])  # A = rows 0-2 (width 5), B = rows 3-5 (width 7)
    g = torch.Generator().manual_seed(seed)
    s, r = len(lengths), int(lengths.max())
    mask = (torch.arange(r)[None, :] < lengths[:, None]).to(torch.float64)  # [S, R]
    old = -(0.2 + 3.0 * torch.rand(s, r, generator=g, dtype=torch.float64)) * mask
    logp = (old + 0.4 * torch.randn(s, r, generator=g, dtype=torch.float64)).clamp(max=-1e-3) * mask
    adv = ((torch.rand(s, 1, generator=g, dtype=torch.float64) * 2 - 1) * 3.0).expand(s, r) * mask
    weights = (0.5 + torch.rand(s, r, generator=g, dtype=torch.float64)) * mask
    return _Probe(old, logp.requires_grad_(), adv.contiguous(), weights, mask, (3, 5), (s, r))


def _rows(p: _Probe, which: str) -> tuple[slice, int]:
    if which == "a":
        return slice(0, p.a[0]), p.a[1]
    if which == "b":
        return slice(p.a[0], p.b[0]), p.b[1]
    return slice(0, p.b[0]), p.b[1]


def _classify(call: Callable[[slice, int], torch.Tensor], p: _Probe, leaf: torch.Tensor,
              rows: dict[str, int], tokens: dict[str, float]) -> tuple[Kind | None, str]:
    """The kind whose law the three calls (``a``, ``b``, the union ``u``) obey, values and gradients with
    respect to ``leaf``; (None, what differed) when none does."""
    val: dict[str, torch.Tensor] = {}
    grad: dict[str, torch.Tensor] = {}
    for which in ("a", "b", "u"):
        sl, width = _rows(p, which)
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(0)  # a loss drawing random numbers draws the same ones
            loss = call(sl, width)
        val[which] = loss.detach().to(torch.float64)
        (g,) = torch.autograd.grad(loss, leaf, allow_unused=True)
        grad[which] = torch.zeros_like(leaf) if g is None else g.to(torch.float64)
    scale = max(float(v.abs()) for v in val.values()) or 1.0
    gscale = max(float(g.abs().max()) for g in grad.values()) or 1.0
    laws = {
        Kind.ADDITIVE: (1.0, 1.0),
        Kind.SAMPLE_MEAN: (rows["a"] / rows["u"], rows["b"] / rows["u"]),
        Kind.TOKEN_MEAN: (tokens["a"] / tokens["u"], tokens["b"] / tokens["u"]),
    }
    worst = ""
    for kind, (wa, wb) in laws.items():
        dv = abs(float(val["u"] - (wa * val["a"] + wb * val["b"]))) / scale
        dg = float((grad["u"] - (wa * grad["a"] + wb * grad["b"])).abs().max()) / gscale
        if dv <= RTOL and dg <= RTOL:
            return kind, ""
        if kind is Kind.ADDITIVE:
            worst = (f"the loss of both row sets together is {float(val['u']):.6g}, the sum of their losses apart "
                     f"{float(val['a'] + val['b']):.6g} (gradients differ by {dg:.2g} of their largest entry)")
    return None, worst


def _config_fingerprint(config: Any) -> tuple[Any, ...]:
    """What a policy loss's kind may depend on: its config's aggregation and policy-loss settings, and whether
    torch.distributed is initialised (verl's losses take collective paths only then)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return (str(getattr(config, "loss_agg_mode", None)), getattr(config, "loss_scale_factor", None),
            repr(getattr(config, "policy_loss", None)), distributed)


_KINDS: dict[tuple[Any, ...], Kind | LossNotAdditiveError] = {}
"""Classified (loss name, function, config fingerprint) -> kind, or the refusal to raise again."""


def policy_loss_kind(name: str, fn: Callable[..., Any], config: Any, *, key: str = "actor_rollout_ref.actor") -> Kind:
    """The `Kind` of verl's policy loss ``fn`` (registered as ``name``) under ``config`` (verl's actor config),
    read from three calls on a synthetic batch, with and without rollout IS weights; `LossNotAdditiveError`
    naming ``key``'s loss keys when it has none.  ``config.global_batch_info`` is restored after the probe."""
    slot = (name, fn, *_config_fingerprint(config))
    known = _KINDS.get(slot)
    if known is None:
        known = _KINDS[slot] = _policy_loss_kind(name, fn, config, key)
    if isinstance(known, LossNotAdditiveError):
        raise known
    return known


def _policy_loss_kind(name: str, fn: Callable[..., Any], config: Any, key: str) -> Kind | LossNotAdditiveError:
    p = _probe_batch()
    rows = {"a": p.a[0], "b": p.b[0] - p.a[0], "u": p.b[0]}
    tokens = {w: float(p.mask[_rows(p, w)[0]].sum()) for w in ("a", "b", "u")}
    info = getattr(config, "global_batch_info", None)
    saved = dict(info) if isinstance(info, dict) else None
    kinds: set[Kind] = set()
    try:
        if isinstance(info, dict):
            info.update(dp_size=1, batch_num_tokens=int(tokens["u"]), global_batch_size=rows["u"],
                        loss_scale_factor=getattr(config, "loss_scale_factor", None))
        for with_weights in (False, True):
            def call(sl: slice, width: int, with_weights: bool = with_weights) -> torch.Tensor:
                loss, _ = fn(old_log_prob=p.old[sl, :width], log_prob=p.logp[sl, :width], advantages=p.adv[sl, :width],
                             response_mask=p.mask[sl, :width].bool(), loss_agg_mode=getattr(config, "loss_agg_mode", "token-mean"),
                             config=config, rollout_is_weights=p.weights[sl, :width] if with_weights else None)
                return loss

            try:
                with collectives_refused():
                    kind, why = _classify(call, p, p.logp, rows, tokens)
            except LossCollectiveError as exc:
                return LossCollectiveError(_collective_message(name, config, key, str(exc)))
            if kind is None:
                return LossNotAdditiveError(_not_additive_message(name, config, key, why))
            kinds.add(kind)
    finally:
        if saved is not None:
            info.clear()
            info.update(saved)
    if len(kinds) != 1:
        return LossNotAdditiveError(_not_additive_message(
            name, config, key, f"it scales as {sorted(k.value for k in kinds)} with and without rollout IS weights"))
    return kinds.pop()


def aggregation_kind(loss_agg_mode: str, loss_scale_factor: Any, *, key: str) -> Kind:
    """The `Kind` of verl's ``agg_loss`` in ``loss_agg_mode`` (the entropy bonus, the KL loss and the value
    loss aggregate through it), with the mini-batch's global information; `LossNotAdditiveError` naming
    ``key.loss_agg_mode`` otherwise (``seq-mean-token-sum-norm`` without ``loss_scale_factor`` divides by the
    padded width of each call)."""
    from verl.trainer.ppo.core_algos import agg_loss

    p = _probe_batch()
    rows = {"a": p.a[0], "b": p.b[0] - p.a[0], "u": p.b[0]}
    tokens = {w: float(p.mask[_rows(p, w)[0]].sum()) for w in ("a", "b", "u")}

    def call(sl: slice, width: int) -> torch.Tensor:
        return agg_loss(loss_mat=p.logp[sl, :width], loss_mask=p.mask[sl, :width].bool(), loss_agg_mode=loss_agg_mode,
                        dp_size=1, batch_num_tokens=int(tokens["u"]), global_batch_size=rows["u"],
                        loss_scale_factor=loss_scale_factor)

    kind, why = _classify(call, p, p.logp, rows, tokens)
    if kind is not Kind.ADDITIVE:
        raise LossNotAdditiveError(
            f"{key}.loss_agg_mode={loss_agg_mode} with {key}.loss_scale_factor={loss_scale_factor}: verl's agg_loss "
            f"is not additive over samples ({why or 'it is a mean of the call'}); hdp runs the loss once per CP group "
            f"and adds the groups, so the update would depend on its plan. {_agg_fix(loss_agg_mode, loss_scale_factor, key)}")
    return kind


def _agg_fix(mode: str, factor: Any, key: str) -> str:
    if mode == "seq-mean-token-sum-norm" and factor is None:
        return (f"Set {key}.loss_scale_factor to a constant (e.g. data.max_response_length): without it each call "
                "divides by its own padded response width")
    return f"Choose another {key}.loss_agg_mode"


def _not_additive_message(name: str, config: Any, key: str, why: str) -> str:
    mode, factor = getattr(config, "loss_agg_mode", None), getattr(config, "loss_scale_factor", None)
    if mode == "seq-mean-token-sum-norm" and factor is None:
        return (f"{key}.loss_agg_mode={mode} with {key}.loss_scale_factor=None (policy loss {name}): the loss divides by "
                f"the padded response width of each call ({why}); hdp calls the loss once per CP group and adds the "
                f"groups, so the update would depend on its plan. {_agg_fix(mode, factor, key)}")
    return (f"{key}.policy_loss.loss_mode={name} (loss_agg_mode={mode}, loss_scale_factor={factor}): this policy loss is "
            f"neither a sum over samples nor a plain mean of its call ({why}): it reads statistics of the samples it is "
            "called with, so under hdp, which calls it once per CP group, the update would depend on the plan. Choose "
            f"another {key}.policy_loss.loss_mode (the additive ones run as in stock verl; a plain mean of the call, "
            "as geo_mean, is normalised by hdp)")


def _collective_message(name: str, config: Any, key: str, op: str) -> str:
    corr = getattr(getattr(config, "policy_loss", None), "rollout_correction", None)
    get = (lambda k: corr.get(k, None)) if hasattr(corr, "get") else (lambda k: getattr(corr, k, None))
    if corr is not None and get("rollout_is_batch_normalize"):
        what = ("algorithm.rollout_correction.rollout_is_batch_normalize=True (in verl's bypass_mode policy loss, as "
                "bypass_mode=True runs it, the IS weights are normalised inside the loss by an all-reduce over the "
                "world group)")
        fix = ("set algorithm.rollout_correction.rollout_is_batch_normalize=False, or bypass_mode=False (the weights "
               "are then normalised over the whole batch by the trainer, before the update)")
    else:
        what, fix = f"{key}.policy_loss.loss_mode={name}", f"choose another {key}.policy_loss.loss_mode"
    return (f"{what}: the loss runs a collective ({op}) inside each call. hdp runs the loss on CP-group leaders only, "
            f"a different number of times on each rank, so the ranks would wait in different collectives until the "
            f"timeout; refused: {fix}")


# ---- the scaling, while hdp runs verl's loss ---------------------------------------------------------------


class _Normalised:
    """A registered policy loss with hdp's plan-invariant normalisation of its `Kind`."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name, self.fn = name, fn
        self.signature = inspect.signature(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind_partial(*args, **kwargs).arguments
        config, mask = bound.get("config"), bound.get("response_mask")
        kind = policy_loss_kind(self.name, self.fn, config)
        loss, metrics = self.fn(*args, **kwargs)
        if kind is Kind.ADDITIVE:
            return loss, metrics
        info = getattr(config, "global_batch_info", {}) or {}
        if kind is Kind.SAMPLE_MEAN:
            total, part, what = info.get("global_batch_size"), mask.shape[0], "global_batch_size"
        else:
            total, part, what = info.get("batch_num_tokens"), mask.sum(), "batch_num_tokens"
        if total is None or float(total) <= 0:
            raise ValueError(f"policy loss {self.name} is a {kind.value} of each call; hdp scales it to the mini-batch "
                             f"by {what}, which this batch does not carry ({what}={total!r})")
        return loss * (part / float(total)), metrics


def normalised_policy_losses(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (registered as ``name``) with hdp's normalisation (the wrap that
    :func:`hdp.integrations.verl.patches.policy_losses_wrapped` applies to the registry)."""
    return _Normalised(name, fn)


# ---- the whole loss on the mini-batch's own samples -----------------------------------------------------------


def _pick_pair(lengths: Sequence[int]) -> tuple[int, int]:
    """Two samples whose loss calls pad to different widths where the batch has them: the shortest and the
    longest response (the first two samples when all are equal)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    lo, hi = order[0], order[-1]
    return (lo, hi) if lo != hi else (0, 1)


def check_additive(run: Callable[[Sequence[int], torch.Tensor], torch.Tensor], lengths: Sequence[int],
                   response_lengths: Sequence[int], width: int, *, what: str, keys: str) -> bool:
    """Check that ``run(samples, outputs)`` — the loss hdp computes for a group of ``samples`` from per-token
    model outputs ``outputs`` [Σ L_i, width] (the group's samples whole, in order) — is additive over two of
    the mini-batch's samples: the shortest and the longest response (``response_lengths``), values and
    gradients, with outputs drawn from a fixed seed.  ``lengths``: L_i of every sample.  Raises
    `LossNotAdditiveError` naming ``what`` and ``keys``, or `LossCollectiveError` when the loss runs a
    collective.  A loss that raises, needs no gradient or is not finite on these outputs is not judged here
    (the rounds' own checks and the step's non-finite rules handle it).  Run on every rank inside the pass's agreement, before any round.  Returns whether the check
    was conclusive for the padded width too: the two samples' responses differ in length (a caller may then
    trust the verdict for the same loss and batch fields; with equal lengths it should check again)."""
    if len(lengths) < 2:
        return False
    a, b = _pick_pair(list(response_lengths))
    g = torch.Generator().manual_seed(1234)
    outs = {i: (-(0.05 + 3.0 * torch.rand(lengths[i], width, generator=g, dtype=torch.float64))) for i in (a, b)}
    leaf = torch.cat([outs[a], outs[b]]).requires_grad_()  # [L_a + L_b, width]
    parts = {a: leaf[: lengths[a]], b: leaf[lengths[a]:]}
    vals: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for name, samples in (("a", [a]), ("b", [b]), ("u", [a, b])):
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(0)
            try:
                with collectives_refused():
                    loss = run(samples, torch.cat([parts[i] for i in samples]))
            except LossCollectiveError as exc:
                raise LossCollectiveError(f"{what} runs a collective ({exc}) inside the loss: hdp runs the loss on "
                                          "CP-group leaders only, a different number of times on each rank, so the "
                                          f"ranks would wait in different collectives; refused ({keys})") from None
            except LossNotAdditiveError:
                raise  # a policy loss refused by its kind (`policy_loss_kind`)
            except Exception:  # noqa: BLE001 - a loss failing here fails in its rounds too, with their error rules
                return False
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return False  # no gradient to compare: the rounds' own check of the loss names it
        vals[name] = loss.detach().to(torch.float64)
        (gr,) = torch.autograd.grad(loss, leaf, allow_unused=True)
        grads[name] = torch.zeros_like(leaf) if gr is None else gr
    if not all(bool(torch.isfinite(x).all()) for x in (*vals.values(), *grads.values())):
        return False  # a loss that is not finite here says nothing of its kind; the step's NaN rules judge it
    scale = max(float(v.abs()) for v in vals.values()) or 1.0
    gscale = max(float(x.abs().max()) for x in grads.values()) or 1.0
    dv = abs(float(vals["u"] - vals["a"] - vals["b"])) / scale
    dg = float((grads["u"] - grads["a"] - grads["b"]).abs().max()) / gscale
    if not (dv <= RTOL and dg <= RTOL):
        raise LossNotAdditiveError(
            f"{what} is not additive over samples under this config: on samples {a} and {b} of this mini-batch the "
            f"loss of both together is {float(vals['u']):.6g}, the sum of their losses apart {float(vals['a'] + vals['b']):.6g} "
            f"(relative {dv:.2g}; gradients differ by {dg:.2g} of their largest entry). hdp computes the loss once per "
            f"CP group and adds the groups, so the update would depend on its plan; refused. Keys: {keys}")
    return response_lengths[a] != response_lengths[b]


# ---- config time (the driver) ------------------------------------------------------------------------------


def check_job_losses(actor: Any, critic: Any = None, *, bypass_loss: Any = None) -> None:
    """The losses of a verl job whose roles run on hdp, checked at config time in the driver (before Ray
    starts): the actor's policy loss (`policy_loss_kind`; ``actor`` is verl's actor config dataclass), its
    aggregation where the entropy bonus or the KL loss use it, and the critic's (``critic``: verl's critic
    config, or None).  ``bypass_loss``: ``algorithm.rollout_correction`` when the trainer runs verl's
    ``bypass_mode`` policy loss with it (verl's legacy trainer turns bypass mode into that loss); with
    batch-normalised IS weights that loss all-reduces over the world group inside each call — on the driver
    torch.distributed is not initialised, so the probe would not see it: refused by its option here (the
    workers' probe sees the collective itself)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    key = "actor_rollout_ref.actor"
    if bypass_loss is not None:
        get = (lambda k: bypass_loss.get(k, None)) if hasattr(bypass_loss, "get") else (lambda k: getattr(bypass_loss, k, None))
        if get("rollout_is") and get("rollout_is_batch_normalize"):
            raise LossCollectiveError(_collective_message("bypass_mode", _WithCorrection(bypass_loss), key, "all_reduce"))
    if actor is not None:
        mode = "bypass_mode" if bypass_loss is not None else str(
            actor.policy_loss.get("loss_mode", "vanilla") if hasattr(actor.policy_loss, "get")
            else getattr(actor.policy_loss, "loss_mode", "vanilla"))
        if mode != "bypass_mode":  # bypass_mode's kind depends on the correction config the trainer passes it
            policy_loss_kind(mode, get_policy_loss_fn(mode), actor, key=key)
        if float(getattr(actor, "entropy_coeff", 0.0) or 0.0) != 0.0 or bool(getattr(actor, "use_kl_loss", False)):
            aggregation_kind(actor.loss_agg_mode, actor.loss_scale_factor, key=key)
        if bool(getattr(actor, "use_kl_loss", False)):
            check_kl_loss_type(str(getattr(actor, "kl_loss_type", "low_var_kl")), key=key)
    if critic is not None:
        aggregation_kind(critic.loss_agg_mode, getattr(critic, "loss_scale_factor", None), key="critic")


def check_kl_loss_type(kl_loss_type: str, *, key: str) -> None:
    """verl's ``kl_penalty`` computes ``kl_loss_type`` (probed on a one-token batch), or a ``ValueError`` naming
    ``key.kl_loss_type``: verl accepts any string there and its engines, stock's included, fail only once an update
    runs (``full`` raises ``NotImplementedError`` in verl 0.9.1)."""
    from verl.trainer.ppo.core_algos import kl_penalty

    x = torch.zeros(1, 1, dtype=torch.float64)
    try:
        kl_penalty(logprob=x, ref_logprob=x, kl_penalty=kl_loss_type)
    except Exception as exc:  # noqa: BLE001 - any failure of verl's function on this value refuses the value
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ValueError(f"{key}.kl_loss_type={kl_loss_type}: verl's kl_penalty cannot compute it ({why}); stock verl's "
                         f"engines fail on it too, once the update runs. Choose another {key}.kl_loss_type (k1, k2, k3, "
                         "abs, mse, low_var_kl, optionally with '+')") from exc


@dataclass(frozen=True)
class _WithCorrection:
    """A stand-in config carrying only ``policy_loss.rollout_correction`` (for `_collective_message`)."""

    rollout_correction: Any

    @property
    def policy_loss(self) -> Any:
        return self


def check_job_config(config: Any, *, critic: bool) -> None:
    """`check_job_losses` on verl's whole OmegaConf job config (the driver, after verl's ``validate_config``):
    the actor's loss when the actor runs on hdp, the critic's when the job has a critic on hdp."""
    from omegaconf import OmegaConf

    from verl.utils.config import omega_conf_to_dataclass

    def on_hdp(key: str) -> bool:
        strategy = OmegaConf.select(config, f"{key}.megatron.strategy", default=None) or \
            OmegaConf.select(config, f"{key}.strategy", default=None)
        return strategy == "hdp"

    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor) if on_hdp("actor_rollout_ref.actor") else None
    crit = omega_conf_to_dataclass(config.critic) if critic and on_hdp("critic") else None
    corr = OmegaConf.select(config, "algorithm.rollout_correction", default=None)
    legacy = not bool(OmegaConf.select(config, "trainer.use_v1", default=True))
    explicit = OmegaConf.select(config, "actor_rollout_ref.actor.policy_loss.loss_mode", default=None) == "bypass_mode"
    if actor is None:
        bypass = None
    elif explicit:  # the actor's own policy_loss.rollout_correction is what that loss reads
        bypass = OmegaConf.select(config, "actor_rollout_ref.actor.policy_loss.rollout_correction", default=None) or {}
    else:
        bypass = corr if legacy and corr is not None and corr.get("bypass_mode", False) else None
    check_job_losses(actor, crit, bypass_loss=bypass)
