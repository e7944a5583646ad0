"""CPU-only test scaffolding for running verl's own workers and trainer with the hdp engine.

Nothing here is on the engine's runtime path: it exists because verl 0.9.1 and mbridge assume an
accelerator and TransformerEngine.  :func:`install` (in :mod:`verl_support.cpu`) is what a test
process calls first; the tiny Qwen3 / Qwen3-MoE checkpoints come from :mod:`verl_support.tiny`.
"""

__all__ = ["cpu", "tiny", "mbridge_local", "platform", "rollout"]
