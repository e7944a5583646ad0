"""hdp: hybrid data-parallel trainer engine for long-sequence LLM post-training."""

__all__: list[str] = []
