"""Plan -> CuTe-DSL source under generated/<variant>/, byte-for-byte reproducible.

The rendered tree holds one Python module per Plan module, the C launch shim and
manifest.json (spec, plan, template hashes, versions). Nothing time- or
machine-dependent goes in, so rendering twice gives identical bytes.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jinja2

from .. import __version__
from ..schedule import Plan
from ..schedule.records import KernelPlan

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "templates"
# The CuTe-DSL release the templates are written against (pyproject pins it).
CUTE_DSL_VERSION = "4.8.1"
SHIM_TEMPLATE = "launch.c.j2"


def _env() -> jinja2.Environment:
    if not TEMPLATE_DIR.is_dir():
        raise FileNotFoundError(f"mokgen templates not found at {TEMPLATE_DIR}; install mokgen from its source tree")
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=False,
        autoescape=False,
    )


def template_hashes(names) -> dict:
    return {n: hashlib.sha256((TEMPLATE_DIR / n).read_bytes()).hexdigest() for n in sorted(set(names))}


def _context_key(template: str) -> str:
    # Each template names its Plan entry by a short variable.
    return {"grouped_gemm_persistent.py.j2": "k", "dispatch.py.j2": "d", "dispatch_chunked.py.j2": "d",
            "combine.py.j2": "c", "route.py.j2": "r", "route_backward.py.j2": "r", "swiglu_backward.py.j2": "s",
            "ep_exchange.py.j2": "p", "grouped_gemm_fp8.py.j2": "k", "quantize_rows_fp8.py.j2": "q",
            "swiglu_backward_fp8.py.j2": "s", "quantize_cols_fp8.py.j2": "q",
            "grouped_gemm_fp8_wgrad.py.j2": "k", "quantize_blocks_fp8.py.j2": "q",
            "status_mirror.py.j2": "m"}[template]


# The parts of grouped_gemm_persistent.py.j2, which it always includes: the device functions
# its kernel calls, the host launch's body, the kernel's start, then its warp roles (each
# part's first lines say what it holds).
GEMM_PARTS = tuple(f"gemm_{part}.py.j2" for part in ("tile_order", "waits", "dispatch_in_launch", "row_moves",
                                                      "scheduler", "host_launch", "kernel_setup", "producer",
                                                      "consumers", "after_tiles"))


def _includes(k: KernelPlan) -> list[str]:
    """Templates a kernel's template includes (their hashes decide staleness too)."""
    ep_rows = k.template == "ep_exchange.py.j2" or k.params.get("ep_return") or k.params.get("send_in_gemm")
    phases = k.template in ("dispatch.py.j2", "dispatch_chunked.py.j2") or k.params.get("dispatch")
    chunks = k.template == "dispatch_chunked.py.j2" or k.params.get("dispatch", {}).get("chunk")
    route = k.template in ("route.py.j2", "route_backward.py.j2") or k.params.get("route")
    fp8_units = k.template in ("grouped_gemm_fp8.py.j2", "grouped_gemm_fp8_wgrad.py.j2")
    fp8_tile = k.template in ("quantize_blocks_fp8.py.j2", "quantize_cols_fp8.py.j2")
    fp8_divide = fp8_tile or k.template == "quantize_rows_fp8.py.j2"
    combine_piece = k.template == "combine.py.j2" or (k.template == "grouped_gemm_persistent.py.j2"
                                                       and k.params.get("fused") and k.params.get("combine"))
    task_record = k.params.get("profile") and k.template in ("dispatch.py.j2", "dispatch_chunked.py.j2",
                                                             "grouped_gemm_persistent.py.j2", "combine.py.j2")
    status_copy = k.template == "status_mirror.py.j2" or k.params.get("mirror_status")
    parts = list(GEMM_PARTS) if k.template == "grouped_gemm_persistent.py.j2" else []
    return parts + (["ep_rows.py.j2"] if ep_rows else []) + (["dispatch_phases.py.j2"] if phases else []) \
        + (["dispatch_chunks.py.j2"] if chunks else []) \
        + (["route_phases.py.j2"] if route else []) + (["fp8_units.py.j2"] if fp8_units else []) \
        + (["fp8_block_tile.py.j2"] if fp8_tile else []) + (["fp8_divide.py.j2"] if fp8_divide else []) \
        + (["task_record.py.j2"] if task_record else []) + (["combine_piece.py.j2"] if combine_piece else []) \
        + (["status_copy.py.j2"] if status_copy else [])


def _shim_kernel(k: KernelPlan) -> dict:
    # The shim passes one dynamic extent per tensor and no strides: a symbolic extent past a
    # tensor's first dimension would leave a dynamic stride unset (read as 0).
    for a in k.args:
        if any(isinstance(d, str) for d in a.shape[1:]) or sum(isinstance(d, str) for d in a.shape) > 1:
            raise ValueError(f"{k.name}: argument {a.name} {a.shape} has a symbolic extent past its first dimension; "
                             "the launch shim passes no strides (lay the tensor out with the symbolic extent first)")
    return dict(name=k.name, stage=k.stage, module=k.module, entry=k.entry,
                args=[dict(name=a.name, symbolic=any(isinstance(d, str) for d in a.shape)) for a in k.args])


def render(plan: Plan) -> dict[str, str]:
    """All files of the variant's source tree: relative path -> text."""
    env = _env()
    files: dict[str, str] = {}
    modules: dict[str, KernelPlan] = {}
    for k in plan.kernels:
        modules.setdefault(k.module, k)
    for module, k in sorted(modules.items()):
        ctx = {_context_key(k.template): k.params, "version": __version__, "variant": plan.variant}
        files[f"{module}.py"] = env.get_template(k.template).render(**ctx)
    files["launch.c"] = env.get_template(SHIM_TEMPLATE).render(
        kernels=[_shim_kernel(k) for k in plan.kernels], version=__version__, variant=plan.variant)
    manifest = {
        "variant": plan.variant,
        "mokgen_version": __version__,
        "cute_dsl_version": CUTE_DSL_VERSION,
        "spec": plan.spec,
        "plan": plan.to_dict(),
        "templates": template_hashes([t for k in plan.kernels for t in [k.template, *_includes(k)]] + [SHIM_TEMPLATE]),
        "files": {},
    }
    manifest["files"] = {p: hashlib.sha256(t.encode()).hexdigest() for p, t in sorted(files.items())}
    files["manifest.json"] = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    return files


def write_tree(files: dict[str, str], root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (root / rel).write_text(text)
