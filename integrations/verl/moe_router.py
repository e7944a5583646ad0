"""The MoE router of verl's Megatron config reconciled with the HF config (DeepSeek-V3's routing).

Under verl the HF config is the model's definition (see :mod:`hdp.integrations.verl.rope`), and mbridge's
translation may lose part of it: mbridge 0.15's DeepSeek-V3 bridge sets the sigmoid score function, the expert
bias and ``routed_scaling_factor``, but not the group-limited choice (``n_group`` / ``topk_group``), so its
Megatron model would route every token over all experts where HF's picks the ``topk_group`` best groups first.
:func:`reconcile_router`, run on the built ``TransformerConfig`` before the model is built (Megatron's router reads
these fields at each forward):

* ``n_group`` / ``topk_group`` (> 1 groups): set as ``moe_router_num_groups`` / ``moe_router_group_topk`` when
  Megatron's config has none (logged); when it has others, ``ValueError`` naming both.  HF scores a group by the
  sum of its top 2 scores, Megatron by its top ``moe_router_topk / moe_router_group_topk``: another ratio is
  refused;
* ``norm_topk_prob=False`` with top-k > 1 is refused (Megatron's sigmoid router always normalises the chosen
  scores); ``routed_scaling_factor`` must equal ``moe_router_topk_scaling_factor``.

Other HF model types pass through unchanged.
"""

from __future__ import annotations

import logging
import math
from typing import Any

__all__ = ["reconcile_router"]

logger = logging.getLogger(__name__)

_DEEPSEEK = ("deepseek_v3",)
_GROUP_SCORE_TOP = 2
"""HF DeepSeek-V3 scores a group by the sum of its best 2 expert scores."""


def reconcile_router(tf_config: Any, hf_config: Any | None, key: str) -> None:
    """Make ``tf_config``'s router route as ``hf_config`` says (module docstring); ``key``: the role's verl key
    (``actor_rollout_ref.actor``), named in errors.  Raises ``ValueError`` before any collective."""
    if tf_config is None or hf_config is None or getattr(hf_config, "model_type", None) not in _DEEPSEEK:
        return
    if not getattr(tf_config, "num_moe_experts", None):
        return
    where = f"{key}.megatron.override_transformer_config"
    topk = int(tf_config.moe_router_topk)
    if topk > 1 and getattr(hf_config, "norm_topk_prob", True) is False:
        raise ValueError(f"hf_config.norm_topk_prob=False with num_experts_per_tok={topk}: Megatron's sigmoid router "
                         "always normalises the chosen scores; hdp cannot compute this model exactly")
    hf_factor = getattr(hf_config, "routed_scaling_factor", None)
    mega_factor = getattr(tf_config, "moe_router_topk_scaling_factor", None)
    if hf_factor is not None and not math.isclose(float(hf_factor), float(mega_factor or 1.0), rel_tol=1e-9):
        raise ValueError(f"hf_config.routed_scaling_factor={hf_factor!r} but {where}.moe_router_topk_scaling_factor="
                         f"{mega_factor!r}; set it to {hf_factor!r}")
    groups, gtop = getattr(hf_config, "n_group", None), getattr(hf_config, "topk_group", None)
    if not groups or int(groups) <= 1:
        return
    groups, gtop = int(groups), int(gtop)
    have = (getattr(tf_config, "moe_router_num_groups", None), getattr(tf_config, "moe_router_group_topk", None))
    if have != (None, None) and have != (groups, gtop):
        raise ValueError(f"hf_config n_group={groups}, topk_group={gtop} but {where}.moe_router_num_groups="
                         f"{have[0]!r}, moe_router_group_topk={have[1]!r}; make them agree")
    experts = int(tf_config.num_moe_experts)
    if experts % groups or topk % gtop or topk // gtop != _GROUP_SCORE_TOP:
        raise ValueError(f"hf_config n_group={groups}, topk_group={gtop} with {experts} experts and top-{topk}: HF "
                         f"scores a group by its best {_GROUP_SCORE_TOP} experts and Megatron by its best "
                         "topk/topk_group; hdp computes group-limited routing where topk = 2 * topk_group only")
    if have == (None, None):
        logger.info("MoE router: the HF config's group-limited routing (%d groups, best %d) set on the Megatron "
                    "config, which had none", groups, gtop)
        tf_config.moe_router_num_groups = groups
        tf_config.moe_router_group_topk = gtop
