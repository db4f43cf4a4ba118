"""The Plan: every decision between the stage graph and the generated code.

A Plan is plain data (JSON round-trip, deterministic for a given spec and target):
tile shapes, stages, warp roles, SM roles, the launch order, the reduction order,
the workspace buffers and (for several GPUs) the queues. Each decision is made in
one function, from the spec and the target's numbers, and is recorded with the reason
in `decisions`. Templates read their numbers from the Plan and nowhere else.

make_plan reads top to bottom. This module decides the forward (tiles, paths, the
single launch, dispatch, combine); backward.py the training forward and the backward,
expert_parallel.py the layer over several GPUs, multinode.py over several nodes and
fp8.py the FP8 layer; records.py holds the records they all build.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from dataclasses import dataclass

import sympy

from .. import __version__
from ..ir import Graph, MoESpec, backward_graph, forward_graph
from ..ir.graph import T
from .backward import (BACKWARD_GEMMS, COPY_BATCH_CONSUMER, COPY_BATCH_PRODUCER, COPY_CLAIM_ROWS,
                       SHARED_BACKWARD_GEMMS, WGRAD_TILE_M, backward_kernels, backward_support)
from .records import (PLAN_FORMAT, SHARED_ROWS, VEC, WARPGROUP_THREADS, WGMMA_ROWS, Buffer, KernelArg, KernelPlan,
                      Plan, PlanError, _expr, simt_threads)
from .target import Target, target_for
from .taskgraph import forward_task_graph, fused_tile_order, gemm_model_params

# Epilogue staging buffers of a GEMM (`<gemm>.epi_stages` overrides). Measured on H200,
# E64 K8 H2048 I1024 at T=16384, three runs: 2 buffers instead of 4 made gate/up 3-8% and
# down 1-6% faster (T=4096 and E256 K8 H7168 I2048: within 1%); 8 was slower.
EPI_STAGES = 2
# Tile-scheduler slots per CTA: the producer claims one tile ahead of the one it loads, so
# it publishes tile i + 1 while readers may still hold tile i.
SCHED_STAGES = 2
# bf16 K step of one TMA box row: 64 elements = 128 bytes, the 128-byte swizzle width.
TILE_K = 64
# Shared memory kept back for mbarriers and alignment padding.
SMEM_RESERVE = 2048
# The token count the cost model assumes when a decision depends on T (one build
# serves every T; this only picks among legal choices).
NOMINAL_TOKENS = 8192
# A kernel's wait that lasts longer than this is a bug (a deadlock): the thread records an
# error code and gives up, the kernel ends, and the host raises KernelTimeout.
WAIT_TIMEOUT_MS = 10_000
# Once any thread has given up, the others notice within this long (a waiting thread reads
# the error code only after waiting this long, so a healthy wait never pays for it).
STATUS_POLL_NS = 1_000_000
# Routed pairs each dispatch thread ranks per step: fewer block barriers per pair.
DISPATCH_ITEMS = 4


# ---- decisions ---------------------------------------------------------------------

def choose_row_tile(spec: MoESpec, target: Target) -> tuple[int, str]:
    """The M tile shared by dispatch and the routed GEMMs: 128 (two consumer warpgroups)
    or 64 (one). Each expert's rows are padded to a multiple of it, so few rows per
    expert favour 64; 128 issues twice the wgmma work per CTA. Cost model: useful rows
    over padded rows at the nominal token count, times the measured relative speed of
    the tile (target.row_tile_efficiency)."""
    rows = NOMINAL_TOKENS * spec.topk / spec.local_experts

    def score(tile):
        # Routed counts scatter around the mean: on average half a tile of padding each.
        return rows / (rows + tile / 2) * target.row_tile_efficiency[tile]

    best = max(sorted(target.row_tile_efficiency), key=score)
    why = ", ".join(f"{t}: {score(t):.2f}" for t in sorted(target.row_tile_efficiency))
    return best, f"~{rows:.0f} rows per expert at T={NOMINAL_TOKENS}; expected efficiency {why}"


def choose_gemm_tiling(n_size: int, k_size: int, epilogue: str, target: Target, tile_m: int = 128,
                       gather_a: bool = False, tile_n: int | None = None, epi_stages: int | None = None,
                       swap: bool = False, tile_k: int | None = None) -> dict:
    """Tile shape, pipeline depth, epilogue tiling and warp roles of one grouped GEMM.

    Persistent and warp-specialised: one producer warpgroup (TMA) and two consumer
    warpgroups of 64 rows each, so the M tile is 128. The accumulator budget is 128
    fp32 registers per consumer thread (consumers run with CONSUMER_REGS): SwiGLU keeps
    two accumulators (gate and up), so its N tile is half of a plain GEMM's. N tiles
    that divide N avoid partial tiles. The epilogue has its own staging buffers (the
    producer refills the A/B stages meanwhile); the A/B stages take what is left.
    """
    num_b = 2 if epilogue in ("swiglu", "swiglu_save", "pair") else 1
    if swap:
        # Swapped operands (swap_tiling): the weights' tile_n rows are the wgmma's M, 64 per
        # consumer warpgroup, and the tile's tile_m token rows its N.
        tile_n = tile_n or SWAP_TILE_N
        check_swap_tiling(tile_m, tile_n, num_b)
        mma_warpgroups = tile_n // WGMMA_ROWS
    else:
        mma_warpgroups = tile_m // WGMMA_ROWS
    consumer_threads = mma_warpgroups * WARPGROUP_THREADS
    threads = consumer_threads + WARPGROUP_THREADS  # + the producer warpgroup
    acc_budget = 128 * consumer_threads  # fp32 accumulators the CTA may hold
    candidates = [n for n in (256, 128, 64) if tile_m * n * num_b <= acc_budget]
    if not swap:
        if tile_n is None:
            tile_n = next((n for n in candidates if n_size % n == 0), candidates[-1])
        elif tile_n not in candidates:
            raise PlanError(f"N tile {tile_n} does not fit the accumulator budget (legal: {candidates})")
    # The epilogue's sub-tiles run along the C tile's second mode: swapped, the tile is stored
    # transposed (weight rows x token rows), 32 token rows at a time (16 where 32 do not divide them).
    epi_tile = (tile_n, swap_epi_rows(tile_m)) if swap else (tile_m, 32)
    def fitting_stages(k_block: int, epi_buffers: int) -> int:
        """A/B stages of K blocks this deep that fit beside the epilogue's buffers."""
        epi = epi_tile[0] * epi_tile[1] * 2 * epi_buffers
        return (target.smem_per_block - SMEM_RESERVE - epi) // ((tile_m + num_b * tile_n) * k_block * 2)

    # The epilogue buffers let the TMA stores of a tile's first sub-tiles drain while
    # the next are staged; the autotuner tries other counts.
    if swap and tile_k is None and epi_stages is None and not (k_size % SWAP_WIDE_K or n_size % SWAP_WIDE_K) \
            and fitting_stages(SWAP_WIDE_K, 1) >= SWAP_WIDE_K_STAGES:
        # Swapped tiles read each weight row 2 x 128 bytes at a time where a stage that deep
        # still leaves SWAP_WIDE_K_STAGES of them (with one epilogue buffer): HBM serves the
        # wider pieces faster (the 32-row tiles 1.03x at E64 T = 64-165, docs/perf.md).
        tile_k, epi_stages = SWAP_WIDE_K, 1
    epi_stages = epi_stages or EPI_STAGES
    epi_bytes = epi_tile[0] * epi_tile[1] * 2 * epi_stages
    tile_k = tile_k or TILE_K
    stage_bytes = (tile_m + num_b * tile_n) * tile_k * 2
    stages = min(fitting_stages(tile_k, epi_stages), 8)
    if stages < 2:
        raise PlanError(f"GEMM tile {tile_m}x{tile_n}: fewer than 2 pipeline stages fit in shared memory")
    smem = stages * stage_bytes + epi_bytes + 1024
    if smem > target.smem_per_block:
        raise PlanError(f"GEMM needs {smem} B of shared memory, {target.name} offers {target.smem_per_block}")
    # setmaxnreg: the producer gives registers to the consumers, within the CTA's pool.
    # A gathering producer keeps a token index per row it copies, so it keeps more.
    producer_regs, consumer_regs = (56, 224) if gather_a else (40, 232)
    try:
        target.check_register_split("GEMM", producer_regs, WARPGROUP_THREADS, consumer_regs, consumer_threads)
    except ValueError as e:
        raise PlanError(str(e)) from None
    return dict(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, stages=stages, epi_tile=list(epi_tile),
                epi_stages=epi_stages, mma_warpgroups=mma_warpgroups, threads=threads, sms=target.sms,
                producer_regs=producer_regs, consumer_regs=consumer_regs, smem_bytes=smem, **({"swap": True} if swap else {}))


