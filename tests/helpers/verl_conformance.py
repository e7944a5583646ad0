"""The differential conformance harness: the same verl job through verl's worker path on hdp and on verl's
stock Megatron engine (CPU, 2 gloo ranks), compared.

One spawn of 2 ranks builds each role's two workers once — verl's ``ActorRolloutRefWorker`` (actor, ref) and
the critic's ``TrainingWorker``, on hdp (``model_engine=hdp``) and on stock (``model_engine=megatron``, its engine
on CPU through :mod:`hdp.integrations.verl.scaffolding.stock_megatron`) — from one tiny Qwen3 checkpoint, then
runs every `Case` on both: the weights and Adam's state are reset to the built ones before each case, the loss
config is the case's (verl reads it per call: ``partial(ppo_loss, config=...)``), and the batch is built as
verl's trainer builds it from the case's config (`trainer_meta`: mini-batch size, epochs, seed, shuffle,
temperature, entropy; rollout correction on the driver).

Layouts: stock at DP 2, CP 1 (each rank its contiguous half of the batch, as verl's dispatch hands it, micro-
batches by its own budget); hdp over a domain of 2 (every rank the whole batch) with a token budget below the
longest sample, so its plan puts that sample on a CP group of 2.

What is compared (rank 0, after gathering stock's halves), each with its tolerance (float32, 2 layers):

* the update: every mini-batch's ``loss``, ``grad_norm``, ``lr``, and each parameter's change over the whole
  update (relative to the largest change: Adam moves every parameter by about ``lr``);
* log-prob passes: log-probs and entropies of every response token (``LOGP_TOL`` absolute), values for the
  critic (``VALUE_TOL``);
* every metric both report under verl's name (`compare_metrics`): ``SUM`` metrics (a share of the mini-batch's
  loss) equal; ``MEAN`` metrics and plain numbers against the mini-batch's own value — verl's loss function on
  the whole mini-batch in one call (``dp_size`` 1), from stock's own per-call outputs — which is hdp's
  documented definition (docs/verl.md "Metrics"), while stock's value is asserted to be the unweighted mean of
  its calls (micro-batches, then DP ranks) that verl's ``Metric.aggregate_dp`` computes.  Metrics that are not
  about the update (timing, memory, mfu, hdp's own ``hdp/*``) are listed in `NOT_COMPARED`.

Used by tests/distributed/verl/test_verl_conformance.py; the option table is tests/helpers/verl_options.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import pytest
import torch

from helpers.verl_main_ppo import _step_metrics as step_metrics

SAMPLES = [(5, 9), (3, 90), (7, 12), (4, 20), (6, 4), (2, 30), (5, 15), (3, 8)]
"""(prompt, response) lengths of the batch: 8 samples, sample 1 (93 tokens) longer than hdp's budget."""
HDP_BUDGET = 64
"""hdp's tokens per rank and round: the 93-token sample runs on a CP group of 2."""
STOCK_BUDGET = 128
"""Stock's ``ppo_max_token_len_per_gpu`` (CP 1: every sample must fit one rank); 2 micro-batches per rank."""

MOE_LAYERS = 2
"""Layers of the tiny Qwen3-MoE (4 experts, top-2) of the router-replay cases."""
LOGP_TOL = 2e-5
"""Log-probs / entropies, absolute (float32; packed zigzag chunks and ring attention against SDPA per sequence)."""
VALUE_TOL = 2e-5
"""Critic values, absolute."""
LOSS_RTOL = 2e-5
"""Losses and loss-share metrics, relative to max(1, |value|)."""
NORM_RTOL = 1e-4
"""Grad norms, relative."""
METRIC_RTOL = 2e-5
"""Mean metrics against the mini-batch's own value, relative to max(1e-3, |value|)."""
DELTA_RTOL = 1e-3
"""The parameters' change over the update, relative (L2 over all parameters; Adam moves each by about ``lr``)."""

NOT_COMPARED = ("perf/", "mfu", "hdp/")
"""Metric name prefixes not compared: time, memory and model-FLOPs figures, and hdp's own metrics."""


@dataclass(frozen=True)
class Case:
    """One differential case: verl config overrides applied to both jobs, and what to run."""

    id: str
    """Name (the option table refers to cases by it)."""
    overrides: tuple[str, ...] = ()
    """verl keys (Hydra dotted ``key=value``) for both engines' jobs."""
    stock: tuple[str, ...] = ()
    """verl keys for the stock job only (micro-batching hdp refuses: it packs by tokens)."""
    kind: str = "update"
    """``update`` (the actor's update), ``logprob`` (the actor's log-prob pass), ``ref`` (the reference's), ``critic``
    (the critic's values and update)."""
    bypass: str | None = None
    """The driver's bypass mode: ``v1`` (verl's v1 trainer: ``old_log_probs`` are the rollout's, the policy loss as
    configured) or ``legacy`` (verl's ``RayPPOTrainer``: ``apply_bypass_mode``, whose ``bypass_mode`` policy loss
    reads ``algorithm.rollout_correction``)."""
    dist_tier: bool = False
    """In the default ``dist`` tier (a representative slice); else ``slow``."""
    nonfinite: bool = False
    """The case's loss is not finite on both engines (every token rejected: verl's loss divides 0 by 0 tokens).
    Documented definitions differ there (docs/verl.md, "Metrics"): hdp skips the update on every rank and reports
    ``grad_norm`` NaN (``hdp/nonfinite_skipped`` 1, as verl's FSDP engine); stock's Megatron optimizer steps on
    the zero gradient and reports 0.  Checked: neither changes the weights, and each reports its own definition."""


def o(*pairs: str) -> tuple[str, ...]:
    """``actor_rollout_ref.actor.`` + each pair (the actor's keys, shortened in the case table)."""
    return tuple(f"actor_rollout_ref.actor.{p}" for p in pairs)


def _c(*pairs: str) -> tuple[str, ...]:
    return tuple(f"critic.{p}" for p in pairs)


_IS = "algorithm.rollout_correction."
_PL = "actor_rollout_ref.actor.policy_loss."


_RS_THRESHOLDS = {"token_k1": "0.5_2.0", "token": "0.15", "seq_mean_k1": "0.8_1.25", "seq_mean": "0.3",
                  "seq_sum_k1": "0.2_5.0", "seq_sum": "4.0", "seq_max_k2": "2.0", "seq_max": "4.0"}
"""Rejection thresholds per ``rollout_rs`` option (most specific first: the option, then its level) that keep part
of the suite's batch (checked by each case)."""


def _rs_threshold(option: str) -> str:
    """A rejection threshold for verl's ``rollout_rs`` option (``*_k1``: ratio bounds ``lower_upper``; else an upper
    bound of the divergence) that rejects some samples or tokens of the suite's batch, not all (an option verl
    adds gets its level's)."""
    level = option.rsplit("_", 1)[0]
    return _RS_THRESHOLDS.get(option, _RS_THRESHOLDS.get(level, "0.5_2.0" if option.endswith("k1") else "1.0"))


