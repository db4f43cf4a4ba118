"""The Plan of an FP8 layer (dtype "fp8": e4m3 with fp32 block scales, docs/fp8.md).

The FP8 layer is generated kernel by kernel. This Plan holds its kernels, each also an entry
point of its own for the golden tests (Variant.run), the forward that chains them with the
bf16 layer's dispatch and combine, the backward's data gradients (backward_data: dx and
d_topk_weights, recomputing the forward's products), every gradient (backward_fp8: the same
chain, then the weight gradients), training (forward_train also saves the gate/up products,
backward_fp8_saved reads them) and the experts' quantisation (quantize_experts):

    quantize_rows_fp8  x_rows_q, x_rows_scales = the routed rows of x in dispatch's order, in
                    e4m3 with 1 x 128 scales (templates/quantize_rows_fp8.py.j2)
    gemm_gateup_fp8 h_q, h_scales = q(silu(blockwise(x_rows) @ w_gate^T) * (... @ w_up^T)) per
                    expert, x_rows the routed rows in dispatch's layout in e4m3, w_gate and
                    w_up interleaved per 64 columns (templates/grouped_gemm_fp8.py.j2, gateup)
    gemm_down_fp8   y = blockwise(h_q, h_scales) @ blockwise(w_down)^T per expert, the down
                    projection over dispatch's row layout (templates/grouped_gemm_fp8.py.j2)
    quantize_dout_fp8  dy_q, dy_scales = dout's rows in dispatch's order in e4m3 (the same kernel)
    bwd_recompute_fp8  a13 = x_rows @ [w_gate; w_up]^T (bf16, interleaved), the gate/up products
    bwd_dgrad_down_fp8 dh = dy @ w_down (unweighted; B = its transposed copy)
    swiglu_backward_fp8  <dh, h> for d_topk_weights, [da | db] in e4m3 (templates/swiglu_backward_fp8.py.j2)
    bwd_dgrad_gateup_fp8 dxs = [da | db] @ [w_gate; w_up] (B = their transposed copy); the bf16
                    layer's bwd_combine sums each token's rows into dx
    quantize_*_t_fp8   x, dout (gathered), w h and [da | db] (rows) in e4m3 per 128-row block of
                    each column, K-major per M tile (templates/quantize_cols_fp8.py.j2)
    wgrad_*_fp8     d_w_down[e] = dy^T (w h), [d_w_gate; d_w_up][e] = [da | db]^T x over each
                    expert's M tiles (templates/grouped_gemm_fp8_wgrad.py.j2)
    gemm_gateup_fp8_train  the gate/up GEMM that also stores a13 (the training forward)
    quantize_w*_fp8  the bf16 masters in e4m3 blocks, as they are and transposed
                    (templates/quantize_blocks_fp8.py.j2)

"""
from __future__ import annotations

import dataclasses
import json

from .. import __version__
from ..ir import MoESpec
from ..ir.spec import E4M3_MAX, FP8_BLOCK, FP8_INTERLEAVE
from .plan import make_plan
from .records import PLAN_FORMAT, Buffer, KernelArg, KernelPlan, Plan, PlanError
from .status import mirror_status_by_last_kernels
from .target import Target

FP8_TILE_M = 128  # two consumer warpgroups of 64 rows
# One weight scale block per tile and K stage (and, gate/up, one h scale block per two tiles):
# templates/grouped_gemm_fp8.py.j2 applies one weight scale per tile and stage, so these
# tiles are the scale block, not a tuning choice.
FP8_TILE_N = FP8_BLOCK
FP8_MMA_WARPGROUPS = 2
FP8_WG_THREADS = 128
FP8_STAGES = 6  # 32 KB per stage (128 x 128 e4m3 of A and of B): 192 KB
FP8_AB_SMEM = FP8_STAGES * (FP8_TILE_M + FP8_TILE_N) * FP8_BLOCK  # the A and B stages' shared memory, any tile
# The blockwise quantisers (weights; the weight gradients' operands): a CTA per 128 x 128
# block, copied in by rows (16-byte loads, a warp two whole rows) to a shared-memory tile and
# read out by columns, warp w its 16 columns 16 w .., lane l its 4 rows 4 l .. (4-byte
# transposed stores that a warp makes 128 contiguous bytes; templates/fp8_block_tile.py.j2).
FP8_IO_THREADS = FP8_BLOCK * 2
# The weight gradients' epilogue tile in shared memory: bf16 rows padded by 8 elements (16
# bytes), so the 8 rows a warp's quads write from the accumulator land on different banks.
FP8_C_PAD = 8
FP8_SMEM_LIMIT = 227 * 1024  # shared memory one CTA may take on sm_90
FP8_SMEM_RESERVED = 2048  # beside the stages and tiles: barriers, unit slots, alignment
# The weight gradients' store warps copy their tile out with this many shared-memory loads in
# flight (unrolled: each load's latency not waited for alone; 2-6% at E256 over the loop of 1;
# 4 spills two registers of the store warps' 40)
FP8_STORE_UNROLL = 2
# The rows' quantiser (quantize_rows_fp8, quantize_dout_fp8) puts a 1 x 128 block on this many
# lanes, 16 contiguous values each (a 32-byte load, a 16-byte store; with 4 values a lane, 32
# lanes a block, its memory instructions were a quarter as wide), and a warp loads this many
# steps of 32 / FP8_ROWS_BLOCK_LANES blocks before it quantises them (their loads in flight
# together; a step past the row's blocks loads and stores nothing)
FP8_ROWS_BLOCK_LANES = 8
FP8_ROWS_BATCH = 2
FP8_PRODUCER_REGS = 40
FP8_CONSUMER_REGS = 232  # the sum and the block accumulator: 2 x 64 fp32 per thread at N = 128
# A GEMM's K loop is unrolled whole up to this many K blocks per unit of work (K blocks times
# the gate/up's two passes); past it the code outgrows the instruction cache (E256 H7168: the
# gate/up's 112 unrolled blocks ran at 395 TFLOP/s, a runtime loop at 573; the down GEMM's 16
# at 665 unrolled, 583 in a runtime loop; docs/fp8.md).
FP8_UNROLLED_K_BLOCKS = 32
FP8_SCHED_STAGES = 2  # unit slots between a GEMM's scheduler and its consumers (claimed a unit ahead)
# Overrides an fp8 Plan takes (experiments, autotuning): per GEMM, the K blocks unrolled per
# runtime iteration of the mainloop (k_unroll: 0 = the whole loop unrolled; otherwise the
# number of 2-block steps per iteration).
FP8_GEMMS = ("gemm_gateup_fp8", "gemm_down_fp8", "bwd_recompute_fp8", "bwd_dgrad_down_fp8", "bwd_dgrad_gateup_fp8")
FP8_OVERRIDES = tuple(f"{g}.{o}" for g in FP8_GEMMS for o in ("k_unroll", "cluster", "tile_n", "half_tail")) + (
    # every wait's bound (ms; the bf16 layer's default), and debug builds whose GEMM's CTAs never
    # get the bytes of their first stage: its waits must give up and the call raise KernelTimeout
    "wait_timeout_ms", "gemm_down_fp8.debug_break", "wgrad_down_fp8.debug_break")