# Swapped tiles (the single launch's bands, launch_bands): an M tile of N token rows is the
# wgmma's N operand (any multiple of 8 up to 256, where its M is 64 rows per warpgroup), so
# an expert's rows need not be padded to 64-row slices and one tile can hold all of an
# expert's rows at mid-size T: its weights then stream into one SM once, where 128-row tiles
# read them again for each of an expert's M tiles. The weights' rows are the wgmma's M: two
# consumer warpgroups of 64 rows of each B tile. Each consumer thread holds NUM_B x N / 2 fp32
# accumulators, within SWAP_ACC_MAX of its registers (the rest: addresses, the epilogue).
SWAP_TILE_N = 128
SWAP_ACC_MAX = 176
SWAP_WIDE_K = 128
SWAP_WIDE_K_STAGES = 3
# The swapped tiles' weight loads are marked evict-first in L2 (override weights_evict_first:
# false keeps the default policy): an expert's rows fit one such tile, so each weight byte is
# read once, and the lines of x, h and y stay in L2 in their place. Measured on H200 (E64 K8
# H2048 I1024, CUDA graphs, 4 interleaved rounds, the same bits): 1.026x at T = 64 (32-row tiles),
# 0.996x at 256 (64 rows), 1.006x at 512 (96 rows), 1.020x at 1024 (160 rows); the plain 128-row
# launch, whose experts' second M tiles find their weights in L2, 0.910x at T = 1536, so not there.
SWAP_WEIGHTS_EVICT_FIRST = True
# The L2 cache-policy word of an evict-first TMA load (the encoding CUTLASS's CacheHintSm90.EVICT_FIRST
# names), which the kernel passes as the load's cache_policy.
L2_EVICT_FIRST = 0x12F0000000000000
# The swapped tiles' h and y rows are marked evict-last in L2 (override rows_evict_last: false keeps
# the default policy): the gate/up tiles' h rows are read again by the down tiles of their M tile,
# and the down tiles' y rows by the combine, while the weight stream passes through L2 beside
# them. Measured on H200 (E64 K8 H2048 I1024, CUDA graphs, 3 interleaved rounds, the same bits):
# 1.011x / 1.009x / 1.008x at T = 64 / 256 / 1024 (per-round median).
SWAP_ROWS_EVICT_LAST = True
# The L2 cache-policy word of an evict-last TMA load or store (CUTLASS's CacheHintSm90.EVICT_LAST).
L2_EVICT_LAST = 0x14F0000000000000
# Weight pairs (override weight_pairs): in swapped tiles of 64-wide K blocks the TMA thread waits
# for two free stages and issues both K blocks' weight loads back to back, so each weight row is
# read 2 x 128 bytes at a time, as the 32-row tiles' 128-wide K blocks read it (HBM serves 256
# bytes a row 3% faster than 128, benchmarks/weight_stream.py), where two 128-wide stages are all
# that would fit. Measured on H200 (CUDA graphs, 4 interleaved rounds, the same bits, docs/perf.md):
# E64 K8 H2048 I1024's 64-row tiles 1.029x / 1.025x / 1.029x at T = 200 / 256 / 375, its 96- and
# 160-row tiles 0.983x / 0.973x at T = 512 / 1024 (L2, not HBM, bounds those); E40 K6 H1536 I640's
# 64-row tiles (1.5 gate/up tiles per SM) 0.983x / 0.990x at T = 320 / 426. So by default: tiles of
# up to SWAP_WEIGHT_PAIRS_MAX_ROWS token rows, in layers of at least SWAP_MIN_WAVES gate/up tiles
# per SM (whose weight stream is long enough to be HBM-bound).
SWAP_WEIGHT_PAIRS = True
SWAP_WEIGHT_PAIRS_MAX_ROWS = 64


def pairs_fit(params: dict) -> bool:
    """Whether a swapped tile's producer can load its weights two K blocks at a time: 64-wide K
    blocks, an even number of them in every tile kind's K, and a stage to spare beside the
    lagged gathers (warp 0 waits for the stage after the one it fills, whose consumers wait
    for the fills this warp has not yet arrived on: GATHER_LAG <= STAGES - 3, one more than
    without pairs)."""
    ks = [params["k_size"], params["n_size"]] + ([params["s_size"]] if params.get("s_size") else [])
    return (params["tile_k"] == TILE_K and all(k % (2 * TILE_K) == 0 for k in ks)
            and params["gather_lag"] <= params["stages"] - 3 and params.get("cluster_m", 1) == 1)


# Gathered stages in flight per producer warp in swapped tiles of up to SWAP_GATHER_LAG_MAX_ROWS
# token rows (where their stages allow it): the weight loads of the next stages are issued by
# a warp that also gathers, and one gathered stage in flight held them back. Measured on H200
# (CUDA graphs, 4 interleaved rounds, the same bits), lag 2 against 1: 64-row tiles 1.009x at
# E64 T = 256, 1.036x at E40 T = 426, level at E40 T = 320 (lag 3 0.992x at E64); 96-row tiles
# mixed (1.018x at E64 T = 512, 0.963x at E40 T = 640), so they keep 1; 160-row tiles 0.993x
# at E64 T = 1024, where L2's throughput bounds the tile (docs/perf.md).
SWAP_GATHER_LAG = 2
SWAP_GATHER_LAG_MAX_ROWS = 64


# A swapped tile's token rows are a multiple of SWAP_ROW_STEP (the epilogue stores them 32 at a
# time, or 16 where 32 do not divide them; the transposing stmatrix writes 8 x 8 pieces).
SWAP_ROW_STEP = 16


def swap_epi_rows(tile_m: int) -> int:
    """Token rows per epilogue sub-tile of a swapped tile."""
    return 32 if tile_m % 32 == 0 else SWAP_ROW_STEP


def check_swap_tiling(tile_m: int, tile_n: int, num_b: int) -> None:
    if tile_n not in (WGMMA_ROWS, SWAP_TILE_N):
        raise PlanError(f"swapped tiles: N tile {tile_n}, only {WGMMA_ROWS} or {SWAP_TILE_N} (one or two warpgroups "
                        "of 64 weight rows)")
    if tile_m % SWAP_ROW_STEP or not SWAP_ROW_STEP <= tile_m <= 256:
        raise PlanError(f"swapped tiles: {tile_m} token rows, a multiple of {SWAP_ROW_STEP} in [{SWAP_ROW_STEP}, 256] (the "
                        "epilogue's sub-tiles)")
    if num_b * tile_m // 2 > SWAP_ACC_MAX:
        raise PlanError(f"swapped tiles: {tile_m} token rows need {num_b * tile_m // 2} accumulator registers per "
                        f"thread, at most {SWAP_ACC_MAX}")


