"""``HdpMegatronEngine``: verl's Megatron engine whose steps run on hdp's step sequence.

Reused from verl's ``MegatronEngineWithLMHead`` unchanged: Megatron initialisation with the TP / PP /
EP layout of verl's own Megatron config (``actor_rollout_ref.actor.megatron.*``) and CP = 1, model
building (vanilla mbridge or Megatron-Bridge), optimizer and LR scheduler, checkpointing, HF weight
export to the rollout, offloading, train/eval contexts.

The step is the library engine's, written once (:mod:`hdp.core.step` on the round core and the
planner): the agreement over the job, every round through Megatron's schedule, one reduce, the
non-finite rules, the optimizer step or an agreed skip, calibration.  verl's primitives map onto its
halves: ``forward_backward_batch`` (agree, rounds, reduce), ``optimizer_step`` (the update or the skip,
then calibration), ``optimizer_zero_grad``; ``train_batch`` is verl's ``BaseEngine.train_batch`` on them.
What stays here is verl's:

* **its data-parallel view** (:mod:`hdp.integrations.verl.domain`): as in verl's dynamic-CP mode, every
  domain rank receives the whole mini-batch (``get_data_parallel_size() == 1``) and hdp decides who runs what;
* **its loss** (:class:`hdp.integrations.verl.loss.VerlLoss`): verl's *real* loss function on each CP
  group's samples, assembled whole, with the mini-batch's global normalisers;
* **its outputs** (:func:`hdp.integrations.verl.batch.verl_outputs`) in verl's sample order on its collect
  rank, verl's metrics reduced over the groups, hdp's added;
* **verl's semantics on a non-finite loss or gradient**: as verl's FSDP engine, the update is skipped on
  every rank and ``grad_norm`` is NaN (``hdp/nonfinite_skipped`` = 1); Megatron's optimizer would apply it.
  Unlike verl, ``hdp.max_consecutive_skips`` skips in a row raise `hdp.core.step.SkippedUpdatesError` on
  every rank (the job fails instead of exiting 0 without training).

Legend: S samples of the mini-batch (verl's order), L_i their lengths, N domain size, R rounds.

Status: on CPU (gloo) driven by verl's own ``ActorRolloutRefWorker`` (tests/distributed/verl/test_verl_worker_path.py
tests/slow/verl/test_verl_worker_path_slow.py)
and ``main_ppo`` (``hdp demo --verl``); not run on any GPU/NPU, nor with Megatron-Bridge model
building (``vanilla_mbridge=False``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from hdp import megatron_compat as mc
from hdp.digest import batch_digest
from hdp.integrations.verl import compat, patches, verl_version
from hdp.integrations.verl.attention import install_hdp_attention
from hdp.integrations.verl.batch import SameRows, sample_lengths, verl_outputs
from hdp.integrations.verl.checkpoint import loaded_view, saved_view
from hdp.integrations.verl.checks import (check_engine_settings, check_model_features, check_per_token_loss,
                                          check_shared_layout, check_value_model_building, role_key,
                                          uses_fused_logprobs)
from hdp.integrations.verl.config import HdpEngineConfig, to_hdp_engine_config, to_mcore_checkpoint_config, to_mcore_optimizer_config
from hdp.integrations.verl.loss import VerlLoss, VerlValueLoss
from hdp.integrations.verl.moe_router import reconcile_router
from hdp.integrations.verl.routes import route_replay
from hdp.integrations.verl.domain import VerlDomain
from hdp.integrations.verl.fusions import Fusions, describe as describe_fusions, resolve as resolve_fusions
from hdp.integrations.verl.memory import verl_memory
from hdp.device import select_device
from hdp.packing.model_shape import ModelShape
from hdp.core.checkpoint import check_fit
from hdp.core.optim_state import restore_adam_steps
from hdp.core.planning import DomainPlanner
from hdp.core.rounds import RoundCore
from hdp.core.stack import StackParts, build_steps
from hdp.core.step import Pass, Prepared, Steps

__all__ = ["HdpMegatronEngine", "HdpMegatronValueEngine", "npu_engine_class"]

logger = logging.getLogger(__name__)

_MegatronLM = compat.megatron_lm_engine()


class HdpMegatronEngine(_MegatronLM):
    """verl's ``MegatronEngineWithLMHead`` running hdp plans over the whole DP×CP domain."""

    loss_class: type[VerlLoss] = VerlLoss
    """The round loss adapter: log-probs and entropies (the value engine's: values)."""
    mindspeed: bool = False
    """MindSpeed runs in this process (the NPU variant, `npu_engine_class`): it takes its own override keys."""
    fusions: Fusions = Fusions()
    """This role's fusion flags (:mod:`hdp.integrations.verl.fusions`), resolved when Megatron's config is built."""

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any) -> None:
        engine_config = to_hdp_engine_config(engine_config)
        check_model_features(model_config, engine_config)  # before any collective: every rank raises alike
        check_engine_settings(model_config, engine_config)
        if getattr(model_config, "model_type", None) == "value_model":  # verl 0.9.0 cannot build it by vanilla mbridge
            check_value_model_building(verl_version(), engine_config.vanilla_mbridge, role_key(engine_config))
        verl_memory(model_config, engine_config, world=dist.get_world_size() if dist.is_initialized() else 1,
                    device=select_device(None), check_only=True)  # a limit below the static memory: ValueError
        self.hdp_config: HdpEngineConfig = engine_config
        self._domain: VerlDomain | None = None  # built by _init_device_mesh, which super().__init__ calls
        self.core: RoundCore | None = None  # built once the model exists (initialize)
        self.planner: DomainPlanner | None = None
        self.steps: Steps | None = None  # the step sequence on the core and the planner
        super().__init__(model_config, engine_config, to_mcore_optimizer_config(optimizer_config),
                         to_mcore_checkpoint_config(checkpoint_config))
        logger.info("hdp engine: %s", engine_config.hdp)

    @classmethod
    def from_modules(cls, *, module: list[Any], optimizer: Any, engine_config: Any, pad_token_id: int,
                     domain_group: dist.ProcessGroup, shape: ModelShape | None = None) -> "HdpMegatronEngine":
        """The engine around an already-built Megatron model, skipping verl's model building.

        For CPU tests and ``hdp bench verl``: ``module`` is the list of Megatron DDP chunks, ``optimizer``
        a Megatron optimizer over them (or ``None``), ``domain_group`` the domain (Megatron's DP group with
        CP = 1).  verl's ``train_batch`` / ``infer_batch`` then run on the round core; model building,
        checkpointing, weight export and offload are not set up.
        """
        from types import SimpleNamespace

        self = cls.__new__(cls)
        self.engine_config = self.hdp_config = to_hdp_engine_config(engine_config)
        self.model_config = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=int(pad_token_id)), hf_config=None)
        self.module, self.optimizer = module, optimizer
        self._domain = VerlDomain.build(domain_group, mc.megatron_groups(), self.hdp_config.hdp.collective_timeout_s)
        self._build_core(shape)
        return self

    # -- Megatron groups, verl's DP view, the core --

    def _init_device_mesh(self) -> None:
        ps = compat.mpu()
        if not ps.is_initialized():  # verl's groups, with hdp's timeout instead of torch's 30 minutes
            compat.initialize_model_parallel(self.hdp_config, self.hdp_config.hdp.collective_timeout_s)
        super()._init_device_mesh()  # verl's: finds Megatron's groups built (TP x PP x DP, CP = 1 by HdpEngineConfig)
        # built by this engine, or by the one constructed before it in this process
        check_shared_layout(self.hdp_config, {
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "expert_model_parallel_size": ps.get_expert_model_parallel_world_size()})
        self._domain = VerlDomain.build(compat.mpu().get_data_parallel_group(), mc.megatron_groups(),
                                     self.hdp_config.hdp.collective_timeout_s)

    def initialize(self) -> None:
        super().initialize()
        self._build_core(None)
        if not getattr(self.engine_config, "forward_only", False):  # stock's mini-batches, each planned ahead
            patches.own_mini_batch_loop(self)

    @contextlib.contextmanager
    def train_mode(self, **kwargs: Any) -> Iterator[None]:
        """verl's ``train_mode``; inside it, the mini-batches verl's worker iterates are stock verl's for this
        engine's domain, each announced ahead to the planner (:func:`hdp.integrations.verl.patches.own_mini_batch_loop`)."""
        with super().train_mode(**kwargs), patches.owns_mini_batches(self):
            yield

    def _build_core(self, shape: ModelShape | None) -> None:
        """The round core and the one planner of this engine (settings resolved once, here)."""
        opts, dom = self.hdp_config.hdp, self.domain
        dev = next(self.module[0].parameters()).device
        mem, limit = verl_memory(self.model_config, self.engine_config, world=dom.layout.world_size, device=dev, vpp=len(self.module))

        def model_shape() -> ModelShape:  # for cost_model=auto only
            hf = getattr(self.model_config, "hf_config", None)
            if shape is None and hf is None:
                raise ValueError(f"{self.role_key}.hdp.cost_model=auto needs the model's config; pass a preset")
            return shape or ModelShape.from_hf_config(hf, dtype=str(getattr(self.engine_config, "dtype", "bfloat16")))

        forward_only = getattr(self.engine_config, "forward_only", False)
        self.steps = build_steps(opts, StackParts(
            groups=dom.layout, megatron_groups=dom.megatron, chunks=self.module, optimizer=getattr(self, "optimizer", None),
            device=dev, shape=model_shape, pad_token_id=self.pad_token_id, memory_model=mem, memory_limit=limit,
            abort_groups=lambda: self.domain.groups_to_abort(), on_broken=self._release,
            fused_logprobs=self._fused_logprobs(),
            door_budgets=(self.engine_config.max_token_len_per_gpu, self.engine_config.infer_max_token_len_per_gpu),
            records_role=None if forward_only else self.role), loss_name="verl loss function")
        self.core, self.planner = self.steps.core, self.steps.planner
        if self.planner.records_path is not None:
            logger.info("hdp engine: calibration records go to %s (hdp calibrate --records)", self.planner.records_path)
        self.same_rows = SameRows()  # verl's batch-wide settings at the groups' batch sizes, kept across steps
        self.losses_checked: dict[Any, Any] = {}  # loss functions found additive (VerlLoss.check_loss)

    def _fused_logprobs(self) -> bool:
        """``use_fused_kernels=True`` (not the critic's): hdp's fused log-prob path
        (`hdp.integrations.verl.checks.uses_fused_logprobs`); ValueError naming the key when the model's output
        layer cannot be replaced exactly (`hdp.megatron_compat.fused_head_problem`), alike on every rank."""
        if not uses_fused_logprobs(self.hdp_config):
            if bool(getattr(self.hdp_config, "use_fused_kernels", False)):
                logger.info("hdp engine: %s has a value head: use_fused_kernels does not apply (log-probs only)",
                            self.role_key)
            return False
        for chunk in self.module:
            problem = mc.fused_head_problem(chunk)
            if problem is not None:
                raise ValueError(f"actor_rollout_ref.model.use_fused_kernels=True: hdp's fused log-prob path cannot "
                                 f"replace this model's output layer exactly ({problem}); set it to False")
        return True

    def _maybe_enable_fused_kernels(self) -> None:
        """Not verl's fused forward (its GPTModel forward computing log-probs inside the model, outside hdp's
        rounds): with ``use_fused_kernels=True`` the round core runs hdp's fused log-prob path instead
        (:meth:`_fused_logprobs`)."""

    def _release(self) -> None:
        """After a phase broke off inside its collectives (the engine then refuses every call): the step's
        teardown, then free the groups hdp made for this engine — on gloo only a freed group ends a peer's
        blocked collective (an abort does not).  Megatron's stay: verl's worker holds the model that uses
        them, so a peer blocked on one waits ``hdp.collective_timeout_s``, which they were built with."""
        dom, self._domain = self.domain, None
        ours = dom.groups_to_free()
        self.steps.close()
        for group in ours:
            with contextlib.suppress(Exception):  # already gone
                dist.destroy_process_group(group)

    @property
    def domain(self) -> VerlDomain:
        """hdp's domain; raises if Megatron was not initialised by this engine."""
        if self._domain is None:
            raise RuntimeError("HdpMegatronEngine.domain: Megatron groups are not built (engine not constructed?)")
        return self._domain

    @property
    def role_key(self) -> str:
        """The verl config key of this engine's role (``actor_rollout_ref.actor`` / ``.ref``, ``critic``)."""
        return role_key(self.hdp_config)

    @property
    def role(self) -> str:
        """``actor``, ``ref`` or ``critic``."""
        return self.role_key.rsplit(".", 1)[-1]

    @property
    def pad_token_id(self) -> int:
        """The token padding rounds run and the target after a sample's last token (neither is ever read by a
        loss, so any id of the vocabulary serves): the tokenizer's pad id, else the HF config's, else 0 — verl
        builds models without a tokenizer (``HFModelConfig(load_tokenizer=False)``)."""
        for source in (getattr(self.model_config, "tokenizer", None), getattr(self.model_config, "hf_config", None)):
            pad = getattr(source, "pad_token_id", None)
            if isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0:
                return pad
        return 0

    def get_data_parallel_rank(self) -> int:
        return 0  # every rank receives the whole mini-batch (as in verl's dynamic-CP mode)

    def get_data_parallel_size(self) -> int:
        return 1

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.domain.verl_dp_group

    def is_mp_src_rank_with_outputs(self) -> bool:
        layout = self.domain.layout
        return layout.is_last_stage and layout.tp_rank == 0 and self.domain.rank == 0

    def _build_tf_config(self) -> None:
        key = f"{self.role_key}.megatron.override_transformer_config"
        # the fusion flags of hdp's own RoPE / SwiGLU and MindSpeed's keys without MindSpeed leave Megatron's config
        self.fusions = resolve_fusions(self.engine_config.override_transformer_config, mindspeed=self.mindspeed, key=key)
        first = not dist.is_initialized() or dist.get_rank() == 0  # the same flags on every rank: said once
        for line in describe_fusions(self.fusions, select_device(None), key):
            logger.log(logging.WARNING if first else logging.DEBUG, "hdp engine: %s", line)
        hf_config = getattr(self.model_config, "hf_config", None)
        compat.expose_rope_theta(hf_config)  # mbridge's DeepSeek-V3 bridge reads it while verl builds the config
        if self.engine_config.vanilla_mbridge:
            compat.mbridge_deepseek_v3()  # its MLA config keyword under megatron-core 0.16's name
        with compat.megatron_sees_overrides(self.engine_config, self.fusions.megatron_overrides):
            super()._build_tf_config()
        cfg = self.tf_config
        if cfg is not None:  # what the built config says (a model's own defaults included)
            check_per_token_loss(getattr(cfg, "calculate_per_token_loss", False), f"{key}.calculate_per_token_loss")
            reconcile_router(cfg, hf_config, self.role_key)  # HF's group-limited routing (DeepSeek-V3)

    def _build_megatron_module(self) -> Any:
        module = super()._build_megatron_module()
        for chunk in module:
            install_hdp_attention(chunk, self.model_config.hf_config, fused_rope=self.fusions.rope)
        if self.hdp_config.hdp.zero_memory.value != "none":
            from hdp.moe import apply_zero_memory

            for chunk in module:
                apply_zero_memory(compat.unwrap_model(chunk), self.hdp_config.hdp.zero_memory,
                                  self.hdp_config.hdp.zero_memory_num_layers,
                                  fused_swiglu=True if self.fusions.swiglu else None)  # None: the built config's own
        return module

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True,
                        **kwargs: Any) -> None:
        """verl's Megatron checkpoint load under ``torch.no_grad()`` (fp32 main params are views of leaf
        params that Megatron copies into in place), then Adam's per-parameter ``step`` restored
        (:func:`hdp.core.optim_state.restore_adam_steps`: megatron-core 0.16.1 leaves a placeholder).

        First, before anything is written, the whole checkpoint is checked against this engine
        (:func:`hdp.core.checkpoint.check_fit` on :mod:`hdp.integrations.verl.checkpoint`'s views: every part verl
        will load — keys, shapes, dtypes from metadata and safetensors headers — and the role and architecture
        verl recorded): a checkpoint of another role (an actor's into the critic), model or layout raises
        :class:`~hdp.core.checkpoint.CheckpointError` (a ``ValueError``) on every rank, naming the first
        differing tensor and both sides; nothing changed and the engine stays usable."""
        self.core.usable("load_checkpoint")
        step = self.step
        with self.core.collectives("load: check", step):
            check_fit(local_path, guard=self.core.guard, step=step, checkpoint=lambda: saved_view(self, local_path),
                      engine=lambda: loaded_view(self, local_path))
        opt = getattr(self, "optimizer", None)
        captured = patches.optimizer_state_captured(opt) if opt is not None else contextlib.nullcontext([])
        with captured as loaded, torch.no_grad(), self.core.collectives("load", self.step), \
                self.core.checkpoint_collectives():
            super().load_checkpoint(local_path, hdfs_path, del_local_after_load, **kwargs)
        if opt is not None and loaded:
            restore_adam_steps(opt, loaded[-1])

    def save_checkpoint(self, local_path: str, *args: Any, **kwargs: Any) -> Any:
        """verl's Megatron checkpoint save, its collectives on a group with hdp's timeout and alarm; then the lock
        file verl's ``local_mkdir_safe`` left in the temporary directory for ``local_path`` is removed
        (:func:`hdp.integrations.verl.compat.mkdir_lock_path`)."""
        try:
            with self.core.collectives("save", self.step), self.core.checkpoint_collectives():
                return super().save_checkpoint(local_path, *args, **kwargs)
        finally:
            with contextlib.suppress(OSError):
                os.remove(compat.mkdir_lock_path(local_path))

    # -- steps: verl's primitives on the one step sequence (hdp.core.step) --

    @property
    def step(self) -> int:
        """Training passes that passed their agreement."""
        return self.steps.step if getattr(self, "steps", None) is not None else 0

    def announce(self, batches: Sequence[Any], extend: bool = False) -> None:
        """The next training mini-batches, in order: each is planned while the one before it trains."""
        self.planner.announce([sample_lengths(b) for b in batches], extend=extend)

    def _prepare(self, data: Any, loss_function: Callable | None, train: bool) -> Callable[[], Prepared]:
        """This door's part of a pass, run inside its agreement: the plan (made ahead when announced), the
        loss adapter on verl's batch, the batch digest, verl's global normalisers for each group's loss."""

        def prepare() -> Prepared:
            taken = self.planner.take(sample_lengths(data), infer=not train)
            mask = data["loss_mask"]
            n_tokens = int(mask.values().sum().item()) if mask.is_nested else int(mask.sum().item())
            compat.tensordict_utils().assign_non_tensor(data, batch_num_tokens=n_tokens, dp_size=1)  # a group's share
            adapter = self.loss_class(self, taken.plan, data, loss_function, train)
            adapter.check_loss(self.losses_checked)  # a loss whose value depends on the plan: refused, every rank
            digest = batch_digest(adapter.samples, None, {"loss_mask": list(mask.unbind()) if mask.is_nested else [mask]})
            return Prepared(taken.plan, digest, adapter.samples, adapter, taken.planner_ms, taken.exposed_ms,
                            hooks=route_replay(self.engine_config, taken.plan, data, train, self.domain.layout,
                                               getattr(self, "tf_config", None)))  # verl's MoE router replay, or None

        return prepare

    def forward_backward_batch(self, data: Any, loss_function: Callable | None, forward_only: bool = False) -> Any:
        """verl's forward (log-prob passes, ``forward_only``) or forward + backward, whose update
        :meth:`optimizer_step` applies (or skips, when the loss or a gradient was not finite on any rank)."""
        return self._collect(self._pass(data, loss_function, "hdp infer_batch" if forward_only else "hdp forward_backward",
                                        train=not forward_only))

    def _pass(self, data: Any, loss_function: Callable | None, what: str, *, train: bool) -> Pass:
        run = self.steps.forward_backward_batch if train else self.steps.infer_batch
        return run(what, what, self._prepare(data, loss_function, train))

    def train_batch(self, data: Any, loss_function: Callable) -> Any:
        """verl's ``BaseEngine.train_batch`` on these primitives, its outputs gathered after the update (they
        carry ``grad_norm`` and the step's calibration metrics)."""
        compat.maybe_fix_3d_position_ids(data)
        self.optimizer_zero_grad()
        done = self._pass(data, loss_function, "hdp train_batch", train=True)
        self.optimizer_step()
        return self._collect(done)

    def optimizer_zero_grad(self) -> None:
        """Zero the gradients (the passes since are the next update's)."""
        self.steps.optimizer_zero_grad()

    def optimizer_step(self) -> float:
        """The update of the passes since :meth:`optimizer_zero_grad` (`hdp.core.step.Steps.optimizer_step`); as
        verl's FSDP engine, a loss or gradient that was NaN/inf on any rank skips it on every rank and the
        grad norm is NaN (Megatron's own optimizer would apply it: its NaN check is off outside FSDP); the
        ``hdp.max_consecutive_skips``-th skip in a row raises `hdp.core.step.SkippedUpdatesError` instead."""
        outcome = self.steps.optimizer_step()
        if outcome.skipped is not None:
            logger.warning("hdp engine: %s", outcome.skipped)
        return outcome.grad_norm

    def _collect(self, done: Pass) -> dict[str, Any]:
        """verl's output dict on its collect rank (model_output in sample order, loss, metrics); ``{}``
        elsewhere.  The gathers run over the domain of TP rank 0 on the last stage only (a recorded pass's
        routes over the job)."""
        fp64 = next(self.module[0].parameters()).dtype == torch.float64  # logprobs_entropy's accumulation
        with self.core.phases.phase("collect"):
            hooks = done.prepared.hooks
            routes = None
            if hooks is not None and hooks.record:
                routes = hooks.collect(done.plan.num_rounds, len(self.module), self.domain.layout.world)
            out = verl_outputs(done, self.domain.layout, torch.float64 if fp64 else torch.float32)
            if routes is not None and out:
                out["model_output"]["routed_experts"] = compat.as_nested(routes)  # [S, L_i, layers, K] int16
            return out


class HdpMegatronValueEngine(HdpMegatronEngine):
    """verl's value model (the critic's engine, ``model_type="value_model"``) on hdp plans: the same engine,
    its model built by verl with the value head (``is_value_model``: mbridge's one-output last layer in place
    of the LM head), each round's values through verl's ``value_loss`` on whole samples
    (:class:`~hdp.integrations.verl.loss.VerlValueLoss`), ``compute_values`` returning ``values``."""

    loss_class = VerlValueLoss


def npu_engine_class(value: bool = False) -> type | None:
    """The hdp engine (``value``: the value model's) for Ascend NPUs, on verl's MindSpeed engine, or None
    when MindSpeed is absent.  Not run on hardware."""
    base = compat.mindspeed_lm_engine()
    if base is None:
        return None
    ours = HdpMegatronValueEngine if value else HdpMegatronEngine
    return type(f"{ours.__name__.replace('Megatron', 'Mindspeed')}", (ours, base),
                {"__doc__": f"{ours.__name__} on verl's MindSpeed engine (NPU).", "mindspeed": True})
