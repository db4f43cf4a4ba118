"""The Plan: every decision between the stage graph and the generated code.

A Plan is plain data (JSON round-trip, deterministic for a given spec and target):
tile shapes, stages, warp roles, SM roles, the launch order, the reduction order,
the workspace buffers and (for several GPUs) the queues. Each decision is made in
one function, from the spec and the target's numbers, and is recorded with the reason
in `decisions`. Templates read their numbers from the Plan and nowhere else.

make_plan reads top to bottom. This module decides the forward's outline (the routed tiles,
the paths, tile_counters' slots, the call's buffers, the route and combine kernels, the
profiling records) and checks the Plan; the decisions it asks for live beside it: tiling.py
(a GEMM's tiles), gemms.py (the grouped GEMM kernels), dispatch.py (the send stage),
single_launch.py (the single launch and its bands by T) and status.py (bounded waits and the
error code); backward.py the training forward and the backward, expert_parallel.py the layer
over several GPUs, multinode.py over several nodes and fp8.py the FP8 layer; records.py holds
the records they all build.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

import sympy

from .. import __version__
from ..ir import Graph, MoESpec, backward_graph, forward_graph
from ..ir.graph import T
from .backward import BACKWARD_GEMMS, SHARED_BACKWARD_GEMMS, backward_kernels, backward_support
from .dispatch import CHUNK_PAIRS, dispatch_kernels
from .gemms import GemmMaker
from .records import (PLAN_FORMAT, SHARED_ROWS, VEC, Buffer, KernelArg, KernelPlan, Plan, PlanError, _expr,
                      simt_threads)
from .single_launch import (COMBINE_EARLY, FUSED_MAX_TOKENS, fused_gemm, fused_misfit, launch_policies,
                            per_gemm_bands, served_ranges, single_launches)
from .status import MIRROR_STATUS, RUNTIME_TENSORS, WAIT_TIMEOUT_MS, mirror_status_by_last_kernels, status_mirror
from .target import Target, target_for
from .taskgraph import forward_task_graph, fused_tile_order, gemm_model_params
from .tiling import SWAP_ROW_STEP, choose_gemm_tiling, choose_row_tile


def make_plan(spec: MoESpec, target: Target | None = None, overrides: dict | None = None,
              override_source: str = "") -> Plan:
    """The Plan for `spec` on `target`. `overrides` (experiments, autotuning) replaces
    decisions by name; the Plan records that it did, and where they came from.

    It is decided in this order, each step one function (here, or in the module this file's
    docstring names for it): the routed M tiles, the forward paths (per-GEMM launches, the single
    launch, or both by T), tile_counters' slots and the call's buffers, the route and dispatch
    kernels, the GEMMs (GemmMaker), the single launches, the shared expert, the combine, the
    expert-parallel steps, the backward, the launches' memory policies, the profiling records;
    last the task graph that orders the single launch's tiles."""
    target = target or target_for(spec.arch)
    if spec.nodes > 1:
        from .multinode import node_local_spec

        raise PlanError(f"{spec.variant} spans {spec.nodes} nodes: its kernels are the node-local layer's "
                        f"({node_local_spec(spec).variant}); `mokgen build` builds that and writes the levels "
                        "(mokgen/schedule/multinode.py)")
    if spec.dtype == "fp8":  # generated kernel by kernel (schedule/fp8.py)
        from .fp8 import fp8_plan

        return fp8_plan(spec, target, overrides)
    ov = overrides or {}
    check_overrides(ov)
    ep = spec.world_size > 1
    if ep:
        from . import expert_parallel  # (it builds on this module's types)

        expert_parallel.check_ep_overrides(ov)
    graph: Graph = forward_graph(spec)
    E, K, H, I, S = spec.local_experts, spec.topk, spec.hidden, spec.intermediate, spec.shared_intermediate
    decisions: list[str] = []
    if overrides:
        decisions.append(f"overrides {json.dumps(overrides, sort_keys=True)}" +
                         (f" from {override_source}" if override_source else ""))

    row_tile, cluster_m, m_tiles = routed_tiles(spec, target, ov, decisions)
    rows = m_tiles * row_tile
    paths = choose_paths(spec, target, row_tile, ov, cluster_m, decisions)
    # (expert parallel, overlapped: the down GEMM returns its rows, claiming M tiles from a counter)
    counters = Counters.for_plan(paths, spec, ep and expert_parallel.gemm_returns(ov))
    wait_timeout_ns = int(ov.get("wait_timeout_ms", WAIT_TIMEOUT_MS)) * 1_000_000
    buffers = call_buffers(spec, counters, m_tiles, rows)
    if ep:
        buffers += expert_parallel.ep_buffers(spec, row_tile)

    kernels = route_kernels(spec)
    # After a call whose last kernel does not copy it itself (mirror_status_by_last_kernels; its
    # own entry point, run by the runtime): the call's error code to the runtime's pinned host
    # word, only when set (a copy behind each call cost 8-10 us, docs/perf.md)
    kernels.append(status_mirror(counters.n, counters.status))
    dispatch, dparams, chunked = dispatch_kernels(spec, target, row_tile, cluster_m, counters, paths.fuse, ov,
                                                  buffers, decisions)
    kernels += dispatch
    gemm = GemmMaker(spec, target, ov, row_tile, cluster_m, counters, wait_timeout_ns, decisions)

    # The routed forward GEMMs (the per-GEMM path's; the single launch starts from gate/up's)
    if ep:  # the received rows are contiguous and grouped by expert: TMA loads them
        gateup = gemm("gemm_gateup", "gemm_gateup", "ep_recv", ("w_gate", "w_up"), "h", I, H, "swiglu",
                      "Routed gate/up projection (received rows) with the SwiGLU epilogue.")
        if expert_parallel.overlapped(ov):
            send_ctas = expert_parallel.comm_ctas(spec, target, ov)[0]
            expert_parallel.overlap_gemm(gateup, spec, target, send_ctas)
            waiting_gateup = copy.deepcopy(gateup)  # what the single launch starts from
            if expert_parallel.gemm_sends(ov):
                expert_parallel.send_in_gemm(gateup, spec, target, send_ctas)
    else:
        gateup = gemm("gemm_gateup", "gemm_gateup", "x", ("w_gate", "w_up"), "h", I, H, "swiglu",
                      "Routed gate/up projection with the SwiGLU epilogue.", gather_a=True)
        decisions.append("gemm_gateup gathers its A rows from x (cp.async by the producer warpgroup): "
                         "no permuted copy of x")
    down = gemm("gemm_down", "gemm_down", "h", ("w_down",), "y", H, I, "store", "Routed down projection." + (
                    " It returns its rows to their source ranks per M tile." if counters.gemm_returns else ""))
    if counters.gemm_returns:
        n_ret, why_ret = expert_parallel.return_in_gemm(down, spec, target, ov, counters.slot("ep_return"))
    steps: dict[str, list[str]] = {}
    laid_out = None  # (expert parallel: whether the single launch dispatches and lays out itself)
    bands: list = []  # (the single launch's tiles by T, launch_bands)
    if paths.kind != "fused":
        kernels += [gateup, down]
        steps["forward"] = ["dispatch_count", "dispatch_scatter", "gemm_gateup", "gemm_down"] + \
            (["shared_gateup", "shared_down"] if S else [])
    if paths.fuse and ep:  # send, gate/up, down and return in one launch
        fused = fused_gemm(waiting_gateup, H, I, E, counters.used, target, 0, 0, counters.slot("gemm_fused"), None, K,
                           bool(ov.get("debug_break_dependency")))
        decisions.append(expert_parallel.make_single_launch(fused, spec, target, send_ctas, ov))
        layout = expert_parallel.layout_params(spec, row_tile, counters.status, wait_timeout_ns, counters.used)
        laid_out = expert_parallel.layout_in_launch(fused, spec, dparams, layout, ov, buffers)
        if laid_out:
            decisions.append(laid_out)
        kernels.append(fused)
        buffers.append(Buffer("h_ready", "i32", [_expr(m_tiles)], memory="persistent"))
    elif paths.fuse:
        bands, rows = single_launches(gemm, gateup, spec, target, row_tile, paths, counters, dparams, ov, kernels,
                                      buffers, steps, decisions, m_tiles, rows)
    s_tiles = sympy.ceiling(T / row_tile)  # the shared expert's M tiles (SHARED_ROWS' ST)
    if S:
        buffers += [Buffer("hs", "bf16", ["T", str(S)]), Buffer("ys", "bf16", ["T", str(H)])]
    if S and paths.kind != "fused":
        buffers.append(Buffer("shared_tiles", "i32", [_expr(s_tiles)], init="zeros"))
        kernels.append(gemm("shared_gateup", "shared_gateup", "x", ("ws_gate", "ws_up"), "hs", S, H, "swiglu",
                            "Shared expert gate/up projection (every token).", rows=SHARED_ROWS, routed=False))
        kernels.append(gemm("shared_down", "shared_down", "hs", ("ws_down",), "ys", H, S, "store",
                            "Shared expert down projection (every token).", rows=SHARED_ROWS, routed=False))
        decisions.append("shared expert: the same grouped GEMM with one group over all T tokens")

    combine, reduction_order = combine_kernel(spec, target, dparams["experts"])
    kernels.append(combine)
    chunks = [k.params["dispatch"]["chunk"] for k in kernels if k.params.get("dispatch", {}).get("chunk")]
    if chunks:  # the single launches' chunk histograms (the smallest chunk has the most)
        buffers.append(Buffer("launch_hist", "i32", [_expr(sympy.ceiling(T * K / min(chunks))), str(E + 1)]))
    combining = {k.name for k in kernels if k.params.get("fused") and k.params.get("combine")}
    for entry in steps:  # a single launch may combine itself
        if not combining & set(steps[entry]):
            steps[entry].append("combine")
    if paths.fused_combine and paths.combine_early:
        decisions.append(
            "gemm_fused also combines: each down tile raises h_ready[m] after its stores (after the gate/up tiles' "
            f"counts); once a CTA has no tile left, each consumer warp claims (token row, part) tasks from "
            f"tile_counters[{counters.slot('combine_next')}], waits until the M tiles of the token's rows have all "
            "their down tiles stored, and reduces them with the combine's fixed k order (the same bits as the "
            "combine kernel), beside the last down tiles")
    elif paths.fused_combine:
        decisions.append(
            f"gemm_fused also combines: each down tile raises tile_counters[{counters.done}] after its stores; once "
            "a CTA has no tile left, its consumer warps wait until every down tile is stored, then reduce token rows "
            "t = CTA, CTA + grid, ... with the combine's fixed k order (the same bits as the combine kernel)")
    sm_roles, queues, side_stream = {"compute": target.sms, "communication": 0}, [], []
    if ep:
        ep_ks, sm_roles, queues, side_stream = expert_parallel.forward_steps(
            spec, target, row_tile, counters.n, counters.status, wait_timeout_ns, ov,
            counters.used if paths.fuse else None, laid_out, steps, decisions,
            (n_ret, why_ret) if counters.gemm_returns else None,
            send_ctas if expert_parallel.overlapped(ov) else None)
        kernels += ep_ks
    decisions.append(f"combine: {reduction_order}; one CTA per token, no atomics: bitwise deterministic")

    if paths.backward:
        exchange = None
        if ep:  # the backward's exchange, its copies beside GEMMs unless ep_overlap is false
            exchange = expert_parallel.backward_exchange(spec, target, row_tile, counters.n, counters.status,
                                                         wait_timeout_ns, ov, steps["forward"])
            buffers += expert_parallel.ep_backward_buffers(spec, row_tile)
        kernels += backward_kernels(gemm, spec, target, row_tile, buffers, steps, decisions, _expr(rows), exchange,
                                    counters.slot("xs_copy"))
        if ep and exchange[1]:
            side_stream += ["ep_send_bwd", "ep_send_bwd_grad", "ep_send_bwd_x", "ep_return_bwd"]
    launch_policies(kernels, spec, target, paths, counters, ov, decisions,
                    served_ranges(kernels, bands, EP_FUSED_MAX_TOKENS if ep else FUSED_MAX_TOKENS))
    profiling(kernels, steps, buffers, spec, target, m_tiles, s_tiles, chunked, ov, decisions)

    steps["route"] = ["route"]
    steps["route_backward"] = ["route_backward"]
    steps["status"] = ["status_mirror"]
    kernels = [k for k in kernels if any(k.name in entry for entry in steps.values())]  # nothing unused is built
    zeroed = {"backward": ["tile_counters"]} if paths.backward else {}
    if paths.mirror_status:
        kernels, why = mirror_status_by_last_kernels(kernels, steps, zeroed, side_stream, counters.n,
                                                     counters.status, counters.slot("launch_done"))
        decisions += why
    task_graph = forward_task_graph(spec, gemm_model_params({k.name: k.params for k in kernels}), target).to_dict()
    for k in kernels:  # the single launch claims its tiles in the task graph's order
        if k.params.get("fused"):
            try:
                k.params = dict(k.params, tile_order=[t for t in fused_tile_order(task_graph)
                                                      if S or not t.startswith("shared")])
            except ValueError as e:
                raise PlanError(str(e)) from None
    launch_bands, launch_bands_on = served_bands(bands, paths, ep, ov, decisions)
    plan = Plan(
        format=PLAN_FORMAT,
        mokgen_version=__version__,
        variant=spec.variant,
        spec=spec.to_dict(),
        target=target.to_dict(),
        row_tile=row_tile,
        sm_roles=sm_roles,
        queues=queues,
        reduction_order=reduction_order,
        buffers=buffers,
        kernels=kernels,
        steps=steps,
        flops=str(graph.flops()),
        decisions=decisions,
        overrides=dict(ov),
        task_graph=task_graph,
        fused_max_tokens=(EP_FUSED_MAX_TOKENS if ep else FUSED_MAX_TOKENS) if paths.kind == "by_tokens" else 0,
        launch_bands=launch_bands,
        launch_bands_on=launch_bands_on,
        zeroed=zeroed,
        side_stream=side_stream,
    )
    check_plan(plan, graph)
    return plan


