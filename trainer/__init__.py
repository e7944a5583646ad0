"""Training engine, command line and benchmarks of hdp."""

__all__: list[str] = []
