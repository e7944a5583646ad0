"""Per-rank memory of a training round, so that plans fit in memory by construction (pure numpy).

A token budget B ("tokens per rank per round") treats every token alike; memory does not.  This
model predicts the peak bytes one rank holds while its micro-batches of a step run, from the model's
shape (`hdp.packing.model_shape.ModelShape`), the layout (`MemoryLayout`: TP, PP, VPP, EP, expert TP,
the domain size, recompute mode, MoE zero-memory level, CP algorithm) and a few fitted coefficients
(`MemoryCoefficients`).  Every term, in bytes, for pipeline stage s holding ``layers_s`` layers:

* **static** — what the rank holds whatever it computes:
  parameters ``P_s · b_param`` (the stage's non-expert weights / TP, its experts / (EP · expert TP),
  embeddings on the first and output layer on the last stage / TP), their gradients
  ``P_s · b_grad`` (Megatron's fp32 main-grad buffers: 4 B), and the distributed optimizer's shard
  ``P_s · b_opt / D`` (fp32 master copy when the parameters are not fp32, Adam's two fp32 moments:
  12 or 8 B per parameter; D the data-parallel size of that parameter: the domain N for dense
  weights, N · TP / (EP · expert TP) for experts);
* **activations** — what autograd saves for backward, per local token and layer (b = activation
  bytes, h hidden, Q = heads · head dim, K = KV heads · head dim, F1 = 2F gated else F):
  - attention block: ``b · (2h + 3Q + 4K + Q) + 4 · heads / TP`` — norm input and output, the QKV
    projection's output and the q/k/v/out that core attention keeps, the output projection's input,
    the fp32 log-sum-exp (under TP each rank keeps its heads: / TP; sequence parallelism splits h);
  - dense MLP: ``b · (2h + F1 + F_act + F)`` — norm in/out, fc1 output, the activation's internals
    (SwiGLU: 2F), fc2 input; MoE layers: norm in/out, the fp32 router logits, and the expert path of
    `hdp.packing.moe_memory` at the zero-memory level (top-k rows per token);
  - recompute ``full`` keeps only each layer's input (``b · h``) plus, during backward, one layer's
    full set; ``selective`` (Megatron's ``core_attn``) drops the q/k/v/out core attention keeps;
  - **in flight**: under 1F1B stage s holds the activations of up to PP − s micro-batches (rounds) at
    once, under the interleaved schedule Megatron's warm-up count of virtual micro-batches of
    ``layers / (PP · VPP)`` layers; a rank's peak is therefore over a window of consecutive rounds;
* **CP extras** of a group of k ≥ 2 ranks, for the one layer that runs at a time (∝ local tokens T):
  ring — two K/V receive buffers ``2 · T · 2K · b``, the fp32 output and LSE accumulators
  ``T · (Q + heads) · 4``, and in backward the travelling fp32 dK/dV ``T · 2K · 4``; all-gather — the
  group's gathered K/V ``k · T · 2K · b`` and their fp32 gradients;
* **logits** (last stage), by the log-prob path (`MemoryLayout.fused_logprobs`): from logits
  (`hdp.logprobs`), the logits ``T · V/TP · b`` and their gradient, plus one fp32 vocabulary chunk
  ``T · min(4096, V/TP) · 4``; fused (`hdp.fused_logprobs`: from the hidden states and the output weight,
  no [T, V/TP]), the hidden states it keeps and their fp32 gradient accumulator ``T · h · (b + 4)``, five
  fp32 per-token statistics ``T · 20``, and one chunk's working set, ``16 · min(T, 4096) · min(4096, V/TP)``
  (four fp32 [tokens × columns] arrays) plus the fp32 weight-gradient chunk ``min(4096, V/TP) · h · 4``
  (`logits_bytes`);
* **headroom** — a fitted constant: allocator fragmentation, workspaces, communication buffers.

The analytic terms are multiplied by fitted coefficients (``activation``, ``expert``, ``cp``,
``logits``; 1 = the formulas as written) and the headroom added: `fit_memory` fits them from the
``"kind": "memory"`` records the engine writes (non-negative least squares on relative error), as
`hdp.packing.calibrate` fits the cost model.  `MemoryModel.token_budget` turns a memory limit into
the largest per-rank token count of a round — the planner's B, now derived (`PlannerConfig.memory`).

Legend: T local tokens of a round, L_s layers of stage s, N domain size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np

from hdp.packing.cost import min_group_size
from hdp.packing.model_shape import ModelShape, get_shape
from hdp.packing.moe_memory import ActivationMemoryModel, MoEShape, ZeroMemoryLevel

__all__ = ["MemoryLayout", "MemoryCoefficients", "MemoryModel", "MemoryBudget", "fit_memory", "RECOMPUTE", "logits_bytes",
           "GB", "memory_features", "window_tokens", "rerun_tokens", "plan_memory", "memory_stats", "rank_group_sizes", "model_for"]

GB = 1 << 30


def _gb(nbytes: float) -> str:
    """``nbytes`` as GB with three significant digits (``"79.5 GB"``, ``"0.0267 GB"``)."""
    return f"{nbytes / GB:.3g} GB"
RECOMPUTE = ("none", "selective", "full")
_LOGIT_CHUNK = 4096
"""Vocabulary columns per chunk of both log-prob paths (`hdp.logprobs.DEFAULT_CHUNK`)."""
_TOKEN_CHUNK = 4096
"""Tokens per chunk of the fused path (`hdp.fused_logprobs.DEFAULT_TOKEN_CHUNK`)."""
_FEATURES = ("activation", "expert", "cp", "logits")


def logits_bytes(tokens: float, hidden: int, vocab_rows: float, activation_bytes: int, *, fused: bool) -> float:
    """The logits term of a round of ``tokens`` tokens (a number or an array) on the last stage (the module
    docstring's formulas): from the logits (linear in T), or on the fused path (``fused``: linear plus the
    bounded chunk working set); ``vocab_rows`` = V / TP."""
    cols = min(_LOGIT_CHUNK, vocab_rows)
    if not fused:
        return tokens * (2 * vocab_rows * activation_bytes + cols * 4)
    rows = np.minimum(_TOKEN_CHUNK, tokens)  # scalars or arrays of tokens (`plan_memory`)
    bounded = 16 * rows * cols + np.where(np.asarray(tokens) > 0, cols * hidden * 4, 0)  # no round: no chunk
    out = tokens * (hidden * (activation_bytes + 4) + 5 * 4) + bounded
    return float(out) if np.ndim(out) == 0 else out


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def _stage_split_ok(layers: int, pp: int) -> bool:
    """Whether `MemoryModel.layers` splits ``layers`` over ``pp`` stages as Megatron can: evenly, or with the
    first (and last) stage one layer fewer — ceil(L / PP) on the others."""
    return pp <= layers and (-(-layers // pp) * pp - layers) <= min(2, pp - 1)


@dataclass(frozen=True, kw_only=True)
class MemoryLayout:
    """How the model is laid out over the job (sizes >= 1), checked on construction: virtual stages need
    PP > 1, and EP x expert TP divides the TP x domain ranks of a stage.  The checks that need the model's
    shape (layers over PP and VPP, experts over EP, heads over TP) are `MemoryModel`'s."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    """Expert tensor parallel size."""
    domain: int = 1
    """N: ranks of one (TP rank, PP stage) position (data x context parallel)."""
    recompute: str = "none"
    """Activation recompute: ``none``, ``selective`` (core attention) or ``full`` (every layer)."""
    zero_memory: str = "none"
    """MoE zero-memory level: ``none``, ``level0``, ``level1``."""
    cp_algorithm: str = "ring"
    """CP attention: ``ring`` or ``allgather``."""
    param_bytes: int = 2
    """Bytes per parameter (bf16: 2, fp32: 4)."""
    activation_bytes: int = 2
    """Bytes per activation element."""
    fused_logprobs: bool = False
    """The last stage computes log-probs on the fused path (`hdp.fused_logprobs`: from the hidden states and
    the output layer's weight, never holding the logits); False: from the logits (`hdp.logprobs`)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "ep", "etp", "domain", "param_bytes", "activation_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MemoryLayout.{name}={v!r}: pass an integer >= 1")
        if not isinstance(self.fused_logprobs, bool):
            raise ValueError(f"MemoryLayout.fused_logprobs={self.fused_logprobs!r}: pass True (the fused log-prob "
                             "path) or False (log-probs from the logits)")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"MemoryLayout.recompute={self.recompute!r}: choose one of {', '.join(RECOMPUTE)}")
        ZeroMemoryLevel.parse(self.zero_memory)
        if self.cp_algorithm not in ("ring", "allgather"):
            raise ValueError(f"MemoryLayout.cp_algorithm={self.cp_algorithm!r}: choose ring or allgather")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"MemoryLayout.vpp={self.vpp} with pp=1: virtual stages interleave pipeline stages; "
                             "set pp >= 2, or vpp=1")
        stage = self.tp * self.domain  # the ranks of one pipeline stage, which expert parallelism is carved from
        if stage % (self.ep * self.etp):
            raise ValueError(
                f"MemoryLayout.ep={self.ep}, etp={self.etp}: ep x etp = {self.ep * self.etp} ranks do not divide the "
                f"{stage} ranks of a pipeline stage (tp {self.tp} x domain {self.domain}); choose ep x etp dividing "
                f"{stage}: {', '.join(map(str, _divisors(stage)))}")

    @classmethod
    def parse(cls, spec: str, **kwargs: Any) -> "MemoryLayout":
        """A layout from ``"tp1,pp8,ep16"`` (keys tp, pp, vpp, ep, etp, dp; any order) plus keyword fields."""
        keys = {"tp": "tp", "pp": "pp", "vpp": "vpp", "ep": "ep", "etp": "etp", "dp": "domain"}
        values: dict[str, int] = {}
        given: dict[str, str] = {}
        for part in (p.strip() for p in str(spec).split(",") if p.strip()):
            name = part.rstrip("0123456789")
            num = part[len(name):]
            if name not in keys or not num.isdigit():
                raise ValueError(f"layout {spec!r}: {part!r} is not one of tpN, ppN, vppN, epN, etpN, dpN "
                                 "(e.g. tp1,pp8,ep16)")
            if name in given:
                raise ValueError(f"layout {spec!r}: {name} is given twice ({given[name]} and {part}); give each key once")
            given[name] = part
            values[keys[name]] = int(num)
        if "domain" in values and "domain" in kwargs and values["domain"] != kwargs["domain"]:
            raise ValueError(f"layout {spec!r}: dp{values['domain']} but the domain is {kwargs['domain']}; drop dp "
                             f"from the layout, or make the domain {values['domain']}")
        return cls(**{**values, **kwargs})


@dataclass(frozen=True, kw_only=True)
class MemoryCoefficients:
    """Fitted multipliers of the analytic terms and the headroom (1, 1, 1, 1, 0: the formulas as written)."""

    activation: float = 1.0
    expert: float = 1.0
    cp: float = 1.0
    logits: float = 1.0
    headroom_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name in (*_FEATURES, "headroom_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"MemoryCoefficients.{name}={v!r}: pass a finite number >= 0")

    def to_dict(self) -> dict[str, float]:
        return {n: float(getattr(self, n)) for n in (*_FEATURES, "headroom_bytes")}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "memory coefficients") -> "MemoryCoefficients":
        """The coefficients of `to_dict`'s form (exactly its five keys, numbers >= 0); ValueError naming
        ``where``, the field, the value and the fix."""
        names = (*_FEATURES, "headroom_bytes")
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: expected an object with {', '.join(names)}, got {type(d).__name__}")
        missing = [n for n in names if n not in d]
        unknown = sorted(set(map(str, d)) - set(names))
        if missing or unknown:
            raise ValueError(f"{where}: {'missing ' + str(missing) if missing else ''}"
                             f"{'; ' if missing and unknown else ''}{'unknown ' + str(unknown) if unknown else ''}; "
                             f"memory coefficients are exactly {', '.join(names)}")
        for n in names:
            v = d[n]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{where}.{n}={v!r}: pass a finite number >= 0 (re-run hdp calibrate to rewrite it)")
        return cls(**{n: float(d[n]) for n in names})


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """Peak bytes of one rank in a round (see the module docstring)."""

    shape: ModelShape
    layout: MemoryLayout
    coef: MemoryCoefficients = field(default_factory=MemoryCoefficients)
    measured_static: float | None = None
    """Static bytes an engine counted on its ranks (the largest over the job), used for every stage
    instead of the formula; ``None``: the formula."""

    def __post_init__(self) -> None:
        s, lay = self.shape, self.layout
        if not isinstance(s, ModelShape):
            raise ValueError(f"MemoryModel.shape={s!r}: pass a hdp.packing.model_shape.ModelShape")
        if not isinstance(lay, MemoryLayout):
            raise ValueError(f"MemoryModel.layout={lay!r}: pass a hdp.packing.memory.MemoryLayout")
        if not isinstance(self.coef, MemoryCoefficients):
            raise ValueError(f"MemoryModel.coef={self.coef!r}: pass a hdp.packing.memory.MemoryCoefficients")
        ms = self.measured_static
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms)
                               or ms < 0):
            raise ValueError(f"MemoryModel.measured_static={ms!r}: pass bytes >= 0 or None")
        n = s.num_layers
        if not _stage_split_ok(n, lay.pp):
            raise ValueError(
                f"MemoryModel: {n} layers of {s.name} do not split over pp={lay.pp}: stages hold the same layers, or "
                "the first and last one layer fewer (Megatron's account_for_embedding/loss_in_pipeline_split), so "
                f"L, L + 1 or L + 2 must be a multiple of pp; choose pp in "
                f"{', '.join(str(p) for p in range(1, min(n, 128) + 1) if _stage_split_ok(n, p))}")
        if lay.vpp > 1 and n % (lay.pp * lay.vpp):
            raise ValueError(
                f"MemoryModel: {n} layers of {s.name} do not split over pp={lay.pp} x vpp={lay.vpp} = "
                f"{lay.pp * lay.vpp} virtual stages (each needs the same layers); choose pp x vpp dividing {n}")
        # a dense model holds no expert weights: Megatron's default expert TP (= tp) or 1 is harmless there
        if not s.is_moe and (lay.ep > 1 or lay.etp not in (1, lay.tp)):
            raise ValueError(f"MemoryModel: {s.name} is dense (no experts) but the layout has ep={lay.ep}, "
                             f"etp={lay.etp}; expert parallelism needs a MoE model: set ep=1 and etp=1 (or etp=tp)")
        if s.is_moe and s.num_experts % lay.ep:
            raise ValueError(f"MemoryModel: {s.num_experts} experts of {s.name} do not split over ep={lay.ep}; "
                             f"choose ep in {', '.join(map(str, _divisors(s.num_experts)))}")
        if s.is_moe and s.moe_ffn_hidden_size % lay.etp:
            raise ValueError(f"MemoryModel: the expert MLP width {s.moe_ffn_hidden_size} of {s.name} does not split "
                             f"over etp={lay.etp}; choose an etp dividing it (1 keeps experts whole)")
        if s.num_heads % lay.tp or s.num_kv_heads % lay.tp and s.num_kv_heads > lay.tp:
            raise ValueError(f"MemoryModel: heads {s.num_heads}/{s.num_kv_heads} of {s.name} do not split over tp={lay.tp}")

    # -- static --

    def layers(self, stage: int = 0) -> int:
        """Layers of pipeline stage ``stage``: an even split, or when PP does not divide the layers,
        ceil(L / PP) on the middle stages and the remainder taken from the first and last stages
        (Megatron's ``decoder_first/last_pipeline_num_layers``, e.g. 94 layers on PP8: 11, 12 x 6, 11)."""
        n, pp = self.shape.num_layers, self.layout.pp
        if n % pp == 0:
            return n // pp
        per = [-(-n // pp)] * pp
        i = 0
        while sum(per) > n:
            per[0 if i % 2 == 0 else pp - 1] -= 1
            i += 1
        return per[stage]

    def params(self, stage: int = 0) -> tuple[float, float]:
        """(dense, expert) parameters this rank holds on ``stage``."""
        s, lay = self.shape, self.layout
        layers = self.layers(stage)
        dense_layer = s.attention_params() + 2 * s.hidden_size
        expert = 0.0
        if s.is_moe:
            dense_layer += s.hidden_size * s.num_experts + (3 if s.gated else 2) * s.hidden_size * s.shared_ffn_hidden_size
            expert = layers * s.num_experts * (3 if s.gated else 2) * s.hidden_size * s.moe_ffn_hidden_size
        else:
            dense_layer += (3 if s.gated else 2) * s.hidden_size * s.ffn_hidden_size
        dense = layers * dense_layer
        if stage == 0:
            dense += s.vocab_size * s.hidden_size
        if stage == lay.pp - 1:
            dense += s.vocab_size * s.hidden_size
        return dense / lay.tp, expert / (lay.ep * lay.etp)

    def static_bytes(self, stage: int = 0) -> float:
        """Parameters, fp32 gradient buffers and the distributed optimizer's shard on ``stage``."""
        if self.measured_static is not None:
            return float(self.measured_static)
        lay = self.layout
        dense, expert = self.params(stage)
        opt = 8 + (4 if lay.param_bytes != 4 else 0)  # Adam moments (+ fp32 master copy)
        expert_dp = max(1, lay.domain * lay.tp // (lay.ep * lay.etp))
        return (dense + expert) * (lay.param_bytes + 4) + dense * opt / lay.domain + expert * opt / expert_dp

    # -- per token --

    def _attention_bytes(self, core: bool = True) -> float:
        s, lay = self.shape, self.layout
        b, h, q, k = lay.activation_bytes, s.hidden_size, s.attn_dim, s.num_kv_heads * s.head_dim
        core_part = (q + 2 * k + q) if core else 0.0  # q, k, v, out kept by core attention
        return (b * (2 * h + q + 2 * k + core_part + q) + 4 * s.num_heads) / lay.tp

    def _mlp_bytes(self) -> tuple[float, float]:
        """(non-expert, expert) bytes per token of one layer's MLP."""
        s, lay = self.shape, self.layout
        b, h = lay.activation_bytes, s.hidden_size
        if not s.is_moe:
            f = s.ffn_hidden_size
            f1, fact = (2 * f, 2 * f) if s.gated else (f, 0)
            return b * (2 * h + f1 + fact + f) / lay.tp, 0.0
        moe = ActivationMemoryModel(MoEShape(hidden_size=h, moe_ffn_hidden_size=s.moe_ffn_hidden_size, topk=s.topk,
                                             gated=s.gated, bytes_per_element=b, other_bytes_per_token=0))
        other = (b * 2 * h + 4 * s.num_experts) / lay.tp
        return other, moe.expert_bytes_per_token(self.layout.zero_memory) / lay.etp

    def per_token_layer(self) -> tuple[float, float]:
        """(activation, expert) bytes one local token leaves saved in one layer under the recompute mode."""
        lay = self.layout
        mlp, expert = self._mlp_bytes()
        if lay.recompute == "full":
            return lay.activation_bytes * self.shape.hidden_size / lay.tp, 0.0
        attn = self._attention_bytes(core=lay.recompute != "selective")
        return attn + mlp, expert

    def in_flight_layers(self, stage: int = 0) -> float:
        """Layer-micro-batches whose activations stage ``stage`` holds at once (1F1B: PP - s micro-batches)."""
        lay = self.layout
        layers = self.layers(stage)
        if lay.pp == 1:
            return float(layers)
        if lay.vpp == 1:
            return float((lay.pp - stage) * layers)
        chunks = (lay.pp - stage - 1) * 2 + (lay.vpp - 1) * lay.pp + 1
        return float(chunks * layers / lay.vpp)

    def features(self, tokens: float, group_size: int, *, stage: int = 0, window_tokens: float | None = None,
                 window_max: float | None = None) -> dict[str, float]:
        """The analytic bytes of each fitted term for a round of ``tokens`` local tokens on a group of
        ``group_size`` ranks; ``window_tokens``: the local tokens of the rounds in flight together (default
        the round's own, for every in-flight micro-batch); ``window_max``: the local tokens of the round
        whose layer a backward recomputes while this round is the newest (`rerun_tokens`; default
        ``tokens``): under full recompute the whole layer, under MoE zero-memory its expert path."""
        lay, s = self.layout, self.shape
        act, expert = self.per_token_layer()
        layers = self.layers(stage)
        flight = self.in_flight_layers(stage)
        held = window_tokens if window_tokens is not None else tokens * flight / max(layers, 1)
        rerun = tokens if window_max is None else window_max
        a = act * layers * held
        plain = replace(self, layout=replace(lay, recompute="none", zero_memory="none"))
        fa, fe = plain.per_token_layer()  # one layer's activations with nothing freed
        if lay.recompute == "full":  # one layer's full activations during its recompute in backward
            a += fa * rerun
            e = fe * rerun
        else:
            e = expert * layers * held
            if lay.zero_memory != "none" and s.is_moe:  # the expert path one backward re-materialises
                e += max(fe - expert, 0.0) * rerun
        b, kv = lay.activation_bytes, 2 * s.num_kv_heads * s.head_dim / lay.tp
        cp = 0.0
        if group_size > 1:
            if lay.cp_algorithm == "ring":
                cp = tokens * (2 * kv * b + (s.attn_dim / lay.tp + s.num_heads / lay.tp) * 4 + kv * 4)
            else:
                cp = group_size * tokens * kv * (b + 4)
        logits = 0.0
        if stage == lay.pp - 1:
            logits = logits_bytes(tokens, s.hidden_size, s.vocab_size / lay.tp, lay.activation_bytes,
                                  fused=lay.fused_logprobs)
        return {"activation": a, "expert": e, "cp": cp, "logits": logits}

    def dynamic_bytes(self, tokens: float, group_size: int, **kwargs: Any) -> float:
        """Predicted bytes beyond the static part for one round (coefficients applied, headroom added)."""
        f = self.features(tokens, group_size, **kwargs)
        c = self.coef
        return (c.activation * f["activation"] + c.expert * f["expert"] + c.cp * f["cp"] + c.logits * f["logits"]
                + c.headroom_bytes)

    def peak_bytes(self, tokens: float, group_size: int, *, stage: int | None = None, **kwargs: Any) -> float:
        """Predicted peak bytes of a rank on ``stage`` (default: the worst stage)."""
        stages = range(self.layout.pp) if stage is None else [stage]
        return max(self.static_bytes(st) + self.dynamic_bytes(tokens, group_size, stage=st, **kwargs) for st in stages)

    def worst_static(self) -> float:
        """The largest static bytes over the stages."""
        return max(self.static_bytes(s) for s in range(self.layout.pp))

    def token_budget(self, limit_bytes: float, group_size: int = 2) -> int:
        """Largest local tokens T of a round on a group of ``group_size`` whose peak fits ``limit_bytes`` on
        every stage (every in-flight round that large); 0 when even the static part does not fit."""
        best = None
        for st in range(self.layout.pp):
            room = limit_bytes - self.static_bytes(st) - self.coef.headroom_bytes
            if room <= 0:
                return 0
            per = self.dynamic_bytes(1.0, group_size, stage=st) - self.coef.headroom_bytes  # linear in T
            t = int(room // per) if per > 0 else 1 << 40
            if self.layout.fused_logprobs and st == self.layout.pp - 1 and 0 < t < 1 << 40:
                t = self._largest_fitting(t, room, group_size, st)
            best = t if best is None else min(best, t)
        return max(0, int(best or 0))

    def _largest_fitting(self, t: int, room: float, group_size: int, stage: int) -> int:
        """The largest T whose dynamic bytes on ``stage`` fit ``room``, from ``t`` that fits: the fused path's
        chunk working set is bounded (not ∝ T), so the bytes per token at T = 1 over-count it and the linear
        answer ``t`` is a lower bound; doubling, then bisection (the bytes grow with T)."""
        def fits(n: int) -> bool:
            return self.dynamic_bytes(float(n), group_size, stage=stage) - self.coef.headroom_bytes <= room

        lo = t
        hi = 2 * lo
        while hi < 1 << 40 and fits(hi):
            lo, hi = hi, 2 * hi
        while hi - lo > 1:  # fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def describe_static(self, stage: int = 0) -> str:
        """``"P GB parameters + G GB gradients + O GB optimizer"`` of ``stage``."""
        lay = self.layout
        dense, expert = self.params(stage)
        opt = 8 + (4 if lay.param_bytes != 4 else 0)
        expert_dp = max(1, lay.domain * lay.tp // (lay.ep * lay.etp))
        p = (dense + expert) * lay.param_bytes
        g = (dense + expert) * 4
        o = dense * opt / lay.domain + expert * opt / expert_dp
        return f"{_gb(p)} parameters + {_gb(g)} gradients + {_gb(o)} optimizer shard"


@dataclass(frozen=True, kw_only=True)
class MemoryBudget:
    """A per-device memory limit and the model that prices a round against it (`PlannerConfig.memory`)."""

    model: MemoryModel
    limit_bytes: float

    def __post_init__(self) -> None:
        v = self.limit_bytes
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"memory_limit={v!r}: pass bytes per device > 0 (e.g. 64 * 2**30)")

    def token_budget(self, num_ranks: int, longest: int) -> int:
        """The planner's B: tokens per rank per round that fit on every stage in a group as wide as the
        longest sample needs (the CP extras of all-gather grow with k)."""
        b = self.model.token_budget(self.limit_bytes, 2 if num_ranks > 1 else 1)
        if self.model.layout.cp_algorithm == "allgather" and b > 0:
            k = min(num_ranks, max(2, -(-longest // b)))
            for _ in range(4):  # the width the budget implies, and the budget of that width
                b = self.model.token_budget(self.limit_bytes, k)
                if b <= 0:
                    break
                k2 = min(num_ranks, max(2, -(-longest // b)))
                if k2 == k:
                    break
                k = k2
        return b

    def check_static(self, field_name: str = "memory_limit") -> None:
        """ValueError naming the limit, the static memory and the fix when the limit does not hold the
        layout's static memory and the headroom."""
        m = self.model
        static = m.worst_static()
        if static + m.coef.headroom_bytes >= self.limit_bytes:
            raise ValueError(
                f"{field_name}={_gb(self.limit_bytes)} per device is below the static memory of {m.shape.name} "
                f"on this layout ({_gb(static)}: {m.describe_static()}, + {_gb(m.coef.headroom_bytes)} "
                "headroom); raise the limit or shard more (a larger PP, EP, TP or domain)")

    def check(self, num_ranks: int, lengths: np.ndarray, field_name: str = "memory_limit") -> int:
        """The derived token budget, or ValueError naming the limit, the figure needed and the fix."""
        m = self.model
        self.check_static(field_name)
        b = self.token_budget(num_ranks, int(lengths.max(initial=1)))
        if b < 1:
            raise ValueError(f"{field_name}={_gb(self.limit_bytes)} leaves no room for one token per round on "
                             f"{m.shape.name}; raise the limit")
        k_min = min_group_size(np.asarray(lengths, dtype=np.int64), b, num_ranks)
        too_long = np.flatnonzero(k_min > num_ranks)
        if too_long.size:
            i = int(too_long[np.argmax(lengths[too_long])])
            longest = int(lengths[i])
            per = -(-longest // num_ranks)
            need = m.peak_bytes(per, num_ranks)
            raise ValueError(
                f"lengths[{i}]={longest} tokens fits no group of the domain: on all {num_ranks} ranks each holds "
                f"about {per} tokens and needs {_gb(need)} > {field_name}={_gb(self.limit_bytes)} "
                f"(the budget there is {b} tokens per rank); raise the limit, recompute (full) or MoE zero-memory, "
                "add ranks, or truncate the sample")
        return b


def memory_features(model: MemoryModel, tokens: float, group_size: int, stage: int, window_tokens: float,
                    window_max: float | None = None) -> list[float]:
    """The design row of one measured round: the analytic bytes of each fitted term (`_FEATURES` order)."""
    f = model.features(tokens, group_size, stage=stage, window_tokens=window_tokens, window_max=window_max)
    return [f[n] for n in _FEATURES]


_PRIOR_WEIGHT = 1e-6
"""Weight of the pull toward the base coefficients, relative to a unit-norm column: it decides what
the records leave undetermined or nearly so (collinear terms, e.g. activation and expert bytes within
one layout: both grow with the tokens in flight), and moves well-determined ones by ~1e-6 (a term
that adds little to any record, more)."""


def _nnls(a: np.ndarray, y: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """min ||a x - y||² + w ||x - prior||² (w = `_PRIOR_WEIGHT` on unit-norm columns) with x >= 0, for a
    few columns (n <= 8), exactly: every active set's least squares, the best feasible one.  Columns are
    scaled to unit norm first (their magnitudes differ by orders)."""
    n = a.shape[1]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    an = a / norms
    pn = prior * norms  # the prior in the scaled coordinates
    lam = math.sqrt(_PRIOR_WEIGHT)
    best, best_sse = np.zeros(n), math.inf
    for mask in range(1 << n):
        cols = [i for i in range(n) if mask >> i & 1]
        x = np.zeros(n)
        if cols:
            rows = np.vstack([an[:, cols], lam * np.eye(len(cols))])
            rhs = np.concatenate([y, lam * pn[cols]])  # the other columns sit at their bound, 0
            sol, *_ = np.linalg.lstsq(rows, rhs, rcond=None)
            if np.any(sol < 0):
                continue
            x[cols] = sol
        r = an @ x - y
        sse = float(r @ r) + _PRIOR_WEIGHT * float((x - pn) @ (x - pn))
        if mask == 0 or sse < best_sse - 1e-12 * max(best_sse, 1.0):
            best, best_sse = x, sse
    return best / norms


def fit_memory(records: Sequence[Mapping[str, Any]], base: MemoryCoefficients | None = None, *,
               cover: bool = False) -> tuple[MemoryCoefficients, dict[str, float]]:
    """Fit `MemoryCoefficients` to ``"kind": "memory"`` records: ``{"features": [activation, expert, cp,
    logits], "static_bytes": S, "peak_bytes": M}`` (what the engine writes).  Minimises the relative error of
    ``M - S`` (non-negative least squares, rows weighted 1/(M - S)) over the four coefficients and the
    headroom; terms no record exercises (all-zero column) keep ``base``'s value.  ``cover``: then scale the
    dynamic part up until no record is under-predicted (the planner's safe variant).  Returns
    (coefficients, {"median_rel_err", "max_rel_err", "n_records"}) of the peak predictions."""
    base = base or MemoryCoefficients()
    rows, ys, statics = [], [], []
    for i, r in enumerate(records):
        try:
            f = [float(x) for x in r["features"]]
            st, m = float(r["static_bytes"]), float(r["peak_bytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"memory record {i}: needs 'features' (4 numbers), 'static_bytes' and 'peak_bytes' "
                             f"({exc})") from None
        if len(f) != len(_FEATURES) or not all(math.isfinite(x) and x >= 0 for x in f) or not m > st >= 0:
            raise ValueError(f"memory record {i}: features {f}, static {st}, peak {m}: need 4 finite features >= 0 "
                             "and peak > static >= 0")
        rows.append(f + [1.0])
        ys.append(m - st)
        statics.append(st)
    if not rows:
        raise ValueError("fit_memory: no memory records")
    a, y, st_arr = np.asarray(rows), np.asarray(ys), np.asarray(statics)
    w = 1.0 / y
    used = a.any(axis=0)
    x = np.zeros(a.shape[1])
    defaults = np.array([*(getattr(base, n) for n in _FEATURES), base.headroom_bytes])
    x[used] = _nnls(a[:, used] * w[:, None], y * w, defaults[used])
    x = np.where(used, x, defaults)
    pred = a @ x
    if cover and np.any(pred < y):
        x = x * float(np.max(y / np.maximum(pred, 1e-30)))
        pred = a @ x
    coef = MemoryCoefficients(**{n: float(v) for n, v in zip((*_FEATURES, "headroom_bytes"), x)})
    rel = np.abs(pred - y) / (y + st_arr)
    return coef, {"median_rel_err": float(np.median(rel)), "max_rel_err": float(rel.max()), "n_records": len(rows)}


def window_tokens(tokens: np.ndarray, model: MemoryModel, stage: int) -> np.ndarray:
    """[R] for each round r, the local tokens of the rounds stage ``stage`` holds activations of while round
    r is the newest one in flight, each weighted by the share of the stage's layers it holds (1F1B: rounds
    r - (PP - 1 - s) .. r, weight 1; interleaved: Megatron's warm-up count of virtual micro-batches);
    ``tokens`` [R]: this rank's local tokens per round."""
    tokens = np.asarray(tokens, dtype=np.float64)
    layers = max(model.layers(stage), 1)
    flight = model.in_flight_layers(stage) / layers  # micro-batches' worth of the stage's layers
    span = max(1, int(math.ceil(flight - 1e-9)))
    csum = np.concatenate([[0.0], np.cumsum(tokens)])
    r = np.arange(tokens.size)
    lo = np.maximum(0, r - span + 1)
    return (csum[r + 1] - csum[lo]) * (flight / span)


def rerun_tokens(tokens: np.ndarray, model: MemoryModel, stage: int) -> np.ndarray:
    """[R] for each round r, the local tokens of the round whose layer full recompute reruns in a backward
    while r is the newest round in flight on stage ``stage`` (``tokens`` [R]).  Megatron's 1F1B runs
    w = PP - 1 - s warm-up forwards, then forward r / backward r - w, then the cool-down backwards after
    the last forward: so none while r < w, round r - w in the steady state, and the largest of the
    rounds still in flight after the last one.  Without pipelining a round reruns its own layers; under
    the interleaved schedule the largest round in flight (an upper bound)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    r_ = tokens.size
    lay = model.layout
    if r_ == 0 or lay.pp == 1:
        return tokens.copy()
    layers = max(model.layers(stage), 1)
    span = max(1, int(math.ceil(model.in_flight_layers(stage) / layers - 1e-9)))
    if lay.vpp > 1:
        out = tokens.copy()
        for lag in range(1, span):
            out[lag:] = np.maximum(out[lag:], tokens[:-lag])
        return out
    w = min(span - 1, r_)
    out = np.zeros(r_)
    idx = np.arange(w, r_)
    out[idx] = tokens[idx - w]
    out[-1] = tokens[max(0, r_ - 1 - w):].max()
    return out


def plan_memory(tokens: np.ndarray, sizes: np.ndarray, model: MemoryModel) -> np.ndarray:
    """[R, N] predicted peak bytes of each domain rank in each round, the worst over its pipeline stages;
    ``tokens`` [R, N] local tokens (`hdp.packing.Plan.tokens_per_rank`), ``sizes`` [R, N] the size of each
    rank's group (1 for an idle rank)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    out = np.zeros(tokens.shape)
    for st in range(model.layout.pp):
        static = model.static_bytes(st)
        win = np.stack([window_tokens(tokens[:, j], model, st) for j in range(tokens.shape[1])], axis=1) \
            if tokens.size else tokens
        wmax = np.stack([rerun_tokens(tokens[:, j], model, st) for j in range(tokens.shape[1])], axis=1) \
            if tokens.size else tokens
        # on the fused log-prob path the logits term is not linear in the tokens (its chunk working set is
        # bounded): it is priced per round below, the other terms through their per-token rates
        exact = model.layout.fused_logprobs and st == model.layout.pp - 1
        linear = [n for n in _FEATURES if not (exact and n == "logits")]
        for k in np.unique(sizes):
            sel = sizes == k
            # the features are linear in the round's tokens, the window's sum and the window's largest round
            f1 = model.features(1.0, int(k), stage=st, window_tokens=0.0, window_max=0.0)
            fw = model.features(0.0, int(k), stage=st, window_tokens=1.0, window_max=0.0)
            fm = model.features(0.0, int(k), stage=st, window_tokens=0.0, window_max=1.0)
            c = model.coef
            per_t, per_w, per_m = (sum(getattr(c, n) * f[n] for n in linear) for f in (f1, fw, fm))
            peak = static + c.headroom_bytes + per_t * tokens[sel] + per_w * win[sel] + per_m * wmax[sel]
            if exact:
                s, lay = model.shape, model.layout
                peak = peak + c.logits * logits_bytes(tokens[sel], s.hidden_size, s.vocab_size / lay.tp,
                                                      lay.activation_bytes, fused=True)
            out[sel] = np.maximum(out[sel], peak)
    return out


def memory_stats(plan: Any, tokens: np.ndarray, model: MemoryModel, limit: float | None) -> dict[str, Any]:
    """The memory figures of a plan (`hdp.packing.PlanStats.memory`): the predicted peak of the worst
    rank in each round and over the step, the limit, the token budget the plan was made with, and what
    that budget is at the limit for groups of 1 and of 2+ ranks (bytes)."""
    peaks = plan_memory(tokens, rank_group_sizes(plan), model)  # [R, N]
    out: dict[str, Any] = {
        "peak_bytes": float(peaks.max()) if peaks.size else model.worst_static(),
        "round_peak_bytes": [float(x) for x in peaks.max(axis=1)] if peaks.size else [],
        "static_bytes": model.worst_static(),
        "limit_bytes": None if limit is None else float(limit),
        "token_budget": int(plan.max_tokens_per_rank),
        "model": model.shape.name,
        "layout": {"tp": model.layout.tp, "pp": model.layout.pp, "vpp": model.layout.vpp, "ep": model.layout.ep,
                   "domain": model.layout.domain, "recompute": model.layout.recompute,
                   "zero_memory": model.layout.zero_memory, "cp_algorithm": model.layout.cp_algorithm,
                   "fused_logprobs": model.layout.fused_logprobs},
    }
    if limit is not None:
        out["within_limit"] = bool(out["peak_bytes"] <= limit * (1 + 1e-9))
    return out


def rank_group_sizes(plan: Any) -> np.ndarray:
    """[R, N] the size of the group each domain rank is in, per round (1 when idle)."""
    sizes = np.ones((plan.num_rounds, plan.num_ranks), dtype=np.int64)
    for rnd in plan.rounds:
        for g in rnd.groups:
            sizes[rnd.index, g.start:g.start + g.size] = g.size
    return sizes


def model_for(name: str | ModelShape, layout: MemoryLayout, coef: MemoryCoefficients | None = None) -> MemoryModel:
    """`MemoryModel` of a named shape (`hdp.packing.model_shape.SHAPES`) on ``layout``."""
    return MemoryModel(shape=get_shape(name), layout=layout, coef=coef or MemoryCoefficients())
