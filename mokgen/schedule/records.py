"""The Plan's records (KernelArg, KernelPlan, Buffer, Plan), PlanError, and the few facts of
the hardware and of the SIMT kernels that every planning module shares. Each planning module
(plan.py and the modules it asks, backward.py, expert_parallel.py, fp8.py) builds these
records; nothing here decides.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import sympy

from ..ir import MoESpec
from .target import Target

PLAN_FORMAT = 1

# Hopper wgmma: a warpgroup (128 threads) owns 64 rows of an MMA tile.
WARPGROUP_THREADS = 128
WGMMA_ROWS = 64
# Elements per 16-byte vector access in the SIMT kernels (bf16).
VEC = 8
# A grouped GEMM's rows as (tile table, rows, tiles, groups): the shared expert's, every token
# in tiles of the row tile, one group (the routed GEMMs' are tile_expert over M rows in MT tiles,
# one group per local expert).
SHARED_ROWS = ("shared_tiles", "T", "ST", 1)


@dataclass
class KernelArg:
    name: str  # parameter name of the compiled entry point
    tensor: str  # graph tensor or workspace buffer bound to it
    dtype: str
    shape: list  # ints and symbol names ("T", "M", ...)


@dataclass
class KernelPlan:
    name: str
    stage: str
    module: str  # generated/<variant>/<module>.py
    template: str
    entry: str
    params: dict
    args: list
    grid: str
    block: int
    warp_roles: list
    smem_bytes: int = 0


@dataclass
class Buffer:
    name: str
    dtype: str
    shape: list  # strings: sympy expressions of T (or, expert parallel, of the capacity C)
    init: str = "none"  # "none" | "zeros"
    # "call": allocated per call at its T; expert parallel: "persistent" (once per peer
    # workspace, at its capacity C) or "symmetric" (the same, in memory peers store into);
    # "state": zeroed once per device and stream by the runtime, kept across calls (the
    # kernels that use it leave it zeroed)
    memory: str = "call"


@dataclass
class Plan:
    format: int
    mokgen_version: str
    variant: str
    spec: dict
    target: dict
    row_tile: int
    sm_roles: dict
    queues: list
    reduction_order: str
    buffers: list
    kernels: list
    steps: dict  # entry point -> ordered kernel names
    flops: str
    decisions: list = field(default_factory=list)
    overrides: dict = field(default_factory=dict)  # decisions replaced by hand or by autotuning
    task_graph: dict = field(default_factory=dict)  # the fused forward's tasks (see taskgraph.py)
    # Calls with at most this many tokens run steps["forward_fused"] (one GEMM launch) instead
    # of steps["forward"]; 0: the Plan has one forward path.
    fused_max_tokens: int = 0
    # [max_tokens, entry] in increasing order: a call with T tokens runs the first entry whose
    # max_tokens is at least T (the single launch's tile sizes by T, launch_bands), else as above.
    launch_bands: list = field(default_factory=list)
    # GPU name (torch.cuda.get_device_name()) -> launch_bands on that GPU, where `mokgen tune --paths`
    # measured the per-GEMM path faster at some T there (override per_gemm_tokens_on); the runtime
    # takes them in place of launch_bands on that GPU.
    launch_bands_on: dict = field(default_factory=dict)
    # Buffers the runtime zeroes before an entry point's kernels, where none of them does
    # (entry -> names; dispatch_count zeroes tile_counters in the entries that dispatch).
    zeroed: dict = field(default_factory=dict)
    # Kernels launched on a second stream (forked from the main one where they stand in the
    # steps, joined at the entry's end), to run beside the kernels that follow them.
    side_stream: list = field(default_factory=list)

    # ---- (de)serialisation -------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        d = dict(d)
        d["buffers"] = [Buffer(**b) for b in d["buffers"]]
        ks = []
        for k in d["kernels"]:
            k = dict(k)
            k["args"] = [KernelArg(**a) for a in k["args"]]
            ks.append(KernelPlan(**k))
        d["kernels"] = ks
        return cls(**d)

    def kernel(self, name: str) -> KernelPlan:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)

    def moe_spec(self) -> MoESpec:
        return MoESpec.from_dict(self.spec)


class PlanError(ValueError):
    """The spec is legal but this target cannot run it (one-line message)."""


def _expr(e) -> str:
    return str(sympy.simplify(e))


def simt_threads(columns: int, target: Target, cap: int = 256) -> int:
    """Threads of a row-copying CTA: one thread per 16-byte vector, whole warps, capped."""
    vecs = max(1, columns // VEC)
    return min(cap, target.max_threads_per_block, ((vecs + 31) // 32) * 32)
