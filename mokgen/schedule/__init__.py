"""mokgen scheduler: stage graph + target numbers -> Plan (plain data)."""
from .plan import make_plan
from .records import Buffer, KernelArg, KernelPlan, Plan, PlanError
from .target import H200, TARGETS, Target, target_for
from .tiling import choose_gemm_tiling

__all__ = ["Buffer", "KernelArg", "KernelPlan", "Plan", "PlanError", "choose_gemm_tiling", "make_plan",
           "H200", "TARGETS", "Target", "target_for"]
