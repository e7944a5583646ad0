"""verl's loss on hdp's rounds: after a round's logits the ranks of each CP group exchange their chunks'
log-probs (and entropies) among themselves only, so each holds its group's samples whole with its own chunk
differentiable, and verl's *real* loss function runs on those whole samples with the mini-batch's global
normalisers (``batch_num_tokens``, ``global_batch_size``, ``dp_size = 1``): each group's loss is its share
of the mini-batch's, so the domain sum of gradients is the single-process gradient.

Legend: S samples of the mini-batch (verl's order), L_i their lengths, Tr this rank's real tokens of a round.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hdp.dispatch import group_samples_flat, pack
from hdp.integrations.verl import compat
from hdp.integrations.verl.batch import SampleRows
from hdp.logprobs import logprobs_entropy
from hdp.packing import Plan
from hdp.trainer.rounds import RoundInput, next_token_targets

__all__ = ["VerlLoss"]


class VerlLoss:
    """The round loss of verl: log-probs (and entropies) of this rank's chunks, the group's samples
    assembled whole, verl's loss function on them; outputs kept for verl's collect rank."""

    def __init__(self, engine: Any, plan: Plan, data: Any, loss_function: Callable | None,
                 train: bool) -> None:
        tu = compat.tensordict_utils()
        self.engine, self.plan, self.data, self.loss_function, self.train = engine, plan, data, loss_function, train
        self.entropy = bool(tu.get_non_tensor_data(data, key="calculate_entropy", default=False))
        self.samples = list(data["input_ids"].unbind())  # S x [L_i]: the rounds' tokens (unbound once a step)
        self.targets = next_token_targets(self.samples, engine.pad_token_id)  # verl: position p predicts p+1
        temp = data["temperature"] if "temperature" in data.keys() else 1.0
        self.temperature = torch.as_tensor(temp, dtype=torch.float32)  # [] or [S]
        self.outputs: dict[int, torch.Tensor] = {}  # round -> [Tr, 2] (log-prob, entropy)
        self.leader_metrics: list[dict[str, Any]] = []  # one per group this rank led
        self.leader_losses: list[torch.Tensor] = []
        self.rows = SampleRows(data) if train and loss_function is not None else None  # each group's sub-batch
        self.whole: dict[int, torch.Tensor] = {}  # round -> [ΣL_i, 2] of the group this rank leads (training)

    def __call__(self, rnd: RoundInput, logits: torch.Tensor) -> torch.Tensor | None:
        meta, eng = rnd.meta, self.engine
        assert meta is not None
        dev = logits.device
        temp = self.temperature if self.temperature.dim() == 0 else self.temperature[meta.sample_index]
        logp, ent = logprobs_entropy(logits, pack(meta, self.targets).to(dev), eng.domain.layout.tp,
                                     temperature=temp.to(dev), entropy=self.entropy,
                                     chunk=int(eng.engine_config.entropy_from_logits_chunk_size))  # [Tr]
        local = torch.stack([logp, ent if ent is not None else torch.zeros_like(logp)], dim=-1)  # [Tr, 2]
        self.outputs[rnd.index] = local.detach()
        if not self.train or self.loss_function is None:
            return None
        with eng.core.phases.phase("exchange"):
            full = group_samples_flat(self.plan, meta, local, eng.domain.layout.domain)  # [ΣL_i, 2]; own rows keep grad
        assert self.rows is not None
        if meta.j == 0:  # the group's leader keeps its samples whole for verl's collect rank
            self.whole[rnd.index] = full.detach()
        sub = self.rows.select(meta.samples)  # the group's rows of verl's batch, in group order
        out = {"log_probs": compat.nested_from_flat(full[:, 0], meta.group_lengths)}
        if self.entropy:
            out["entropy"] = compat.nested_from_flat(full[:, 1], meta.group_lengths)
        loss, metrics = self.loss_function(model_output=out, data=sub, dp_group=eng.get_data_parallel_group())
        if meta.j == 0:  # one copy per group (its leader)
            self.leader_metrics.append({k: float(v.detach()) if isinstance(v, torch.Tensor) else v
                                        for k, v in metrics.items()})
            self.leader_losses.append(loss.detach())
        return loss
