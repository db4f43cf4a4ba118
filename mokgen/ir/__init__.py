"""mokgen IR: the validated spec and the stage graph (pure Python + sympy)."""
from .graph import C, T, Graph, Stage, TensorType, backward_graph, forward_graph
from .spec import DEFAULT_PRESET, PRESETS, MoESpec, SpecError

__all__ = ["C", "T", "Graph", "Stage", "TensorType", "forward_graph", "backward_graph", "MoESpec", "SpecError", "PRESETS", "DEFAULT_PRESET"]
