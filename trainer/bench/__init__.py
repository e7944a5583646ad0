"""The benchmarks users run on their own job and machine (``hdp bench train|regress|device|planner|memory``),
and megatron-core's scheduler as a planner peer.  This project's CI-only benchmarks and fault scenarios live
outside the package, in the checkout's ``benchmarks/`` folder (``python -m benchmarks --help``)."""