def routed_tiles(spec: MoESpec, target: Target, ov: dict, decisions: list) -> tuple[int, int, sympy.Expr]:
    """The routed GEMMs' row tile, their cluster size along M, and the bound on their M tiles
    (sized on the host from T alone, so that no call reads a count back)."""
    E, K = spec.local_experts, spec.topk
    row_tile, why = choose_row_tile(spec, target)
    if "row_tile" in ov:
        row_tile, why = ov["row_tile"], "set by override"
    decisions.append(f"row tile {row_tile}: each expert's rows start on a multiple of it, so every GEMM M tile "
                     f"has one expert; {why}")
    # Clusters of 2 CTAs along M share (multicast) the routed GEMMs' weight tiles, so an
    # expert's M tiles come in pairs: dispatch pads each expert to an even tile count.
    cluster_m = int(ov.get("cluster_m", 1))
    ep = spec.world_size > 1
    if cluster_m == 2:
        if ov.get("fuse_gemms"):
            raise PlanError("cluster_m=2 and fuse_gemms together are not generated yet")
        if any(ov.get(f"{g}.raster", "m") != "m" for g in ("gemm_gateup", "gemm_down")):
            raise PlanError("cluster_m=2 needs M-major raster order")
        m_tiles = 2 * sympy.ceiling(T * K / (2 * row_tile)) + 2 * E
        decisions.append("cluster 2x1 for the routed GEMMs: the two CTAs take M tiles 2p and 2p+1 of one expert "
                         "and the same N tile, each loads half of every weight tile and multicasts it to both "
                         "(half the L2-to-SM weight traffic); experts padded to an even number of M tiles")
    elif ep:  # the GEMMs run on the rows this rank receives
        from . import expert_parallel

        m_tiles = expert_parallel.received_tiles(spec, row_tile)
    else:
        m_tiles = sympy.ceiling(T * K / row_tile) + E
    decisions.append(f"routed M tiles bounded by {_expr(m_tiles)}: sized on the host from "
                     f"{'the peer workspace capacity C' if ep else 'T'} alone, no host sync")
    return row_tile, cluster_m, m_tiles


