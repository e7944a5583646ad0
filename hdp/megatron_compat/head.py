"""The output layer of one Megatron ``GPTModel`` returning its input instead of the logits: the fused
log-prob path (`hdp.fused_logprobs`).

Megatron's ``GPTModel._postprocess`` ends with ``logits, _ = self.output_layer(hidden_states,
weight=output_weight)`` and returns ``logits.transpose(0, 1)`` [1, T, Vl]; the output layer is a
``ColumnParallelLinear`` that, under sequence parallelism, all-gathers the sequence-parallel rows over TP
first (its backward reduce-scatters the input gradient), and otherwise all-reduces the input gradient over
TP in its backward.  :func:`install_hidden_head` replaces the forward **of that one module instance** (an
instance attribute: other models, and Megatron's class, are untouched), for as long as the caller holds the
handle — the round core holds it for its own rounds only, so another engine (or anything else) running the
same model meets Megatron's forward — by one that does only the TP part:

    h = gather_from_sequence_parallel_region(x)   (sequence parallel: AG forward, RS backward)
    h = copy_to_tensor_model_parallel_region(x)   (TP without it: identity forward, AR backward)
    return h, None                                [T, 1, H] -> the model returns [1, T, H]

and records the weight the model passed (the embedding's under tied embeddings, else its own), so the
model returns the final hidden states and the round core reads the weight from the handle
(:class:`HiddenHead`).  The fused path's gradient of ``h`` is each TP rank's part of the sum over its
vocabulary shard; the mapping's backward sums it, exactly as it sums the output layer's ``dgrad``.

Why a patch: megatron-core 0.16.1 has no option to return the pre-logit hidden states from the training
forward (``GPTModel.forward`` with ``labels`` computes the cross-entropy, without them the logits; MTP and
``inference_context`` options aside).  It can go when Megatron offers such an output (or a fused
log-prob output layer).  Undone by :meth:`HiddenHead.remove` (at the end of each of the core's runs).
"""

from __future__ import annotations

from typing import Any

import torch

from hdp.megatron_compat.names import tensor_parallel

__all__ = ["HiddenHead", "fused_head_problem", "install_hidden_head"]


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


def fused_head_problem(model: Any) -> str | None:
    """Why the fused path cannot stand in exactly for this model chunk's output layer (a sentence), or
    ``None`` when it can (a chunk without the output layer: ``None``, nothing to replace)."""
    m = _unwrap(model)
    if not getattr(m, "post_process", False):
        return None
    layer = getattr(m, "output_layer", None)
    if type(layer) is not tensor_parallel.ColumnParallelLinear:
        return (f"the model's output layer is {type(layer).__name__}, not Megatron's ColumnParallelLinear LM head "
                "(a value head?)")
    cfg = m.config
    if getattr(cfg, "mtp_num_layers", None):
        return f"multi-token prediction (mtp_num_layers={cfg.mtp_num_layers}) runs the output layer on its own"
    if layer.gather_output:
        return "the output layer gathers the logits over TP (parallel_output=False)"
    if getattr(layer, "bias", None) is not None and not layer.skip_bias_add:
        return "the output layer has a bias"
    if getattr(cfg, "defer_embedding_wgrad_compute", False):
        return "defer_embedding_wgrad_compute defers the output layer's weight gradient"
    if getattr(layer, "explicit_expert_comm", False) or getattr(layer, "disable_grad_reduce", False):
        return "the output layer skips its TP input-gradient reduction"
    return None


class HiddenHead:
    """One model chunk's output layer returning its (TP-gathered) input; ``weight`` is the weight the last
    forward was given (``None`` before the first).  :meth:`remove` puts Megatron's forward back."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.weight: torch.Tensor | None = None
        self._previous = layer.__dict__.get("forward")  # an instance forward set before this one, if any

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        """[S, 1, H] (S = T / TP under sequence parallelism) -> ([T, 1, H], None)."""
        layer = self.layer
        if runtime_gather_output:
            raise RuntimeError("hdp's fused log-prob head does not gather logits (runtime_gather_output=True: inference)")
        self.weight = layer.weight if weight is None else weight  # [Vl, H]
        group = layer.tp_group
        if layer.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                                          group=group)
        elif group is not None and group.size() > 1:
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(input_, group=group)
        else:
            hidden = input_
        return hidden, None

    def remove(self) -> None:
        """The forward the layer had before back: Megatron's (idempotent)."""
        if self.layer is not None and self.layer.__dict__.get("forward") == self.forward:
            if self._previous is None:
                del self.layer.forward
            else:
                self.layer.forward = self._previous
        self.layer, self.weight, self._previous = None, None, None


def install_hidden_head(model: Any) -> HiddenHead | None:
    """Replace this model chunk's output-layer forward (see the module docstring); ``None`` for a chunk
    without the output layer.  ValueError naming the reason when the fused path cannot stand in for it
    exactly (:func:`fused_head_problem`)."""
    problem = fused_head_problem(model)
    if problem is not None:
        raise ValueError(f"the fused log-prob path cannot replace this model's output layer: {problem}")
    m = _unwrap(model)
    if not getattr(m, "post_process", False):
        return None
    head = HiddenHead(m.output_layer)
    m.output_layer.forward = head.forward  # this instance only
    return head