# A GEMM's unit of work spans FP8_WIDE_B_TILES weight tiles side by side in N (a 128 x 256
# tile) where N allows: A is loaded once for both, so the bytes into the SM per FLOP fall by a
# quarter, at the cost of one block accumulator per warpgroup instead of two (the two sums
# take the second's registers). On an
# H200 at E256 T=8192 the gate/up GEMM went from 6.20 to 5.42 ms, the down GEMM from 2.77 to
# 2.68 ms; at E64 T=16384 both about the same (docs/fp8.md).
FP8_WIDE_B_TILES = 2
FP8_WIDE_UNROLL = 4  # K blocks per runtime iteration of a wide tile's mainloop: no spills at 1, 2, 4; at E256 T=8192 4 ran the forward ~2% faster than 2


# A unit whose M tile holds tokens in its first FP8_TILE_M / 2 rows only (an expert's last tile;
# the rest padding, row_token -1) loads only those rows of A, and its second consumer warpgroup
# issues no QGMMA and keeps the zero sums that padding rows give (the same bits). These GEMMs
# are bound by the bytes each SM takes in (docs/fp8.md), and such a unit's stage is a sixth
# smaller: measured 5% off the gate/up GEMM and 2% off the down GEMM at E256 T = 8192 (docs/
# perf.md). Wide tiles only, and not in a debug_break build (its stall sits in the full-tile
# load); override half_tail per GEMM.
FP8_HALF_TAIL = 1


def half_tail(name: str, tiles: int, overrides: dict) -> bool:
    """Whether the GEMM's tail units load half of A (FP8_HALF_TAIL; override {name}.half_tail)."""
    key = f"{name}.half_tail"
    debug = bool(overrides.get(f"{name}.debug_break"))
    want = int(overrides.get(key, FP8_HALF_TAIL if tiles == FP8_WIDE_B_TILES and not debug else 0))
    if want not in (0, 1):
        raise PlanError(f"override {key} must be 0 or 1, got {want}")
    if want and tiles != FP8_WIDE_B_TILES:
        raise PlanError(f"override {key}: only wide tiles ({name}.tile_n {FP8_WIDE_B_TILES * FP8_TILE_N}) "
                         "load half of A")
    if want and debug:  # (the debug stall sits in the full-tile load)
        raise PlanError(f"override {key} does not combine with {name}.debug_break")
    return bool(want)


def row_token_arg(tail: bool) -> list:
    """A half_tail GEMM's last argument: which rows hold tokens."""
    return [KernelArg("row_token", "row_token", "i32", ["M"])] if tail else []


def b_tiles(name: str, n_size: int, cluster: int, overrides: dict) -> tuple[int, str]:
    """(B tiles per unit of work, why) for a GEMM over n_size columns: wide where n_size is a
    multiple of the wide tile and no cluster is asked for; the override tile_n picks."""
    key = f"{name}.tile_n"
    wide = FP8_WIDE_B_TILES * FP8_TILE_N
    fits = n_size % wide == 0 and cluster == 1
    want = int(overrides.get(key, wide if fits else FP8_TILE_N))
    if want not in (FP8_TILE_N, wide):
        raise PlanError(f"override {key} must be {FP8_TILE_N} or {wide}, got {want}")
    src = " (override)" if key in overrides else ""
    if want == FP8_TILE_N:
        why = "" if src else f" ({n_size} columns are not a multiple of {wide})" if n_size % wide else \
            " (clusters take 128-wide tiles)"
        return 1, f"{name}: {FP8_TILE_M} x {FP8_TILE_N} tiles, two block accumulators per warpgroup{src or why}"
    if n_size % wide:
        raise PlanError(f"override {key}: {n_size} columns are not a multiple of {wide}")
    if cluster > 1:
        raise PlanError(f"override {key}: {wide}-wide tiles do not take clusters ({name}.cluster)")
    return FP8_WIDE_B_TILES, (f"{name}: {FP8_TILE_M} x {wide} tiles ({FP8_WIDE_B_TILES} weight tiles per unit), one "
                              f"block accumulator per warpgroup{src}")


def cluster_n(name: str, units_n: int, overrides: dict) -> tuple[int, str]:
    """(CTAs per cluster, why) for a GEMM. Clusters of 2 CTAs on the two units of a unit pair
    (multicasting A; an M tile's units must pair up) are an override: on an H200 they measured
    no faster than single CTAs (E64 T=16384 gate/up 1.52 against 1.44 ms, E256 T=8192 6.18
    against 6.07 ms; docs/fp8.md), though ncu puts these GEMMs at 84-90% of L2 bandwidth."""
    key = f"{name}.cluster"
    want = int(overrides.get(key, 1))
    if want not in (1, 2):
        raise PlanError(f"override {key} must be 1 or 2, got {want}")
    if want == 1:
        return 1, f"{name}: no cluster" + (" (override)" if key in overrides else
                                           " (A multicast over 2-CTA clusters measured no faster)")
    if units_n % 2:
        raise PlanError(f"override {key}: {units_n} units per M tile do not pair up")
    return 2, f"{name}: clusters of 2 CTAs on the units of one M tile, A multicast to both (override)"