@dataclass(frozen=True)
class Paths:
    """The forward's paths and what the single launch does besides its GEMM tiles."""
    kind: str  # "multi" (one launch per GEMM), "fused" (the single launch) or "by_tokens" (both, by T)
    fused_combine: bool  # the single launch combines too
    combine_early: bool  # ... per token, as soon as its rows' down tiles are stored
    mirror_status: bool  # an entry's last kernel copies the error code to the host itself
    backward: bool  # the Plan has the training forward and the backward

    @property
    def fuse(self) -> bool:
        """The Plan has the single launch (and dispatch feeds it)."""
        return self.kind != "multi"


def choose_paths(spec: MoESpec, target: Target, row_tile: int, ov: dict, cluster_m: int, decisions: list) -> Paths:
    """The forward paths (forward_paths), and the single launch's combine, the error code's copy
    and the backward; an override that would change nothing is an error."""
    ep = spec.world_size > 1
    # "multi" (one launch per GEMM), "fused" (all in one launch, the shared expert's tiles
    # included), or "by_tokens": both built, the fused one run up to FUSED_MAX_TOKENS tokens.
    # Override fuse_gemms: true / false forces one path.
    kind, why = forward_paths(spec, target, row_tile, ov, cluster_m)
    decisions.append(why)
    fuse = kind != "multi"
    for key, needs in (("gemm_fused.wave_lag", fuse), ("ep_fused_combine", fuse and ep), ("dispatch_in_launch", fuse)):
        if key in ov and not needs:
            raise PlanError(f"{key}: the layer is not expert parallel" if key.startswith("ep_") and not ep else
                            f"{key}: this Plan has no single launch ({why})")
    # The fused launch combines too (expert parallel: the combine reads the returned rows after
    # the wait).
    fused_combine = fuse and not ep
    # Early combine (COMBINE_EARLY, override combine_early): the launch's combine tasks wait per
    # token for the down tiles of its rows, not for every down tile (not with a shared expert,
    # whose ys rows every token needs).
    combine_early = fused_combine and not spec.shared_intermediate and bool(ov.get("combine_early", COMBINE_EARLY))
    # An entry's last kernel copies the call's error code itself where it can (MIRROR_STATUS,
    # override mirror_status; mirror_status_by_last_kernels): the single launch and the
    # backward's last GEMM count their finished CTAs in tile_counters' launch_done slot (an
    # expert-parallel backward ends in bwd_combine, which needs no count).
    mirror_status = bool(ov.get("mirror_status", MIRROR_STATUS))
    if ov.get("debug_break_combine") and not combine_early:
        raise PlanError("debug_break_combine: this Plan's single launch has no early combine to break")
    backward, why = backward_support(spec, ov, kind)
    decisions.append(why)
    return Paths(kind, fused_combine, combine_early, mirror_status, backward)