def _cases() -> list[Case]:
    """The suite: fixed cases and one per covered value of the option table's registries and choice lists
    (tests/helpers/verl_options.py `VALUES`, checked there against verl's own)."""
    import helpers.verl_options as T

    m = "actor_rollout_ref.actor.megatron."
    cases = [
        Case("logprob", kind="logprob", dist_tier=True),
        Case("logprob-temperature", ("actor_rollout_ref.rollout.temperature=0.7",), kind="logprob"),
        Case("logprob-sum-pi-squared", o("calculate_sum_pi_squared=true"), kind="logprob"),
        Case("logprob-fixed-micro-batches", kind="logprob",
             stock=("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
                    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1")),
        Case("ref", kind="ref", dist_tier=True),
        Case("base", o("entropy_coeff=0.01", "use_kl_loss=true", "kl_loss_coef=0.1"), dist_tier=True),
        Case("no-entropy", o("entropy_coeff=0.0", "calculate_entropy=false")),
        Case("calculate-entropy", o("entropy_coeff=0.0", "calculate_entropy=true")),
        Case("temperature", ("actor_rollout_ref.rollout.temperature=0.7", *o("entropy_coeff=0.01"))),
        # the log-prob pass only: verl 0.9.1's chunked entropy fails in backward in its own engine (its
        # _VocabParallelEntropy.backward writes into logits that other chunks' views share)
        Case("entropy-chunking", o("entropy_from_logits_with_chunking=true", "entropy_from_logits_chunk_size=16"),
             kind="logprob"),
        Case("clip-ratio", o("clip_ratio=0.1")),
        Case("clip-low-high", o("clip_ratio_low=0.1", "clip_ratio_high=0.3"), dist_tier=True),
        Case("dual-clip", o("clip_ratio_c=1.5")),
        Case("epochs-minibatches", o("ppo_epochs=2", "ppo_mini_batch_size=4"), dist_tier=True),
        Case("shuffle", o("ppo_epochs=2", "ppo_mini_batch_size=4", "shuffle=true", "data_loader_seed=7")),
        Case("fixed-micro-batches", o("ppo_mini_batch_size=4"),
             stock=o("use_dynamic_bsz=false", "ppo_micro_batch_size_per_gpu=1", "ppo_max_token_len_per_gpu=null")),
        Case("dynamic-budget", o("ppo_mini_batch_size=4"), stock=o("ppo_max_token_len_per_gpu=96")),
        Case("stock-pad-to-length", o("entropy_coeff=0.01"), stock=(f"{m}pad_to_length=true", f"{m}pad_to_length_bucket=16")),
        Case("loss-scale-factor", o("loss_agg_mode=seq-mean-token-sum-norm", "loss_scale_factor=64")),
        Case("optim", o("optim.lr=3e-6", "optim.weight_decay=0.0", "optim.clip_grad=0.5", "optim.betas=[0.8,0.95]")),
        Case("sapo-tau", o("policy_loss.loss_mode=sapo", "tau_pos=0.5", "tau_neg=2.0")),
        Case("bypass-v1", o("entropy_coeff=0.01"), bypass="v1"),
        Case("critic", kind="critic", dist_tier=True),
        Case("critic-value-clip", _c("cliprange_value=0.2"), kind="critic"),
        Case("critic-epochs-shuffle", _c("ppo_epochs=2", "ppo_mini_batch_size=4", "shuffle=true", "data_loader_seed=7"),
             kind="critic"),
        Case("critic-fixed-micro-batches", _c("ppo_mini_batch_size=4"), kind="critic",
             stock=_c("use_dynamic_bsz=false", "ppo_micro_batch_size_per_gpu=1")),
        Case("critic-loss-scale-factor", _c("loss_agg_mode=seq-mean-token-sum-norm", "loss_scale_factor=64"),
             kind="critic"),
    ]
    def listed(name: str) -> list[str]:  # the table's covered values (a value verl adds needs an entry first)
        return [v for v, e in T.VALUES[name][1].items() if isinstance(e, T.Covered)]

    for agg in listed("loss_agg_mode"):
        if agg == "seq-mean-token-sum-norm":  # needs loss_scale_factor: the loss-scale-factor cases
            continue
        cases.append(Case(f"agg-{agg}", o(f"loss_agg_mode={agg}", "entropy_coeff=0.01", "use_kl_loss=true"),
                          dist_tier=agg == "seq-mean-token-mean"))
        cases.append(Case(f"critic-agg-{agg}", _c(f"loss_agg_mode={agg}"), kind="critic"))
    for kl in listed("kl_loss_type"):
        cases.append(Case(f"kl-{kl}", o("use_kl_loss=true", "kl_loss_coef=0.5", f"kl_loss_type={kl}")))
    for mode in listed("policy_loss.loss_mode"):
        if mode == "bypass_mode":  # the bypass-* cases
            continue
        extra = ("policy_loss.dro_beta=0.1",) if mode == "dro" else ()
        # geo_mean is a mean over each call's rows: stock's loss is then its micro-batches' means added, and
        # equals hdp's (the mean over the mini-batch) when each DP rank trains one micro-batch of an equal share
        # (docs/verl.md "Loss kinds"); with more micro-batches stock's objective grows with their count
        stock = o("use_dynamic_bsz=false", "ppo_micro_batch_size_per_gpu=4") if mode == "geo_mean" else ()
        cases.append(Case(f"loss-{mode}", o(f"policy_loss.loss_mode={mode}", *extra, "entropy_coeff=0.01"), stock=stock,
                          dist_tier=mode in ("geo_mean", "gspo")))
    for level in listed("rollout_correction.rollout_is"):
        cases.append(Case(f"rollout-is-{level}", (f"{_IS}rollout_is={level}", f"{_IS}rollout_is_threshold=1.5"),
                          dist_tier=level == "sequence"))
    for rs in listed("rollout_correction.rollout_rs"):
        cases.append(Case(f"rollout-rs-{rs}", (f"{_IS}rollout_is=token", f"{_IS}rollout_rs={rs}",
                                               f"{_IS}rollout_rs_threshold={_rs_threshold(rs)}")))
    cases.append(Case("rollout-rs-reject-all", (f"{_IS}rollout_is=token", f"{_IS}rollout_rs=seq_sum_k2",
                                                f"{_IS}rollout_rs_threshold=0.01"), nonfinite=True))
    cases.append(Case("rollout-is-batch-normalize", (f"{_IS}rollout_is=sequence", f"{_IS}rollout_is_batch_normalize=true")))
    for loss_type in listed("rollout_correction.loss_type"):
        for level in listed("rollout_correction.rollout_is"):
            keys = ["bypass_mode=true", f"rollout_is={level}", f"loss_type={loss_type}", "rollout_is_threshold=1.5"]
            if level == "sequence":  # with rejection sampling too
                keys += ["rollout_rs=seq_mean_k1", "rollout_rs_threshold=0.8_1.25"]
            cases.append(Case(f"bypass-{loss_type}-{level}", tuple(_IS + k for k in keys), bypass="legacy",
                              dist_tier=(loss_type, level) == ("reinforce", "sequence")))
    cases += [Case("router-replay-r3", kind="r3", dist_tier=True), Case("router-replay-r2", kind="r2"),
              Case("checkpoint", o("entropy_coeff=0.01", "use_kl_loss=true", "checkpoint.save_contents=[model,optimizer,extra]"),
                   kind="checkpoint")]
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), ids
    return cases


CASES: dict[str, Case] = {}
"""Every case by id (filled on first use: the policy losses come from verl's registry)."""


def cases() -> dict[str, Case]:
    if not CASES:
        CASES.update({c.id: c for c in _cases()})
    return CASES


# ---- checks -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One comparison: what, both values, the bound, whether it holds."""

    what: str
    hdp: float
    stock: float
    bound: float
    ok: bool
    labels: tuple[str, str] = ("hdp", "stock")
    """What the two values are (hdp's and stock's unless the check compares something else)."""

    def __str__(self) -> str:
        a, b = self.labels
        return f"{'ok ' if self.ok else 'BAD'} {self.what}: {a} {self.hdp:.9g} {b} {self.stock:.9g} (bound {self.bound:.3g})"


def _close(what: str, a: float, b: float, rtol: float, floor: float = 1.0,
           labels: tuple[str, str] = ("hdp", "stock")) -> Check:
    bound = rtol * max(floor, abs(b))
    ok = abs(a - b) <= bound or (a != a and b != b)
    return Check(what, float(a), float(b), bound, ok, labels)


def _tensors_close(what: str, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], atol: float) -> Check:
    if len(a) != len(b):
        return Check(f"{what} (count {len(a)} vs {len(b)})", float(len(a)), float(len(b)), 0.0, False)
    worst = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return Check(f"{what} (shapes {tuple(x.shape)} vs {tuple(y.shape)})", 0.0, 0.0, 0.0, False)
        if x.numel():
            worst = max(worst, float((x.double() - y.double()).abs().max()))
    return Check(f"{what}: max |diff|", worst, 0.0, atol, worst <= atol)


# ---- the batch, as verl's trainer builds it ----------------------------------------------------------------


def trainer_meta(cfg: Any) -> dict[str, Any]:
    """The update's batch settings verl's v1 trainer reads from the job config (``_update_actor``,
    verl/trainer/ppo/v1/trainer_base.py): mini-batch size (× rollout.n), epochs, seed, shuffle, temperature,
    and whether the entropy is computed."""
    a = cfg.actor_rollout_ref.actor
    mini = int(a.ppo_mini_batch_size) * int(cfg.actor_rollout_ref.rollout.n)
    return dict(mini=mini, epochs=int(a.ppo_epochs), seed=int(a.data_loader_seed), shuffle=bool(a.shuffle),
                temperature=float(cfg.actor_rollout_ref.rollout.temperature),
                calculate_entropy=bool(a.calculate_entropy) or float(a.entropy_coeff) != 0.0)


def critic_meta(cfg: Any) -> dict[str, Any]:
    """``_update_critic``'s settings (the same file)."""
    c = cfg.critic
    return dict(mini=int(c.ppo_mini_batch_size) * int(cfg.actor_rollout_ref.rollout.n), epochs=int(c.ppo_epochs),
                seed=int(c.data_loader_seed), shuffle=bool(c.shuffle))


def _td(padded: dict[str, torch.Tensor], rows: Any, **meta: Any) -> Any:
    """verl's no-padding TensorDict of ``rows`` of the padded batch (``left_right_2_no_padding``), ``meta`` as
    non-tensor data (``temperature`` as the trainer passes it)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    from hdp.integrations.verl.scaffolding import padding

    padding.install()  # verl 0.9.0 on CPU: unpads through flash-attn only
    tensors = {k: v[rows] for k, v in padded.items()}
    td = tu.get_tensordict(tensor_dict=tensors, non_tensor_dict={"temperature": meta.pop("temperature", 1.0)})
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, **meta)
    return td


def update_td(padded: dict[str, torch.Tensor], rows: Any, meta: dict[str, Any]) -> Any:
    """``_update_actor``'s TensorDict of ``rows`` (``meta``: `trainer_meta`)."""
    return _td(padded, rows, temperature=meta["temperature"], calculate_entropy=meta["calculate_entropy"],
               distillation_use_topk=False, distillation_only=False, global_batch_size=meta["mini"],
               mini_batch_size=meta["mini"], epochs=meta["epochs"], seed=meta["seed"],
               dataloader_kwargs={"shuffle": meta["shuffle"]}, compute_loss=True)


