"""``HdpMegatronEngine``: verl's Megatron engine with hdp plans instead of micro-batches.

Reused from verl's ``MegatronEngineWithLMHead`` unchanged: Megatron initialisation with the TP / PP /
EP layout of verl's own Megatron config (``actor_rollout_ref.actor.megatron.*``) and CP = 1, model
building through Megatron-Bridge, optimizer and LR scheduler, checkpointing, HF weight export to the
rollout, offloading, train/eval contexts.

Layout: world = TP x PP x N.  The **domain** is Megatron's DP group (the N ranks of one TP rank and PP
stage); hdp plans over it, and every TP rank and PP stage of a domain rank runs the same plan (the
plan checksum is compared over the whole job once per step, :func:`hdp.checksum.agree_step`).  Under
PP each round is one micro-batch of Megatron's 1F1B schedule with its own length (every stage knows
each round's shape from the plan: :class:`hdp.megatron_compat.HdpP2PCommunicator` sends none), or of
the interleaved schedule with virtual stages (rounds padded with idle micro-batches to a multiple of
PP, shapes exchanged); under
TP with sequence parallelism packed lengths are padded to a multiple of TP (padding tokens weigh 0)
and log-probs / entropies come from the vocabulary shards (:func:`hdp.logprobs.logprobs_entropy`).
Outputs and metrics come back, as in verl's own Megatron engine, on the last stage's TP rank 0 —
here its domain rank 0, verl's one collect rank.

Replaced:

* **verl's data-parallel view.**  Like verl's dynamic-CP mode, every rank of the domain receives the
  whole mini-batch (``get_data_parallel_size() == 1``, rank 0, a one-rank group), so the single
  controller sends it unsplit and hdp decides who runs what.
* **micro-batching and forward/backward** (:meth:`forward_backward_batch`): one hdp plan over the
  domain (:func:`hdp.packing.plan`, verified by checksum), each round run by every rank in lock-step
  through Megatron's ``forward_backward_func`` (so DDP's no-sync and grad finalisation stay
  Megatron's), each rank packing its zigzag chunks (:func:`hdp.dispatch.pack`) with hdp's CP
  attention context (:class:`hdp.trainer.attention_spec.HdpPackedSeqParams`).
* **loss normalisation.**  After a round the group's ranks exchange their chunk log-probs so each
  holds its samples whole (its own chunk keeps the graph); verl's *real* loss function then runs on
  whole samples with the global normalisers of the mini-batch (``batch_num_tokens``,
  ``global_batch_size`` from the trainer, ``dp_size = N``: verl's agg_loss multiplies by dp_size,
  which cancels Megatron DDP's 1/N averaging).  Every rank of a group computes the same loss but
  differentiates only through its own tokens, so the domain sum of gradients is the single-process
  gradient for every ``loss_agg_mode`` whose normalisers are global (token-mean, token-sum,
  seq-mean-token-mean, seq-mean-token-sum; seq-mean-token-sum-norm with ``actor.loss_scale_factor``
  set — without it verl itself divides by the padded width of each micro-batch).
* **outputs** — log-probs / entropies gathered to domain rank 0 in verl's sample order
  (:func:`hdp.dispatch.gather_outputs`); metrics reduced over the domain, counting each group once.

Legend: S samples of the mini-batch (verl's order), L_i their lengths, T this rank's tokens in one
round, V vocabulary, N domain size (Megatron's DP world), R rounds.

Status: on CPU (gloo) the engine is built and driven by verl's own ``ActorRolloutRefWorker``
(vanilla mbridge model building from an HF checkpoint, ref/actor log-probs and entropies, updates,
checkpoint save/load with bit-for-bit continuation, HF weight export, offload; dense Qwen3 and
Qwen3-MoE with EP 2 on 2 ranks, TP 2 (sequence parallel) x domain 2, PP 2 x domain 2 and PP 2 x 2
virtual stages x domain 2 on 4 ranks;
TP 2 x PP 2 x domain 2 on 8 ranks and Qwen3-MoE EP 2 x PP 2 x domain 2 on 4 ranks by hand)
and matches an fp32 HF reference (tests/test_verl_worker_path.py); the round loop alone on 2 and 4
ranks through :meth:`HdpMegatronEngine.from_modules` (tests/test_verl_engine_dist.py).  Not run: any
GPU/NPU run, Megatron-Bridge model building (``vanilla_mbridge=False``), EP with TP.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from hdp import megatron_compat as mc
from hdp.checksum import agree_step, collective_device
from hdp.cp import CPAlgorithm
from hdp.dispatch import LocalMeta, gather_outputs, local_meta, pack, unpack_into
from hdp.groups import DomainGroups, LayoutGroups
from hdp.logprobs import logprobs_entropy
from hdp.integrations.verl import compat
from hdp.integrations.verl.checks import ACTOR_KEY, REF_KEY, check_remove_padding, check_token_budgets, role_key
from hdp.integrations.verl.config import (
    HdpEngineConfig,
    to_hdp_engine_config,
    to_mcore_checkpoint_config,
    to_mcore_optimizer_config,
)
from hdp.packing import Plan, plan as make_plan
from hdp.trainer.attention_spec import CPContext, HdpPackedSeqParams, packed_seq_params

__all__ = ["HdpMegatronEngine", "RoundInputs", "sample_lengths", "round_inputs", "reduce_metrics", "reject_unsupported"]

logger = logging.getLogger(__name__)

_MegatronLM = compat.megatron_lm_engine()


# ---- pure helpers (tested on CPU) ----------------------------------------------------------------


def sample_lengths(data: Any) -> list[int]:
    """L_i of every sample of verl's batch (``input_ids`` is a jagged nested tensor [S, j1])."""
    ids = data["input_ids"]
    if not getattr(ids, "is_nested", False):
        raise ValueError(
            "the hdp engine takes verl's no-padding batch (nested input_ids); "
            "set actor_rollout_ref.model.use_remove_padding=True"
        )
    return [int(x) for x in ids.offsets().diff().tolist()]


