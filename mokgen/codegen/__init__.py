"""mokgen codegen: Plan -> CuTe-DSL source (jinja2) -> ahead-of-time compiled library.

cutlass is imported only inside the compile worker processes.
"""
from .build import BuildError, build, default_out, is_built
from .render import TEMPLATE_DIR, render, write_tree

__all__ = ["BuildError", "build", "default_out", "is_built", "TEMPLATE_DIR", "render", "write_tree"]