def k_unroll(name: str, k_blocks: int, passes: int, overrides: dict, wide: bool = False) -> tuple[int, str]:
    """(k_unroll, why) for a GEMM's mainloop: 0 unrolls it whole, n > 0 unrolls n of its 2-block
    steps (wide tiles: n K blocks)."""
    key = f"{name}.k_unroll"
    if key in overrides:
        return int(overrides[key]), f"{name}: K loop unroll {overrides[key]} (override)"
    if wide:
        return FP8_WIDE_UNROLL, (f"{name}: K loop in a runtime loop of {FP8_WIDE_UNROLL} K blocks per iteration "
                                 f"(wide tiles: unrolled whole, the down GEMM spilled registers)")
    if k_blocks * passes <= FP8_UNROLLED_K_BLOCKS:
        return 0, f"{name}: K loop unrolled whole ({k_blocks * passes} K blocks per unit <= {FP8_UNROLLED_K_BLOCKS})"
    return 1, (f"{name}: K loop in a runtime loop of 2-block steps ({k_blocks * passes} K blocks per unit > "
               f"{FP8_UNROLLED_K_BLOCKS}: unrolled, the code outgrows the instruction cache)")


def fp8_plan(spec: MoESpec, target: Target, overrides: dict | None = None) -> Plan:
    """The Plan of an fp8 spec: the bf16 twin's dispatch and combines (rows padded to the FP8 M
    tile) around the FP8 kernels of the module docstring, each also an entry point of its own,
    and the entries that chain them (fp8_steps)."""
    overrides = check_fp8_spec(spec, overrides)
    E, H, I = spec.experts, spec.hidden, spec.intermediate
    # The forward around them (below): the bf16 layer's dispatch (rows padded to the FP8 M tile) and
    # combine, from the bf16 twin's Plan on the per-GEMM path, and the FP8 row buffers.
    twin = make_plan(dataclasses.replace(spec, dtype="bf16"), target,
                     {"row_tile": FP8_TILE_M, "fuse_gemms": False,
                      **{k: v for k, v in overrides.items() if k == "wait_timeout_ms"}})
    fp8 = FP8Kernels(spec, target, overrides, twin)
    gateup_shape = fp8.gateup_shape()
    target.check_register_split("FP8 GEMMs", FP8_PRODUCER_REGS, FP8_WG_THREADS, FP8_CONSUMER_REGS,
                                FP8_WG_THREADS * FP8_MMA_WARPGROUPS)
    down = fp8.blockwise_gemm("gemm_down_fp8", "GemmDownFP8", "gemm_down",
                              "FP8 down projection: y = h @ w_down^T per expert, blockwise scaled.",
                              "h_q", "w_down_q", "y", H, I)
    # The backward's data gradients: the gate/up products recomputed, and the same GEMM over
    # the transposed weight copies.
    recompute = fp8.blockwise_gemm("bwd_recompute_fp8", "RecomputeFP8", "gemm_gateup",
                                   "FP8 recompute of the gate/up products for the backward: a13 = x @ [w_gate; "
                                   "w_up]^T per expert (interleaved per 64 columns), blockwise scaled.",
                                   "x_rows_q", "w13_q", "a13", 2 * I, H)
    dgrad_down = fp8.blockwise_gemm("bwd_dgrad_down_fp8", "DgradDownFP8", "gemm_down",
                                    "FP8 dgrad of the down projection: dh = dy @ w_down per expert (B = w_down^T), "
                                    "blockwise scaled.", "dy_q", "w_down_t_q", "dh", I, H)
    dgrad_gateup = fp8.blockwise_gemm("bwd_dgrad_gateup_fp8", "DgradGateUpFP8", "gemm_gateup",
                                      "FP8 dgrad of the gate/up projection: dxs = [da | db] @ [w_gate; w_up] per "
                                      "expert (B = their interleaved transposed copy), blockwise scaled.",
                                      "dab_q", "w13_t_q", "dxs", H, 2 * I)
    gateup, gateup_train = fp8.gateup_gemms(*gateup_shape[:3])
    quantize, quantize_dout = quantize_rows_kernels(spec)
    swiglu, swiglu_w = swiglu_backward_kernels(spec)
    wgrad_down = fp8.wgrad_gemm("wgrad_down_fp8", "WgradDownFP8",
                                "FP8 weight gradient of the down projection: d_w_down[e] = dy_e^T @ (w h)_e over the "
                                "expert's rows.", "doutt", "hwt", "d_w_down", H, I)
    wgrad_gateup = fp8.wgrad_gemm("wgrad_gateup_fp8", "WgradGateUpFP8",
                                  "FP8 weight gradient of the gate/up projection: [d_w_gate; d_w_up][e] = [da | db]_e^T "
                                  "@ x_e over the expert's rows (computed interleaved per 64, written apart).", "dabt",
                                  "xt", ("d_w_gate", "d_w_up"), 2 * I, H)
    # The experts' weights from bf16 masters, as mokgen.fp8.quantize_experts (the same bits), on
    # the GPU: mokgen.moe_fp8_train quantises them on every call.
    quantize_w13 = quantize_weights(E, "quantize_w13_fp8", "QuantizeW13",
                                    "w_gate and w_up, interleaved, in e4m3 blocks (and transposed).",
                                    ("w_gate", "w_up"), "w13", 2 * I, H, FP8_INTERLEAVE)
    quantize_w_down = quantize_weights(E, "quantize_w_down_fp8", "QuantizeWDown", "w_down in e4m3 blocks (and "
                                       "transposed).", ("w_down", "w_down"), "w_down", H, I, 0)
    quantize_x_t = quantize_cols("quantize_x_t_fp8", "x", H, "xt")
    quantize_dout_t = quantize_cols("quantize_dout_t_fp8", "dout", H, "doutt")
    quantize_hw_t = quantize_cols("quantize_hw_t_fp8", "hw_rows", I, "hwt", gather=False)
    quantize_dab_t = quantize_cols("quantize_dab_t_fp8", "dab_rows", 2 * I, "dabt", gather=False)
    kept = [k for k in twin.kernels if k.name in ("dispatch_count", "dispatch_scatter", "combine", "bwd_combine")]
    buffers = fp8_buffers(spec, twin, kept)
    kernels = kept[:2] + [quantize, gateup, down] + kept[2:] + [
        quantize_dout, recompute, dgrad_down, swiglu, dgrad_gateup, quantize_x_t, quantize_dout_t, wgrad_down,
        wgrad_gateup, swiglu_w, quantize_hw_t, quantize_dab_t, quantize_w13, quantize_w_down, gateup_train,
        twin.kernel("status_mirror")]
    steps = fp8_steps([quantize, gateup, down, quantize_dout, recompute, dgrad_down, swiglu, dgrad_gateup,
                       quantize_x_t, quantize_dout_t, wgrad_down, wgrad_gateup])
    # The combines copy the call's error code themselves (FP8's GEMMs leave it to status_mirror).
    kernels, mirror_why = mirror_status_by_last_kernels(kernels, steps, {}, [], fp8.n_counters,
                                                        twin.kernel("status_mirror").params["status_slot"], None)
    return Plan(
        format=PLAN_FORMAT, mokgen_version=__version__, variant=spec.variant, spec=spec.to_dict(),
        target=target.to_dict(), row_tile=FP8_TILE_M, sm_roles={}, queues=[], reduction_order=twin.reduction_order,
        buffers=buffers,
        kernels=kernels,
        steps=steps,
        flops=twin.flops,
        decisions=["dtype fp8: the forward is dispatch (the bf16 layer's, rows padded to 128), the routed rows of x "
                   "in e4m3, the gate/up projection (SwiGLU, h in e4m3), the down projection (bf16 y), the bf16 "
                   "combine; each FP8 kernel is also an entry point of its own for its golden test (docs/fp8.md)",
                   *gateup_shape[3], *fp8.why, *mirror_why]
        + ([f"overrides {json.dumps(overrides, sort_keys=True)}"] if overrides else []),
        overrides=overrides)