@dataclass(frozen=True, eq=False)
class RoundInputs:
    """This rank's inputs of one round (CPU tensors)."""

    meta: LocalMeta
    """Layout of the local tokens (group, chunk boundaries, positions)."""
    tokens: torch.Tensor
    """[T] int64 local input ids (one pad token when the rank is idle)."""
    targets: torch.Tensor
    """[T] int64 the token each local position predicts (token p+1 of its sample; pad after the last)."""
    temperature: torch.Tensor
    """[T] float32 sampling temperature of each local token's sample."""


def round_inputs(
    meta: LocalMeta,
    samples: Sequence[torch.Tensor],
    temperature: torch.Tensor | float,
    pad_token_id: int,
) -> RoundInputs:
    """Pack this rank's chunks of one round from the whole batch (every rank holds it; no communication).

    ``samples[i]`` is sample i's ids [L_i]; ``temperature`` a scalar or one value per sample [S].
    Targets follow verl's alignment: position p predicts token p+1 (``no_padding_2_padding``
    left-shifts by one), so the log-prob at the last position of a sample is never used.
    """
    if meta.num_tokens == 0:
        pad = torch.full((1,), pad_token_id, dtype=torch.int64)
        return RoundInputs(meta, pad, pad.clone(), torch.ones(1, dtype=torch.float32))
    targets = [torch.cat([s[1:], s.new_full((1,), pad_token_id)]) for s in samples]  # S x [L_i]
    temp = torch.as_tensor(temperature, dtype=torch.float32)
    if temp.dim() == 0:
        per_token = torch.full((meta.num_tokens,), float(temp))  # [T]
    else:
        per_token = temp[meta.sample_index]  # [T]
    return RoundInputs(
        meta=meta,
        tokens=pack(meta, samples).to(torch.int64),
        targets=pack(meta, targets).to(torch.int64),
        temperature=per_token.clamp_min(1e-8),
    )


def reduce_metrics(per_rank: Sequence[Sequence[dict[str, Any]]], num_ranks: int) -> dict[str, Any]:
    """verl metrics of one step from every rank's group-leader metric dicts.

    ``per_rank[r]`` holds the metric dicts of the groups rank r led (one per round it led).  verl's
    ``Metric`` values: SUM metrics (``actor/pg_loss``, computed with ``dp_size = N``) add up over
    groups and divide by N, which is verl's "mean over DP ranks of per-rank sums"; MEAN metrics
    average over groups (verl: over micro-batches and DP ranks); MIN/MAX reduce.  Plain numbers are
    averaged.  The shapes are those of verl's own engines (``postprocess_batch_func`` through
    ``append_to_dict``): one ``Metric`` per name for Metric-valued metrics, a list of floats for
    plain ones — the worker all-gathers them over its (one-rank) DP group and the trainer reduces.
    """
    from verl.utils.metric.utils import AggregationType, Metric

    values: dict[str, list[float]] = {}
    kinds: dict[str, Any] = {}
    for dicts in per_rank:
        for d in dicts:
            for name, m in d.items():
                if isinstance(m, Metric):
                    kinds[name] = m.aggregation
                    values.setdefault(name, []).append(float(Metric._aggregate(m.values, m.aggregation)))
                else:
                    kinds.setdefault(name, None)
                    values.setdefault(name, []).append(float(m))
    out: dict[str, Any] = {}
    for name, vals in values.items():
        kind = kinds[name]
        if kind is AggregationType.SUM:
            out[name] = Metric(AggregationType.SUM, sum(vals) / num_ranks)
        elif kind is AggregationType.MIN:
            out[name] = Metric(AggregationType.MIN, min(vals))
        elif kind is AggregationType.MAX:
            out[name] = Metric(AggregationType.MAX, max(vals))
        elif kind is AggregationType.MEAN:
            out[name] = Metric(AggregationType.MEAN, sum(vals) / len(vals))
        else:
            out[name] = [sum(vals) / len(vals)]
    return out


