"""hdp.packing: the sequence-length-aware planner (pure, deterministic; numpy, and numba for its inner
loops -- compiled once per machine and cached, `hdp.packing.kernels.jit`).

`plan(lengths, config)` decides, for one training step, which samples run on which ranks in which
round and how each sample is cut into zigzag chunks; `simulate` scores any plan under a cost model.
"""

from hdp.packing.chunks import rank_chunks, zigzag_bounds
from hdp.packing.config import GroupShape, PlannerConfig, PlannerOptions, Policy, SearchBudget
from hdp.packing.cost import CostModel
from hdp.packing.plan import Group, Plan, PlanStats, Round
from hdp.packing.planner import plan
from hdp.packing.profiles import MODELS, PROFILES, HardwareProfile, ModelPreset, cost_model
from hdp.packing.simulate import lower_bound, simulate
from hdp.packing.validate import PlanError, check_plan

__all__ = [
    "plan", "PlannerConfig", "PlannerOptions", "SearchBudget", "Policy", "GroupShape", "CostModel", "cost_model",
    "HardwareProfile", "ModelPreset", "PROFILES", "MODELS", "Plan", "Round", "Group",
    "PlanStats", "simulate", "lower_bound", "check_plan", "PlanError", "zigzag_bounds", "rank_chunks",
]