def critic_td(padded: dict[str, torch.Tensor], rows: Any, meta: dict[str, Any]) -> Any:
    return _td(padded, rows, global_batch_size=meta["mini"], mini_batch_size=meta["mini"], epochs=meta["epochs"],
               seed=meta["seed"], dataloader_kwargs={"shuffle": meta["shuffle"]})


def base_batch(vocab: int) -> dict[str, torch.Tensor]:
    """The padded rollout batch (verl's layout) with ``sid`` (sample ids, for the stock recorder)."""
    from hdp.integrations.verl.scaffolding import batches as B

    padded = B.padded_batch(B.random_samples(SAMPLES, vocab, seed=1), pad_id=0)
    padded["sid"] = torch.arange(len(SAMPLES))
    return padded


def driver_fields(padded: dict[str, torch.Tensor], logp: torch.Tensor, cfg: Any, bypass: str | None) -> tuple[dict, dict]:
    """What verl's driver adds before the update (the same for both engines): ``old_log_probs`` (the actor's
    log-probs ``logp`` [S, R] perturbed, so PPO's ratio clips), ``rollout_log_probs``, ``ref_log_prob``,
    per-sample ``advantages``, and rollout correction as the v1 trainer applies it: decoupled mode (weights and
    rejection from ``compute_rollout_correction_and_add_to_batch``) or bypass (`Case.bypass`: ``old_log_probs`` :=
    rollout's; ``legacy``: verl's ``apply_bypass_mode``, which also points ``cfg``'s actor policy loss at
    ``bypass_mode`` with the correction config — ``cfg`` is changed in place).  Returns (the padded batch with
    them, the driver's ``rollout_corr/*`` metrics)."""
    from omegaconf import OmegaConf

    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    g = torch.Generator().manual_seed(3)
    mask = padded["response_mask"].float()
    shape = mask.shape
    noise = torch.randn(shape, generator=g) * 0.6
    old = (logp + noise) * mask
    rollout = (logp + torch.randn(shape, generator=g) * 0.3) * mask
    adv = (torch.randn(shape[0], 1, generator=g) * mask).expand(shape) * mask
    out = dict(padded)
    out.update(old_log_probs=old, rollout_log_probs=rollout, advantages=adv.contiguous(),
               ref_log_prob=(logp - 0.2 * torch.rand(shape, generator=g)) * mask)
    metrics: dict[str, Any] = {}
    corr = OmegaConf.select(cfg, "algorithm.rollout_correction", default=None)
    if bypass == "legacy":
        from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

        proto = DataProto.from_dict({"old_log_probs": out["old_log_probs"], "rollout_log_probs": out["rollout_log_probs"]})
        apply_bypass_mode(proto, corr, cfg.actor_rollout_ref.actor.policy_loss)
        out["old_log_probs"] = proto.batch["old_log_probs"]
    elif bypass == "v1":
        out["old_log_probs"] = out["rollout_log_probs"]
    elif corr is not None and (corr.get("rollout_is") or corr.get("rollout_rs")):
        proto = DataProto.from_dict({k: v for k, v in out.items() if v.dim() == 2 and k in (
            "old_log_probs", "rollout_log_probs", "response_mask")})
        proto, metrics = compute_rollout_correction_and_add_to_batch(proto, corr)
        out["response_mask"] = proto.batch["response_mask"].to(padded["response_mask"].dtype)
        if corr.get("rollout_rs"):  # the fraction of response tokens rejection sampling keeps
            metrics["suite/kept_tokens"] = float(out["response_mask"].sum()) / float(padded["response_mask"].sum())
        if "rollout_is_weights" in proto.batch.keys():
            out["rollout_is_weights"] = proto.batch["rollout_is_weights"]
    return out, metrics


# ---- the stock recorder --------------------------------------------------------------------------------------