def check_fp8_spec(spec: MoESpec, overrides: dict | None) -> dict:
    """What the FP8 layer generates, and the overrides it takes (a copy of them)."""
    if spec.world_size > 1:
        raise PlanError(f"{spec.variant}: an FP8 expert-parallel megakernel over {spec.topology} is not generated; "
                        f"the FP8 layer spans {spec.world_size} GPUs one per node, tokens through NCCL: build it with "
                        f"--nodes {spec.world_size} (mokgen.moe_fp8 / moe_fp8_train with group=)")
    if spec.shared_intermediate:
        raise PlanError(f"{spec.variant}: FP8 with a shared expert is not generated yet")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(FP8_OVERRIDES))
    if unknown:
        raise PlanError(f"{spec.variant}: an fp8 Plan takes the overrides {', '.join(FP8_OVERRIDES)}; "
                        f"not {', '.join(unknown)}")
    for key in overrides:
        if not isinstance(overrides[key], int) or isinstance(overrides[key], bool) or overrides[key] < 0:
            raise PlanError(f"{spec.variant}: override {key} must be an integer >= 0, got {overrides[key]!r}")
    return overrides


# Each FP8 GEMM claims its units from its bf16 twin GEMM's slot of tile_counters (which the
# twin's dispatch zeroes every call).
TWIN_OF = {"gemm_gateup_fp8": "gemm_gateup", "gemm_down_fp8": "gemm_down", "bwd_recompute_fp8": "bwd_recompute",
           "bwd_dgrad_down_fp8": "bwd_dgrad_down", "bwd_dgrad_gateup_fp8": "bwd_dgrad_gateup",
           "wgrad_down_fp8": "wgrad_down", "wgrad_gateup_fp8": "wgrad_gate"}


