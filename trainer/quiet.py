"""The known, harmless third-party warnings hdp's launchers and the ``hdp`` command silence.

Kept apart from :mod:`hdp.trainer.launch` (which imports torch) so that commands that start no process,
such as ``hdp plan``, can apply the filters without importing torch.  ``hdp.trainer.launch`` re-exports
both names.
"""

from __future__ import annotations

import warnings

__all__ = ["THIRD_PARTY_WARNINGS", "quiet_third_party_warnings"]

THIRD_PARTY_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    # megatron-core 0.16.1 on a machine without TransformerEngine / Apex (every CPU run): its
    # fallbacks to torch implementations, printed once per importing module and process
    (UserWarning, r"Transformer Engine and Apex are not installed", r"megatron\."),
    (UserWarning, r"Apex is not installed", r"megatron\."),
    (DeprecationWarning, r"The 'megatron\.core\.transformer\.custom_layers\.transformer_engine'", r"megatron\."),
    (UserWarning, r"full scope is deprecated", r"megatron\."),
    # GPU advice printed on every sequence-parallel linear, also on CPU (integrations/verl/VERL_NOTES.md
    # repeats it for GPU runs: set CUDA_DEVICE_MAX_CONNECTIONS=1 with sequence parallelism)
    (UserWarning, r"When using sequence parallelism it is recommended to set the environment variable "
                  r"CUDA_DEVICE_MAX_CONNECTIONS", r"megatron\."),
    # Megatron's optimizer probes .grad of its non-leaf main parameters (harmless)
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor", r"megatron\."),
    # torch 2.13 deprecations hit inside Megatron's DDP and distributed checkpointing
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", r"torch\."),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor", r"torch\."),
    (FutureWarning, r"`load_state_dict` is deprecated", r"megatron\.|torch\."),
)
"""(category, message regex, module regex) of the known third-party warnings hdp's launchers silence."""


def quiet_third_party_warnings() -> None:
    """Ignore :data:`THIRD_PARTY_WARNINGS` in this process (warning filters; nothing else changes)."""
    for category, message, module in THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