class Recorder:
    """verl's loss function as stock's engine calls it (once per micro-batch), each call's per-sample outputs,
    sample ids, micro-batch count and metrics kept (the reference of `compare_metrics`)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, []
        self.keywords = getattr(fn, "keywords", {})  # as a partial's (hdp and verl read .keywords["config"])
        self.func = getattr(fn, "func", fn)

    def __call__(self, model_output: Any, data: Any, dp_group: Any = None) -> Any:
        loss, metrics = self.fn(model_output=model_output, data=data, dp_group=dp_group)
        self.calls.append({
            "sid": [int(x) for x in data["sid"].tolist()],
            "n_micro": int(data["num_micro_batch"]),
            "outputs": {k: [t.detach().clone() for t in v.unbind()] for k, v in model_output.items()
                        if k in ("log_probs", "entropy", "values")},
            "metrics": {k: _plain(v) for k, v in metrics.items()},
        })
        return loss, metrics


def _mini_batches(calls: list[dict]) -> list[list[dict]]:
    """A rank's recorded calls grouped by mini-batch (each mini-batch's calls carry its micro-batch count)."""
    out, i = [], 0
    while i < len(calls):
        n = calls[i]["n_micro"]
        out.append(calls[i:i + n])
        i += n
    return out


def _metric_values(metrics: dict[str, Any], counts: Sequence[int]) -> dict[str, list[float]]:
    """A worker's update metrics as one float per mini-batch (``len(counts)`` of them).  verl's shapes: one
    value per name and mini-batch, except plain numbers (``kl_coef``, ``critic/vf_clipfrac``), which come once per
    loss call — every call of every mini-batch in one flat list, which verl's trainer averages; ``counts[k]``:
    the calls of mini-batch k (stock's, from its recorder), each run averaged here."""
    out = {}
    n = len(counts)
    for k, v in metrics.items():
        vals = [float(x) for x in (v if isinstance(v, list) else [v])]
        if len(vals) != n and len(vals) == sum(counts):
            edges = [sum(counts[:i]) for i in range(n + 1)]
            vals = [sum(vals[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]
        out[k] = vals
    return out


def compare_metrics(hdp: dict[str, Any], stock: dict[str, Any], calls: list[list[dict]], reference: list[dict],
                    prefix: str = "") -> list[Check]:
    """Every metric both report (see the module docstring); ``calls[r]``: stock rank r's recorded calls,
    ``reference[k]``: the metrics of verl's loss on mini-batch k whole (name -> (kind, aggregation, value))."""
    checks: list[Check] = []
    per_rank = [_mini_batches(c) for c in calls]
    n_mb = len(per_rank[0])
    h = _metric_values(hdp, [1] * n_mb)
    s = _metric_values(stock, [sum(len(r[mb]) for r in per_rank) for mb in range(n_mb)])
    ours = {k for k in h if not k.startswith(NOT_COMPARED)}
    theirs = {k for k in s if not k.startswith(NOT_COMPARED)}
    if ours != theirs:
        checks.append(Check(f"{prefix}metric names differ: hdp only {sorted(ours - theirs)}, stock only "
                            f"{sorted(theirs - ours)}", 0.0, 0.0, 0.0, False))
    for k in sorted(ours & theirs):
        if len(h[k]) != len(s[k]):
            checks.append(Check(f"{prefix}{k}: {len(h[k])} values vs {len(s[k])}", 0, 0, 0, False))
            continue
        for mb in range(len(s[k])):
            what = f"{prefix}{k}[mini-batch {mb}]"
            ref = reference[mb].get(k) if mb < len(reference) else None
            if k in ("loss", "grad_norm", "lr") or ref is None:
                rtol = NORM_RTOL if k == "grad_norm" else LOSS_RTOL
                checks.append(_close(what, h[k][mb], s[k][mb], rtol))
                continue
            kind, agg, want = ref
            if kind == "metric" and agg == "sum":
                checks.append(_close(what, h[k][mb], s[k][mb], LOSS_RTOL))
                checks.append(_close(f"{what} = the mini-batch's loss share", h[k][mb], want, LOSS_RTOL,
                                     labels=("hdp", "mini-batch")))
                continue
            # a mean or a plain number: hdp reports the mini-batch's own value; stock the unweighted mean of its calls
            checks.append(_close(f"{what} = the mini-batch's own value", h[k][mb], want, METRIC_RTOL, floor=1e-3,
                                 labels=("hdp", "mini-batch")))
            ranks = [sum(c["metrics"][k][2] for c in r[mb]) / len(r[mb]) for r in per_rank if k in r[mb][0]["metrics"]]
            stock_def = sum(ranks) / len(ranks)
            checks.append(_close(f"{what}: stock = the unweighted mean of its micro-batches and DP ranks", s[k][mb],
                                 stock_def, METRIC_RTOL, floor=1e-3, labels=("stock", "mean of its calls")))
    return checks


# ---- the rank ------------------------------------------------------------------------------------------------


COMMON = (
    "actor_rollout_ref.actor.entropy_coeff=0.0",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "algorithm.adv_estimator=grpo",
)
"""Both jobs' defaults beyond the scaffolding's (every case overrides from here)."""


def _critic_keys(model_path: str, budget: int, stock: bool) -> list[str]:
    # verl's megatron_critic.yaml lacks ppo_infer_max_token_len_per_gpu, which its critic worker's budgets read
    # (hdp's critic config sets it from forward_max_token_len_per_gpu)
    infer = "+critic.ppo_infer_max_token_len_per_gpu" if stock else "critic.ppo_infer_max_token_len_per_gpu"
    return [f"critic.model.path={model_path}", "critic.model.use_remove_padding=True", "critic.megatron.dtype=float32",
            f"critic.ppo_max_token_len_per_gpu={budget}", f"{infer}={budget}",
            "critic.ppo_mini_batch_size=8", "critic.optim.lr=1e-6", "critic.optim.total_training_steps=100",
            "critic.cliprange_value=0.5",
            "critic.megatron.vanilla_mbridge=true"]


def compose_jobs(model_path: str, moe: bool = False) -> tuple[Any, Any]:
    """(hdp's job config, stock's): verl's ``ppo_trainer`` with ``model_engine=hdp`` / ``megatron``; ``moe``: the
    MoE model's jobs, with verl's router replay on (R3; `Rank._replay` switches to R2)."""
    from hdp.integrations.verl.scaffolding.stock_megatron import compose_stock
    from hdp.integrations.verl.scaffolding.worker import compose

    replay = ["actor_rollout_ref.actor.megatron.router_replay.mode=R3"] if moe else []
    hdp = compose(model_path, budget=HDP_BUDGET, records=None, overrides=[
        *COMMON, *replay, *_critic_keys(model_path, HDP_BUDGET, False),
        "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo", "actor_rollout_ref.actor.hdp.auto_calibrate=false",
        "actor_rollout_ref.actor.hdp.measure_memory=false"])
    stock = compose_stock(model_path, budget=STOCK_BUDGET, overrides=[*COMMON, *replay,
                                                                       *_critic_keys(model_path, STOCK_BUDGET, True)])
    return hdp, stock


def with_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
    """``cfg`` with Hydra-style ``key=value`` overrides merged (existing keys)."""
    from omegaconf import OmegaConf

    out = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    OmegaConf.resolve(out)
    return out


def _engine_settings(base: Any, cfg: Any, section: str) -> dict[str, Any]:
    """The engine settings (``section``: ``actor_rollout_ref.actor.megatron`` / ``critic.megatron``) in which the
    case's job ``cfg`` differs from the built one ``base``: settings verl's engines read on every pass
    (``pad_to_length``, ``entropy_from_logits_*``), applied to the built engine for the case (`_applied`)."""
    from omegaconf import OmegaConf

    a, b = OmegaConf.select(base, section), OmegaConf.select(cfg, section)
    return {k: b[k] for k in b if k in a and not OmegaConf.is_config(b[k]) and a[k] != b[k]}


@contextlib.contextmanager
def _applied(engine: Any, settings: dict[str, Any]) -> Iterator[None]:
    """``settings`` on ``engine.engine_config`` for the duration of a case."""
    saved = {k: getattr(engine.engine_config, k) for k in settings}
    for k, v in settings.items():
        object.__setattr__(engine.engine_config, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            object.__setattr__(engine.engine_config, k, v)


def _stock_batching(td: Any, switch: Any, micro: Any, budget: Any) -> None:
    """Stock's micro-batching keys on a batch (verl's worker fills them from its engine config only when absent)."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(td, use_dynamic_bsz=bool(switch), micro_batch_size_per_gpu=micro, max_token_len_per_gpu=budget)


@dataclass
class Side:
    """One engine's workers in this rank, built lazily, and their built state (for the reset)."""

    name: str
    cfg: Any
    actor: Any = None
    ref: Any = None
    critic: Any = None
    critic_cfg: Any = None
    saved: dict[str, Any] = field(default_factory=dict)

    def training(self, role: str) -> Any:
        """The role's TrainingWorker (``actor`` / ``critic``)."""
        return self.actor.actor if role == "actor" else self.critic


def _snapshot(worker: Any) -> dict[str, Any]:
    from hdp.core.optim_state import optimizers

    eng = worker.engine
    params = [p.detach().clone() for chunk in eng.module for p in chunk.parameters()]
    states = []
    for opt in optimizers(eng.optimizer):
        inner = opt.optimizer
        states.append({id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in inner.state[p].items()}
                       for g in inner.param_groups for p in g["params"] if p in inner.state})
    sched = getattr(eng, "lr_scheduler", None)
    return {"params": params, "opt": states, "sched": getattr(sched, "num_steps", None)}


def _restore(worker: Any, saved: dict[str, Any]) -> None:
    """The weights, Adam's state and the LR schedule's step as built (every case starts from them)."""
    from hdp.core.optim_state import optimizers

    eng = worker.engine
    with torch.no_grad():
        for p, s in zip([p for chunk in eng.module for p in chunk.parameters()], saved["params"]):
            p.copy_(s)
    for opt, state in zip(optimizers(eng.optimizer), saved["opt"]):
        inner = opt.optimizer
        for g in inner.param_groups:
            for p in g["params"]:
                inner.state.pop(p, None)
                if id(p) in state:
                    inner.state[p] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state[id(p)].items()}
    sched = getattr(eng, "lr_scheduler", None)
    if sched is not None and saved["sched"] is not None:
        sched.num_steps = saved["sched"]
        sched.step(0)


def _params(worker: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in worker.engine.module for p in chunk.parameters()]


def _named(worker: Any) -> list[str]:
    return [n for chunk in worker.engine.module for n, _ in chunk.named_parameters()]


def _build(side: Side, role: str) -> None:
    """The role's worker of ``side`` (each from a copy of the job config: verl's worker rewrites the ref's section
    in place, ``ActorRolloutRefWorker.init_model``, and the cases read the job as written)."""
    import copy

    from hdp.integrations.verl.scaffolding.worker import actor_worker, critic_worker

    if role == "actor" and side.actor is None:
        side.actor = actor_worker(copy.deepcopy(side.cfg), role="actor")
        side.saved["actor"] = _snapshot(side.actor.actor)
    elif role == "ref" and side.ref is None:
        side.ref = actor_worker(copy.deepcopy(side.cfg), role="ref")
    elif role == "critic" and side.critic is None:
        side.critic, side.critic_cfg = critic_worker(side.cfg)
        side.saved["critic"] = _snapshot(side.critic)


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=dist.group.WORLD)
    return out


def _per_sample(out: Any, key: str, td: Any) -> list[torch.Tensor]:
    """A log-prob pass's ``key`` as per-sample response tensors (verl's ``no_padding_2_padding`` then each
    sample's response tokens)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    padded = no_padding_2_padding(tu.get(out, key), td).float()  # [S, R]
    mask = td["response_mask"]
    lens = mask.offsets().diff().tolist() if mask.is_nested else [mask.shape[1]] * mask.shape[0]
    return [padded[i, :n] for i, n in enumerate(lens)]


class Rank:
    """This rank's two sides and the case runner."""

    def __init__(self, rank: int, world: int, root: str, moe: bool = False) -> None:
        from hdp.integrations.verl.scaffolding import stock_megatron
        from hdp.integrations.verl.scaffolding.tiny import VOCAB
        from hdp.integrations.verl.scaffolding.worker import prepare_rank

        self.rank, self.world, self.moe, self.root = rank, world, moe, root
        self.model_path = prepare_rank(rank, world, root, moe=moe, layers=MOE_LAYERS if moe else 2)
        stock_megatron.install()
        hdp_cfg, stock_cfg = compose_jobs(self.model_path, moe=moe)
        self.hdp, self.stock = Side("hdp", hdp_cfg), Side("stock", stock_cfg)
        self.padded = base_batch(VOCAB)
        self.half = slice(rank * len(SAMPLES) // world, (rank + 1) * len(SAMPLES) // world)
        self._logp: torch.Tensor | None = None

    def ensure(self, role: str) -> None:
        # either builds Megatron's parallel state for both; with router replay stock last: each engine's
        # construction empties verl's process-global router registry (apply_router_replay_patch), whose routers
        # stock's engine sets its replay actions on (hdp's set their own, per model)
        order = (self.hdp, self.stock) if self.moe else (self.stock, self.hdp)
        for side in order:
            _build(side, "actor" if role in ("update", "logprob", "r2", "r3") else role)
        if role == "critic" and "critic_synced" not in self.hdp.saved:
            # the value head is initialised at random when each engine is built: both start from stock's
            self._sync(self.stock.critic, self.hdp.critic)
            self.hdp.saved["critic"] = _snapshot(self.hdp.critic)
            self.hdp.saved["critic_synced"] = True

    def _sync(self, src: Any, dst: Any) -> None:
        names_src, names_dst = _named(src), _named(dst)
        assert names_src == names_dst, (names_src, names_dst)
        with torch.no_grad():
            for p, s in zip([p for c in dst.engine.module for p in c.parameters()], _params(src)):
                p.copy_(s)

    def base_logp(self) -> torch.Tensor:
        """Stock's log-probs of the batch at the built weights [S, R] (the driver's old log-probs are made from them)."""
        if self._logp is None:
            self.ensure("logprob")
            _restore(self.stock.actor.actor, self.stock.saved["actor"])
            td = _td(self.padded, self.half, temperature=1.0, calculate_entropy=False, compute_loss=False)
            out = self.stock.actor.compute_log_prob(td)
            mine = _per_sample(out, "log_probs", td)
            every = [x for part in _gather(mine) for x in part]
            r = self.padded["responses"].shape[1]
            self._logp = torch.stack([torch.nn.functional.pad(x, (0, r - len(x))) for x in every])
        return self._logp

    # -- cases --

    def run(self, case: Case) -> list[Check]:
        if case.kind == "checkpoint":
            return self._checkpoint(case)
        if case.kind in ("r2", "r3"):
            return self._replay(case)
        if case.kind in ("logprob", "ref"):
            return self._logprob(case)
        if case.kind == "critic":
            return self._critic(case)
        return self._update(case)

    def _logprob(self, case: Case) -> list[Check]:
        role = "actor" if case.kind == "logprob" else "ref"
        self.ensure("logprob" if role == "actor" else "ref")
        cfgs = {"hdp": with_overrides(self.hdp.cfg, case.overrides),
                "stock": with_overrides(self.stock.cfg, (*case.overrides, *case.stock))}
        temp = float(cfgs["hdp"].actor_rollout_ref.rollout.temperature)
        spi = role == "actor" and bool(cfgs["hdp"].actor_rollout_ref.actor.calculate_sum_pi_squared)
        keys = ("log_probs",) + (("entropy",) if role == "actor" else ()) + (("sum_pi_squared",) if spi else ())
        checks = []
        outs = {}
        for side, rows in ((self.hdp, slice(None)), (self.stock, self.half)):
            td = _td(self.padded, rows, temperature=temp, calculate_entropy=role == "actor", compute_loss=False,
                     calculate_sum_pi_squared=spi)
            if side is self.stock:
                r = cfgs["stock"].actor_rollout_ref.rollout if role == "actor" else cfgs["stock"].actor_rollout_ref.ref
                _stock_batching(td, r.log_prob_use_dynamic_bsz, r.log_prob_micro_batch_size_per_gpu,
                                r.log_prob_max_token_len_per_gpu)
            if role == "actor":
                _restore(side.actor.actor, side.saved["actor"])
                with _applied(side.actor.actor.engine, _engine_settings(side.cfg, cfgs[side.name],
                                                                        "actor_rollout_ref.actor.megatron")):
                    out = side.actor.compute_log_prob(td)
            else:
                out = side.ref.compute_ref_log_prob(td)
            outs[side.name] = {k: (_per_sample(out, k, td) if out is not None else None) for k in keys}
        stock_parts = _gather(outs["stock"])
        if role == "actor":
            checks.append(self._cp_group())
        if self.rank != 0:
            return []
        for k in outs["hdp"]:
            stock_all = [x for part in stock_parts for x in part[k]]
            checks.append(_tensors_close(f"{role} {k}", outs["hdp"][k], stock_all, LOGP_TOL))
        return checks

    def _update(self, case: Case, extra: dict[str, torch.Tensor] | None = None,
                logp: torch.Tensor | None = None) -> list[Check]:
        """The actor's update on both (``extra``: padded fields the batch carries besides, e.g. ``routed_experts``;
        ``logp``: the log-probs the driver's fields are made from, stock's at the built weights by default)."""
        from functools import partial

        from verl.utils import tensordict_utils as tu
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.utils.losses import ppo_loss

        from hdp.integrations.verl.scaffolding import batches as B

        logp = self.base_logp() if logp is None else logp
        cfgs = {"hdp": with_overrides(self.hdp.cfg, case.overrides),
                "stock": with_overrides(self.stock.cfg, (*case.overrides, *case.stock))}
        padded, driver = driver_fields(self.padded, logp, cfgs["hdp"], case.bypass)
        padded.update(extra or {})
        driver_fields(self.padded, logp, cfgs["stock"], case.bypass)  # the same driver for the stock job's config
        meta = trainer_meta(cfgs["hdp"])
        results, deltas, recorders, loss_cfgs = {}, {}, {}, {}
        for side, rows in ((self.hdp, slice(None)), (self.stock, self.half)):
            cfg = cfgs[side.name]
            actor_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
            loss_cfgs[side.name] = actor_cfg
            fn = partial(ppo_loss, config=actor_cfg)
            if side is self.stock:
                fn = recorders["stock"] = Recorder(fn)
            worker = side.actor
            worker.loss_fn = fn
            worker.actor.set_loss_fn(fn)
            _restore(worker.actor, side.saved["actor"])
            before = _params(worker.actor)
            td = update_td(padded, rows, meta)
            if side is self.stock:  # stock's micro-batching from its own job config (the worker's defaults otherwise)
                a = cfg.actor_rollout_ref.actor
                _stock_batching(td, a.use_dynamic_bsz, a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu)
            settings = _engine_settings(side.cfg, cfg, "actor_rollout_ref.actor.megatron")
            with _applied(worker.actor.engine, settings):
                out = worker.update_actor(td)
            results[side.name] = tu.get(out, "metrics") if out is not None else None
            deltas[side.name] = [a - b for a, b in zip(_params(worker.actor), before)]
        calls = _gather(recorders["stock"].calls)
        if self.rank != 0:
            return []
        checks = [_deltas(deltas["hdp"], deltas["stock"], _named(self.stock.actor.actor))]
        if case.nonfinite:  # see Case.nonfinite
            h, st = _metric_values(results["hdp"], [1]), _metric_values(results["stock"], [1])
            return checks + [
                Check("every token rejected", driver.get("suite/kept_tokens", -1.0), 0.0, 0.0,
                      driver.get("suite/kept_tokens") == 0.0),
                Check("the loss is not finite on both", h["loss"][0], st["loss"][0], 0.0,
                      h["loss"][0] != h["loss"][0] and st["loss"][0] != st["loss"][0]),
                Check("hdp skips the update: grad_norm NaN, hdp/nonfinite_skipped 1", h["grad_norm"][0],
                      h["hdp/nonfinite_skipped"][0], 0.0,
                      h["grad_norm"][0] != h["grad_norm"][0] and h["hdp/nonfinite_skipped"][0] == 1.0),
                Check("stock's optimizer reports grad_norm 0", st["grad_norm"][0], 0.0, 0.0, st["grad_norm"][0] == 0.0),
                Check("neither changes the weights (largest change, hdp / stock)",
                      max(float(d.abs().max()) for d in deltas["hdp"]), max(float(d.abs().max()) for d in deltas["stock"]),
                      0.0, all(not bool(d.any()) for d in deltas["hdp"] + deltas["stock"]))]
        if "suite/kept_tokens" in driver:  # rejection sampling: some tokens rejected, not all
            kept = driver["suite/kept_tokens"]
            checks.append(Check("the driver's rejection sampling keeps part of the response tokens (fraction kept)",
                                kept, 0.0, 0.0, 0.0 < kept < 1.0))
        # the reference: verl's loss on each stock mini-batch whole, from stock's own per-call outputs
        reference = []
        for mb in range(len(_mini_batches(calls[0]))):
            parts = [c for r in calls for c in _mini_batches(r)[mb]]
            sids = [s for c in parts for s in c["sid"]]
            outs = {k: [t for c in parts for t in c["outputs"].get(k, [])] for k in ("log_probs", "entropy")}
            order = sorted(range(len(sids)), key=lambda i: sids[i])
            data = update_td(padded, [sids[i] for i in order], dict(meta, mini=len(sids)))
            per = {k: [v[i] for i in order] for k, v in outs.items() if v}
            cfg = omega_conf_to_dataclass(cfgs["stock"].actor_rollout_ref.actor)
            _, m = B.whole_batch_loss(partial(ppo_loss, config=cfg), data, **per)
            reference.append({k: _plain(v) for k, v in m.items()})
        checks += compare_metrics(results["hdp"], results["stock"], calls, reference)
        return checks

    def _routes(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Random routes (top-2 of a random permutation per token and layer, unlike the native ones): S x [L_i,
        layers, K] int16, and verl's padded ``routed_experts`` [S, P + R, layers, K]."""
        from hdp.integrations.verl.scaffolding import batches as B
        from hdp.integrations.verl.scaffolding.tiny import VOCAB

        samples = B.random_samples(SAMPLES, VOCAB, seed=1)
        g = torch.Generator().manual_seed(7)
        experts, topk = 4, 2
        routes = [torch.stack([torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(MOE_LAYERS)])
                               for _ in range(p + r)]).to(torch.int16) for p, r in SAMPLES]
        return routes, self._padded_routes(samples, routes)

    def _padded_routes(self, samples: Any, routes: Sequence[torch.Tensor]) -> torch.Tensor:
        pmax = self.padded["prompts"].shape[1]
        out = torch.zeros((len(routes), self.padded["input_ids"].shape[1], *routes[0].shape[1:]), dtype=torch.int16)
        for i, ((p, r), x) in enumerate(zip(SAMPLES, routes)):
            out[i, pmax - p: pmax + r] = x
        return out

    def _cp_group(self) -> Check:
        """hdp's plan of the batch puts a sample on a CP group (the case runs hdp's CP path)."""
        from hdp.integrations.verl.batch import sample_lengths

        td = _td(self.padded, slice(None), temperature=1.0, compute_loss=False)
        widest = max(self.hdp.actor.actor.engine.planner.plan(sample_lengths(td)).group_size)
        return Check("hdp's plan of the batch has a CP group (largest group size)", float(widest), 2.0, 0.0, widest > 1)

    def _set_mode(self, mode: str) -> None:
        """verl's router replay mode on both actors' engines (verl's engines and hdp's read it per pass)."""
        for side in (self.hdp, self.stock):
            object.__setattr__(side.actor.actor.engine.engine_config.router_replay, "mode", mode)

    def _replay(self, case: Case) -> list[Check]:
        """MoE router replay: R3 (the rollout's routes with the batch, replayed in every pass) or R2 (routes
        recorded by the log-prob pass, replayed in the update), the log-prob pass and the update on both."""
        from verl.utils import tensordict_utils as tu

        self.ensure("r3")
        mode = case.kind.upper()
        self._set_mode(mode)
        checks = []
        outs = {}
        routes = padded_routes = None
        if mode == "R3":
            routes, padded_routes = self._routes()
        for side, rows in ((self.hdp, slice(None)), (self.stock, self.half)):
            _restore(side.actor.actor, side.saved["actor"])
            padded = dict(self.padded)
            if padded_routes is not None:
                padded["routed_experts"] = padded_routes
            td = _td(padded, rows, temperature=1.0, calculate_entropy=True, compute_loss=False)
            out = side.actor.compute_log_prob(td)
            got = {}
            if out is not None:
                got = {k: _per_sample(out, k, td) for k in ("log_probs", "entropy")}
                if mode == "R2":
                    got["routed_experts"] = [x.to(torch.int64).sort(dim=-1).values for x in tu.get(out, "routed_experts").unbind()]
            outs[side.name] = got
        stock_parts = _gather(outs["stock"])
        stock_all = {k: [x for part in stock_parts for x in part[k]] for k in outs["hdp"]} if self.rank == 0 else None
        if mode == "R2":  # every rank replays the routes stock recorded
            recorded = _gather(stock_all["routed_experts"] if self.rank == 0 else None)[0]
            padded_routes = self._padded_routes(None, [x.to(torch.int16) for x in recorded])
            if self.rank == 0:
                same = all(torch.equal(a, b) for a, b in zip(outs["hdp"]["routed_experts"], stock_all["routed_experts"]))
                checks.append(Check("R2: the routes the log-prob pass recorded (top-2 sets per token and layer) equal",
                                    float(same), 1.0, 0.0, same and len(outs["hdp"]["routed_experts"]) == len(SAMPLES)))
        logp_parts = _gather(outs["stock"]["log_probs"])
        r = self.padded["responses"].shape[1]
        logp = torch.stack([torch.nn.functional.pad(x, (0, r - len(x))) for part in logp_parts for x in part])
        if self.rank == 0:
            for k in ("log_probs", "entropy"):
                checks.append(_tensors_close(f"{mode} actor {k}", outs["hdp"][k], stock_all[k], LOGP_TOL))
        if mode == "R3":  # the routes were followed: native routing gives other log-probs
            self._set_mode("disabled")
            td = _td(self.padded, slice(None), temperature=1.0, calculate_entropy=False, compute_loss=False)
            native = self.hdp.actor.compute_log_prob(td)
            self._set_mode(mode)
            if self.rank == 0:
                moved = max(float((a - b).abs().max()) for a, b in zip(_per_sample(native, "log_probs", td),
                                                                       outs["hdp"]["log_probs"]))
                checks.append(Check("R3: replayed routes move the log-probs off native routing's by more than 1e-3",
                                    moved, 0.0, 1e-3, moved > 1e-3))
        checks.append(self._cp_group())
        checks += self._update(case, extra={"routed_experts": padded_routes}, logp=logp)
        return checks if self.rank == 0 else []

    def _checkpoint(self, case: Case) -> list[Check]:
        """verl's checkpoint on both: an update, ``save_checkpoint``, a second update, ``load_checkpoint``, the
        second update again.  Each engine's continuation is its uninterrupted update bit for bit (metrics and
        weights), and hdp's second update is stock's (parameter changes, loss, grad norm)."""
        from functools import partial

        from verl.utils import tensordict_utils as tu
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.utils.losses import ppo_loss

        self.ensure("update")
        cfg = with_overrides(self.hdp.cfg, case.overrides)
        padded, _ = driver_fields(self.padded, self.base_logp(), cfg, None)
        meta = trainer_meta(cfg)
        got: dict[str, Any] = {}
        for side, rows in ((self.hdp, slice(None)), (self.stock, self.half)):
            worker = side.actor
            fn = partial(ppo_loss, config=omega_conf_to_dataclass(with_overrides(side.cfg, case.overrides).actor_rollout_ref.actor))
            worker.loss_fn = fn
            worker.actor.set_loss_fn(fn)
            _restore(worker.actor, side.saved["actor"])

            def step() -> tuple[Any, list[torch.Tensor]]:
                out = worker.update_actor(update_td(padded, rows, meta))
                m = tu.get(out, "metrics") if out is not None else None
                return (None if m is None else (m["loss"], m["grad_norm"])), _params(worker.actor)

            step()
            path = os.path.join(self.root, f"ckpt-{side.name}")
            worker.save_checkpoint(path, global_step=1)
            at_save = _params(worker.actor)
            m2, w2 = step()
            worker.load_checkpoint(path, del_local_after_load=False)
            loaded = _params(worker.actor)
            m2b, w2b = step()
            got[side.name] = dict(m2=m2, m2b=m2b, exact_load=all(torch.equal(a, b) for a, b in zip(at_save, loaded)),
                                  exact=all(torch.equal(a, b) for a, b in zip(w2, w2b)),
                                  delta=[a - b for a, b in zip(w2b, loaded)])
        if self.rank != 0:
            return []
        checks = []
        for name, g in got.items():
            checks.append(Check(f"{name}: load_checkpoint restores the saved weights bit for bit", float(g["exact_load"]),
                                1.0, 0.0, g["exact_load"]))
            checks.append(Check(f"{name}: the update after the load equals the uninterrupted one bit for bit (weights "
                                f"and loss, grad norm {g['m2']} / {g['m2b']})", float(g["exact"]), 1.0, 0.0,
                                g["exact"] and g["m2"] == g["m2b"]))
        checks.append(_deltas(got["hdp"]["delta"], got["stock"]["delta"], _named(self.stock.actor.actor)))
        (hl, hg), (sl, sg) = got["hdp"]["m2b"], got["stock"]["m2b"]
        checks.append(_close("loss of the update after the load", float(hl[0]), float(sl[0]), LOSS_RTOL))
        checks.append(_close("grad_norm of the update after the load", float(hg[0]), float(sg[0]), NORM_RTOL))
        return checks

    def _critic(self, case: Case) -> list[Check]:
        from functools import partial

        from verl.utils import tensordict_utils as tu
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.utils.losses import value_loss

        from hdp.integrations.verl.scaffolding import batches as B

        self.ensure("critic")
        cfgs = {"hdp": with_overrides(self.hdp.cfg, case.overrides),
                "stock": with_overrides(self.stock.cfg, (*case.overrides, *case.stock))}
        meta = critic_meta(cfgs["hdp"])
        # values at the built weights (both sides), then the update on returns drawn around stock's
        values = {}
        for side, rows in ((self.hdp, slice(None)), (self.stock, self.half)):
            _restore(side.critic, side.saved["critic"])
            td = _td(self.padded, rows, compute_loss=False)
            if side is self.stock:
                c = cfgs["stock"].critic  # verl's critic yaml has no infer micro-batch size: its worker's is the train one
                _stock_batching(td, c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu, c.ppo_infer_max_token_len_per_gpu)
            out = side.critic.infer_batch(td)
            values[side.name] = _per_sample(out, "values", td) if out is not None else None
        stock_parts = _gather(values["stock"])
        stock_values = [x for part in stock_parts for x in part]
        r = self.padded["responses"].shape[1]
        old = torch.stack([torch.nn.functional.pad(x, (0, r - len(x))) for x in stock_values])
        g = torch.Generator().manual_seed(5)
        mask = self.padded["response_mask"]
        padded = dict(self.padded)
        padded["values"] = (old + 0.8 * (2 * torch.rand(old.shape, generator=g) - 1)) * mask
        padded["returns"] = (old + 0.3 * torch.randn(old.shape, generator=g)) * mask
        results, deltas, recorders = {}, {}, {}
        for side, rows in ((self.hdp, slice(None)), (self.stock, self.half)):
            cfg = omega_conf_to_dataclass(cfgs[side.name].critic)
            fn = partial(value_loss, config=cfg)
            if side is self.stock:
                fn = recorders["stock"] = Recorder(fn)
            side.critic.set_loss_fn(fn)
            _restore(side.critic, side.saved["critic"])
            before = _params(side.critic)
            td = critic_td(padded, rows, meta)
            if side is self.stock:
                c = cfgs["stock"].critic
                _stock_batching(td, c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu, c.ppo_max_token_len_per_gpu)
            out = side.critic.train_mini_batch(td)
            results[side.name] = tu.get(out, "metrics") if out is not None else None
            deltas[side.name] = [a - b for a, b in zip(_params(side.critic), before)]
        calls = _gather(recorders["stock"].calls)
        if self.rank != 0:
            return []
        checks = [_tensors_close("critic values", values["hdp"], stock_values, VALUE_TOL), _deltas(deltas["hdp"], deltas["stock"], _named(self.stock.critic))]
        reference = []
        for mb in range(len(_mini_batches(calls[0]))):
            parts = [c for rk in calls for c in _mini_batches(rk)[mb]]
            sids = [s for c in parts for s in c["sid"]]
            vals = [t for c in parts for t in c["outputs"]["values"]]
            order = sorted(range(len(sids)), key=lambda i: sids[i])
            data = critic_td(padded, [sids[i] for i in order], dict(meta, mini=len(sids)))
            cfg = omega_conf_to_dataclass(cfgs["stock"].critic)
            _, m = B.whole_batch_loss(partial(value_loss, config=cfg), data, values=[vals[i] for i in order])
            reference.append({k: _plain(v) for k, v in m.items()})
        checks += compare_metrics(results["hdp"], results["stock"], calls, reference, prefix="critic ")
        return checks


def _plain(v: Any) -> tuple[str, Any, float]:
    from verl.utils.metric.utils import Metric

    if isinstance(v, Metric):
        return ("metric", v.aggregation.value, float(Metric._aggregate(v.values, v.aggregation)))
    return ("plain", None, float(v))


def _deltas(hdp: list[torch.Tensor], stock: list[torch.Tensor], names: Sequence[str] = ()) -> Check:
    """The change of every parameter over the update, hdp against stock: ||Δ_hdp − Δ_stock|| / ||Δ_stock|| over
    all parameters (Adam's step amplifies the round-off of gradients near its ``eps`` in single entries; the
    worst entry is named in the message)."""
    if len(hdp) != len(stock):
        return Check("parameter count", len(hdp), len(stock), 0, False)
    num = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(hdp, stock)) ** 0.5
    den = sum(float(b.double().pow(2).sum()) for b in stock) ** 0.5 or 1.0
    diffs = [float((a - b).abs().max()) for a, b in zip(hdp, stock)]
    i = max(range(len(diffs)), key=diffs.__getitem__)
    where = names[i] if i < len(names) else str(i)
    a, b = hdp[i].flatten(), stock[i].flatten()
    j = int((a - b).abs().argmax())
    return Check(f"parameter changes over the update: ||hdp - stock|| / ||stock|| (worst entry {where}[{j}]: "
                 f"{float(a[j]):.4g} vs {float(b[j]):.4g})", num / den, 0.0, DELTA_RTOL, num / den <= DELTA_RTOL)