# ---- parent features hdp's round loop does not carry ----------------------------------------------

_UNSUPPORTED = {
    "calculate_per_token_loss": (
        "actor_rollout_ref.actor.megatron.override_transformer_config.calculate_per_token_loss=True: "
        "hdp's round loop returns verl's globally normalised loss per group (Megatron's per-micro-batch "
        "regime), not the per-token 3-tuple; remove the override (MoE aux/z losses then follow Megatron's "
        "per-micro-batch scaling)"
    ),
    "mtp": "actor_rollout_ref.model.mtp.enable=True: multi-token prediction is not supported by the hdp engine; set it to False",
    "router_replay": (
        "actor_rollout_ref.actor.megatron.router_replay.mode={mode!r}: routed-expert recording/replay "
        "(R2/R3) is not supported by the hdp engine; set it to 'disabled'"
    ),
    "fused": (
        "actor_rollout_ref.model.use_fused_kernels=True: verl's fused Megatron forward bypasses hdp's "
        "chunked log-probs and CP packing; set it to False (hdp computes log-probs in vocab chunks itself)"
    ),
    "multimodal": (
        "actor_rollout_ref.model.path is a multimodal model (hf_config.vision_config is set): multimodal "
        "inputs / 3-D position ids are not supported by the hdp engine"
    ),
}


def reject_unsupported(model_config: Any, engine_config: Any) -> None:
    """Raise ``ValueError`` naming the setting for verl features the hdp engine's round loop drops.

    Checked when the engine is constructed (the worker has filled in ``use_fused_kernels`` by then);
    ``calculate_per_token_loss`` is checked again once the TransformerConfig is built.
    """
    mode = getattr(getattr(engine_config, "router_replay", None), "mode", "disabled")
    if mode not in (None, "disabled"):
        raise ValueError(_UNSUPPORTED["router_replay"].format(mode=mode))
    if getattr(engine_config, "use_fused_kernels", False):
        raise ValueError(_UNSUPPORTED["fused"])
    if (getattr(engine_config, "override_transformer_config", None) or {}).get("calculate_per_token_loss", False):
        raise ValueError(_UNSUPPORTED["calculate_per_token_loss"])
    mtp = getattr(model_config, "mtp", None)
    if mtp is not None and getattr(mtp, "enable", False):
        raise ValueError(_UNSUPPORTED["mtp"])
    if getattr(getattr(model_config, "hf_config", None), "vision_config", None) is not None:
        raise ValueError(_UNSUPPORTED["multimodal"])


def check_engine_settings(model_config: Any, engine_config: HdpEngineConfig) -> None:
    """Raise ``ValueError`` naming the verl key for settings the worker filled in that hdp cannot take:
    ``model.use_remove_padding=False`` and non-positive token budgets (verl's per-GPU budgets are hdp's
    when ``actor.hdp.max_tokens_per_rank`` is null).  Pure: runs before any collective."""
    check_remove_padding(getattr(model_config, "use_remove_padding", True))
    if role_key(engine_config) == REF_KEY:
        budgets = {f"{REF_KEY}.log_prob_max_token_len_per_gpu": engine_config.infer_max_token_len_per_gpu}
    else:
        budgets = {
            f"{ACTOR_KEY}.ppo_max_token_len_per_gpu": engine_config.max_token_len_per_gpu,
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": engine_config.infer_max_token_len_per_gpu,
        }
    check_token_budgets(hdp_budget=engine_config.hdp.max_tokens_per_rank, budgets=budgets)


# ---- the domain ----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Domain:
    """hdp's layout (world = TP x PP x domain; the domain is Megatron's DP group with CP = 1), Megatron's
    process groups, and the one-rank group verl sees as "DP"."""

    layout: LayoutGroups
    megatron: Any
    """Megatron's ``ProcessGroupCollection`` of this rank (passed to the pipeline schedule)."""
    verl_dp_group: dist.ProcessGroup

    @property
    def group(self) -> dist.ProcessGroup:
        """The domain (this rank's DP group: same TP rank and PP stage)."""
        return self.layout.domain.domain

    @property
    def groups(self) -> DomainGroups:
        return self.layout.domain

    @property
    def rank(self) -> int:
        return self.layout.domain.domain_rank

    @property
    def size(self) -> int:
        return self.layout.domain.size

    @classmethod
    def build(cls, dp_group: dist.ProcessGroup, megatron_groups: Any) -> "_Domain":
        """Collective over the world: every rank calls it (``new_subgroups`` builds the one-rank groups)."""
        mine, _ = dist.new_subgroups(group_size=1)
        layout = LayoutGroups(
            world=dist.group.WORLD,  # verl's worker group: Megatron's parallel state spans it
            domain=DomainGroups.build(dp_group),
            tp=megatron_groups.tp,
            pp=megatron_groups.pp,
            ep=megatron_groups.ep,
        )
        return cls(layout=layout, megatron=megatron_groups, verl_dp_group=mine)


