"""Every raw mbarrier arrival in the generated kernels is made by one thread.

A barrier made to count one arrival (a pipeline's full barrier, a scheduler slot, a mailbox)
breaks if a whole warp arrives on it: the phase flips up to 32 times and, for an arrival that
expects bytes, the barrier waits for 32 times the bytes. CuTe DSL's pipeline objects arrive
from one elected lane; a kernel that calls cute.arch.mbarrier_arrive* itself must guard it.
(The FP8 GEMMs' half-A tail loads once armed their stage from the whole producer warp: the
kernel faulted on the GPU and compiled cleanly here.) So, on the rendered sources: each such
call sits under an `if` that picks one thread (lane 0, thread 0, an elected lane) or in a
helper documented as run by one thread."""
import ast
import re

import pytest

from mokgen.codegen import render
from mokgen.ir import PRESETS, MoESpec
from mokgen.schedule import make_plan
from mokgen.schedule.fp8 import FP8_GEMMS

ONE_THREAD = re.compile(r"lane_idx\(\) == 0|\blane == 0|\btidx == 0|elect_one")

PLANS = {
    **{name: (spec, {}) for name, spec in PRESETS.items()},
    "shared": (MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=768), {}),
    "fp8": (MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, dtype="fp8"), {}),
    "fp8_full_tail": (MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, dtype="fp8"),
                      {f"{g}.half_tail": 0 for g in FP8_GEMMS}),
    "fp8_cluster": (MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, dtype="fp8"),
                    {"gemm_gateup_fp8.cluster": 2, "gemm_down_fp8.cluster": 2}),
    "ep2": (MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, world_size=2, topology="nvlink"), {}),
}


def unguarded_arrivals(source: str) -> list[str]:
    """The raw mbarrier arrivals in a module that no one-thread guard covers: 'function:line'."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func).startswith("cute.arch.mbarrier_arrive")):
            continue
        p, guarded, where = parents.get(node), False, "<module>"
        while p is not None and not guarded:
            if isinstance(p, ast.If):
                guarded = bool(ONE_THREAD.search(ast.unparse(p.test)))
            elif isinstance(p, ast.With):
                guarded = any(ONE_THREAD.search(ast.unparse(i.context_expr)) for i in p.items)
            elif isinstance(p, ast.FunctionDef):
                where = p.name
                guarded = (ast.get_docstring(p) or "").startswith("(one thread)")
                break
            p = parents.get(p)
        if not guarded:
            bad.append(f"{where}:{node.lineno}")
    return bad


@pytest.mark.parametrize("name", PLANS)
def test_raw_barrier_arrivals_are_one_threads(name):
    spec, overrides = PLANS[name]
    files = render(make_plan(spec, overrides=overrides))
    bad = {rel: unguarded_arrivals(text) for rel, text in files.items() if rel.endswith(".py")}
    assert not {rel: b for rel, b in bad.items() if b}, "arrivals no one-thread guard covers"


def test_the_check_sees_a_warp_wide_arrival():
    """The fault this guards against, as the tail branch first had it (the whole warp arrives)."""
    warp_wide = (
        "def kernel():\n"
        "    if warp_idx == 0:\n"
        "        if tail:\n"
        "            cute.arch.mbarrier_arrive_and_expect_tx(bar, half_tx)\n")
    assert unguarded_arrivals(warp_wide) == ["kernel:4"]
    one_lane = warp_wide.replace("        if tail:\n", "        if tail and cute.arch.lane_idx() == 0:\n")
    assert unguarded_arrivals(one_lane) == []
