"""verl's loss on hdp's rounds: after a round's logits the members of each CP group send their chunks'
log-probs (and entropies) to the group's first rank (its leader), which holds the group's samples whole and
runs verl's *real* loss function on them once, with the mini-batch's global normalisers
(``batch_num_tokens``, ``global_batch_size``, ``dp_size = 1``): each group's loss is its share of the
mini-batch's.  The leader sends each member the loss's gradient at the member's rows, and each member's
round loss is its rows times that gradient (value 0; the leader's is the group's loss), so the domain sum of
gradients is the single-process gradient.  A rank alone in its group holds its samples whole and runs
verl's loss through its own rows.  verl's metrics of the pass come from one more call, without gradient, on
the whole mini-batch at verl's collect rank (`VerlLoss.whole_metrics`): each is the mini-batch's own value.

That sum is the mini-batch's loss only for a loss additive over samples: before any round, every training pass
checks verl's loss on two of the mini-batch's own samples (:func:`hdp.integrations.verl.loss_kinds.check_additive`),
and the policy losses that are a plain mean of their call run with hdp's normalisation
(:mod:`hdp.integrations.verl.loss_kinds`).

Legend: S samples of the mini-batch (verl's order), L_i their lengths, Tr this rank's real tokens of a round.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hdp.dispatch import group_to_leader, leader_to_group, pack
from hdp.integrations.verl import compat, loss_kinds, old_log_prob
from hdp.integrations.verl.batch import SampleRows
from hdp.fused_logprobs import LastHidden, token_logprobs_entropy, token_sum_pi_squared
from hdp.packing import Plan
from hdp.core.rounds import RoundInput, check_round_loss, next_token_targets

__all__ = ["VerlLoss", "VerlValueLoss"]


class VerlLoss:
    """The round loss of verl: log-probs (and entropies) of this rank's chunks, the group's samples
    assembled whole, verl's loss function on them; outputs kept for verl's collect rank."""

    @property
    def width(self) -> int:
        """C: per-token columns `local` returns (`fields`: the log-prob, and the entropy when it is asked for)."""
        return len(self.fields())

    def __init__(self, engine: Any, plan: Plan, data: Any, loss_function: Callable | None,
                 train: bool) -> None:
        tu = compat.tensordict_utils()
        self.engine, self.plan, self.data, self.loss_function, self.train = engine, plan, data, loss_function, train
        self.entropy = bool(tu.get_non_tensor_data(data, key="calculate_entropy", default=False))
        # the driver skipped the old-log-prob pass (`hdp.integrations.verl.old_log_prob`): this update's own
        # log-probs are the old ones, and its entropy is the pass's ``actor/entropy``
        self.own_old = train and bool(tu.get_non_tensor_data(data, key=old_log_prob.SKIP_FLAG, default=False))
        self.entropy_asked = self.entropy
        self.entropy = self.entropy or self.own_old
        # verl's optimal-token-baseline estimators read Σ_v p_v² of every token from the log-prob pass
        self.sum_pi_squared = not train and bool(tu.get_non_tensor_data(data, key="calculate_sum_pi_squared", default=False))
        self.samples = list(data["input_ids"].unbind())  # S x [L_i]: the rounds' tokens (unbound once a step)
        self.targets = next_token_targets(self.samples, engine.pad_token_id)  # verl: position p predicts p+1
        temp = data["temperature"] if "temperature" in data.keys() else 1.0
        self.temperature = torch.as_tensor(temp, dtype=torch.float32)  # [] or [S]
        self.outputs: dict[int, torch.Tensor] = {}  # round -> [Tr, C] (`fields`: log-prob, entropy; or value)
        self.leader_losses: list[torch.Tensor] = []
        self.rows = (SampleRows(data, unbound={"input_ids": self.samples}, same=engine.same_rows)
                     if train and loss_function is not None else None)  # each group's sub-batch
        self.whole: dict[int, torch.Tensor] = {}  # round -> [ΣL_i, C] of the group this rank leads (training)

    def fields(self) -> dict[str, int]:
        """verl's ``model_output`` names of the columns this adapter keeps per token."""
        names = ["log_probs"] + (["entropy"] if self.entropy else []) + (["sum_pi_squared"] if self.sum_pi_squared else [])
        return {name: col for col, name in enumerate(names)}

    def check_loss(self, checked: dict[Any, Any]) -> None:
        """Before any round (inside the pass's agreement, on every rank): verl's loss function, as this adapter
        runs it on a group, is additive over two of the mini-batch's samples
        (:func:`hdp.integrations.verl.loss_kinds.check_additive`), or the pass raises naming the keys.
        ``checked``: the engine's record of conclusive checks — the same loss function on a batch with the
        same fields and outputs is not checked again (its policy loss's kind stays checked at every call)."""
        if not self.train or self.loss_function is None:
            return
        assert self.rows is not None
        slot = (id(self.loss_function), tuple(sorted(self.data.keys())), self.own_old, self.entropy)
        if checked.get(slot) is self.loss_function:
            return
        lengths = [int(t.shape[0]) for t in self.samples]
        resp = self.data["response_mask"] if "response_mask" in self.data.keys() else None
        response = [int(x) for x in resp.offsets().diff().tolist()] if getattr(resp, "is_nested", False) else lengths
        cols = self.fields()

        def run(samples: list[int], outputs: torch.Tensor) -> torch.Tensor:
            loss, _, _ = self._call_loss(samples, [lengths[i] for i in samples], outputs)
            return loss

        if loss_kinds.check_additive(run, lengths, response, len(cols), what=self._loss_name(), keys=self._loss_keys()):
            checked[slot] = self.loss_function  # held: its id cannot be reused while the record stands

    def _loss_name(self) -> str:
        name = getattr(getattr(self.loss_function, "func", self.loss_function), "__name__", "the loss function")
        return f"verl's loss function {name}"

    def _loss_keys(self) -> str:
        config = getattr(self.loss_function, "keywords", {}).get("config")
        key = "critic" if self.fields() == {"values": 0} else "actor_rollout_ref.actor"
        if config is None:
            return "the loss function passed to the engine"
        parts = [f"{key}.loss_agg_mode={getattr(config, 'loss_agg_mode', None)}",
                 f"{key}.loss_scale_factor={getattr(config, 'loss_scale_factor', None)}"]
        policy = getattr(config, "policy_loss", None)
        if policy is not None:
            parts.insert(0, f"{key}.policy_loss.loss_mode={policy.get('loss_mode', 'vanilla')}")
        return ", ".join(parts)

    def local(self, rnd: RoundInput, out: torch.Tensor | LastHidden) -> torch.Tensor:
        """[Tr, C] per-token outputs of this rank's chunks (log-prob, entropy) from the round's output: logits
        [Tr, Vl], or on the fused path (``use_fused_kernels``) the hidden states and output weight."""
        meta, eng = rnd.meta, self.engine
        assert meta is not None
        dev = out.device
        temp = self.temperature if self.temperature.dim() == 0 else self.temperature[meta.sample_index]
        chunk = int(eng.engine_config.entropy_from_logits_chunk_size)
        logp, ent = token_logprobs_entropy(out, pack(meta, self.targets).to(dev), eng.domain.layout.tp,
                                           temperature=temp.to(dev), entropy=self.entropy, chunk=chunk)  # [Tr]
        cols = [logp] + ([ent] if ent is not None else [])
        if self.sum_pi_squared:
            cols.append(token_sum_pi_squared(out, eng.domain.layout.tp, temperature=temp.to(dev), chunk=chunk).to(logp.dtype))
        return torch.stack(cols, dim=-1)  # [Tr, C]

    def __call__(self, rnd: RoundInput, out: torch.Tensor | LastHidden) -> torch.Tensor | None:
        assert rnd.meta is not None
        local = self.local(rnd, out)  # [Tr, C]
        self.outputs[rnd.index] = local.detach()
        if not self.train or self.loss_function is None:
            return None
        return self._round_share(rnd, local)

    def _round_share(self, rnd: RoundInput, local: torch.Tensor) -> torch.Tensor:
        """This rank's round loss from its rows ``local`` [Tr, C] (training): its group's loss on its leader,
        a zero carrying the loss's gradient at its rows on the other members."""
        meta, eng = rnd.meta, self.engine
        if meta.k == 1:  # alone in its group: the rank holds its samples whole, verl's loss through its rows
            self.whole[rnd.index] = local.detach()
            loss = self._group_loss(meta, local)
            check_round_loss(loss, "verl's loss function", "model_output")
            return loss
        # a CP group: its leader (position 0) assembles the samples whole, runs verl's loss once and hands each
        # member the loss's gradient at its rows; each member's share carries that gradient into its rows
        group = eng.domain.layout.domain
        with eng.core.phases.phase("exchange"):
            full = group_to_leader(meta, local, group)  # [ΣL_i, C] on the leader (detached), None elsewhere
        loss, grad, error = None, None, None
        if full is not None:
            self.whole[rnd.index] = full
            leaf = full.detach().requires_grad_()  # [ΣL_i, C]
            try:
                loss = self._group_loss(meta, leaf)
                check_round_loss(loss, "verl's loss function", "model_output")
                (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
            except Exception as exc:  # noqa: BLE001 - the members wait for their rows: send them, then raise
                error = exc
            grad = torch.zeros_like(full) if grad is None else grad
        with eng.core.phases.phase("exchange"):
            mine = leader_to_group(meta, grad, local, group)  # [Tr, C]: dloss/d(own rows)
        if error is not None:
            raise error
        share = (local * mine).sum()
        zero = share - share.detach()  # 0 (NaN where the gradient is), the gradient of the group's loss at own rows
        return zero if loss is None else loss.detach() + zero  # the group's loss counted once: on its leader

    def _call_loss(self, samples: Any, lengths: Any, full: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        """verl's loss function on ``samples`` whole (``full`` [ΣL_i, C] their per-token outputs, in that order,
        ``lengths`` their L_i), the policy losses normalised (:mod:`hdp.integrations.verl.loss_kinds`): (loss,
        metrics, the samples' rows of verl's batch)."""
        assert self.rows is not None and self.loss_function is not None
        sub = self.rows.select(samples)  # the samples' rows of verl's batch, in that order
        out = {name: compat.nested_from_flat(full[:, col], lengths) for name, col in self.fields().items()}
        if self.own_old:
            old_log_prob.substitute(sub, out["log_probs"])
        with compat.policy_losses_wrapped(loss_kinds.normalised_policy_losses):
            loss, metrics = self.loss_function(model_output=out, data=sub, dp_group=self.engine.get_data_parallel_group())
        return loss, metrics, sub

    def _group_loss(self, meta: Any, full: torch.Tensor) -> torch.Tensor:
        """verl's loss function on the group's samples whole (``full`` [ΣL_i, C], group order); the leader
        (position 0) keeps its loss for verl's collect rank (verl's metrics come from `whole_metrics`)."""
        loss, _, _ = self._call_loss(meta.samples, meta.group_lengths, full)
        if meta.j == 0:  # one copy per group (its leader)
            self.leader_losses.append(loss.detach())
        return loss

    def _metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """A loss call's metrics as verl reports them (tensors as floats; with the old-log-prob pass skipped, the
        pass's ``actor/entropy`` from this forward)."""
        if self.own_old and "actor/entropy_loss" in metrics:  # the skipped pass's metric, from this forward
            metrics = dict(metrics)
            metrics["actor/entropy"] = metrics["actor/entropy_loss"] if self.entropy_asked else metrics.pop("actor/entropy_loss")
        return {k: float(v.detach()) if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}

    def whole_metrics(self, full: list[torch.Tensor]) -> dict[str, Any]:
        """verl's metrics of this training pass: verl's loss function once more on the mini-batch whole, without
        gradient (``full``: S x [L_i, C] every sample's per-token outputs in verl's sample order, as verl's collect
        rank gathers them).  Every metric is then the mini-batch's own value, whatever the plan — what verl's
        stock engine reports with one micro-batch at DP 1 — including those no weighting of the groups' values
        recovers (minima, maxima, standard deviations, per-sequence statistics: bypass mode's ``rollout_corr/*``)."""
        assert self.rows is not None and self.loss_function is not None
        with torch.no_grad():
            _, metrics, _ = self._call_loss(list(range(len(full))), [int(x.shape[0]) for x in full], torch.cat(full))
        return self._metrics(metrics)


class VerlValueLoss(VerlLoss):
    """The round loss of verl's value model (critic): the value head's output per token (one value per input
    token, verl's ``values`` before its shift to the responses), the group's samples whole, verl's
    ``value_loss`` on them; values kept for verl's collect rank."""

    def fields(self) -> dict[str, int]:
        return {"values": 0}

    def local(self, rnd: RoundInput, logits: torch.Tensor) -> torch.Tensor:
        """[Tr, 1] float32 values from the value head's output [Tr, 1] (every TP rank holds them whole:
        the head gathers the sequence-parallel rows)."""
        return logits[:, :1].float()