def suite_worker(rank: int, world: int, root: str, ids: Sequence[str], moe: bool = False) -> dict[str, Any] | None:
    """Every case of ``ids`` on this rank (``moe``: the router-replay cases, on the MoE model); rank 0 returns
    {case id: [Check] or the error's traceback}."""
    import logging

    logging.getLogger("verl").setLevel(logging.ERROR)
    here = Rank(rank, world, root, moe=moe)
    out: dict[str, Any] = {}
    table = cases()
    for cid in ids:
        try:
            out[cid] = here.run(table[cid])
        except Exception:  # noqa: BLE001 - a case's error is its result (the others still run)
            out[cid] = traceback.format_exc()
    return out if rank == 0 else None


# ---- the loss-level slice (one process, no model) -----------------------------------------------------------------

LOSS_RTOL_FP64 = 1e-10
"""The loss-level slice's tolerance (float64 outputs; relative to the largest value or gradient entry)."""


def _micro_batches(rows: list[int], lengths: list[int], dynamic: bool, micro: Any, budget: Any) -> list[list[int]]:
    """Stock's micro-batches of one DP rank's ``rows``: ``micro`` samples each (fixed), or consecutive runs of at
    most ``budget`` tokens (dynamic; verl balances its runs, which additive losses do not see)."""
    if not dynamic:
        return [rows[i:i + int(micro)] for i in range(0, len(rows), int(micro))]
    out: list[list[int]] = [[]]
    for r in rows:
        if out[-1] and sum(lengths[i] for i in out[-1]) + lengths[r] > int(budget):
            out.append([])
        out[-1].append(r)
    return out


