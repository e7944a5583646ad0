"""What the hdp engine takes from verl and gives back: batch lengths, metrics, the settings it rejects.

Pure helpers of :mod:`hdp.integrations.verl.engine` (no collective), tested on CPU.
"""

from __future__ import annotations

from typing import Any, Sequence

from hdp.integrations.verl.checks import ACTOR_KEY, REF_KEY, check_remove_padding, check_token_budgets, role_key

__all__ = ["sample_lengths", "SampleRows", "reduce_metrics", "reject_unsupported", "check_engine_settings",
           "install_hdp_attention"]


def sample_lengths(data: Any) -> list[int]:
    """L_i of every sample of verl's batch (``input_ids`` is a jagged nested tensor [S, j1])."""
    ids = data["input_ids"]
    if not getattr(ids, "is_nested", False):
        raise ValueError(
            "the hdp engine takes verl's no-padding batch (nested input_ids); "
            "set actor_rollout_ref.model.use_remove_padding=True"
        )
    return [int(x) for x in ids.offsets().diff().tolist()]




class SampleRows:
    """The rows of one verl batch for many sample subsets (a group's samples, round after round).

    `select` returns what ``verl.utils.tensordict_utils.index_select_tensor_dict`` does — every field
    indexed by the samples, a nested one rebuilt from its selected samples — with less work per call:
    each nested field is unbound once per batch (verl's function unbinds every nested field of the
    whole batch at each call), the tensors and per-sample non-tensor stacks are indexed in one
    TensorDict indexing, and the batch-wide non-tensor data (the same value on every row: verl's
    settings such as ``temperature``, ``dp_size``) is sliced once per subset size.
    """

    def __init__(self, data: Any) -> None:
        import torch
        from tensordict import NonTensorData

        nested = [k for k, v in data.items() if isinstance(v, torch.Tensor) and v.is_nested]
        same = [k for k, v in data.items() if isinstance(v, NonTensorData)]
        self._rows = data.exclude(*nested, *same)  # tensors and per-sample non-tensor stacks
        self._same = data.select(*same)
        self._same_of_size: dict[int, Any] = {}
        self._nested = [(k, data[k].unbind(), getattr(data[k], "_ragged_idx", data[k].dim() - 1)) for k in nested]

    def select(self, samples: Sequence[int]) -> Any:
        """The TensorDict of ``samples`` (caller indices, in that order)."""
        import torch
        from verl.utils.tensordict_utils import nested_tensor_from_tensor_list

        n = len(samples)
        sub = self._rows[torch.tensor(list(samples), dtype=torch.int64)]
        same = self._same_of_size.get(n)
        if same is None:
            same = self._same_of_size[n] = self._same[:n]  # every row holds the same value
        sub.update(same)
        for key, per_sample, ragged in self._nested:
            sub[key] = nested_tensor_from_tensor_list([per_sample[i] for i in samples], ragged_idx=ragged)
        return sub


def reduce_metrics(per_rank: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """verl metrics of one step from every rank's group-leader metric dicts.

    ``per_rank[r]`` holds the metric dicts of the groups rank r led (one per round it led).  verl's
    ``Metric`` values: SUM metrics (``actor/pg_loss``: each group's loss is its share of the
    mini-batch's, computed with ``dp_size = 1``) add up over groups, which is verl's "mean over DP
    ranks of per-rank sums" of a stock run; MEAN metrics
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
            out[name] = Metric(AggregationType.SUM, sum(vals))
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


def check_engine_settings(model_config: Any, engine_config: Any) -> None:
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





def install_hdp_attention(chunk: Any, hf_config: Any) -> None:
    """Swap every layer's core attention for hdp's and move RoPE into it (positions of the unsplit sample).

    Megatron's own RoPE takes positions from ``cu_seqlens``, which for zigzag chunks are not the
    sample positions; hdp's core attention applies RoPE at ``HdpPackedSeqParams.positions``.
    """
    from hdp.integrations.verl import compat
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