class FP8Kernels:
    """Makes the FP8 GEMMs of one Plan (templates/grouped_gemm_fp8.py.j2 and
    grouped_gemm_fp8_wgrad.py.j2): their tiles, K loops and clusters (from the overrides), the
    bf16 twin's unit counters and bounded waits; `why` collects the blockwise GEMMs' decisions."""

    def __init__(self, spec: MoESpec, target: Target, overrides: dict, twin: Plan):
        self.spec, self.target, self.overrides = spec, target, overrides
        self.n_counters = int(next(b for b in twin.buffers if b.name == "tile_counters").shape[0])
        # Each FP8 GEMM takes its bf16 twin's unit counter and the launch's error code (every wait is
        # bounded by the same timeout: templates/bounded_wait.py.j2)
        self.sched = {name: dict(sched_slot=twin.kernel(bf16).params["sched_slot"], sched_stages=FP8_SCHED_STAGES,
                                 **{key: twin.kernel(bf16).params[key]
                                    for key in ("status_slot", "wait_timeout_ns", "status_poll_ns")})
                      for name, bf16 in TWIN_OF.items()}
        self.threads = FP8_WG_THREADS * (1 + FP8_MMA_WARPGROUPS)  # a producer warpgroup, the consumers
        self.why: list[str] = []

    def gateup_shape(self) -> tuple:
        """(cluster, B tiles per unit, K unroll, why) of the gate/up GEMM (two passes per unit
        unless its tiles are wide)."""
        I, H = self.spec.intermediate, self.spec.hidden
        cluster, why_cluster = cluster_n("gemm_gateup_fp8", I // FP8_BLOCK, self.overrides)
        tiles, why_tile = b_tiles("gemm_gateup_fp8", 2 * I, cluster, self.overrides)
        unroll, why_unroll = k_unroll("gemm_gateup_fp8", H // FP8_BLOCK, 2, self.overrides, wide=tiles > 1)
        return cluster, tiles, unroll, (why_tile, why_unroll, why_cluster)

    def blockwise_gemm(self, name, class_name, stage, doc, a, b, c, n_size, k_size) -> KernelPlan:
        """C [M, n_size] bf16 = A [M, k_size] (e4m3, 1 x 128 row scales) @ B[e]^T (B [E, n_size,
        k_size] e4m3, 128 x 128 scales) per used M tile of expert e: the template's plain mode."""
        E, target, overrides, threads = self.spec.experts, self.target, self.overrides, self.threads
        cluster, why_cluster = cluster_n(name, n_size // FP8_TILE_N, overrides)
        tiles, why_tile = b_tiles(name, n_size, cluster, overrides)
        unroll, why_unroll = k_unroll(name, k_size // FP8_BLOCK, tiles, overrides, wide=tiles > 1)
        self.why.extend([why_tile, why_unroll, why_cluster])
        stages = FP8_AB_SMEM // ((FP8_TILE_M + tiles * FP8_TILE_N) * FP8_BLOCK)
        tail = half_tail(name, tiles, overrides)
        return KernelPlan(
            name=name, stage=stage, module=name, template="grouped_gemm_fp8.py.j2", entry="main",
            params=dict(name=name, class_name=class_name, doc=doc, tile_m=FP8_TILE_M, tile_n=FP8_TILE_N,
                        tile_k=FP8_BLOCK, scale_block=FP8_BLOCK, e4m3_max=E4M3_MAX,
                        mma_warpgroups=FP8_MMA_WARPGROUPS, stages=stages, n_size=n_size, k_size=k_size,
                        groups=E, threads=threads, sms=target.sms, producer_regs=FP8_PRODUCER_REGS,
                        consumer_regs=FP8_CONSUMER_REGS, k_unroll=unroll, cluster_n=cluster, b_tiles=tiles,
                        debug_break=bool(overrides.get(f"{name}.debug_break")), half_tail=tail, **self.sched[name]),
            # (scales row-major [M, K/128]: a tensor's dynamic extent may only be its first, as
            # the launch shim passes no strides)
            args=[KernelArg("a", a, "e4m3", ["M", k_size]),
                  KernelArg("a_scales", f"{a[:-2]}_scales", "f32", ["M", k_size // FP8_BLOCK]),
                  KernelArg("b", b, "e4m3", [E, n_size, k_size]),
                  KernelArg("b_scales", f"{b[:-2]}_scales", "f32", [E, n_size // FP8_BLOCK, k_size // FP8_BLOCK]),
                  KernelArg("tile_expert", "tile_expert", "i32", ["MT"]),
                  KernelArg("tile_counter", "tile_counters", "i32", [self.n_counters]),
                  KernelArg("c", c, "bf16", ["M", n_size])] + row_token_arg(tail),
            grid=f"(min({target.sms}, MT * {n_size // (tiles * FP8_TILE_N)}),)", block=threads,
            warp_roles=["warpgroup 0, warp 0: the unit scheduler and TMA producer of the A and B stages",
                        "warpgroups 1-2: QGMMA per 128-wide K block, then its promotion times the row and block "
                        "scales"],
            smem_bytes=stages * (FP8_TILE_M + tiles * FP8_TILE_N) * FP8_BLOCK)

    def gateup_gemms(self, cluster: int, tiles: int, unroll: int) -> tuple[KernelPlan, KernelPlan]:
        """The gate/up GEMM with the SwiGLU epilogue (h in e4m3 with its 1 x 128 scales), and the
        training forward's, which also stores the products before SwiGLU (a13, bf16)."""
        E, H, I = self.spec.experts, self.spec.hidden, self.spec.intermediate
        stages = FP8_AB_SMEM // ((FP8_TILE_M + tiles * FP8_TILE_N) * FP8_BLOCK)
        # gate/up keeps the first pass's h (fp32) per consumer thread until the second pass
        stash_bytes = 4 * FP8_TILE_M * FP8_TILE_N // 2
        tail = half_tail("gemm_gateup_fp8", tiles, self.overrides)
        args = [KernelArg("a", "x_rows_q", "e4m3", ["M", H]),
                KernelArg("a_scales", "x_rows_scales", "f32", ["M", H // FP8_BLOCK]),
                KernelArg("b", "w13_q", "e4m3", [E, 2 * I, H]),
                KernelArg("b_scales", "w13_scales", "f32", [E, 2 * I // FP8_BLOCK, H // FP8_BLOCK]),
                KernelArg("tile_expert", "tile_expert", "i32", ["MT"]),
                KernelArg("tile_counter", "tile_counters", "i32", [self.n_counters]),
                KernelArg("c", "h_q", "e4m3", ["M", I]),
                KernelArg("c_scales", "h_scales", "f32", ["M", I // FP8_BLOCK])]
        gateup = KernelPlan(
            name="gemm_gateup_fp8", stage="gemm_gateup", module="gemm_gateup_fp8",
            template="grouped_gemm_fp8.py.j2", entry="main",
            params=dict(name="gemm_gateup_fp8", class_name="GemmGateUpFP8", gateup=True,
                        doc="FP8 gate/up projection with SwiGLU: h = silu(x @ w_gate^T) * (x @ w_up^T) per expert, "
                            "blockwise scaled, written in e4m3 with 1 x 128 scales.",
                        tile_m=FP8_TILE_M, tile_n=FP8_TILE_N, tile_k=FP8_BLOCK, scale_block=FP8_BLOCK,
                        e4m3_max=E4M3_MAX, mma_warpgroups=FP8_MMA_WARPGROUPS, stages=stages,
                        n_size=2 * I, k_size=H, groups=E, threads=self.threads, sms=self.target.sms,
                        producer_regs=FP8_PRODUCER_REGS, consumer_regs=FP8_CONSUMER_REGS, k_unroll=unroll,
                        cluster_n=cluster, b_tiles=tiles, half_tail=tail, **self.sched["gemm_gateup_fp8"]),
            args=args + row_token_arg(tail),
            grid=f"(min({self.target.sms}, MT * {I // FP8_BLOCK}),)", block=self.threads,
            warp_roles=["warpgroup 0, warp 0: TMA producer of the A and B stages",
                        "warpgroups 1-2: QGMMA per 128-wide K block and its promotion; per 1 x 128 block of h, two "
                        + ("weight tiles per K block" if tiles > 1 else "passes")
                        + " (gate and up interleaved per 64 columns), SwiGLU, the row's amax, h in e4m3"],
            smem_bytes=stages * (FP8_TILE_M + tiles * FP8_TILE_N) * FP8_BLOCK + (0 if tiles > 1 else stash_bytes))
        # The training forward's gate/up GEMM: the same kernel, also storing the products before
        # SwiGLU in bf16 (a13, the backward's input), so that the backward does not recompute them.
        train = dataclasses.replace(
            gateup, name="gemm_gateup_fp8_train", module="gemm_gateup_fp8_train",
            params={**gateup.params, "name": "gemm_gateup_fp8_train", "class_name": "GemmGateUpFP8Train",
                    "save_products": True},
            args=args + [KernelArg("products", "a13", "bf16", ["M", 2 * I])] + row_token_arg(tail),
            warp_roles=gateup.warp_roles[:1] + [gateup.warp_roles[1] + "; the products in bf16 (a13) before SwiGLU"])
        return gateup, train

    def wgrad_gemm(self, name, class_name, doc, a, b, c, n1, n2) -> KernelPlan:
        """C[e] [n1, n2] = sum over e's M tiles of A_t^T-blocks @ B_t (templates/grouped_gemm_fp8_wgrad.py.j2);
        c = (gate's, up's): C's rows are w_gate's and w_up's interleaved, written to two outputs."""
        E, target = self.spec.experts, self.target
        split = isinstance(c, tuple)
        outs = [KernelArg("c", c[0], "bf16", [E * n1 // 2, n2]), KernelArg("c2", c[1], "bf16", [E * n1 // 2, n2])] \
            if split else [KernelArg("c", c, "bf16", [E * n1, n2])]
        c_stride = FP8_TILE_N + FP8_C_PAD
        # warpgroup 0's three store warps walk whole rows of the tile, 16 bytes a thread
        assert (FP8_WG_THREADS - 32) % (FP8_TILE_N * 2 // 16) == 0, "the store threads must cover whole rows"
        c_bytes = FP8_TILE_M * c_stride * 2  # the epilogue's bf16 tile in shared memory
        # a stage: the e4m3 A and B tiles of one K block, and the M tile's fp32 scales of the
        # unit's columns of A and of B
        stage_bytes = (FP8_TILE_M + FP8_TILE_N) * FP8_BLOCK + (FP8_TILE_M + FP8_TILE_N) * 4
        stages = min(FP8_STAGES, (FP8_SMEM_LIMIT - FP8_SMEM_RESERVED - c_bytes) // stage_bytes)
        return KernelPlan(
            name=name, stage="wgrad", module=name, template="grouped_gemm_fp8_wgrad.py.j2", entry="main",
            params=dict(name=name, class_name=class_name, doc=doc, tile_m=FP8_TILE_M, tile_n=FP8_TILE_N,
                        tile_k=FP8_BLOCK, mma_warpgroups=FP8_MMA_WARPGROUPS, stages=stages, n1=n1, n2=n2,
                        groups=E, threads=self.threads, sms=target.sms, producer_regs=FP8_PRODUCER_REGS,
                        consumer_regs=FP8_CONSUMER_REGS, split=split, interleave=FP8_INTERLEAVE, c_stride=c_stride,
                        store_unroll=FP8_STORE_UNROLL, debug_break=bool(self.overrides.get(f"{name}.debug_break")),
                        **self.sched[name]),
            args=[KernelArg("a", f"{a}_q", "e4m3", ["MT", n1, FP8_TILE_M]),
                  KernelArg("a_scales", f"{a}_scales", "f32", ["MT", n1]),
                  KernelArg("b", f"{b}_q", "e4m3", ["MT", n2, FP8_TILE_M]),
                  KernelArg("b_scales", f"{b}_scales", "f32", ["MT", n2]),
                  KernelArg("tile_expert", "tile_expert", "i32", ["MT"]),
                  KernelArg("tile_counter", "tile_counters", "i32", [self.n_counters])] + outs,
            grid=f"(min({target.sms}, {E * (n1 // FP8_TILE_M) * (n2 // FP8_TILE_N)}),)", block=self.threads,
            warp_roles=["warpgroup 0, warp 0: the unit scheduler (expert, m, n) and TMA producer, per M tile of the "
                        "expert (the A and B tiles and their columns' scales)", "warpgroup 0, warps 1-3: each unit's tile from shared memory to C (16-byte stores)",
                        "warpgroups 1-2: QGMMA per M tile, waited for, promoted with the row and column scales of "
                        "both operands"],
            smem_bytes=stages * stage_bytes + c_bytes)


QUANTIZE_ROWS_THREADS = 256


def quantize_rows_kernels(spec: MoESpec) -> tuple[KernelPlan, KernelPlan]:
    """x's routed rows in dispatch's order in e4m3 with 1 x 128 scales, and dout's the same way."""
    H, E, threads = spec.hidden, spec.experts, QUANTIZE_ROWS_THREADS
    quantize = KernelPlan(
        name="quantize_rows_fp8", stage="send", module="quantize_rows_fp8", template="quantize_rows_fp8.py.j2",
        entry="main",
        params=dict(name="quantize_rows_fp8", hidden=H, topk=spec.topk, experts=E, threads=threads,
                    tile_m=FP8_TILE_M, scale_block=FP8_BLOCK, e4m3_max=E4M3_MAX,
                    block_lanes=FP8_ROWS_BLOCK_LANES, batch=FP8_ROWS_BATCH),
        args=[KernelArg("x", "x", "bf16", ["T", H]),
              KernelArg("ids", "topk_ids", "i32", ["T", spec.topk]),
              KernelArg("pos", "pos", "i32", ["T", spec.topk]),
              KernelArg("row_token", "row_token", "i32", ["M"]),
              KernelArg("tile_expert", "tile_expert", "i32", ["MT"]),
              KernelArg("x_rows_q", "x_rows_q", "e4m3", ["M", H]),
              KernelArg("x_rows_scales", "x_rows_scales", "f32", ["M", H // FP8_BLOCK])],
        grid=f"(ceil(T/{threads // 32}) + ceil(M/{threads // 32}),)", block=threads,
        warp_roles=["the first ceil(T / 8) CTAs, each warp: one token's x in 1 x 128 blocks (amax, scale, e4m3), "
                    "stored to each of its K rows",
                    "the CTAs after them, each warp: one row of dispatch's layout, zeroed if it is padding"])
    # dout's rows in dispatch's order, in e4m3: the same kernel as x's
    quantize_dout = dataclasses.replace(
        quantize, name="quantize_dout_fp8", module="quantize_dout_fp8", stage="bwd_quantize",
        params={**quantize.params, "name": "quantize_dout_fp8"},
        args=[dataclasses.replace(a, tensor={"x": "dout", "x_rows_q": "dy_q", "x_rows_scales": "dy_scales"}.get(
            a.tensor, a.tensor)) for a in quantize.args],
        warp_roles=[r.replace("x in", "dout row in") for r in quantize.warp_roles])
    return quantize, quantize_dout


SWIGLU_BWD_THREADS = 256


def swiglu_backward_kernels(spec: MoESpec) -> tuple[KernelPlan, KernelPlan]:
    """The SwiGLU backward ([da | db] in e4m3 and <g, h> for the routing weights' gradient), and
    the full backward's, which also writes [da | db] and w h in bf16 rows, which the weight
    gradients' operands are quantised from (per 128-row block of each column)."""
    I, threads = spec.intermediate, SWIGLU_BWD_THREADS
    swiglu = KernelPlan(
        name="swiglu_backward_fp8", stage="bwd_swiglu", module="swiglu_backward_fp8",
        template="swiglu_backward_fp8.py.j2", entry="main",
        params=dict(name="swiglu_backward_fp8", topk=spec.topk, intermediate=I, threads=threads,
                    tile_m=FP8_TILE_M, interleave=FP8_INTERLEAVE, scale_block=FP8_BLOCK, e4m3_max=E4M3_MAX,
                    rows_bf16=False),
        args=[KernelArg("row_token", "row_token", "i32", ["M"]),
              KernelArg("tile_expert", "tile_expert", "i32", ["MT"]),
              KernelArg("pos", "pos", "i32", ["T", spec.topk]),
              KernelArg("weights", "topk_weights", "f32", ["T", spec.topk]),
              KernelArg("g", "dh", "bf16", ["M", I]),
              KernelArg("a13", "a13", "bf16", ["M", 2 * I]),
              KernelArg("dab_q", "dab_q", "e4m3", ["M", 2 * I]),
              KernelArg("dab_scales", "dab_scales", "f32", ["M", 2 * I // FP8_BLOCK]),
              KernelArg("d_weights", "d_topk_weights", "f32", ["T", spec.topk])],
        grid=f"(ceil(M/{threads // 32}),)", block=threads,
        warp_roles=["each warp: one row (pair): <g, h> for the routing weight's gradient, da and db in e4m3 per "
                    "1 x 128 block of the interleaved columns"])
    swiglu_w = dataclasses.replace(
        swiglu, name="swiglu_backward_fp8_w", module="swiglu_backward_fp8_w",
        params={**swiglu.params, "name": "swiglu_backward_fp8_w", "rows_bf16": True},
        args=swiglu.args + [KernelArg("dab_rows", "dab_rows", "bf16", ["M", 2 * I]),
                            KernelArg("hw_rows", "hw_rows", "bf16", ["M", I])])
    return swiglu, swiglu_w


def quantize_cols(name: str, src: str, cols: int, out: str, gather: bool = True) -> KernelPlan:
    """A weight gradient's operand: rows in e4m3 with one scale per 128-row block of each column,
    K-major per M tile. gather: src is token-major [T, cols], its rows gathered through
    row_token; else src is [M, cols] in dispatch's layout already."""
    return KernelPlan(
        name=name, stage="bwd_quantize", module=name, template="quantize_cols_fp8.py.j2", entry="main",
        params=dict(name=name, cols=cols, threads=FP8_IO_THREADS, tile_m=FP8_TILE_M, e4m3_max=E4M3_MAX,
                    gather=gather, cta_cols=FP8_BLOCK),
        args=[KernelArg("src", src, "bf16", ["T" if gather else "M", cols]),
              KernelArg("row_token", "row_token", "i32", ["M"]),
              KernelArg("tile_expert", "tile_expert", "i32", ["MT"]),
              KernelArg("out_q", f"{out}_q", "e4m3", ["MT", cols, FP8_TILE_M]),
              KernelArg("out_scales", f"{out}_scales", "f32", ["MT", cols])],
        grid=f"(MT, {cols // FP8_BLOCK})", block=FP8_IO_THREADS,
        warp_roles=[f"one CTA per (M tile, {FP8_BLOCK} columns): the rows into shared memory (16-byte loads, a warp "
                    "two whole rows), then each warp 16 columns, each lane 4 rows: each column's amax over the "
                    "lanes, then e4m3, a column's 4 rows to a store"])


def quantize_weights(E: int, name: str, class_name: str, doc: str, srcs: tuple, out: str, n: int, k: int,
                     interleave: int) -> KernelPlan:
    """out_q, out_t_q and their scales from the bf16 masters srcs (templates/quantize_blocks_fp8.py.j2)."""
    src_shape = [E, n // 2 if interleave else n, k]
    return KernelPlan(
        name=name, stage="quantize_weights", module=name, template="quantize_blocks_fp8.py.j2", entry="main",
        params=dict(name=name, class_name=class_name, doc=doc, groups=E, n=n, k=k, block=FP8_BLOCK,
                    interleave=interleave, e4m3_max=E4M3_MAX, threads=FP8_IO_THREADS),
        args=[KernelArg("src0", srcs[0], "bf16", src_shape), KernelArg("src1", srcs[1], "bf16", src_shape),
              KernelArg("q", f"{out}_q", "e4m3", [E, n, k]),
              KernelArg("scales", f"{out}_scales", "f32", [E, n // FP8_BLOCK, k // FP8_BLOCK]),
              KernelArg("q_t", f"{out}_t_q", "e4m3", [E, k, n]),
              KernelArg("scales_t", f"{out}_t_scales", "f32", [E, k // FP8_BLOCK, n // FP8_BLOCK])],
        grid=f"({E * (n // FP8_BLOCK) * (k // FP8_BLOCK)},)", block=FP8_IO_THREADS,
        warp_roles=[f"one CTA per {FP8_BLOCK} x {FP8_BLOCK} block: its rows into shared memory (16-byte loads, a "
                    "warp two whole rows) and the block's amax; then by columns, each warp 16, each lane 4 rows: "
                    "each value divided once, its e4m3 stored transposed (4-byte stores) and to a second tile, "
                    "from which the rows are stored as they are (16-byte stores)"])


def fp8_buffers(spec: MoESpec, twin: Plan, kept: list) -> list[Buffer]:
    """The twin's buffers that its kept kernels bind, and the FP8 rows and operands, in
    dispatch's row layout (a function of T) or per M tile."""
    H, I = spec.hidden, spec.intermediate
    bound = {a.tensor for k in kept for a in k.args}
    rows = next(b for b in twin.buffers if b.name == "y").shape[0]  # dispatch's padded rows, a function of T
    m_tiles = next(b for b in twin.buffers if b.name == "tile_expert").shape[0]
    return [b for b in twin.buffers if b.name in bound] + [
        Buffer("x_rows_q", "e4m3", [rows, str(H)]), Buffer("x_rows_scales", "f32", [rows, str(H // FP8_BLOCK)]),
        Buffer("h_q", "e4m3", [rows, str(I)]), Buffer("h_scales", "f32", [rows, str(I // FP8_BLOCK)]),
        # (the dgrad GEMMs' operands, in dispatch's row layout)
        Buffer("dy_q", "e4m3", [rows, str(H)]), Buffer("dy_scales", "f32", [rows, str(H // FP8_BLOCK)]),
        Buffer("dh", "bf16", [rows, str(I)]),
        Buffer("dab_q", "e4m3", [rows, str(2 * I)]), Buffer("dab_scales", "f32", [rows, str(2 * I // FP8_BLOCK)]),
        Buffer("a13", "bf16", [rows, str(2 * I)]),  # (dxs, the gate/up dgrad's rows, is the twin's)
        Buffer("xt_q", "e4m3", [m_tiles, str(H), str(FP8_TILE_M)]), Buffer("xt_scales", "f32", [m_tiles, str(H)]),
        Buffer("doutt_q", "e4m3", [m_tiles, str(H), str(FP8_TILE_M)]),
        Buffer("doutt_scales", "f32", [m_tiles, str(H)]),
        Buffer("hwt_q", "e4m3", [m_tiles, str(I), str(FP8_TILE_M)]), Buffer("hwt_scales", "f32", [m_tiles, str(I)]),
        Buffer("dabt_q", "e4m3", [m_tiles, str(2 * I), str(FP8_TILE_M)]),
        Buffer("dabt_scales", "f32", [m_tiles, str(2 * I)]),
        Buffer("dab_rows", "bf16", [rows, str(2 * I)]), Buffer("hw_rows", "bf16", [rows, str(I)])]


def fp8_steps(own_entries: list) -> dict:
    """The entries: each of own_entries alone (its golden test), and the chains."""
    forward = ["dispatch_count", "dispatch_scatter", "quantize_rows_fp8", "gemm_gateup_fp8", "gemm_down_fp8",
               "combine"]
    # The data gradients (dx, d_topk_weights) from dout, recomputing the forward's products
    # (nothing saved).
    backward_data = ["dispatch_count", "dispatch_scatter", "quantize_rows_fp8", "quantize_dout_fp8",
                     "bwd_recompute_fp8", "bwd_dgrad_down_fp8", "swiglu_backward_fp8", "bwd_dgrad_gateup_fp8",
                     "bwd_combine"]
    # Every gradient (Variant.backward_fp8): the data gradients' chain with the SwiGLU backward
    # that also writes bf16 rows, then the weight gradients' operands and GEMMs.
    backward_fp8 = [("swiglu_backward_fp8_w" if n == "swiglu_backward_fp8" else n) for n in backward_data] + [
        "quantize_x_t_fp8", "quantize_dout_t_fp8", "quantize_hw_t_fp8", "quantize_dab_t_fp8", "wgrad_down_fp8",
        "wgrad_gateup_fp8"]
    # Training (mokgen.moe_fp8_train): the forward also saves the gate/up products (a13), and the
    # backward starts from them: no x rows in e4m3, no recompute GEMM. (Dispatch runs again in
    # the backward: the row layout is a function of topk_ids, the same rows in the same order.)
    forward_train = [("gemm_gateup_fp8_train" if n == "gemm_gateup_fp8" else n) for n in forward]
    backward_fp8_saved = [n for n in backward_fp8 if n not in ("quantize_rows_fp8", "bwd_recompute_fp8")]
    return {**{k.name: [k.name] for k in own_entries},
            "forward": forward, "backward_data": backward_data, "backward_fp8": backward_fp8,
            "quantize_experts": ["quantize_w13_fp8", "quantize_w_down_fp8"],
            "forward_train": forward_train, "backward_fp8_saved": backward_fp8_saved,
            "status": ["status_mirror"]}