# Expert parallel: tokens per rank up to which a call runs the single launch (send, GEMMs and
# return in one kernel). Measured on 2 H200s (E64 K8 H2048 I1024, docs/perf.md, "Expert
# parallelism: send, both GEMMs and the return in one launch"), from a CUDA graph: 1.04-1.05x
# the per-GEMM path at 64 / 256 / 1024 tokens per rank in one run, 1.00-1.05x in another,
# 0.98x at 2048.
EP_FUSED_MAX_TOKENS = 1024


def forward_paths(spec: MoESpec, target: Target, row_tile: int, overrides: dict | None, cluster_m: int):
    """("multi" | "fused" | "by_tokens", why): which GEMM paths the forward is built with."""
    ov = overrides or {}
    if spec.world_size > 1:
        from . import expert_parallel

        if ov.get("fuse_gemms") is True:  # the training forward and the backward build on the per-GEMM path
            raise PlanError("fuse_gemms: true is not generated for several GPUs: the single launch is built beside "
                            "the per-GEMM path by default (fuse_gemms: false leaves it out)")
        tn = choose_gemm_tiling(spec.intermediate, spec.hidden, "swiglu", target, row_tile, False,
                                ov.get("gemm_gateup.tile_n"), ov.get("gemm_gateup.epi_stages"))["tile_n"]
        unfit = expert_parallel.fused_misfit_ep(spec, ov, tn)
        if unfit:
            return "multi", f"GEMM path: one launch per GEMM ({unfit})"
        if ov.get("fuse_gemms") is not False:
            return "by_tokens", (f"GEMM paths: calls with T <= {EP_FUSED_MAX_TOKENS} tokens per rank run the single "
                                 "launch (send, gate/up, down and return in one kernel), larger ones the send kernel "
                                 "beside one launch per GEMM (measured crossover, docs/perf.md)")
    if ov.get("fuse_gemms") is True:
        return "fused", "GEMM path: one fused launch (override fuse_gemms)"
    if ov.get("fuse_gemms") is False:
        return "multi", "GEMM path: one launch per GEMM (override fuse_gemms: false)"
    H, I, S = spec.hidden, spec.intermediate, spec.shared_intermediate
    tn = choose_gemm_tiling(I, H, "swiglu", target, row_tile, True, ov.get("gemm_gateup.tile_n"),
                            ov.get("gemm_gateup.epi_stages"))["tile_n"]
    unfit = fused_misfit(H, I, S, tn)
    if unfit:
        return "multi", f"GEMM path: one launch per GEMM ({unfit})"
    if cluster_m != 1:
        return "multi", "GEMM path: one launch per GEMM (clusters are built for it only)"
    return "by_tokens", (f"GEMM paths: calls with T <= {FUSED_MAX_TOKENS} run the fused launch (all GEMM tiles in "
                         "one persistent kernel), larger ones one launch per GEMM (measured crossover, docs/perf.md)")


