"""verl 0.9.0's padding helpers on a machine without flash-attn (CPU): what verl 0.9.1 does itself.

verl's no-padding batches (``verl.workers.utils.padding.left_right_2_no_padding``, which the trainer and the
tests build every update batch with) unpad through ``verl.utils.attention_utils``.  verl 0.9.0 imports them from
``flash_attn.bert_padding`` unconditionally (flash-attn ships CUDA wheels only); verl 0.9.1 falls back to pure-torch
equivalents when flash-attn is missing.  :func:`install` gives verl 0.9.0 the same fallbacks (a scaffolding patch of
``attention_utils._get_attention_functions``; a no-op on 0.9.1, on NPUs and where flash-attn is installed).

Legend: B batch, L padded length, T tokens kept (Σ of the mask).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["install", "index_first_axis", "pad_input", "unpad_input", "rearrange"]


def index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``flash_attn.bert_padding.index_first_axis``: the rows ``indices`` of ``tensor`` [N, ...] -> [len(indices), ...]."""
    assert tensor.ndim >= 2
    return tensor[indices]


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """``flash_attn.bert_padding.pad_input``: the kept rows [T, ...] scattered back to [B, L, ...] (zeros elsewhere)."""
    other = hidden_states.shape[1:]
    out = hidden_states.new_zeros(batch * seqlen, *other)  # [B*L, ...]
    out[indices] = hidden_states
    return out.view(batch, seqlen, *other)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: Any = None) -> tuple:
    """``flash_attn.bert_padding.unpad_input``: (kept rows [T, ...], their flat indices [T], cu_seqlens [B+1] int32,
    the longest row's length, each row's used length [B] int32) of ``hidden_states`` [B, L, ...]."""
    masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask  # [B, L]
    seqlens = masks.sum(dim=-1, dtype=torch.int32)  # [B]
    used = attention_mask.sum(dim=-1, dtype=torch.int32)  # [B]
    indices = torch.nonzero(masks.flatten(), as_tuple=False).flatten()  # [T]
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))  # [B+1]
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])  # [B*L, ...]
    return index_first_axis(flat, indices), indices, cu_seqlens, int(seqlens.max().item()), used


def rearrange(*args: Any, **kwargs: Any) -> Any:
    """``einops.rearrange`` (what flash-attn re-exports)."""
    from einops import rearrange as einops_rearrange

    return einops_rearrange(*args, **kwargs)


def _functions() -> tuple[Callable, Callable, Callable, Callable]:
    return index_first_axis, pad_input, rearrange, unpad_input


def install() -> bool:
    """Give verl's ``attention_utils`` the fallbacks above where it would import flash-attn and flash-attn is not
    installed (verl 0.9.0 on CPU); True if it changed anything.  Idempotent."""
    from verl.utils import attention_utils
    from verl.utils.device import is_torch_npu_available

    if importlib.util.find_spec("flash_attn") is not None or hasattr(attention_utils, "_fallback_unpad_input"):
        return False  # flash-attn is there, or verl has its own fallback (0.9.1)
    if is_torch_npu_available(check_device=False):
        return False  # verl's NPU helpers serve
    if attention_utils._get_attention_functions is _functions:
        return False
    attention_utils._get_attention_functions = _functions
    return True