def tile_n_choices(epilogue: str, tile_m: int = 128) -> list[int]:
    """N tiles that fit the accumulator budget (what an autotuner may try)."""
    num_b = 2 if epilogue == "swiglu" else 1
    return [n for n in (256, 128, 64) if tile_m * n * num_b <= 128 * (tile_m // WGMMA_ROWS) * WARPGROUP_THREADS]


def make_plan(spec: MoESpec, target: Target | None = None, overrides: dict | None = None,
              override_source: str = "") -> Plan:
    """The Plan for `spec` on `target`. `overrides` (experiments, autotuning) replaces
    decisions by name; the Plan records that it did, and where they came from.

    It is decided in this order, each step one function below: the routed M tiles, the forward
    paths (per-GEMM launches, the single launch, or both by T), tile_counters' slots and the
    call's buffers, the route and dispatch kernels, the GEMMs (GemmMaker), the single launches,
    the shared expert, the combine, the expert-parallel steps, the backward, the launches' memory
    policies, the profiling records; last the task graph that orders the single launch's tiles."""
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
    launch_policies(kernels, spec, target, paths, counters, ov, decisions)
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
        launch_bands=[[t, f"forward_n{n}" if n else "forward_fused"] for t, n in bands] if paths.fuse and not ep
        else [],
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


def dispatch_kernels(spec: MoESpec, target: Target, row_tile: int, cluster_m: int, counters: Counters, fuse: bool,
                     ov: dict, buffers: list, decisions: list) -> tuple[list[KernelPlan], dict, bool]:
    """The send stage: count, then scatter (positions, row -> token table, tile table); its
    parameters (which the single launch's own dispatch reuses); whether it goes by chunks of
    (token, slot) pairs (O(T*K)) rather than one CTA per expert."""
    ep = spec.world_size > 1
    K, E = spec.topk, spec.local_experts
    threads = min(1024, target.max_threads_per_block)
    # Expert parallel: dispatch groups the rank's pairs by global expert with a one-row tile
    # (no padding: rows leave for their owners, whose layout pads them), into send_token /
    # send_expert.
    dparams = dict(experts=spec.experts if ep else E, topk=K, tile_m=1 if ep else row_tile, threads=threads,
                   items_per_thread=DISPATCH_ITEMS, tile_align=cluster_m, status_slot=counters.status,
                   bad_ids_code=BAD_IDS_CODE, empty_id=EMPTY_ID)
    if ep:  # the send order: local expert first (expert_parallel.py)
        dparams.update(order_world=spec.world_size, order_local=E)
    d_experts, n = dparams["experts"], counters.n
    kernels = [
        KernelPlan("dispatch_count", "send", "dispatch", "dispatch.py.j2", "count", dparams,
                   [KernelArg("ids", "topk_ids", "i32", ["T", K]), KernelArg("counts", "counts", "i32", [d_experts]),
                    KernelArg("tile_counters", "tile_counters", "i32", [n])],
                   grid=f"({d_experts},)", block=threads,
                   warp_roles=["all warps: count one expert's pairs; CTA 0 also zeroes the GEMM tile counters"]),
        KernelPlan("dispatch_scatter", "send", "dispatch", "dispatch.py.j2", "scatter", dparams,
                   [KernelArg("ids", "topk_ids", "i32", ["T", K]), KernelArg("counts", "counts", "i32", [d_experts]),
                    KernelArg("pos", "pos", "i32", ["T", K]),
                    KernelArg("row_token", "send_token" if ep else "row_token", "i32", ["M"]),
                    KernelArg("tile_expert", "send_expert" if ep else "tile_expert", "i32", ["MT"]),
                    KernelArg("tile_counters", "tile_counters", "i32", [n])]
                   + ([KernelArg("h_ready", "h_ready", "i32", ["MT"])] if fuse and not ep else []),
                   grid=f"({d_experts},)", block=threads,
                   warp_roles=["all warps: stable compaction of one expert's pairs (block scan)"]),
    ]
    dparams.update(fused=fuse and not ep, used_slot=counters.used)  # expert parallel: layout writes them
    # The dispatch kernels (the single launch dispatches by itself, per expert): O(T*K) by chunks of
    # pairs, unless overridden; expert parallel groups by owner first (the per-expert kernels).
    chunked = not ep and ov.get("dispatch_chunked", True)
    if chunked:
        kernels = chunked_dispatch(kernels, dparams, K, E, buffers)
        decisions.append(f"dispatch: O(T*K), one CTA of {CHUNK_THREADS} threads per {CHUNK_PAIRS} pairs; per-chunk "
                         "histograms, fixed-order sums and match.sync ranks keep (token, slot) order (the per-expert "
                         "kernels' positions, bit for bit; 106 -> 13 us at E64 T=16384, docs/perf.md)")
    else:
        decisions.append(f"dispatch: one CTA of {threads} threads per expert; scan-based stable "
                         "compaction keeps (token, slot) order, so positions are deterministic")
    return kernels, dparams, chunked


class GemmMaker:
    """Makes the Plan's grouped GEMM kernels (templates/grouped_gemm_persistent.py.j2): every
    routed, shared-expert and backward GEMM, in one Plan's context (its target, overrides, row
    tile, cluster, counters and bounded waits). Each call states its tiling in `decisions`."""

    def __init__(self, spec: MoESpec, target: Target, ov: dict, row_tile: int, cluster_m: int, counters: Counters,
                 wait_timeout_ns: int, decisions: list):
        self.spec, self.target, self.ov, self.row_tile, self.cluster_m = spec, target, ov, row_tile, cluster_m
        self.counters, self.wait_timeout_ns, self.decisions = counters, wait_timeout_ns, decisions

    def __call__(self, name, stage, a, b, c, n, k, epilogue, doc, *, rows: tuple | None = None, gather_a=False,
                 routed=True, b_major="k", split_k=False, wgrad_m=0, clustered=True, gather_mn="", copy_rows=None,
                 rows_tile=None, swap=False) -> KernelPlan:
        """One grouped GEMM. rows: (the tile table, the symbol of its rows, of its tiles, the
        groups), the routed rows (tile_expert over M rows in MT tiles, one group per local
        expert) unless given (SHARED_ROWS: the shared expert's). The backward's modes: epilogue
        "pair" (c = (c0, c1), both products stored), b_major "mn" (B stored [groups, K, N]),
        split_k (a = (a0, a1) and b = (b0, b1) along K), wgrad_m (weight gradients [groups,
        wgrad_m, n] contracted over each group's rows; k is unused; gather_mn "a" or "b": that
        operand's rows gathered from token rows through row_token; copy_rows (source,
        destination, counter slot): the kernel's idle warps also copy the source's token rows
        into the destination in dispatch order, see COPY_CLAIM_ROWS); rows_tile: the M tile of
        a routed GEMM whose launch lays its rows out itself (the small calls' single launch),
        else row_tile; swap: the wgmma's operands swapped (swap_tiling)."""
        ov, target, H = self.ov, self.target, self.spec.hidden
        tiles_tensor, m_sym, tiles_sym, groups = rows or ("tile_expert", "M", "MT", self.spec.local_experts)
        n_counters = self.counters.n
        rows_tile = rows_tile or self.row_tile
        tile_m = WGRAD_TILE_M if wgrad_m else rows_tile  # a weight-gradient tile runs over H or I, not rows
        tl = choose_gemm_tiling(n, k, epilogue, target, tile_m, gather_a or bool(gather_mn) or bool(copy_rows),
                                ov.get(f"{name}.tile_n"), ov.get(f"{name}.epi_stages"), swap, ov.get(f"{name}.tile_k"))
        cs = c if isinstance(c, tuple) else (c,)
        if wgrad_m:  # A [rows, wgrad_m], B [rows, n]; counts give each group's rows
            args = [KernelArg("a", a, "bf16", ["T" if gather_mn == "a" else m_sym, wgrad_m])]
            if gather_mn:
                args.append(KernelArg("row_token", "row_token", "i32", [m_sym]))
            args += [KernelArg("b0", b[0], "bf16", ["T" if gather_mn == "b" else m_sym, n]),
                     KernelArg("tile_expert", tiles_tensor, "i32", [groups]),
                     KernelArg("tile_counter", "tile_counters", "i32", [n_counters]),
                     KernelArg("c", cs[0], "bf16", [groups, wgrad_m, n])]
        else:
            a_k = k // 2 if split_k else k
            if gather_a:  # A rows gathered from the token rows through row_token
                args = [KernelArg("a", a, "bf16", ["T", k]), KernelArg("row_token", "row_token", "i32", [m_sym])]
            else:
                args = [KernelArg("a", a[0] if split_k else a, "bf16", [m_sym, a_k])]
                if split_k:
                    args.append(KernelArg("a1", a[1], "bf16", [m_sym, a_k]))
                if routed:
                    args.append(KernelArg("row_token", "row_token", "i32", [m_sym]))
            bshape = [groups, n, a_k] if b_major == "k" else [groups, a_k, n]
            args.append(KernelArg("b0", b[0], "bf16", bshape))
            if epilogue in ("swiglu", "swiglu_save", "pair") or split_k:
                args.append(KernelArg("b1", b[1], "bf16", bshape))
            args += [KernelArg("tile_expert", tiles_tensor, "i32", [tiles_sym]),
                     KernelArg("tile_counter", "tile_counters", "i32", [n_counters])]
            args += [KernelArg(f"c{i + 1 if i else ''}", t, "bf16", [m_sym, n]) for i, t in enumerate(cs)]
            if copy_rows:
                args += [KernelArg("copy_src", copy_rows[0], "bf16", ["T", H]),
                         KernelArg("copy_dst", copy_rows[1], "bf16", [m_sym, H])]
        raster = ov.get(f"{name}.raster", "m")
        # Gathered A stages a producer warp keeps in flight before releasing the oldest.
        # The consumers release a stage only after the next one is full (one wgmma batch
        # stays in flight), so the producer may hold at most stages - 2 un-released
        # stages; one more and producer and consumers wait on each other forever.
        # Measured on H200 (E64 K8 H2048 I1024, T=16384): lag 2 was no faster than lag 1
        # (3.14 vs 3.12 ms), so the default keeps the shallower, simpler one; swapped tiles of
        # few token rows keep SWAP_GATHER_LAG (see there).
        default_lag = SWAP_GATHER_LAG if swap and rows_tile <= SWAP_GATHER_LAG_MAX_ROWS else 1
        gather_lag = ov.get(f"{name}.gather_lag", min(default_lag, max(tl["stages"] - 2, 1)))
        if not 1 <= gather_lag <= tl["stages"] - 2 and not ov.get("debug_unchecked"):
            raise PlanError(f"{name}: gather lag {gather_lag} must be in [1, stages - 2] (deadlock otherwise)")
        # Which rows of an M tile hold tokens. A consumer warpgroup whose whole slice is
        # padding skips its wgmma (the tensor cores then serve the other one alone): the
        # routed GEMMs read it from row_token (-1 marks padding), the shared expert's
        # tiles are full up to the last one, whose rows end at T. A weight-gradient tile
        # contracts its group's rows (counts) and is never part padding.
        valid_rows = "counts" if wgrad_m else "row_token" if routed else "m_rows"
        cluster_m = self.cluster_m if routed and clustered else 1
        params = dict(tl, n_size=n, k_size=k, groups=groups, epilogue=epilogue, gather_a=gather_a, raster=raster,
                      cluster_m=cluster_m, valid_rows=valid_rows, sched_slot=self.counters.gemm_slot(name),
                      sched_stages=SCHED_STAGES, status_slot=self.counters.status, gather_lag=gather_lag, vec=VEC,
                      wait_timeout_ns=self.wait_timeout_ns, status_poll_ns=STATUS_POLL_NS, b_major=b_major,
                      split_k=split_k, wgrad=bool(wgrad_m), m_size=wgrad_m, gather_mn=gather_mn,
                      row_align=rows_tile * self.cluster_m,
                      **(dict(copy_rows=True, copy_slot=copy_rows[2], copy_cols=H, copy_claim_rows=COPY_CLAIM_ROWS,
                              copy_batch_producer=COPY_BATCH_PRODUCER, copy_batch_consumer=COPY_BATCH_CONSUMER)
                         if copy_rows else {}),
                      class_name=class_name(name), name=name, doc=doc)
        smem = params.pop("smem_bytes")
        self.decisions.append(
            f"{name}: persistent over min({tl['sms']} SMs, tiles), tile {tl['tile_m']}x{tl['tile_n']}x{tl['tile_k']}, "
            f"{tl['stages']} stages ({smem // 1024} KiB smem), 1 producer + {tl['mma_warpgroups']} MMA warpgroups; "
            f"tiles claimed from tile_counters[{params['sched_slot']}] in {raster}-major order, so the tiles in "
            "flight stay together in L2 even when some take less time (half-empty ones)"
        )
        return KernelPlan(name, stage, name, "grouped_gemm_persistent.py.j2", "main", params, args,
                          grid=f"(min({tl['sms']}, {tiles_sym}*ceil({n}/{tl['tile_n']})),)", block=tl["threads"],
                          warp_roles=[f"warpgroup 0: TMA producer (warp 0), {tl['producer_regs']} registers",
                                      f"warpgroups 1..{tl['mma_warpgroups']}: wgmma consumers + epilogue "
                                      f"(stmatrix + TMA store), {tl['consumer_regs']} registers"],
                          smem_bytes=smem)


def single_launches(gemm: GemmMaker, gateup: KernelPlan, spec: MoESpec, target: Target, row_tile: int, paths: Paths,
                    counters: Counters, dparams: dict, ov: dict, kernels: list, buffers: list, steps: dict,
                    decisions: list, m_tiles, rows) -> tuple[list, sympy.Expr]:
    """The single launch (one GPU): gemm_fused, which may dispatch itself, its routing twin,
    and its bands of swapped tiles by T (launch_bands). Returns the bands and the routed row
    count every row buffer is sized for."""
    E, K, H, I, S = spec.local_experts, spec.topk, spec.hidden, spec.intermediate, spec.shared_intermediate
    fused_slot = counters.slot("gemm_fused")
    kernels.append(fused_gemm(gateup, H, I, E, counters.used, target, S, counters.shared, fused_slot,
                              counters.done, K, bool(ov.get("debug_break_dependency"))))
    lag = ov.get("gemm_fused.wave_lag", 0)
    if lag and S:
        raise PlanError("gemm_fused.wave_lag: the wavefront tile order is not generated with a shared expert")
    kernels[-1].params["wave_lag"] = lag
    buffers.append(Buffer("h_ready", "i32", [_expr(m_tiles)]))
    in_launch = dispatch_in_launch(kernels[-1], dparams, ov, buffers)
    steps["forward_fused" if paths.kind == "by_tokens" else "forward"] = \
        ["gemm_fused"] if in_launch else ["dispatch_count", "dispatch_scatter", "gemm_fused"]
    if in_launch:
        chunk = kernels[-1].params["dispatch"].get("chunk")
        how = (f"each CTA counts, then places, every grid-th chunk of {chunk} pairs (the chunked dispatch "
               "kernels' code, templates/dispatch_chunks.py.j2: one step a chunk, where a CTA placing an expert "
               "scans every pair; every dispatch's bits)" if chunk else
               "each CTA counts, then places, every grid-th expert's pairs (the per-expert dispatch kernels' "
               "code; every dispatch's bits)")
        decisions.append(
            f"gemm_fused also dispatches: {how} before it takes tiles; two launch-wide counters order the phases "
            "(bounded waits; the last CTA past them zeroes them for the next call), so the forward is one launch")
        kernels.append(routed_launch(kernels[-1], spec))
        steps["forward_routed"] = ["gemm_fused_routed"]
        decisions.append(
            "gemm_fused_routed: the same launch, routing first (router logits -> softmax -> top-k, the route "
            "kernel's code and bits, one token per warp; a third counter says when every CTA has routed): "
            "mokgen.moe_routed runs it for calls the fused launch serves")
    bands, why_bands = launch_bands(spec, row_tile, target.sms, in_launch and paths.kind == "by_tokens", ov)
    if bands:
        rows = swapped_bands(gemm, bands, spec, counters, dparams, ov, kernels, buffers, steps, decisions, row_tile,
                             rows)
    if why_bands:
        decisions.append(why_bands)
    decisions.append(
        f"gemm_fused: gate/up and down in one persistent launch; tiles claimed in order (all gate/up "
        f"tiles, then all down tiles); a down tile waits until h_ready[m] counts the "
        f"{I // gateup.params['tile_n']} gate/up tiles of its M tile (release/acquire at GPU scope, "
        "bounded spin), so there is no grid-wide barrier and no deadlock: a down tile only waits for tiles "
        "claimed before it")
    if S:
        decisions.append(
            f"gemm_fused also runs the shared expert: its gate/up tiles come after the routed gate/up tiles "
            f"(they fill the SMs while the last routed gate/up tiles finish), its down tiles last, after "
            f"tile_counters[{counters.shared}] counts every shared gate/up tile")
    return bands, rows


def swapped_bands(gemm: GemmMaker, bands: list, spec: MoESpec, counters: Counters, dparams: dict, ov: dict,
                  kernels: list, buffers: list, steps: dict, decisions: list, row_tile: int, rows) -> sympy.Expr:
    """The single launch once per band of swapped tiles (and its routing twin): the same tasks,
    the token rows the wgmma's N. Returns the routed row count the row buffers now hold."""
    E, K, H, I = spec.local_experts, spec.topk, spec.hidden, spec.intermediate
    swapped = sorted({n for _, n in bands if n})
    # One tile table and one set of gate/up counts for all of them (a call runs one),
    # sized for the smallest tile (the most tiles); the row buffers for the per-GEMM
    # path's tiles (the training forward and the backward take it at every T) or the
    # band's that serves T, whichever lays out more rows (not the largest band's at
    # every T: a small call's workspace stays small enough to keep, KEEP_WORKSPACE_BYTES).
    m_tiles_w = sympy.ceiling(T * K / swapped[0]) + E
    buffers += [Buffer("tile_expert_w", "i32", [_expr(m_tiles_w)]),
                Buffer("h_ready_w", "i32", [_expr(m_tiles_w)])]
    rows_w = sympy.Max(rows, sympy.Piecewise(*(((sympy.ceiling(T * K / n) + E) * n if n else rows,
                                                sympy.Le(T, top)) for top, n in bands), (rows, True)))
    for b in buffers:
        if b.name in ("row_token", "h", "y"):
            b.shape[0] = _expr(rows_w)
        if b.name == "tile_expert":
            # The per-GEMM tile table covers every row of these buffers: the kernels that
            # walk all rows of row_token (the SwiGLU backward, the x-row copy) read
            # tile_expert[r // row_tile] first, and dispatch writes -1 past the used tiles.
            b.shape[0] = _expr(sympy.ceiling(rows_w / row_tile))
    small_t = SMALL_ROWS_PER_EXPERT * spec.experts // spec.topk
    for n in swapped:
        name = f"gemm_fused_n{n}"
        gateup_w = gemm(name, "gemm", "x", ("w_gate", "w_up"), "h", I, H, "swiglu", "", gather_a=True, rows_tile=n,
                        swap=True)
        decisions.pop()  # (its tiling is stated with the launch below)
        band = fused_gemm(gateup_w, H, I, E, counters.used, gemm.target, 0, 0, counters.slot("gemm_fused"),
                          counters.done, K, name=name)
        band.params.update(wave_lag=0, doc="Routed gate/up (SwiGLU) and down projections in one launch, "
                                           f"swapped tiles of {n} token rows.")
        for a in band.args:
            a.tensor = {"tile_expert": "tile_expert_w", "h_ready": "h_ready_w"}.get(a.tensor, a.tensor)
        # (launch_sync shared). Calls up to small_t tokens: each CTA counts every expert
        # itself, 3.7 against 5.2 us of dispatch phase at E64 T=64, 1.01x the call there
        # and 1.05x at E40; larger ones by chunks of pairs (docs/perf.md).
        top = max(t for t, m in bands if m == n)
        dispatch_in_launch(band, dict(dparams, tile_m=n), ov, [], local_count=top <= small_t)
        kernels.append(band)
        steps[f"forward_n{n}"] = [name]
        kernels.append(routed_launch(band, spec))
        steps[f"forward_routed_n{n}"] = [f"{name}_routed"]
        bp = band.params
        decisions.append(
            f"{name} (and {name}_routed, its routing twin): the single launch (it dispatches, runs every "
            f"gate/up and down tile and combines: the same bits) with swapped {bp['tile_m']}x{bp['tile_n']}"
            f"x{bp['tile_k']} tiles: the weights' {bp['tile_n']} rows the wgmma's M (1 producer + "
            f"{bp['mma_warpgroups']} MMA warpgroups of 64), the {n} token rows its N; {bp['stages']} stages, "
            f"{bp['gather_lag']} gathered in flight per producer warp; "
            + ("each CTA counts every expert's pairs itself" if bp["dispatch"]["local_count"] else
               "dispatch by chunks of pairs"))
    return rows_w


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


def launch_policies(kernels: list, spec: MoESpec, target: Target, paths: Paths, counters: Counters, ov: dict,
                    decisions: list) -> None:
    """What the single launches do besides their tiles, set on every launch that has them (the
    bands and the routing twins too): the combine's unroll and early start, the error code's
    copy by the last CTA, and the swapped tiles' L2 policies and paired weight loads."""
    for k in kernels:
        if k.params.get("combine") and "combine_unroll" in ov:
            k.params = dict(k.params, combine_unroll=ov["combine_unroll"])
        if k.params.get("combine") and k.params.get("fused") and paths.combine_early:
            k.params = dict(k.params, combine_early=True, combine_slot=counters.slot("combine_next"),
                            debug_break_combine=bool(ov.get("debug_break_combine")))
            k.warp_roles = k.warp_roles + ["a consumer warp with no tile left claims combine tasks, each waiting "
                                           "for the M tiles of its token's rows"]
        if k.params.get("fused") and k.params.get("dispatch") and paths.fused_combine and paths.mirror_status:
            # The single launch is its entry's only kernel: its last CTA mirrors the error code.
            k.params = dict(k.params, mirror_status=True, finished_slot=counters.slot("launch_done"))
            k.warp_roles = k.warp_roles + ["thread 0 of the launch's last CTA: a set error code to pinned host memory"]
            k.args = k.args + [KernelArg("status_host", "status_host", "i32", [1])]
        if k.params.get("swap") and k.params.get("fused"):
            # The swapped tiles' L2 policies: weight loads evict-first (SWAP_WEIGHTS_EVICT_FIRST),
            # the h and y rows' TMA loads and stores evict-last (SWAP_ROWS_EVICT_LAST).
            if ov.get("weights_evict_first", SWAP_WEIGHTS_EVICT_FIRST):
                k.params = dict(k.params, weights_evict_first=True, weight_l2_policy=L2_EVICT_FIRST)
            if ov.get("rows_evict_last", SWAP_ROWS_EVICT_LAST):
                k.params = dict(k.params, rows_evict_last=True, rows_l2_policy=L2_EVICT_LAST)
            pairs = ov.get("weight_pairs")
            if pairs is None:  # (the default: where they were measured to pay)
                pairs = SWAP_WEIGHT_PAIRS and k.params["tile_m"] <= SWAP_WEIGHT_PAIRS_MAX_ROWS \
                    and not weight_starved(spec, target.sms)
            if pairs and pairs_fit(k.params):
                k.params = dict(k.params, weight_pairs=True)
    for param, what in (("weights_evict_first", "weight loads evict-first in L2 (an expert's rows fit one tile, so "
                                                "each weight byte is read once; x, h and y keep their lines)"),
                        ("rows_evict_last", "h and y rows evict-last in L2 (the down tiles read h again, the "
                                            "combine y)"),
                        ("weight_pairs", "weight loads of two 64-wide K blocks issued together (each weight row "
                                         "read 256 bytes at a time)"),
                        ("mirror_status", "the launch's last CTA copies a set error code to the runtime's pinned "
                                          "host word itself (no status_mirror launch behind the call)")):
        marked = [k.name for k in kernels if k.params.get(param) and not k.name.endswith("_routed")]
        if marked:
            decisions.append(f"{', '.join(marked)} (and their routing twins): {what}")


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


# Up to this many tokens a call runs the fused launch. Measured crossover on H200
# (docs/perf.md, "The shared expert inside the fused launch"): the fused launch is 1.0-1.5x
# the multi-kernel path up to T=1024 and 0.96-1.0x from T=4096 on the bench layers.
FUSED_MAX_TOKENS = 2048
# The single launch's tiles by T (launch_bands). Each expert's rows are padded to its M tile, and
# an M tile's weights stream into an SM once per tile: the tile that holds all of an expert's rows
# with the least padding wins. Swapped tiles (check_swap_tiling) hold any multiple of
# SWAP_ROW_STEP rows; the plain launch's row_tile rows (128: two 64-row warpgroups, a slice of
# padding rows skips its MMAs) beyond the largest swapped one, and in place of a swapped tile of
# as many rows. Routed counts scatter around their mean r = T*K/E (binomial: sd about sqrt(r)),
# so a tile of n rows serves r + SWAP_SPREAD*sqrt(r) <= n. Measured on an H200 (E64 K8 H2048
# I1024, the same bits, docs/perf.md): 32 rows 1.03x the 64-row plain launch at T=64, 64 rows
# 1.015x at T=256, 160 rows 1.13x the 128-row launch at T=1024 (0.94x at T=512, where 160 rows are
# mostly padding: 96 serves it). A tile's padding rows still cost it their gathered x rows and
# h rows, which queue with the weights into its SM, so the sizes step by 16 rows: against the
# sizes in steps of 32, 1.02x-1.03x at E64 T = 64 / 200-268 / 450 / 650 / 900 (16, 48, 80, 112 and
# 144 rows), 1.02-1.08x on E40 K6 H1536 I640, 1.02x on E128 K8 H2048 I768 (48 rows).
SWAP_ROWS = (16, 32, 48, 64, 80, 96, 112, 144, 160)
SWAP_SPREAD = 2.5
# A layer with few weight tiles (E x I / SWAP_TILE_N gate/up tiles under SWAP_MIN_WAVES per SM)
# loses more to the last wave of tiles than an expert's rows spilling into a second tile costs:
# E40 K6 H1536 I640 (1.5 per SM) ran 0.92x the plain launch at T=800 with 160 rows and 0.98x the
# 64-row plain launch at T=320 with 96 rows. Such layers take the smallest tile that holds an
# expert's mean rows (no spread), and none larger than the plain launch's (which would cut the
# number of tiles further).
SWAP_MIN_WAVES = 3
# Up to this many rows per expert on average, a launch's CTAs count every expert's pairs
# themselves (no launch-wide counter between counting and placing; docs/perf.md); above it
# they dispatch by chunks of pairs.
SMALL_ROWS_PER_EXPERT = 48


def weight_starved(spec: MoESpec, sms: int) -> bool:
    """Whether a layer has fewer than SWAP_MIN_WAVES swapped gate/up tiles per SM."""
    return spec.local_experts * spec.intermediate // SWAP_TILE_N < SWAP_MIN_WAVES * sms


def launch_bands(spec: MoESpec, row_tile: int, sms: int, in_launch: bool, overrides: dict) -> tuple[list, str]:
    """([(max_tokens, rows)], why): the single launch's tiles by token count, rows the swapped
    tiles' token rows (0: the plain launch, row_tile rows), in increasing max_tokens up to
    FUSED_MAX_TOKENS; [] where the Plan has only the plain launch: several GPUs, no launch that
    dispatches beside the per-GEMM path, a shared expert (its tiles are not swapped), H and I
    that SWAP_TILE_N-row weight tiles do not divide, the wavefront tile order, or override
    fused_small: false. Override swap_rows: the swapped tile
    sizes to choose from ([] for none)."""
    if spec.world_size > 1 or not in_launch or spec.shared_intermediate or "gemm_fused.wave_lag" in overrides \
            or overrides.get("fused_small") is False:
        return [], ""
    unfit = fused_misfit(spec.hidden, spec.intermediate, 0, SWAP_TILE_N)  # (its weight tiles are SWAP_TILE_N rows)
    if unfit:
        return [], f"no swapped tiles: {unfit}"
    starved = weight_starved(spec, sms)
    spread = 0 if starved else SWAP_SPREAD
    sizes = {n for n in overrides.get("swap_rows", SWAP_ROWS) if n < row_tile or not starved} | {row_tile}
    bands: list = []
    for t in range(1, FUSED_MAX_TOKENS + 1):
        r = t * spec.topk / spec.local_experts
        need = r + spread * math.sqrt(r)
        rows = next((n for n in sorted(sizes) if n >= need), row_tile)
        rows = 0 if rows == row_tile else rows
        if bands and bands[-1][1] == rows:
            bands[-1][0] = t
        else:
            bands.append([t, rows])
    if not any(n for _, n in bands):
        return [], ""
    return [(t, n) for t, n in bands], (
        "the single launch's tiles by T (an expert's rows, mean r = T*K/E, fit one tile of n rows while "
        f"r + {spread} sqrt(r) <= n" + ("" if spread else f": fewer than {SWAP_MIN_WAVES} gate/up tiles per SM")
        + "): " + ", ".join(
            f"T <= {t}: " + (f"swapped, {n} token rows" if n else f"plain, {row_tile} rows") for t, n in bands))


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


# Error code dispatch_scatter records when some topk_ids are outside [0, E) and not EMPTY_ID
# (codes of the GEMMs' timed-out waits are 16 and up; mokgen/runtime/variant.py turns both
# into errors).
BAD_IDS_CODE = 1
# The id of an empty slot: a dropped (token, slot) pair, which gets no row and contributes
# nothing (its d_topk_weights entry is 0); the layer over several nodes marks the slots of other
# nodes' experts so.
EMPTY_ID = -1

CHUNK_THREADS = 256  # chunked dispatch: threads per CTA (8 warps)
CHUNK_PAIRS = 1024  # and (token, slot) pairs per CTA: 4 ranking steps of 32 per warp


def chunk_scratch(threads: int, experts: int) -> dict:
    """The chunked dispatch phases' shared-memory needs (templates/dispatch_chunks.py.j2):
    chunk_parts threads per expert sum the chunks' histograms, each over every chunk_parts-th
    chunk; chunk_scratch ints hold the histogram, each expert's count, segment and first M
    tile, the parts' sums and every warp's next position per expert."""
    parts = threads // experts if threads >= experts else 1
    return dict(chunk_parts=parts, chunk_scratch=4 * experts + 2 * parts * experts + threads // 32 * experts + 2)


def chunked_dispatch(plain: list, dparams: dict, K: int, E: int, buffers: list) -> list:
    """The O(T*K) dispatch (templates/dispatch_chunked.py.j2): the same outputs as the
    per-expert one, with per-chunk histograms in chunk_hist [ceil(T*K/CHUNK_PAIRS), E + 1] (the
    last column: the chunk's ids that are neither an expert nor EMPTY_ID)."""
    chunks = sympy.ceiling(T * K / CHUNK_PAIRS)
    buffers.append(Buffer("chunk_hist", "i32", [_expr(chunks), str(E + 1)]))
    hist = KernelArg("chunk_hist", "chunk_hist", "i32", ["C", E + 1])
    params = dict(dparams, threads=CHUNK_THREADS, chunk=CHUNK_PAIRS, **chunk_scratch(CHUNK_THREADS, E))
    count, scatter = plain
    grid = f"(ceil(T*{K}/{CHUNK_PAIRS}),)"
    count_args = [count.args[0], hist, count.args[2]]  # ids, chunk_hist, tile_counters
    scatter_args = [scatter.args[0], hist] + scatter.args[1:]  # ids, chunk_hist, counts, pos, ...
    return [
        KernelPlan("dispatch_count", "send", "dispatch", "dispatch_chunked.py.j2", "count", params, count_args,
                   grid=grid, block=CHUNK_THREADS,
                   warp_roles=["all warps: histogram one chunk of pairs; CTA 0 also zeroes the GEMM tile counters"]),
        KernelPlan("dispatch_scatter", "send", "dispatch", "dispatch_chunked.py.j2", "scatter", params, scatter_args,
                   grid=grid, block=CHUNK_THREADS,
                   warp_roles=["all warps: rank one chunk's pairs (match.sync), write positions and tables"]),
    ]


# Tensors the runtime provides itself, bound by no Plan buffer: the variant's pinned host word
# for the call's error code (mokgen/runtime/variant.py).
RUNTIME_TENSORS = ("status_host",)
# A single launch's last CTA copies the call's error code to the host word itself, so its entry
# has one launch, not two (override mirror_status).
MIRROR_STATUS = True


def mirror_status_by_last_kernels(kernels: list, steps: dict, zeroed: dict, side_stream: list, n_counters: int,
                                  status_slot: int, finished_slot: int | None) -> tuple[list, list]:
    """(kernels, decisions): an entry's last kernel copies a set error code to the runtime's
    pinned host word itself where it can, so no status_mirror launch follows the entry (a
    launch costs a small call about 16 us of host time, docs/perf.md). An entry with
    side-stream kernels keeps status_mirror: they are joined only after its last kernel
    (runtime mirrored_entries).
    - A combine kernel records no error: its first thread copies the code as it starts, when
      every kernel before it on the stream has finished (harmless where it is not last).
    - A per-GEMM path's grouped GEMM may record one: each CTA counts itself in finished_slot
      once done, and the last copies the code (as the single launch does). So it must run last
      in every entry that runs it (the count is per launch), and the slot must start at 0: each
      of those entries dispatches (dispatch_count zeroes tile_counters) or the runtime zeroes
      tile_counters first.
    The single launch mirrors already; every other kernel keeps its params."""
    runs_in: dict = {}  # kernel -> the entries that run it
    for entry, names in steps.items():
        for n in names:
            runs_in.setdefault(n, []).append(entry)
    alone = {e for e in steps if not set(steps[e]) & set(side_stream)}  # entries on one stream
    marked, out = [], []
    for k in kernels:
        entries = runs_in.get(k.name, [])
        lasts = [e for e in entries if steps[e][-1] == k.name and e in alone]
        if k.params.get("mirror_status") or not lasts:
            out.append(k)
            continue
        if k.template == "combine.py.j2":
            extra = dict(status_slot=status_slot)
            args = [KernelArg("tile_counters", "tile_counters", "i32", [n_counters])]
            role = "thread 0 of CTA 0: a set error code (every kernel before it has finished) to pinned host memory"
        elif k.template == "grouped_gemm_persistent.py.j2" and not k.params.get("fused") \
                and finished_slot is not None and lasts == entries \
                and all(steps[e][0] == "dispatch_count" or "tile_counters" in zeroed.get(e, ()) for e in entries):
            extra, args = dict(finished_slot=finished_slot), []
            role = "thread 0 of the launch's last CTA: a set error code to pinned host memory"
        else:
            out.append(k)
            continue
        args.append(KernelArg("status_host", "status_host", "i32", [1]))
        # (before a profiling build's record, which stays last)
        at = next((i for i, a in enumerate(k.args) if a.name == "prof"), len(k.args))
        out.append(dataclasses.replace(k, params=dict(k.params, mirror_status=True, **extra),
                                       args=k.args[:at] + args + k.args[at:], warp_roles=k.warp_roles + [role]))
        marked.append(k.name)
    why = [f"{', '.join(marked)}: where it ends an entry, it copies a set error code to the runtime's pinned "
           "host word itself (no status_mirror launch behind that entry)"] if marked else []
    return out, why


def status_mirror(n_counters: int, status_slot: int) -> KernelPlan:
    """The one-thread launch behind every call that copies a set error code to the runtime's
    pinned host word (templates/status_mirror.py.j2): one warp, its first thread works."""
    threads = 32
    return KernelPlan(
        name="status_mirror", stage="status", module="status_mirror", template="status_mirror.py.j2", entry="main",
        params=dict(status_slot=status_slot, threads=threads),
        args=[KernelArg("tile_counters", "tile_counters", "i32", [n_counters]),
              KernelArg("status_host", "status_host", "i32", [1])],
        grid="(1,)", block=threads, warp_roles=["thread 0: the call's error code to pinned host memory, if set"])


def class_name(kernel: str) -> str:
    """The generated class of a kernel: gemm_fused_n32 -> GemmFusedN32."""
    return "".join(p.capitalize() for p in kernel.split("_"))


def fused_misfit(H: int, I: int, S: int, tile_n: int) -> str | None:
    """Why the fused launch cannot run this layer with gate/up tiles tile_n wide (None: it can):
    every tile kind shares that tile, a down tile being two of them side by side."""
    if H % (2 * tile_n) or I % tile_n or S % tile_n:
        return (f"the fused launch needs H={H} a multiple of {2 * tile_n}, and I={I} and the shared expert's "
                f"{S} multiples of {tile_n}")
    return None


# A combine task's 16-byte pieces that each lane loads (from all K rows) before it sums them (the
# loop over a task's pieces is unrolled this far): 2 x TOPK loads in flight per lane. 4 measured
# level with 2 (E64 T = 64-2048, E40; docs/perf.md); override combine_unroll.
COMBINE_UNROLL = 2

# The single launch's combine, task by task as the down tiles of a token's rows are stored
# (override combine_early), or after every down tile of the launch. Measured level to 2% faster
# (E64, E128, E40 at T = 64-2048; docs/perf.md), the SMs' idle time in the span 4% -> 1.3%.
COMBINE_EARLY = True


def combine_parts(hidden: int) -> list[int]:
    """How many parts the single launch's combine may split a token row into, one (row, part)
    task per warp: the divisors of hidden / (32 lanes x VEC). The launch takes the most parts
    that still leave no warp more than one task (T x parts <= its consumer warps), so a small
    call's few rows spread over every CTA, each lane with one 16-byte piece of each of the K
    rows in flight, where one warp walking a whole row left the combine to a few CTAs,
    latency-bound (E64 T=64: 16 CTAs, 11.4 us; split in 8 parts, 4.8 us), and a larger call
    keeps whole rows, whose loads a warp overlaps better than one task after another (E64
    T=1024: 15.8 us whole, 30.7 us in 8 parts; docs/perf.md). Each output element is still
    summed over k in order: the combine kernel's bits. (Expert parallel keeps whole rows: not
    yet measured over NVLink.)"""
    most = hidden // (32 * VEC) if hidden % (32 * VEC) == 0 else 1
    return [d for d in range(1, most + 1) if most % d == 0]


def fused_gemm(gateup: KernelPlan, H: int, I: int, E: int, used_slot: int, target: Target, S: int = 0,
               shared_slot: int = 0, sched_slot: int = 0, done_slot: int | None = None, K: int = 0,
               debug_break_dependency: bool = False, name: str = "gemm_fused") -> KernelPlan:
    """gate/up and down as one persistent kernel, plus the shared expert's two GEMMs when
    the spec has one. A down tile (TILE_M x 2*tile_n) is two tile_n-wide halves, so all tile
    kinds share the gate/up kernel's MMA shape (two B operands, two accumulators), its
    shared-memory stages and its register budget."""
    p = gateup.params
    unfit = fused_misfit(H, I, S, p["tile_n"])
    if unfit:
        raise PlanError(f"fuse_gemms: {unfit}")
    params = dict(p, fused=True, name=name, class_name=class_name(name), n2_size=H, k2_size=I,
                  n2_tiles=H // (2 * p["tile_n"]), used_slot=used_slot, s_size=S, shared_slot=shared_slot,
                  sched_slot=sched_slot, combine=done_slot is not None, done_slot=done_slot or 0, topk=K,
                  combine_parts=combine_parts(H) if done_slot is not None else [1],
                  combine_unroll=COMBINE_UNROLL,
                  debug_break_dependency=debug_break_dependency,
                  doc="Routed gate/up (SwiGLU) and down projections in one launch"
                      + (", with the shared expert's." if S else "."))
    args = list(gateup.args[:-1]) + [
        KernelArg("b2", "w_down", "bf16", [E, H, I]),
        KernelArg("c", "h", "bf16", ["M", I]),
        KernelArg("c2", "y", "bf16", ["M", H]),
        KernelArg("h_ready", "h_ready", "i32", ["MT"]),
    ]
    tiles = f"MT*{I // p['tile_n'] + H // (2 * p['tile_n'])}"
    if S:
        args += [KernelArg("b3", "ws_gate", "bf16", [S, H]), KernelArg("b4", "ws_up", "bf16", [S, H]),
                 KernelArg("b5", "ws_down", "bf16", [H, S]), KernelArg("c3", "hs", "bf16", ["T", S]),
                 KernelArg("c4", "ys", "bf16", ["T", H])]
        tiles += f" + ST*{S // p['tile_n'] + H // (2 * p['tile_n'])}"
    if done_slot is not None:  # the combine's inputs and output
        args += [KernelArg("ids", "topk_ids", "i32", ["T", K]), KernelArg("weights", "topk_weights", "f32", ["T", K]),
                 KernelArg("pos", "pos", "i32", ["T", K]), KernelArg("out", "out", "bf16", ["T", H])]
    return KernelPlan(name, "gemm", name, "grouped_gemm_persistent.py.j2", "main", params, args,
                      grid=f"(min({p['sms']}, {tiles}),)", block=p["threads"],
                      warp_roles=gateup.warp_roles + ["a down tile's TMA producer first waits on h_ready[m]"],
                      smem_bytes=gateup.smem_bytes)


def dispatch_in_launch(fused: KernelPlan, dparams: dict, overrides: dict, buffers: list,
                       local_count: bool = False) -> bool:
    """The single-GPU fused launch dispatches too (override dispatch_in_launch: false keeps
    the two dispatch kernels before it). It needs the launch to combine (it writes the
    positions the combine reads) and takes the dispatch's Plan params, its counts and a
    launch_sync buffer (its counters, zeroed once by the runtime and left zeroed by every
    launch). local_count: each CTA counts every expert's pairs itself in shared memory, so no
    launch-wide counter stands between counting and placing (override launch_local_count
    sets it for every single launch)."""
    if not overrides.get("dispatch_in_launch", True) or not fused.params.get("combine"):
        if overrides.get("debug_break_dispatch"):
            raise PlanError("debug_break_dispatch: this Plan's single launch does not dispatch")
        return False
    sync = dispatch_phase(fused, dparams, buffers, fused_tables=True,
                          debug_break=bool(overrides.get("debug_break_dispatch")))
    d = fused.params["dispatch"]
    d["local_count"] = bool(overrides.get("launch_local_count", local_count))
    fused.args += [KernelArg("counts", "counts", "i32", [dparams["experts"]]), sync]
    chunk = launch_chunk(fused, overrides)
    if chunk:
        d.update(local_count=False, chunk=chunk)
        fused.args.append(KernelArg("chunk_hist", "launch_hist", "i32", ["C", dparams["experts"] + 1]))
    return True


def launch_chunk(fused: KernelPlan, overrides: dict) -> int:
    """Pairs per chunk of a single launch's chunked dispatch phase (templates/dispatch_chunks.py.j2),
    0 where it dispatches by experts. Chunked where the launch does not count locally (override
    launch_chunked sets it for every single launch, or clears it): CTA b counts and places
    chunks b, b + grid, ..., each one step of THREADS pairs per T the launch serves, where
    CTA b would scan all T*K pairs for its expert. Its scratch lives in the A stages (no tile
    has started), so it must fit there."""
    d, p = fused.params["dispatch"], fused.params
    if not overrides.get("launch_chunked", not d["local_count"]):
        return 0
    threads = p["threads"]
    scratch = chunk_scratch(threads, d["experts"])
    if scratch["chunk_scratch"] * 4 > p["tile_m"] * p["tile_k"] * p["stages"] * 2:  # i32 in bf16 A stages
        return 0
    d.update(scratch)
    pairs = FUSED_MAX_TOKENS * d["topk"]
    return threads * max(1, -(-pairs // (p["sms"] * threads)))


def dispatch_phase(fused: KernelPlan, dparams: dict, buffers: list, fused_tables: bool,
                   debug_break: bool = False) -> KernelArg:
    """What a single launch that dispatches itself needs, on one GPU and expert parallel: the
    dispatch's Plan params at the launch's thread count (fused_tables: it also writes the
    launch's tile range and h_ready, as on one GPU; expert parallel, layout does), and the
    launch_sync state buffer (its counters, zeroed once by the runtime and left zeroed by every
    launch). Returns the launch_sync argument, which the caller places in its argument order."""
    fused.params["dispatch"] = dict(dparams, threads=fused.params["threads"], fused=fused_tables,
                                    debug_break=debug_break, sync_counters=LAUNCH_SYNC_COUNTERS)
    buffers.append(Buffer("launch_sync", "i32", [str(LAUNCH_SYNC_COUNTERS)], memory="state"))
    return KernelArg("launch_sync", "launch_sync", "i32", [LAUNCH_SYNC_COUNTERS])


def routed_launch(fused: KernelPlan, spec: MoESpec) -> KernelPlan:
    """A single launch (gemm_fused, gemm_fused_n<rows>) that routes first: <name>_routed, router
    logits in, topk_ids and topk_weights out (they are its arguments as before; the route phase
    writes them)."""
    k = copy.deepcopy(fused)
    k.name = k.module = f"{fused.name}_routed"
    k.params.update(name=k.name, class_name=class_name(k.name), doc=k.params["doc"][:-1] + ", routing first.",
                    route=dict(experts=spec.experts, topk=spec.topk, renormalize=spec.renormalize))
    k.args.append(KernelArg("logits", "logits", "f32", ["T", spec.experts]))
    k.warp_roles = ["all warps first: route one token per warp, then count and place"] + k.warp_roles
    return k


# dispatch inside the fused launch: experts counted, experts placed, CTAs past every wait,
# CTAs that routed (the routing launch), experts laid out (expert parallel)
LAUNCH_SYNC_COUNTERS = 5


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
OVERRIDE_KEYS = re.compile(r"row_tile|wait_timeout_ms|debug_unchecked|debug_break_dependency|debug_break_dispatch"
                           r"|debug_break_combine"
                           r"|profile|fuse_gemms"
                           r"|cluster_m|dispatch_chunked|comm_sms|return_sms|bwd_send_sms|bwd_send_grad_sms"
                           r"|bwd_send_x_sms|bwd_return_sms|comm_threads|ep_overlap|gemm_returns|gemm_sends"
                           r"|ep_fused_combine|dispatch_in_launch|fused_small|combine_unroll|launch_local_count|launch_chunked|swap_rows"
                           r"|weights_evict_first|rows_evict_last|weight_pairs|combine_early|mirror_status"
                           r"|(gemm_gateup|gemm_down|shared_gateup|shared_down)"
                           r"\.(tile_n|raster|epi_stages)|gemm_fused_n\d+\.(epi_stages|tile_k|tile_n|gather_lag)"
                           r"|(gemm_gateup|bwd_dgrad_down)\.gather_lag|gemm_fused\.wave_lag")


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
                   "rows_evict_last", "weight_pairs", "combine_early", "mirror_status"):
            if not isinstance(value, bool):
                raise PlanError(f"{key} must be true or false")
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
