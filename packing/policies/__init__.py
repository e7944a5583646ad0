"""Packing policies: one module per policy, all producing an hdp.packing Plan."""
