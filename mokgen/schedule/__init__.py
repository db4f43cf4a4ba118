"""mokgen scheduler: stage graph + target numbers -> Plan (plain data)."""
from .plan import Buffer, KernelArg, KernelPlan, Plan, PlanError, choose_gemm_tiling, make_plan
from .target import H200, TARGETS, Target, target_for

__all__ = ["Buffer", "KernelArg", "KernelPlan", "Plan", "PlanError", "choose_gemm_tiling", "make_plan",
           "H200", "TARGETS", "Target", "target_for"]
