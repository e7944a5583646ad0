"""MoE router replay on hdp plans (``actor_rollout_ref.actor.megatron.router_replay.mode``: R2 or R3).

verl's router replay (``verl/utils/megatron/router_replay_patch.py``, applied by verl's Megatron engine when the
mode is not ``disabled``) gives every ``TopKRouter`` a ``RouterReplay``: in ``RECORD`` it keeps the experts it
chose, in ``REPLAY_FORWARD`` it routes each row to the given experts (the probabilities re-gathered from the
live scores there) where a mask allows, and in ``REPLAY_BACKWARD`` a recompute pops the targets in forward
order.  verl's own engine feeds the routes through its own packing; hdp packs, splits (zigzag CP chunks) and
orders tokens its own way, so the routes must follow them.  :class:`RouteReplay` does that as the round core's
`hdp.core.rounds.RoundHooks`:

* **replay** (R3: the rollout's routes, in every pass; R2: the routes its old-log-prob pass recorded, in the
  update): before a chunk's forward of a round, each of its routers gets the routes of exactly the rows it will
  see — this rank's packed tokens of the round (`hdp.dispatch.pack`: the group's samples, this rank's zigzag
  chunks, in order), then the padding rows (native routing), cut to this TP rank's sequence-parallel slice —
  for its layer; after the forward the routers turn to backward replay.  Under R3 the last token of each
  sample keeps its native routing (the rollout never routed it; verl's ``build_r3_replay_mask``);
* **record** (R2, the actor's forward-only pass without routes): the routers record; afterwards each rank's
  rows go back to their samples (`hdp.dispatch.gather_outputs` over the domain, after the TP ranks' slices are
  joined) and the pipeline stages' layers to verl's collect rank, as ``routed_experts`` [S, L_i, layers, topk]
  (int16, verl's dtype) in verl's sample order.

Routes index layers as verl's do: by absolute layer when they hold every layer, else by MoE ordinal.
Legend: S samples, L_i their lengths, T a rank's rows of a round (Tr real), Lr route layers, K top-k.
Status: on CPU (gloo) through verl's ``ActorRolloutRefWorker``; not run on hardware.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from hdp.dispatch import gather_outputs, pack
from hdp.groups import LayoutGroups
from hdp.packing import Plan
from hdp.core.rounds import RoundInput

__all__ = ["RouteReplay", "replay_mode", "route_replay"]


def replay_mode(engine_config: Any, data: Any, train: bool) -> tuple[bool, bool]:
    """(replay, record) for one pass of an engine whose ``router_replay.mode`` is ``engine_config``'s: replay
    whenever the batch holds ``routed_experts`` (R3 from the rollout; R2 from the pass that recorded them), record
    on an R2 forward-only pass without them (verl's actor old-log-prob pass)."""
    mode = str(getattr(getattr(engine_config, "router_replay", None), "mode", "disabled") or "disabled")
    if mode == "disabled":
        return False, False
    has = "routed_experts" in data.keys()
    return has, (mode == "R2" and not train and not has)


def route_replay(engine_config: Any, plan: Plan, data: Any, train: bool, layout: LayoutGroups,
                 tf_config: Any) -> RouteReplay | None:
    """The round hooks of one pass (`replay_mode`): a :class:`RouteReplay` replaying the batch's routes or
    recording them, or None when the pass neither replays nor records."""
    replay, record = replay_mode(engine_config, data, train)
    if not (replay or record):
        return None
    routes = list(data["routed_experts"].unbind()) if replay else None  # S x [L_i, Lr, K]
    return RouteReplay(plan, routes, str(engine_config.router_replay.mode), layout, tf_config,
                       bool(getattr(tf_config, "sequence_parallel", False)))


def _routers(model: Any) -> list[tuple[int, Any]]:
    """(layer number, RouterReplay) of every replay-enabled router of ``model``'s decoder, in layer order."""
    from verl.utils.megatron.router_replay_utils import iter_model_routers

    from hdp.integrations.verl import compat

    return sorted(iter_model_routers(compat.unwrap_model(model)), key=lambda x: x[0])


def _moe_layers(config: Any) -> list[int]:
    """0-based indices of the model's MoE layers (Megatron's ``moe_layer_freq``: every k-th layer, or a 0/1 list)."""
    n = int(config.num_layers)
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return [i for i in range(n) if i % freq == 0]
    return [i for i in range(n) if int(list(freq)[i])]


class RouteReplay:
    """The round core's hooks that make verl's router replay follow hdp's packing (see the module docstring).

    ``routes``: S x [L_i or L_i - 1, Lr, K] int (verl's ``routed_experts``), or None when recording; ``mode``:
    ``R2`` or ``R3``; ``layout``: the job's groups; ``config``: the model's TransformerConfig; ``sequence_parallel``:
    the routers see this TP rank's slice of each round's rows."""

    def __init__(self, plan: Plan, routes: Sequence[torch.Tensor] | None, mode: str, layout: LayoutGroups,
                 config: Any, sequence_parallel: bool) -> None:
        from verl.utils.megatron.router_replay_patch import RouterReplayAction

        self.plan, self.mode, self.layout, self.config = plan, mode, layout, config
        self.sp = bool(sequence_parallel) and layout.tp_size > 1
        self.action = RouterReplayAction
        self.record = routes is None
        self.models: dict[int, Any] = {}  # chunk -> model (whose routers are cleared at the end)
        self.recorded: dict[tuple[int, int], torch.Tensor] = {}  # (round, chunk) -> [T(/tp), L_chunk, K]
        self.layers: dict[int, list[int]] = {}  # chunk -> its routers' layer numbers (1-based)
        self._targets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # round -> ([T(/tp), Lr, K], [T(/tp)])
        if routes is not None:
            self.routes = [r.to(torch.int64) for r in routes]
            moe = _moe_layers(config)
            width = self.routes[0].shape[1] if self.routes else len(moe)
            self.by_layer = width == int(config.num_layers)
            self.moe_ordinal = {layer: i for i, layer in enumerate(moe)}

    # -- the round core's hooks --

    def before_forward(self, rnd: RoundInput, chunk: int, model: Any) -> None:
        self.models[chunk] = model
        routers = _routers(model)
        self.layers.setdefault(chunk, [n for n, _ in routers])
        if self.record:
            for _, router in routers:
                router.set_router_replay_action(self.action.RECORD)
            return
        idx, mask = self._round_targets(rnd)
        for number, router in routers:
            layer = number - 1 if self.by_layer else self.moe_ordinal[number - 1]
            router.set_target_indices(idx[:, layer], replay_mask=mask)  # [T(/tp), K], [T(/tp)]
            router.set_router_replay_action(self.action.REPLAY_FORWARD)

    def after_forward(self, rnd: RoundInput, chunk: int, model: Any) -> None:
        routers = _routers(model)
        if self.record:
            got = [router.get_recorded_indices() for _, router in routers]
            if got and all(g is not None for g in got):
                self.recorded[(rnd.index, chunk)] = torch.stack(got, dim=1).to("cpu", torch.int64)  # [T(/tp), L, K]
            return
        for _, router in routers:
            router.set_router_replay_action(self.action.REPLAY_BACKWARD)  # a recompute pops its forward's targets

    def finish(self) -> None:
        """Clear this model's routers (targets, records, actions); the records are kept here."""
        for model in self.models.values():
            for _, router in _routers(model):
                router.clear_indices()
                router.clear_router_replay_action()

    # -- replay --

    def _round_targets(self, rnd: RoundInput) -> tuple[torch.Tensor, torch.Tensor]:
        """([T(/tp), Lr, K] int64 experts, [T(/tp)] bool mask) of this rank's rows of round ``rnd``."""
        got = self._targets.get(rnd.index)
        if got is not None:
            return got
        t = int(rnd.tokens.shape[0])
        lr, k = self.routes[0].shape[1:] if self.routes else (1, 1)
        idx = torch.zeros((t, lr, k), dtype=torch.int64)
        mask = torch.zeros(t, dtype=torch.bool)
        meta = rnd.meta
        if meta is not None and meta.num_tokens:
            full, ok = {}, {}
            for s, length in zip(meta.samples, meta.group_lengths):
                r = self.routes[s]  # [L_i or fewer, Lr, K]
                rows = min(int(r.shape[0]), length)
                full[s] = torch.zeros((length, lr, k), dtype=torch.int64)
                full[s][:rows] = r[:rows]
                m = torch.zeros(length, dtype=torch.bool)
                m[:rows] = True
                if self.mode == "R3":
                    m[length - 1] = False  # the rollout never routed a sample's last token
                ok[s] = m
            tr = meta.num_tokens
            idx[:tr] = pack(meta, full)
            mask[:tr] = pack(meta, ok)
        if self.sp:  # the routers see this TP rank's contiguous slice of the round's rows
            per = t // self.layout.tp_size
            lo = self.layout.tp_rank * per
            idx, mask = idx[lo:lo + per], mask[lo:lo + per]
        dev = rnd.tokens.device
        self._targets[rnd.index] = got = (idx.to(dev), mask.to(dev))
        return got

    # -- record --

    def collect(self, num_rounds: int, num_chunks: int, world_group: dist.ProcessGroup) -> list[torch.Tensor] | None:
        """The recorded routes, S x [L_i, L_moe, K] int16 in verl's sample order, on verl's collect rank (TP rank 0
        of the last stage, domain rank 0); None elsewhere.  Collective over the TP group, the domain and
        ``world_group`` (every rank calls it)."""
        lay, plan = self.layout, self.plan
        per_chunk: dict[int, list[torch.Tensor] | None] = {}
        for chunk in range(num_chunks):
            layers = len(self.layers.get(chunk, []))
            local = []
            for r in range(plan.num_rounds):
                rec = self.recorded.get((r, chunk))
                if rec is None:
                    rec = torch.zeros((0, layers, 1), dtype=torch.int64)
                if self.sp:  # the TP ranks' slices of the round's rows, joined in TP order
                    parts = [torch.empty_like(rec) for _ in range(lay.tp_size)]
                    dist.all_gather(parts, rec.contiguous(), group=lay.tp)
                    rec = torch.cat(parts)
                from hdp.dispatch import local_meta

                tr = local_meta(plan, lay.domain.domain_rank, r).num_tokens
                local.append(rec[:tr].reshape(tr, -1).to(torch.float64))  # [Tr, L_chunk * K]: ids exact in float64
            if all(x.shape[1] == 0 for x in local):
                per_chunk[chunk] = None
                continue
            per_chunk[chunk] = gather_outputs(plan, lay.domain.domain_rank, local, lay.domain.domain, dst=0)
        mine: list[tuple[list[int], list[torch.Tensor]]] = []
        if lay.domain.domain_rank == 0 and lay.tp_rank == 0:
            for chunk, samples in per_chunk.items():
                if samples is not None:
                    k = samples[0].shape[1] // max(1, len(self.layers[chunk])) if samples else 1
                    mine.append((self.layers[chunk], [x.reshape(x.shape[0], -1, k).to(torch.int16) for x in samples]))
        everyone: list[Any] = [None] * lay.world_size
        dist.all_gather_object(everyone, mine, group=world_group)
        if not (lay.is_last_stage and lay.tp_rank == 0 and lay.domain.domain_rank == 0):
            return None
        pieces = [(layers, samples) for got in everyone if got for layers, samples in got]
        pieces.sort(key=lambda p: p[0][0])  # stages and virtual chunks in global layer order
        return [torch.cat([samples[s] for _, samples in pieces], dim=1) for s in range(plan.num_samples)]
