"""Every private (or version-sensitive) Megatron-core name hdp uses, imported here and nowhere else."""

from __future__ import annotations

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, _p2p_ops  # noqa: F401 (p2p.py)
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint


from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP
from megatron.core.transformer.mlp import MLPSubmodules
# TransformerEngine's grouped linears as Megatron wraps them; both None when TransformerEngine is absent
from megatron.core.extensions.transformer_engine import (  # noqa: F401 (grouped_experts.py)
    TEColumnParallelGroupedLinear,
    TERowParallelGroupedLinear,
)
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.utils import (  # noqa: F401 (grouped_experts.py)
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding  # noqa: F401 (grouped_experts.py)

__all__ = [
    "MEGATRON_CORE_VERSION", "TESTED_VERSIONS", "dist_checkpointing", "parallel_state", "tensor_parallel",
    "DistributedDataParallel", "DistributedDataParallelConfig", "finalize_model_grads", "GPTModel",
    "get_gpt_layer_local_spec", "OptimizerConfig", "get_megatron_optimizer", "PackedSeqParams", "P2PCommunicator",
    "ProcessGroupCollection", "forward_backward_no_pipelining", "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving", "TransformerConfig", "AttnMaskType", "MegatronModule",
    "ModuleSpec", "TransformerBlockSubmodules", "get_num_layers_to_build", "MoELayer", "build_module",
    "nested_values", "ShardedObject", "ShardedTensor", "apply_factories", "load_sharded_metadata",
    "GroupedMLP", "SequentialMLP", "TEGroupedMLP", "MLPSubmodules",
    "make_sharded_tensors_for_checkpoint", "MLATransformerConfig", "MLASelfAttention", "get_gpt_decoder_block_spec",
    "get_transformer_layer_offset",
]

try:
    from megatron.core.package_info import __version__ as MEGATRON_CORE_VERSION
except ImportError:  # very old releases had no package_info
    MEGATRON_CORE_VERSION = "unknown"

TESTED_VERSIONS: tuple[str, ...] = ("0.16.1",)
"""megatron-core versions the CPU shim was run against."""