def served_bands(bands: list, paths: Paths, ep: bool, ov: dict, decisions: list) -> tuple[list, dict]:
    """launch_bands: the entry that serves each band of T (the single launch's model bands), with
    the ranges of override per_gemm_tokens given to the per-GEMM path (per_gemm_bands); and
    launch_bands_on, the same per GPU model for override per_gemm_tokens_on ({GPU name: ranges},
    what `mokgen tune --paths` measured on each)."""
    served = [[t, f"forward_n{n}" if n else "forward_fused"] for t, n in bands] if paths.fuse and not ep else []
    ranges, on = ov.get("per_gemm_tokens"), ov.get("per_gemm_tokens_on", {})
    if (ranges is not None or on) and (not served or paths.kind != "by_tokens"):
        key = "per_gemm_tokens" if ranges is not None else "per_gemm_tokens_on"
        raise PlanError(f"{key}: this Plan has no single launch served by T beside the per-GEMM path")

    def given(ranges):
        return ", ".join(f"[{lo}, {hi}]" for lo, hi in ranges)

    if ranges is not None:
        decisions.append(f"calls with T in {given(ranges)} run the per-GEMM path in place of the single launch "
                         "(override per_gemm_tokens: measured faster there)")
        served = per_gemm_bands(served, ranges)
    for gpu, r in sorted(on.items()):
        decisions.append(f"on an {gpu}, calls with T in {given(r)} run the per-GEMM path in place of the single "
                         "launch (override per_gemm_tokens_on: measured faster there)")
    return served, {gpu: per_gemm_bands(served, r) for gpu, r in sorted(on.items())}