@functools.lru_cache(maxsize=1)
def _loss_level_job() -> Any:
    """The suite's hdp job without a model (the loss-level slice reads only its loss settings)."""
    from hdp.integrations.verl.scaffolding.worker import compose

    return compose("/tmp/none", budget=HDP_BUDGET, records=None, overrides=list(COMMON))


def loss_level(case: Case) -> list[Check]:
    """The case's loss on synthetic model outputs (float64), the first mini-batch: verl's loss function as stock's
    Megatron engine accounts for it — each DP rank's micro-batches with ``dp_size`` = DP and the mini-batch's
    ``batch_num_tokens``, added (Megatron scales each by the micro-batch count and divides it back), averaged over
    DP by DDP — against hdp's: verl's loss once per CP group of a plan (one sample alone, the rest in pairs), with
    ``dp_size`` 1 and hdp's normalisation of the policy losses that are a mean of their call
    (`hdp.integrations.verl.loss_kinds.normalised_policy_losses`), added.  Values and gradients with respect to
    every sample's log-probs and entropies."""
    from functools import partial

    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    from hdp.integrations.verl import compat, loss_kinds
    from hdp.integrations.verl.scaffolding.tiny import VOCAB

    base = _loss_level_job()
    cfg = with_overrides(base, case.overrides)
    stock_cfg = with_overrides(base, (*case.overrides, *case.stock))
    padded = base_batch(VOCAB)
    g = torch.Generator().manual_seed(11)
    logp = -(0.05 + 3 * torch.rand(padded["responses"].shape, generator=g)) * padded["response_mask"]
    padded, _ = driver_fields(padded, logp, cfg, case.bypass)
    driver_fields(base_batch(VOCAB), logp, stock_cfg, case.bypass)
    meta = trainer_meta(cfg)
    lengths = [p + r for p, r in SAMPLES]
    world, n = 2, len(SAMPLES)
    per_rank = meta["mini"] // world
    parts = [list(range(r * n // world, (r + 1) * n // world))[:per_rank] for r in range(world)]  # stock's first
    mini = sorted(s for part in parts for s in part)
    leaves = {k: [(-(0.05 + 3 * torch.rand(L, generator=g, dtype=torch.float64))).requires_grad_() for L in lengths]
              for k in ("log_probs", "entropy")}
    tokens = int(padded["response_mask"][mini].sum())

    def call(fn: Any, rows: list[int], dp: int) -> torch.Tensor:
        data = update_td(padded, rows, meta)
        tu.assign_non_tensor(data, dp_size=dp, batch_num_tokens=tokens, global_batch_size=meta["mini"])
        outs = {k: torch.nested.as_nested_tensor([v[i] for i in rows], layout=torch.jagged) for k, v in leaves.items()
                if k == "log_probs" or meta["calculate_entropy"]}
        return fn(model_output=outs, data=data)[0]

    stock_fn = partial(ppo_loss, config=omega_conf_to_dataclass(stock_cfg.actor_rollout_ref.actor))
    a = stock_cfg.actor_rollout_ref.actor
    stock = sum(call(stock_fn, m, world) for part in parts
                for m in _micro_batches(part, lengths, bool(a.use_dynamic_bsz), a.ppo_micro_batch_size_per_gpu,
                                        a.ppo_max_token_len_per_gpu)) / world
    hdp_fn = partial(ppo_loss, config=omega_conf_to_dataclass(cfg.actor_rollout_ref.actor))
    groups = [mini[:1]] + [mini[i:i + 2] for i in range(1, len(mini), 2)]
    with compat.policy_losses_wrapped(loss_kinds.normalised_policy_losses):
        hdp = sum(call(hdp_fn, grp, 1) for grp in groups)
    flat = [x for v in leaves.values() for x in v]
    gs = torch.autograd.grad(stock, flat, allow_unused=True)
    gh = torch.autograd.grad(hdp, flat, allow_unused=True)
    gs = [torch.zeros_like(x) if y is None else y for x, y in zip(flat, gs)]
    gh = [torch.zeros_like(x) if y is None else y for x, y in zip(flat, gh)]
    scale = max(float(x.abs().max()) for x in gs) or 1.0
    worst = max(float((x - y).abs().max()) for x, y in zip(gh, gs)) / scale
    return [_close("loss (float64, the first mini-batch)", float(hdp.detach()), float(stock.detach()), LOSS_RTOL_FP64),
            Check("gradient w.r.t. every sample's outputs: max |hdp - stock| / max |stock|", worst, 0.0, LOSS_RTOL_FP64,
                  worst <= LOSS_RTOL_FP64 and scale > 0)]


# ---- main_ppo: the whole trainer on both engines -------------------------------------------------------------------

MAIN_PPO_STEPS = 2
MAIN_PPO_HDP_BUDGET = 32
"""hdp's tokens per rank in the main_ppo case: the demo's samples (19-token prompts, up to 16 response tokens) are
longer, so its plans put them on CP groups of 2 (checked: ``actor/hdp/cp_degree_hist/2``)."""
MAIN_PPO_STOCK_BUDGET = 512
"""Stock's tokens per micro-batch: the whole mini-batch in one (stock runs at DP 1, so each of its metrics is the
mini-batch's own value — hdp's definition, docs/verl.md "Metrics")."""
MAIN_PPO_RTOL = 1e-4
"""Every logged metric, relative to max(1, |stock's|): two steps at ``lr`` 1e-3 (the demo's), float32: the second
step starts from weights that differ by the first update's round-off (its rollout, seeded per sample, generates
the same responses)."""
MAIN_PPO_NOT_COMPARED = ("timing_s/", "timing_per_token_ms/", "perf/", "global_seqlen/", "hdp/")
"""Not compared (name prefixes, after a role's ``actor/`` / ``critic/``): times, throughput, memory, model FLOPs, the
driver's per-DP-rank token balance (stock runs at DP 1, hdp at 2), hdp's own metrics."""


def _main_ppo_compared(name: str) -> bool:
    bare = name.split("/", 1)[1] if name.startswith(("actor/", "critic/")) else name
    return not bare.startswith(MAIN_PPO_NOT_COMPARED)


MAIN_PPO_CASE = ("actor_rollout_ref.actor.entropy_coeff=0.01",)
"""Both jobs' settings beyond ``hdp demo --verl --critic``'s (GAE with a critic on the engine, the KL loss on, the
ref's log-probs, verl's ``rollout_corr/*`` diagnostics of the rollout's log-probs): an entropy bonus.  Not rollout
IS: on policy its weights are 1 within round-off, and verl's ``rollout_corr/rollout_is_std``, sqrt(E[w²] − E[w]²)
in float32, is then 0 or about sqrt(eps) = 3.5e-4 by the last bit of the inputs (0 on stock, 3.45e-4 on hdp in
one run); the worker-path cases run IS with weights far from 1."""


def main_ppo_job(root: str, engine: str) -> tuple[list[str], dict[str, str]]:
    """(``python -m verl.trainer.main_ppo ...``, its environment) of ``hdp demo --verl --critic`` under ``root`` with
    `MAIN_PPO_CASE` on ``engine``: ``hdp`` (2 ranks, `MAIN_PPO_HDP_BUDGET`) or ``megatron`` (verl's stock engine on
    CPU through ``hdp.integrations.verl.scaffolding.autoload_stock``, 1 rank, `MAIN_PPO_STOCK_BUDGET`)."""
    from hdp.integrations.verl import demo

    paths = demo.prepare(root, n_prompts=4)
    env = demo.environment()
    if engine == "hdp":
        b = MAIN_PPO_HDP_BUDGET
        extra = [f"critic.ppo_max_token_len_per_gpu={b}", f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={b}",
                 f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={b}",
                 f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={b}"]
        return demo.command(paths, steps=MAIN_PPO_STEPS, ranks=2, critic=True, overrides=[*MAIN_PPO_CASE, *extra]), env
    b = MAIN_PPO_STOCK_BUDGET
    extra = ["critic.megatron.vanilla_mbridge=True", "actor_rollout_ref.ref.megatron.vanilla_mbridge=True",
             f"+critic.ppo_infer_max_token_len_per_gpu={b}",  # verl's megatron_critic.yaml lacks it (its worker reads it)
             f"critic.ppo_max_token_len_per_gpu={b}", f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={b}",
             f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={b}",
             f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={b}"]
    cmd = demo.command(paths, steps=MAIN_PPO_STEPS, ranks=1, critic=True, overrides=[*MAIN_PPO_CASE, *extra])
    cmd = ["model_engine=megatron" if c == "model_engine=hdp" else c for c in cmd if ".hdp." not in c]
    env["VERL_USE_EXTERNAL_MODULES"] = "hdp.integrations.verl.scaffolding.autoload_stock"
    return cmd, env


def main_ppo_steps(root: str, engine: str, timeout: float) -> tuple[list[dict[str, float]], str]:
    """Run `main_ppo_job`; returns (every logged step's metrics, the output's tail for a failure's message)."""
    import re
    import subprocess

    os.makedirs(root, exist_ok=True)
    cmd, env = main_ppo_job(root, engine)
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    log = out.stdout + out.stderr
    steps = [step_metrics(line[line.index("step:"):]) for line in log.splitlines() if re.search(r"\bstep:\d+ - ", line)]
    tail = f"{engine}: exit {out.returncode}\n{log[-4000:]}"
    return (steps if out.returncode == 0 else []), tail


def compare_main_ppo(hdp: list[dict[str, float]], stock: list[dict[str, float]]) -> list[Check]:
    """Every metric both jobs log at every step (but `MAIN_PPO_NOT_COMPARED`), hdp's against stock's."""
    checks = [Check(f"main_ppo logged steps (hdp / stock, {MAIN_PPO_STEPS} wanted)", len(hdp), len(stock), 0.0,
                    len(hdp) == len(stock) == MAIN_PPO_STEPS)]
    for i, (h, s) in enumerate(zip(hdp, stock)):
        ours = {k for k in h if _main_ppo_compared(k)}
        theirs = {k for k in s if _main_ppo_compared(k)}
        if ours != theirs:
            checks.append(Check(f"step {i + 1}: metric names differ: hdp only {sorted(ours - theirs)}, stock only "
                                f"{sorted(theirs - ours)}", 0.0, 0.0, 0.0, False))
        checks += [_close(f"step {i + 1} {k}", h[k], s[k], MAIN_PPO_RTOL) for k in sorted(ours & theirs)]
        cp = h.get("actor/hdp/cp_degree_hist/2", 0.0)
        checks.append(Check(f"step {i + 1}: hdp's plan put samples on CP groups of 2 (actor/hdp/cp_degree_hist/2)",
                            cp, 0.0, 0.0, cp > 0))
    return checks


# ---- the pytest side: one spawn per model runs every selected case of a test module -------------------------

SUITE_TIMEOUT_S = 1500.0
"""One spawn's limit: every case of a model (about 75 s for the 61 dense cases on an idle 2-core machine)."""
MOE_KINDS = ("r2", "r3")


def case_ids(*, moe: bool, dist_tier: bool) -> list[str]:
    """The ids of the cases of one model (dense or router replay on a tiny Qwen3-MoE) in one tier: the
    representative slice (``dist_tier``) or the rest of the suite."""
    return [c.id for c in cases().values() if (c.kind in MOE_KINDS) == moe and c.dist_tier == dist_tier]


def run_selected(request: Any, tmp_path_factory: Any, test_name: str, moe: bool) -> dict[str, Any]:
    """Every case of the requesting module's ``test_name`` items selected in this session (skipped ones left
    out), from one spawn of 2 ranks: case id -> its checks (or the error text)."""
    from helpers.dist_helper import run_distributed

    ids = [item.callspec.params["case"] for item in request.session.items
           if item.module is request.module and item.originalname == test_name and not item.get_closest_marker("skip")]
    if not ids:
        return {}
    root = str(tmp_path_factory.mktemp("moe" if moe else "dense"))
    return run_distributed(suite_worker, 2, root, ids, moe, timeout=SUITE_TIMEOUT_S)[0]


@pytest.fixture(scope="module")
def dense(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every selected dense case's checks of the requesting module, from one spawn (a module imports it)."""
    return run_selected(request, tmp_path_factory, "test_hdp_matches_stock_megatron", moe=False)


@pytest.fixture(scope="module")
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every selected router-replay case's checks (tiny Qwen3-MoE) of the requesting module, from one spawn."""
    return run_selected(request, tmp_path_factory, "test_router_replay_matches_stock_megatron", moe=True)


def assert_conforms(result: Any) -> None:
    """Every check of one case held (the failing ones listed)."""
    assert not isinstance(result, str), f"the case raised on the ranks:\n{result}"
    assert result, "the case made no checks"
    bad = [c for c in result if not c.ok]
    assert not bad, "hdp differs from stock verl:\n" + "\n".join(str(c) for c in bad)
