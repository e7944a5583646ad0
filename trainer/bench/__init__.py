"""hdp's benchmarks (``hdp bench ...``): attention kernels, MoE zero-memory, training throughput, faults,
and megatron-core's scheduler as a planner peer.  Speed and memory targets live here, not in unit tests."""