@dataclass(frozen=True)
class Counters:
    """tile_counters, one place for every slot; dispatch_count zeroes them all, so no extra
    launch or memset per call:
      one tile counter per grouped GEMM (its tile scheduler claims tiles from it);
      the fused launch's number of used M tiles (written by dispatch_scatter), its count
      of finished shared gate/up tiles and of finished down tiles (the combine waits);
      last, the call's error code (a wait that timed out, or ids out of range; 0: none)."""
    slots: tuple[str, ...]
    gemms: tuple[str, ...]  # the grouped GEMMs, the first slots
    gemm_returns: bool  # (expert parallel: the down GEMM returns its rows itself, ep_return's slot)

    @classmethod
    def for_plan(cls, paths: Paths, spec: MoESpec, gemm_returns: bool) -> "Counters":
        S, ep, fuse = spec.shared_intermediate, spec.world_size > 1, paths.fuse
        gemms = ([] if paths.kind == "fused" else ["gemm_gateup", "gemm_down"]
                 + (["shared_gateup", "shared_down"] if S else [])) \
            + (["gemm_fused"] if fuse else []) + (BACKWARD_GEMMS if paths.backward else []) \
            + (SHARED_BACKWARD_GEMMS if paths.backward and S else [])
        slots = gemms + (["used"] if fuse else []) + (["shared_done"] if fuse and S else []) \
            + (["down_done"] if paths.fused_combine else []) + (["combine_next"] if paths.combine_early else []) \
            + (["launch_done"] if paths.mirror_status and (paths.fused_combine or paths.backward and not ep) else []) \
            + (["ep_return"] if gemm_returns else []) \
            + (["xs_copy"] if paths.backward and not ep else []) + ["status"]
        return cls(tuple(slots), tuple(gemms), gemm_returns)

    def slot(self, name: str) -> int | None:
        return self.slots.index(name) if name in self.slots else None

    def gemm_slot(self, name: str) -> int:
        """A grouped GEMM's tile counter (0 for one that claims no tiles from a counter)."""
        return self.gemms.index(name) if name in self.gemms else 0

    @property
    def n(self) -> int:
        return len(self.slots)

    @property
    def status(self) -> int:
        return self.slots.index("status")

    @property
    def used(self) -> int:
        return self.slot("used") or 0

    @property
    def shared(self) -> int:
        return self.slot("shared_done") or 0

    @property
    def done(self) -> int | None:
        return self.slot("down_done")


def call_buffers(spec: MoESpec, counters: Counters, m_tiles, rows) -> list[Buffer]:
    """The forward's workspace: the counters, the dispatch tables and the routed rows."""
    ep = spec.world_size > 1
    recv = "persistent" if ep else "call"  # expert parallel: sized by the workspace capacity
    return [
        Buffer("tile_counters", "i32", [str(counters.n)]),
        Buffer("counts", "i32", [str(spec.experts if ep else spec.local_experts)]),
        Buffer("pos", "i32", ["T", str(spec.topk)]),
        Buffer("tile_expert", "i32", [_expr(m_tiles)], memory=recv),
        Buffer("row_token", "i32", [_expr(rows)], memory=recv),
        Buffer("h", "bf16", [_expr(rows), str(spec.intermediate)], memory=recv),
        Buffer("y", "bf16", [_expr(rows), str(spec.hidden)], memory=recv),
    ]


ROUTE_THREADS = 128


def route_kernels(spec: MoESpec) -> list[KernelPlan]:
    """The route stage (its own entry point) and its backward (mokgen.route is differentiable:
    d_logits from d_topk_weights), one token per warp."""
    K, threads = spec.topk, ROUTE_THREADS
    params = dict(experts=spec.experts, topk=K, threads=threads, renormalize=spec.renormalize)
    grid = f"(ceil(T/{threads // 32}),)"
    return [
        KernelPlan(
            name="route", stage="route", module="route", template="route.py.j2", entry="main", params=params,
            args=[KernelArg("logits", "logits", "f32", ["T", spec.experts]),
                  KernelArg("ids", "topk_ids", "i32", ["T", K]),
                  KernelArg("weights", "topk_weights", "f32", ["T", K])],
            grid=grid, block=threads,
            warp_roles=["each warp: one token (lanes hold its logits; arg-max rounds over the lanes)"]),
        KernelPlan(
            name="route_backward", stage="route_backward", module="route_backward", template="route_backward.py.j2",
            entry="main", params=dict(params),
            args=[KernelArg("logits", "logits", "f32", ["T", spec.experts]),
                  KernelArg("ids", "topk_ids", "i32", ["T", K]),
                  KernelArg("d_weights", "d_topk_weights", "f32", ["T", K]),
                  KernelArg("d_logits", "d_logits", "f32", ["T", spec.experts])],
            grid=grid, block=threads,
            warp_roles=["each warp: one token (lanes hold its logits and write its d_logits)"]),
    ]


def combine_kernel(spec: MoESpec, target: Target, d_experts: int) -> tuple[KernelPlan, str]:
    """The reduce stage: one CTA per token sums its K rows in a fixed order (and the shared
    expert's row); and that order, stated."""
    K, H, S, ep = spec.topk, spec.hidden, spec.shared_intermediate, spec.world_size > 1
    threads = simt_threads(H, target)
    args = [KernelArg("ids", "topk_ids", "i32", ["T", K]), KernelArg("weights", "topk_weights", "f32", ["T", K]),
            KernelArg("pos", "pos", "i32", ["T", K]), KernelArg("y", "ep_ret" if ep else "y", "bf16", ["M", H])]
    if S:
        args.append(KernelArg("ys", "ys", "bf16", ["T", H]))
    args.append(KernelArg("out", "out", "bf16", ["T", H]))
    reduction_order = "out[t] = bf16(sum over k = 0..K-1 in order of w[t,k]*y[t,k] in fp32" + (
        ", then + shared(x)[t])" if S else ")")
    return KernelPlan(
        "combine", "reduce", "combine", "combine.py.j2", "main",
        dict(experts=d_experts, topk=K, hidden=H, threads=threads, vec=VEC, shared=bool(S)),
        args, grid="(T,)", block=threads, warp_roles=["all warps: one token row, fixed k order"]), reduction_order