# ---- the engine ----------------------------------------------------------------------------------


class HdpMegatronEngine(_MegatronLM):
    """verl's ``MegatronEngineWithLMHead`` running hdp plans over the whole DP×CP domain."""

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any) -> None:
        engine_config = to_hdp_engine_config(engine_config)
        reject_unsupported(model_config, engine_config)  # before any collective: every rank raises alike
        check_engine_settings(model_config, engine_config)
        self.hdp_config: HdpEngineConfig = engine_config
        self._domain: _Domain | None = None  # built by _init_device_mesh, which super().__init__ calls
        super().__init__(
            model_config,
            engine_config,
            to_mcore_optimizer_config(optimizer_config),
            to_mcore_checkpoint_config(checkpoint_config),
        )
        logger.info("hdp engine: %s", engine_config.hdp)

    @classmethod
    def from_modules(
        cls,
        *,
        module: list[Any],
        optimizer: Any,
        engine_config: Any,
        pad_token_id: int,
        domain_group: dist.ProcessGroup,
    ) -> "HdpMegatronEngine":
        """The engine around an already-built Megatron model, skipping verl's Megatron-Bridge initialisation.

        For CPU tests and ``hdp bench verl``: verl's ``MegatronEngine.__init__``/``initialize`` need
        Megatron-Bridge and an HF checkpoint.  ``module`` is the list of Megatron DDP chunks (PP = 1:
        one chunk) whose ``TransformerConfig`` has ``finalize_model_grads_func`` set, ``optimizer`` a
        Megatron optimizer over them, ``domain_group`` the domain (Megatron's DP group with CP = 1).
        What runs is verl's ``train_batch``/``infer_batch``/``optimizer_*`` and hdp's round loop;
        model building, checkpointing, weight export and offload stay verl's and are not set up.
        """
        from types import SimpleNamespace

        self = cls.__new__(cls)
        self.engine_config = to_hdp_engine_config(engine_config)
        self.hdp_config = self.engine_config
        self.model_config = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=int(pad_token_id)), hf_config=None)
        self.module = module
        self.optimizer = optimizer
        self._domain = _Domain.build(domain_group, mc.megatron_groups())
        return self

    # -- Megatron groups and verl's DP view --

    def _init_device_mesh(self) -> None:
        super()._init_device_mesh()  # Megatron: TP x PP x DP with CP = 1 (HdpEngineConfig enforces CP = 1)
        dp_group = compat.mpu().get_data_parallel_group()
        self._domain = _Domain.build(dp_group, mc.megatron_groups())

    @property
    def domain(self) -> _Domain:
        """hdp's domain; raises if Megatron was not initialised by this engine."""
        if self._domain is None:
            raise RuntimeError("HdpMegatronEngine.domain: Megatron groups are not built (engine not constructed?)")
        return self._domain

    def get_data_parallel_rank(self) -> int:
        return 0  # every rank receives the whole mini-batch (as in verl's dynamic-CP mode)

    def get_data_parallel_size(self) -> int:
        return 1

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.domain.verl_dp_group

    def is_mp_src_rank_with_outputs(self) -> bool:
        return bool(super().is_mp_src_rank_with_outputs()) and self.domain.rank == 0

    def _build_tf_config(self) -> None:
        super()._build_tf_config()
        if self.tf_config is not None and getattr(self.tf_config, "calculate_per_token_loss", False):
            raise ValueError(_UNSUPPORTED["calculate_per_token_loss"])

    # -- checkpoints --

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True, **kwargs: Any) -> None:
        """verl's Megatron checkpoint load, under ``torch.no_grad()``, then Adam's per-parameter step restored.

        * ``no_grad``: with ``dtype=float32`` Megatron's distributed optimizer keeps its main params as
          views of the model params (leaves that require grad), and its ``load_state_dict`` copies into
          them in place (megatron-core 0.16.1 ``distrib_optimizer.py:940``), which autograd rejects.
        * Adam's ``step``: with torch's Adam (no Apex/TE: the CPU case) megatron-core 0.16.1 restores
          exp_avg/exp_avg_sq but leaves every state entry's ``step`` at a placeholder, so the update after
          a reload differs from the uninterrupted one.  The optimizer state dict verl's checkpoint manager
          loads is captured on its way into ``optimizer.load_state_dict`` and handed to the library
          engine's fix (:func:`hdp.trainer.optim_state.restore_adam_steps`).
        """
        from hdp.trainer.optim_state import restore_adam_steps

        opt = getattr(self, "optimizer", None)
        loaded: list[Any] = []
        if opt is not None:
            orig = opt.load_state_dict

            def capture(state_dict: Any, *args: Any, **kw: Any) -> Any:
                loaded.append(state_dict)
                return orig(state_dict, *args, **kw)

            opt.load_state_dict = capture  # this instance, for this call only
        try:
            with torch.no_grad():
                super().load_checkpoint(local_path, hdfs_path, del_local_after_load, **kwargs)
        finally:
            if opt is not None:
                del opt.load_state_dict
        if opt is not None and loaded:
            restore_adam_steps(opt, loaded[-1])

    # -- model --

    def _build_megatron_module(self) -> Any:
        module = super()._build_megatron_module()
        for chunk in module:
            _install_hdp_attention(chunk, self.model_config.hf_config)
        if self.hdp_config.hdp.zero_memory.value != "none":
            from hdp.moe import apply_zero_memory

            for chunk in module:
                apply_zero_memory(compat.unwrap_model(chunk), self.hdp_config.hdp.zero_memory)
        return module

    # -- one step --

    @property
    def _token_multiple(self) -> int:
        """Packed lengths are padded to a multiple of this: TP under sequence parallelism, else 1."""
        cfg = compat.unwrap_model(self.module[0]).config
        tp = self.domain.layout.tp_size
        return tp if tp > 1 and bool(getattr(cfg, "sequence_parallel", False)) else 1

    def forward_backward_batch(self, data: Any, loss_function: Callable | None, forward_only: bool = False) -> Any:
        tu = compat.tensordict_utils()
        dom = self.domain
        plan, planner_ms = self._agreed_plan(data)

        # verl's loss normalisers over the whole (replicated) mini-batch; dp_size = N cancels DDP's 1/N
        loss_mask = data["loss_mask"]
        num_tokens = int(loss_mask.values().sum().item()) if loss_mask.is_nested else int(loss_mask.sum().item())
        tu.assign_non_tensor(data, batch_num_tokens=num_tokens, dp_size=dom.size)

        samples = list(data["input_ids"].unbind())  # S x [L_i]
        temperature = data["temperature"] if "temperature" in data.keys() else 1.0
        pad_id = int(self.model_config.tokenizer.pad_token_id or 0)
        dev = next(self.module[0].parameters()).device
        rounds = [
            self._round(round_inputs(local_meta(plan, dom.rank, r), samples, temperature, pad_id), pad_id, dev)
            for r in range(plan.num_rounds)
        ]
        calculate_entropy = bool(tu.get_non_tensor_data(data, key="calculate_entropy", default=False))
        state = _StepState(
            plan=plan, data=data, loss_function=loss_function, forward_only=forward_only, calculate_entropy=calculate_entropy
        )
        self._run_schedule(rounds, state)
        return self._collect(state, planner_ms)

    def _agreed_plan(self, data: Any) -> tuple[Plan, float]:
        """Plan the mini-batch (pure), then one fixed-size all-reduce over the job agrees on planning
        errors and compares the plan checksum over the domain, the pipeline and the TP ranks at once."""
        dom = self.domain
        error: BaseException | None = None
        plan: Plan | None = None
        t0 = time.perf_counter()
        try:
            plan = self._make_plan(data)
        except (ValueError, TypeError) as exc:
            error = exc
        planner_ms = (time.perf_counter() - t0) * 1e3
        world = dom.layout.world
        bad = agree_step(plan, world, failed=error is not None, device=collective_device(world), domain_size=dom.size)
        if error is not None:
            raise type(error)(f"hdp engine (domain rank {dom.rank}): {error}") from error
        if bad:
            raise ValueError(f"hdp engine: planning failed on ranks {bad} (see their errors); nothing was run")
        assert plan is not None
        return plan, planner_ms

    def _make_plan(self, data: Any) -> Plan:
        """The hdp plan of this mini-batch over the domain (pure; every rank computes the same one)."""
        tu = compat.tensordict_utils()
        default_budget = tu.get_non_tensor_data(data, key="max_token_len_per_gpu", default=None)
        planner = self.hdp_config.hdp.planner_config(
            self.domain.size, default_budget, pipeline_stages=self.domain.layout.pp_size
        )
        return make_plan(sample_lengths(data), planner)

    def _round(self, inp: RoundInputs, pad_id: int, dev: torch.device) -> "_Round":
        """One round's micro-batch on the device: the real tokens, then padding (a multiple of TP under
        sequence parallelism; one micro-batch of padding when the rank holds no token)."""
        meta = inp.meta
        psp = self._packed_seq_params(meta, dev)
        real = inp.tokens[: meta.num_tokens]
        tokens = torch.cat([real, real.new_full((psp.pad_tokens,), pad_id)]).to(dev)  # [T]
        return _Round(inputs=inp, tokens=tokens, psp=psp)

    def _run_schedule(self, rounds: Sequence["_Round"], state: "_StepState") -> None:
        """Every round through Megatron's schedule, one micro-batch each, with its own length: no pipelining
        at PP = 1, 1F1B under PP, the interleaved schedule with virtual stages (rounds padded with idle
        micro-batches to a multiple of ``microbatch_group_size_per_vp_stage``, PP by default)."""
        layout = self.domain.layout
        step = partial(self._hdp_forward_step, state=state)
        if layout.pp_size == 1:
            state.num_microbatches = len(rounds)
            compat.forward_backward_func()(
                forward_step_func=step, data_iterator=iter(rounds), model=self.module,
                num_microbatches=len(rounds), seq_length=1, micro_batch_size=1, forward_only=state.forward_only,
            )
            return
        chunk = self.module[0]
        cfg = compat.unwrap_model(chunk).config
        if not getattr(cfg, "variable_seq_lengths", False):
            raise ValueError(
                "the model's TransformerConfig.variable_seq_lengths is False: hdp rounds have their own lengths; "
                "set actor_rollout_ref.actor.megatron.override_transformer_config.variable_seq_lengths=True"
            )
        dev = next(chunk.parameters()).device
        p2p = mc.HdpP2PCommunicator(layout.pp, cfg, dev)
        if len(self.module) > 1:  # interleaved: idle padding rounds; shapes exchanged
            # Megatron wants whole groups of microbatch_group_size_per_vp_stage (default PP, at least PP)
            group = max(int(getattr(cfg, "microbatch_group_size_per_vp_stage", None) or layout.pp_size), layout.pp_size)
            total = -(-len(rounds) // group) * group
            rounds = list(rounds) + [self._padding_round(dev) for _ in range(total - len(rounds))]
            state.num_microbatches = total
            split = self._token_multiple
            p2p.expect_interleaved_shapes([(r.tokens.shape[0] // split, 1, cfg.hidden_size) for r in rounds],
                                          len(self.module), group, forward_only=state.forward_only)
            mc.forward_backward_pipelining_with_interleaving(
                forward_step_func=step, data_iterator=[iter(rounds) for _ in self.module], model=self.module,
                num_microbatches=total, seq_length=max(r.tokens.shape[0] for r in rounds), micro_batch_size=1,
                forward_only=state.forward_only, p2p_communicator=p2p, pg_collection=self.domain.megatron,
            )
            if p2p.unused_shapes():
                raise RuntimeError(f"pipeline schedule of {total} micro-batches ended with messages not received")
            return
        # 1F1B: every stage knows each round's length from the plan, so no shape messages; under
        # sequence parallelism a stage sends its [T/TP, 1, H] shard
        state.num_microbatches = len(rounds)
        split = self._token_multiple
        p2p.expect_shapes([(r.tokens.shape[0] // split, 1, cfg.hidden_size) for r in rounds],
                          forward_only=state.forward_only)
        mc.forward_backward_pipelining_without_interleaving(
            forward_step_func=step, data_iterator=iter(rounds), model=chunk, num_microbatches=len(rounds),
            seq_length=max(r.tokens.shape[0] for r in rounds), micro_batch_size=1, forward_only=state.forward_only,
            p2p_communicator=p2p, pg_collection=self.domain.megatron,
        )
        if p2p.unused_shapes():
            raise RuntimeError(f"pipeline schedule of {len(rounds)} micro-batches ended with messages not received")

    def _padding_round(self, dev: torch.device) -> "_Round":
        """An idle micro-batch beyond the plan (interleaved schedule): padding tokens only, weight 0."""
        psp = packed_seq_params((), dev, token_multiple=self._token_multiple)
        pad_id = int(self.model_config.tokenizer.pad_token_id or 0)
        return _Round(inputs=None, tokens=torch.full((psp.pad_tokens,), pad_id, dtype=torch.int64, device=dev), psp=psp)

    def _hdp_forward_step(self, data_iterator: Iterator["_Round"], model: Any, *, state: "_StepState") -> Any:
        """Megatron forward step of one round on this stage; on the last stage the logits of this rank's
        chunks give log-probs (and entropies), then the group's verl loss."""
        rnd = next(data_iterator)
        inp = rnd.inputs
        out = model(input_ids=rnd.tokens[None, :], position_ids=None, attention_mask=None, packed_seq_params=rnd.psp)
        if not compat.unwrap_model(model).post_process:  # not the last stage: [T/TP?, 1, H] to the next one
            return out, partial(_never_called_loss)
        if inp is None:  # a padding round (interleaved schedule): nothing to compute, every rank alike
            return out, partial(_padding_loss)
        meta = inp.meta
        logits = out[0][: meta.num_tokens]  # [Tr, V/TP]
        dev = logits.device
        logp, ent = logprobs_entropy(
            logits,
            inp.targets[: meta.num_tokens].to(dev),
            self.domain.layout.tp,
            temperature=inp.temperature[: meta.num_tokens].to(dev),
            chunk=int(self.engine_config.entropy_from_logits_chunk_size),
            entropy=state.calculate_entropy,
        )  # [Tr], [Tr] or None
        if ent is None:
            ent = torch.zeros_like(logp)  # never read: entropy was not requested
        state.local_outputs[meta.round_index] = torch.stack([logp, ent], dim=-1).detach()  # [Tr, 2]; [0, 2] idle
        return out, partial(self._hdp_loss, inp=inp, logp=logp, ent=ent, state=state)

    def _hdp_loss(self, output: Any, *, inp: RoundInputs, logp: torch.Tensor, ent: torch.Tensor, state: "_StepState") -> Any:
        """verl's loss on the group's whole samples; Megatron divides by its micro-batch count, so it is
        scaled by that (R, or R padded to a multiple of PP under the interleaved schedule)."""
        meta = inp.meta
        zero = output.sum() * 0.0  # a rank without tokens: backward still runs (EP all-to-alls, TP, CP line up)
        if state.loss_function is None:
            return zero, {}
        local = torch.stack([logp, ent], dim=-1)  # [Tr, 2]; [0, 2] when idle
        full = _group_full_samples(state.plan, meta, local, self.domain.group)  # collective: idle ranks too
        if meta.num_tokens == 0:
            return zero, {}
        tu = compat.tensordict_utils()
        sub = tu.index_select_tensor_dict(state.data, list(meta.samples))  # group order
        model_output = {"log_probs": compat.as_nested([f[:, 0] for f in full])}  # Sg x [L_i]
        if state.calculate_entropy:
            model_output["entropy"] = compat.as_nested([f[:, 1] for f in full])
        loss, metrics = state.loss_function(model_output=model_output, data=sub, dp_group=self.get_data_parallel_group())
        if meta.j == 0:  # one copy per group (its leader); plain floats so they can be gathered
            state.leader_metrics.append(
                {k: float(v.detach()) if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
            )
            state.leader_losses.append(float(loss.detach()))
        return loss * state.num_microbatches + zero, {}

    def _packed_seq_params(self, meta: LocalMeta, dev: torch.device) -> HdpPackedSeqParams:
        """THD parameters of one round: this rank's chunks with its group's CP context (a rank with no
        token of a group still joins the group's ring / all-gather), padded to the token multiple."""
        m = self._token_multiple
        if meta.k == 1:
            return packed_seq_params(meta.group_lengths, dev, token_multiple=m)
        aligned = meta.k & (meta.k - 1) == 0 and meta.group_start % meta.k == 0
        algo = CPAlgorithm.ALLGATHER if self.hdp_config.hdp.cp_algorithm is CPAlgorithm.ALLGATHER and aligned else CPAlgorithm.RING
        cp = CPContext(
            group_lengths=meta.group_lengths,
            k_group=meta.k,
            ring=self.domain.groups.ring(meta.group_start, meta.k),
            groups=self.domain.groups,
            algo=algo,
        )
        return packed_seq_params(meta.group_lengths, dev, cp=cp, token_multiple=m)

    def _collect(self, state: "_StepState", planner_ms: float) -> dict[str, Any]:
        """verl's output dict on verl's collect rank (TP rank 0 of the last stage, domain rank 0):
        model_output in sample order and metrics; ``{}`` elsewhere (as verl's Megatron engine off the
        last stage).  The gathers run over the domain of TP rank 0 on the last stage only."""
        dom = self.domain
        layout = dom.layout
        if not (layout.is_last_stage and layout.tp_rank == 0):
            return {}
        none = torch.zeros((0, 2))
        local = [state.local_outputs.get(r, none) for r in range(state.plan.num_rounds)]  # R x [T_r, 2]
        full = gather_outputs(state.plan, dom.rank, local, dom.group, dst=0)  # S x [L_i, 2] on rank 0
        gathered: list[Any] = [None] * dom.size
        dist.all_gather_object(gathered, (state.leader_metrics, state.leader_losses), group=dom.group)
        if dom.rank != 0:
            return {}
        assert full is not None
        if state.loss_function is not None:
            metrics = reduce_metrics([m for m, _ in gathered], dom.size)
            # each group's loss carries verl's dp_size = N factor: the step's loss is their sum / N
            # (stock verl: per-rank sums averaged over DP); one float, as the worker all-reduces it
            loss = [sum(sum(ls) for _, ls in gathered) / dom.size]
        else:
            metrics = {}
            loss = [1.0] * state.plan.num_rounds  # stock verl: 1.0 per micro-batch without a loss function
        stats = state.plan.stats
        metrics.update(
            {
                "hdp/rounds": [state.plan.num_rounds],
                "hdp/planner_ms": [planner_ms],
                "hdp/efficiency_planned": [float(stats.efficiency) if stats else float("nan")],
            }
        )
        lp = [x[:, 0] for x in full]
        out: dict[str, Any] = {"log_probs": compat.as_nested(lp)}
        if state.calculate_entropy:
            out["entropy"] = compat.as_nested([x[:, 1] for x in full])
        return {"model_output": out, "loss": loss, "metrics": metrics}


def _never_called_loss(output: Any) -> Any:
    raise RuntimeError("Megatron called the loss function on a stage that is not the last one")


def _padding_loss(output: Any) -> Any:
    """Loss of a padding round: 0, with a graph so its backward runs like every other micro-batch's."""
    return output.sum() * 0.0, {}


@dataclass(frozen=True, eq=False)
class _Round:
    """One round's micro-batch of this rank: its inputs, the padded tokens on the device, THD params."""

    inputs: RoundInputs | None
    """``None`` for a padding round beyond the plan (interleaved schedule)."""
    tokens: torch.Tensor
    """[T] int64 on the device: the real tokens, then padding."""
    psp: HdpPackedSeqParams


@dataclass(eq=False)
class _StepState:
    """Per-step state passed to the forward/loss callbacks (never module state)."""

    plan: Plan
    data: Any
    loss_function: Callable | None
    forward_only: bool
    calculate_entropy: bool = False

    def __post_init__(self) -> None:
        self.num_microbatches = self.plan.num_rounds  # what the schedule runs (padded under interleaving)
        self.local_outputs: dict[int, torch.Tensor] = {}  # round -> [T_r, 2] (last stage)
        self.leader_metrics: list[dict[str, Any]] = []  # one per group this rank led
        self.leader_losses: list[float] = []  # verl loss of each group this rank led


def _group_full_samples(plan: Plan, meta: LocalMeta, local: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Whole per-sample tensors [L_i, ...] of this rank's group from the group's chunks; own chunk keeps its graph.

    ``local`` is this rank's [T, ...] values of the round (``[0, ...]`` when idle).  Collective over
    ``group`` (the domain): every rank calls it every round.  One padded all-gather of log-prob-sized
    tensors; every rank of a group then computes the same loss but differentiates only through its
    own tokens, so the domain sum of gradients is the gradient of the group's loss.
    TODO: gather over the group's ring only.
    """
    n = plan.num_ranks
    feat = tuple(local.shape[1:])
    width = max(local_meta(plan, q, meta.round_index).num_tokens for q in range(n))
    buf = local.new_zeros((max(width, 1), *feat))  # [P, ...]
    buf[: local.shape[0]] = local.detach()
    bufs = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    outs = [local.new_zeros((length, *feat)) for length in meta.group_lengths]  # Sg x [L_i, ...], group order
    by_caller = dict(zip(meta.samples, outs))
    for q in range(meta.group_start, meta.group_start + meta.k):
        if q == meta.rank:
            continue
        mq = local_meta(plan, q, meta.round_index)
        unpack_into(mq, bufs[q][: mq.num_tokens], by_caller)  # type: ignore[arg-type]
    result = []
    sample_index = meta.sample_index.to(local.device)
    positions = meta.position_ids.to(local.device)
    for s, out in zip(meta.samples, outs):
        idx = torch.nonzero(sample_index == s).flatten()  # local rows of sample s
        result.append(out.index_put((positions[idx],), local[idx]))  # out-of-place: grad flows to `local`
    return result


def _install_hdp_attention(chunk: Any, hf_config: Any) -> None:
    """Swap every layer's core attention for hdp's and move RoPE into it (positions of the unsplit sample).

    Megatron's own RoPE takes positions from ``cu_seqlens``, which for zigzag chunks are not the
    sample positions; hdp's core attention applies RoPE at ``HdpPackedSeqParams.positions``.
    """
    from hdp.integrations.verl.rope import rope_config
    from hdp.trainer.attention_spec import HdpCoreAttention

    model = compat.unwrap_model(chunk)
    rope = rope_config(model, hf_config)  # raises on any RoPE variant hdp does not implement
    for layer in model.decoder.layers:
        attn = layer.self_attention
        old = attn.core_attention
        attn.core_attention = HdpCoreAttention(  # parameter-free: nothing to move to the device
            config=old.config,
            layer_number=old.layer_number,
            attn_mask_type=compat.causal_mask_type(),
            attention_type="self",
            rope=rope,
        )
    model.position_embedding_type = "none"  # RoPE now happens inside hdp's core attention


def npu_engine_class() -> type | None:
    """The hdp engine for Ascend NPUs (on verl's MindSpeed engine), or None when MindSpeed is absent."""
    base = compat.mindspeed_lm_engine()
    if base is None:
        return None
    return type("HdpMindspeedEngine", (HdpMegatronEngine, base), {"__doc__": "HdpMegatronEngine on verl's MindSpeed engine (NPU)."})