def profiling(kernels: list, steps: dict, buffers: list, spec: MoESpec, target: Target, m_tiles, s_tiles,
              chunked: bool, ov: dict, decisions: list) -> None:
    """Every template reads the `profile` flag; in a profiling build (override profile) the
    forward paths' kernels (the per-GEMM path, the single launch and its bands by T; not the
    routing twins, which run the same tiles) record each task's SM and times."""
    profile = bool(ov.get("profile"))
    profiled = {n for entry in steps if entry == "forward" or entry == "forward_fused"
                or re.fullmatch(r"forward_n\d+", entry) for n in steps[entry]}
    for k in kernels:
        k.params = dict(k.params, profile=profile and k.name in profiled)
    if not profile:
        return
    E, K = spec.local_experts, spec.topk
    d_tasks = sympy.ceiling(T * K / CHUNK_PAIRS) if chunked else sympy.Integer(E)  # one per dispatch CTA
    tasks = {"dispatch_count": d_tasks, "dispatch_scatter": d_tasks, "combine": T}
    for k in kernels:
        if k.template == "grouped_gemm_persistent.py.j2":
            m = s_tiles if k.name.startswith("shared") else \
                sympy.ceiling(T * K / k.params["tile_m"]) + E if k.params.get("swap") else m_tiles
            tasks[k.name] = m * (-(-k.params["n_size"] // k.params["tile_n"]) + k.params.get("n2_tiles", 0))
            if k.params.get("s_size"):  # the fused launch's shared-expert tiles
                tasks[k.name] += s_tiles * (k.params["s_size"] // k.params["tile_n"] + k.params["n2_tiles"])
            if k.params.get("fused") and k.params.get("combine"):  # each CTA's dispatch and combine phases
                k.params["prof_cta_rows"] = target.sms  # (rows before the tiles'; the grid is at most SMS)
                tasks[k.name] += 2 * target.sms
    add_task_records(kernels, profiled, buffers, tasks)
    decisions.append("profiling build: every task (GEMM tile, dispatch CTA, combine CTA; in a single launch "
                     "each CTA's dispatch and combine phases too) records its SM and its start and end time "
                     "(globaltimer) in prof_<kernel>; `mokgen profile` draws them")


def add_task_records(kernels: list, forward: list, buffers: list, tasks: dict) -> None:
    """A profiling build: kernel K of the forward gets a zeroed buffer prof_K [tasks, 3] (i64:
    SM id, start ns, end ns; one row per task, at the task's index) as its last argument."""
    for k in kernels:
        if k.name not in forward:
            continue
        buf = f"prof_{k.name}"
        buffers.append(Buffer(buf, "i64", [_expr(tasks[k.name]), "3"], init="zeros"))
        k.args.append(KernelArg("prof", buf, "i64", ["P", 3]))


# debug_unchecked skips the safety checks (tests inject a deadlock with it: a gather lag past
# stages - 2 in gemm_gateup, the forward's, or bwd_dgrad_down, the backward's);
# debug_break_dependency makes the fused launch's down tiles wait for a count h_ready never
# reaches, debug_break_dispatch its CTAs wait for one expert more than there are,
# debug_break_combine its early combine for one down tile more than an M tile has (tests check
# that a broken dependency ends in a clear error, not a hang).
# discard_what ("all", "rows" or "padding") limits the combine's discards (discard_consumed) to the
# token rows' lines or to the padding rows' (to measure each part); discard_h_early puts h's
# discards in every band on the M tile's last down tile (true) or on the combine (false).
OVERRIDE_KEYS = re.compile(r"row_tile|wait_timeout_ms|debug_unchecked|debug_break_dependency|debug_break_dispatch"
                           r"|debug_break_combine"
                           r"|profile|fuse_gemms"
                           r"|cluster_m|dispatch_chunked|comm_sms|return_sms|bwd_send_sms|bwd_send_grad_sms"
                           r"|bwd_send_x_sms|bwd_return_sms|comm_threads|ep_overlap|gemm_returns|gemm_sends"
                           r"|ep_fused_combine|dispatch_in_launch|fused_small|combine_unroll|launch_local_count|launch_chunked|swap_rows"
                           r"|weights_evict_first|rows_evict_last|weight_pairs|combine_early|mirror_status"
                           r"|discard_consumed|discard_what|discard_h_early|per_gemm_tokens|per_gemm_tokens_on"
                           r"|claim_late"
                           r"|(gemm_gateup|gemm_down|shared_gateup|shared_down)"
                           r"\.(tile_n|raster|epi_stages)|gemm_fused_n\d+\.(epi_stages|tile_k|tile_n|gather_lag)"
                           r"|(gemm_gateup|bwd_dgrad_down)\.gather_lag|gemm_fused\.wave_lag")


def check_token_ranges(key: str, value) -> None:
    """A list of [lo, hi] token ranges, 1 <= lo <= hi, increasing and apart."""
    if not isinstance(value, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(t, int) and not isinstance(t, bool) for t in r)
            and 1 <= r[0] <= r[1] for r in value) or any(a[1] >= b[0] for a, b in zip(value, value[1:])):
        raise PlanError(f"{key} must be a list of [lo, hi] token ranges, 1 <= lo <= hi, increasing and apart, "
                        f"got {value!r}")


def check_overrides(overrides: dict) -> None:
    """Overrides name real decisions with legal values: a typo is an error, never ignored."""
    for key, value in overrides.items():
        if not OVERRIDE_KEYS.fullmatch(key):
            raise PlanError(f"unknown plan override {key!r}")
        if key.endswith(".raster") and value not in ("m", "n"):
            raise PlanError(f"{key} must be 'm' or 'n', got {value!r}")
        if key in ("debug_unchecked", "debug_break_dependency", "debug_break_dispatch", "debug_break_combine", "profile",
                   "fuse_gemms", "dispatch_chunked",
                   "ep_overlap", "gemm_returns", "gemm_sends", "ep_fused_combine", "dispatch_in_launch",
                   "fused_small", "launch_local_count", "launch_chunked", "weights_evict_first",
                   "rows_evict_last", "weight_pairs", "combine_early", "mirror_status", "discard_consumed",
                   "discard_h_early", "claim_late"):
            if not isinstance(value, bool):
                raise PlanError(f"{key} must be true or false")
            continue
        if key == "discard_what":
            if value not in ("all", "rows", "padding"):
                raise PlanError(f"discard_what must be 'all', 'rows' or 'padding', got {value!r}")
            continue
        if key == "per_gemm_tokens":
            check_token_ranges(key, value)
            continue
        if key == "per_gemm_tokens_on":
            if not isinstance(value, dict) or not all(isinstance(gpu, str) and gpu for gpu in value):
                raise PlanError(f"per_gemm_tokens_on must map GPU names (torch.cuda.get_device_name()) to token "
                                f"ranges, got {value!r}")
            for gpu, ranges in value.items():
                check_token_ranges(f"per_gemm_tokens_on[{gpu!r}]", ranges)
            continue
        if key == "swap_rows":
            if not isinstance(value, list) or any(isinstance(n, bool) or not isinstance(n, int) or n % SWAP_ROW_STEP
                                                  or not SWAP_ROW_STEP <= n <= 160 for n in value):
                raise PlanError(f"swap_rows must be a list of multiples of {SWAP_ROW_STEP} in [{SWAP_ROW_STEP}, 160], got {value!r}")
            continue
        if not key.endswith(".raster") and (isinstance(value, bool) or not isinstance(value, int)):
            raise PlanError(f"illegal value {value!r} for plan override {key!r}")
        if ((key == "row_tile" and value not in (64, 128)) or (key == "wait_timeout_ms" and value < 1)
                or (key == "cluster_m" and value not in (1, 2))
                or (key.endswith(".epi_stages") and value not in range(1, 9))
                or (key.endswith(".tile_k") and value not in (64, 128))
                or (key == "gemm_fused.wave_lag" and value < 0)  # (0: every gate/up tile first)
                or (key == "combine_unroll" and value not in range(1, 9))):
            raise PlanError(f"illegal value {value!r} for plan override {key!r}")


def check_plan(plan: Plan, graph: Graph) -> None:
    """Invariants every Plan keeps (also asserted by the tests). Kernels bind workspace
    buffers or tensors of the forward graph (given) or of the backward graph."""
    known = set(graph.tensors) | set(backward_graph(graph.spec, fused_route=True).tensors)
    names = [k.name for k in plan.kernels]
    if len(set(names)) != len(names):
        raise PlanError("duplicate kernel names")
    buffers = {b.name for b in plan.buffers}
    for entry, steps in plan.steps.items():
        for s in steps:
            k = plan.kernel(s)
            for a in k.args:
                if a.tensor not in buffers and a.tensor not in known and a.tensor not in ("logits", *RUNTIME_TENSORS):
                    raise PlanError(f"kernel {k.name} binds {a.name} to unknown tensor {a.tensor}")
                if sum(1 for d in a.shape if isinstance(d, str)) > 1:
                    raise PlanError(f"kernel {k.name} arg {a.name}: at most one symbolic dimension")
    for k in plan.kernels:
        if k.block > 1024 or k.block % 32:
            raise PlanError(f"kernel {k.name}: block of {k.block} threads")
        if k.smem_bytes > plan.target["smem_per_block"]:
            raise PlanError(f"kernel {k.name}: {k.smem_bytes} B of shared memory")
