"""The single launch on one GPU: gate/up and down (and the shared expert's GEMMs) in one
persistent kernel that may dispatch, route and combine too; its bands of swapped tiles by T
(launch_bands); and what it does besides its tiles (launch_policies: the combine's early
start, the error code's copy, the swapped tiles' L2 policies and paired weight loads). The
expert-parallel single launch (expert_parallel.py) builds on fused_gemm and dispatch_phase."""
from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

import sympy

from ..ir import MoESpec
from ..ir.graph import T
from .dispatch import chunk_scratch
from .gemms import class_name
from .records import VEC, Buffer, KernelArg, KernelPlan, PlanError, _expr
from .target import Target
from .taskgraph import claim_late_gain
from .tiling import SWAP_TILE_N, TILE_K

if TYPE_CHECKING:
    from .gemms import GemmMaker
    from .plan import Counters, Paths


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
# Past the largest swapped tile (no tile holds r + SWAP_SPREAD sqrt(r) rows), a swapped tile that
# some experts' rows spill out of still beats the plain launch: a spilled expert's second M tile
# streams its weights again, but the plain launch gives every expert two M tiles. Measured on an
# H100 (the bands forced at each T, CUDA graphs, 4 interleaved rounds, the same bits; docs/perf.md):
# E64 K8 H2048 I1024's 160-row tiles 1.26x / 1.24x / 1.06x the plain launch at T = 1100 / 1200 /
# 1300 and 0.99x at 1350; E8 K2 H4096 I14336's 1.40x / 1.25x / 1.11x at T = 540 / 620 / 650. So
# there the launch takes, of the swapped tiles that hold r - SPILL_SPREAD sqrt(r) rows (at most
# about 58% of the experts spill), the one the tile model costs least (spilled_tile_cost). Not in
# the plain launch's own band below the largest tile: there E64 gained 1.06x / 1.03x at T = 720 / 800
# and E128 K8 H2048 I768 1.03x at T = 1450-1550, but E8 lost 0.92x at T = 370.
SPILL_SPREAD = 0.2
# The tile model (docs/perf.md, "Where a 160-row tile's time goes"; H200, E64 at T = 64-1024): an SM
# takes a swapped tile's weight bytes from HBM at 35.6 GB/s and its token rows' bytes (gathered x
# rows, h rows), L2 hits, at 63 GB/s, one after the other.
TILE_WEIGHT_GBS = 35.6
TILE_ROWS_GBS = 63.0
# Up to this many rows per expert on average, a launch's CTAs count every expert's pairs
# themselves (no launch-wide counter between counting and placing; docs/perf.md); above it
# they dispatch by chunks of pairs.
SMALL_ROWS_PER_EXPERT = 48


def weight_starved(spec: MoESpec, sms: int) -> bool:
    """Whether a layer has fewer than SWAP_MIN_WAVES swapped gate/up tiles per SM."""
    return spec.local_experts * spec.intermediate // SWAP_TILE_N < SWAP_MIN_WAVES * sms


def launch_bands(spec: MoESpec, row_tile: int, sms: int, in_launch: bool, overrides: dict) -> tuple[list, str]:
    """([(max_tokens, rows)], why): the single launch's tiles by token count, rows the swapped
    tiles' token rows (0: the plain launch, row_tile rows; past the largest tile, one that some
    experts spill out of while spilled_tile finds one), in increasing max_tokens up to
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
        rows = next((n for n in sorted(sizes) if n >= need), None)
        if rows is None:  # (no tile holds the spread: the plain launch, or a tile some experts spill out of)
            rows = (None if starved else spilled_tile(spec, r, sizes - {row_tile})) or row_tile
        rows = 0 if rows == row_tile else rows
        if bands and bands[-1][1] == rows:
            bands[-1][0] = t
        else:
            bands.append([t, rows])
    if not any(n for _, n in bands):
        return [], ""
    return [(t, n) for t, n in bands], (
        "the single launch's tiles by T (an expert's rows, mean r = T*K/E, fit one tile of n rows while "
        f"r + {spread} sqrt(r) <= n" + (f"; where none does, the swapped tile of least modelled cost (weights at "
                                        f"{TILE_WEIGHT_GBS} GB/s, token rows at {TILE_ROWS_GBS} GB/s an SM, a "
                                        "spilled expert's second tile streaming its weights again) of those that "
                                        f"hold r - {SPILL_SPREAD} sqrt(r)" if spread else
                                        f": fewer than {SWAP_MIN_WAVES} gate/up tiles per SM")
        + "): " + ", ".join(
            f"T <= {t}: " + (f"swapped, {n} token rows" if n else f"plain, {row_tile} rows") for t, n in bands))


def per_gemm_bands(bands: list, ranges: list) -> list:
    """launch_bands ([[max_tokens, entry]], increasing) with the T ranges [lo, hi] served by the
    per-GEMM path ("forward") in place of the single launch (override per_gemm_tokens, which
    `mokgen tune --paths` measures per layer): bands cut at the ranges' edges, adjacent bands of
    one entry merged. T past the last band is the per-GEMM path's already. The row buffers stay
    sized by the model's bands, so every entry still finds its rows at every T."""
    top = bands[-1][0] if bands else 0
    cuts = sorted({t for t, _ in bands} | {lo - 1 for lo, _ in ranges if 1 < lo <= top}
                  | {hi for _, hi in ranges if hi < top})
    out: list = []
    lo = 1
    for cut in cuts:
        entry = "forward" if any(a <= lo <= b for a, b in ranges) else next(e for t, e in bands if lo <= t)
        if out and out[-1][1] == entry:
            out[-1][0] = cut
        else:
            out.append([cut, entry])
        lo = cut + 1
    return out


def spilled_tile_cost(spec: MoESpec, r: float, n: int) -> float:
    """The tile model's SM time (us) of one expert's swapped M tiles of n rows, where its routed
    rows scatter around r (normal, sd sqrt(r)): each M tile streams the expert's weights and n
    token rows through every gate/up tile (x rows) and down tile (h rows)."""
    H, I = spec.hidden, spec.intermediate
    sd = math.sqrt(r)
    # expected M tiles: P(rows > j n) summed over j (an expert with no rows is all but impossible here)
    tiles = sum(0.5 * math.erfc((j * n + 0.5 - r) / (sd * math.sqrt(2))) for j in range(int((r + 6 * sd) // n) + 1))
    weights = 3 * H * I * 2 / (TILE_WEIGHT_GBS * 1e3)
    row = (I // SWAP_TILE_N * H * 2 + down_tiles(H, SWAP_TILE_N) * I * 2) / (TILE_ROWS_GBS * 1e3)
    return tiles * (weights + n * row)


def spilled_tile(spec: MoESpec, r: float, sizes: set) -> int | None:
    """Where no swapped tile holds an expert's rows with the spread: of the sizes that hold
    r - SPILL_SPREAD sqrt(r) rows, the one of least modelled cost; None where none does."""
    fit = [n for n in sorted(sizes) if n >= r - SPILL_SPREAD * math.sqrt(r)]
    return min(fit, key=lambda n: spilled_tile_cost(spec, r, n)) if fit else None


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


def launch_policies(kernels: list, spec: MoESpec, target: Target, paths: Paths, counters: Counters, ov: dict,
                    decisions: list, served: list) -> None:
    """What the single launches do besides their tiles, set on every launch that has them (the
    bands and the routing twins too): the combine's unroll and early start, the error code's
    copy by the last CTA, when each CTA claims its next tile, and the swapped tiles' L2 policies
    and paired weight loads. `served`: served_ranges, the T each single launch serves."""
    late, why_late = (ov["claim_late"], "override claim_late") if "claim_late" in ov else \
        claims_late(spec, target, served)
    for k in kernels:
        if k.params.get("combine") and "combine_unroll" in ov:
            k.params = dict(k.params, combine_unroll=ov["combine_unroll"])
        if k.params.get("combine") and k.params.get("fused") and paths.combine_early:
            k.params = dict(k.params, combine_early=True, combine_slot=counters.slot("combine_next"),
                            debug_break_combine=bool(ov.get("debug_break_combine")))
            k.warp_roles = k.warp_roles + ["a consumer warp with no tile left claims combine tasks, each waiting "
                                           "for the M tiles of its token's rows"]
            if k.params.get("swap") and ov.get("discard_consumed", DISCARD_CONSUMED):
                k.params = dict(k.params, discard_consumed=True, discard_what=ov.get("discard_what", "all"),
                                discard_h_early=ov.get("discard_h_early",
                                                       k.params["tile_m"] >= DISCARD_H_EARLY_ROWS))
        if k.params.get("fused") and k.stage == "gemm" and late:
            # Each CTA claims its next tile once its current tile's loads are all issued, not as the
            # tile starts: see the template's note (templates/gemm_producer.py.j2, late_claim_note).
            k.params = dict(k.params, claim_late=True)
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
                        ("discard_consumed", "scratch rows leave L2 unwritten once read last (discard.global.L2): "
                                             "the combine drops the y lines it read and the padding rows', h's "
                                             "lines too, or in the bands of "
                                             f"{DISCARD_H_EARLY_ROWS} rows and more the M tile's last down tile "
                                             "does once stored; no scratch row goes back to HBM"),
                        ("claim_late", "each CTA claims its next tile once the current tile's loads are "
                                       "issued, not as it starts (a tile claimed ahead waits behind the current "
                                       f"tile's wait and MMAs while other SMs may have none: {why_late})"),
                        ("mirror_status", "the launch's last CTA copies a set error code to the runtime's pinned "
                                          "host word itself (no status_mirror launch behind the call)")):
        marked = [k.name for k in kernels if k.params.get(param) and not k.name.endswith("_routed")]
        if marked:
            decisions.append(f"{', '.join(marked)} (and their routing twins): {what}")


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
# The swapped tiles' early combine drops from L2 the y and h lines it reads last (discard.global.L2;
# override discard_consumed): each token's task its rows' lines, and first one task per M tile its
# padding rows' lines, once the tile's down tiles are stored (h's lines: see DISCARD_H_EARLY_ROWS).
# Scratch rows nobody reads again are then never written back to HBM, where the weight stream of
# the call or of the next one evicted them. Measured on H200 (E64 K8 H2048 I1024, CUDA graphs, 4
# interleaved rounds, per-round median, the same bits): 0.997x / 1.036x / 1.054x / 1.006x at T =
# 64 / 256 / 512 / 1024; E40 K6 H1536 I640 1.000x / 1.006x / 1.011x at T = 64 / 320 / 1024; on an
# H100 1.00x / 1.04x / 1.06x / 1.03x (E64) and 1.00x / 1.05x / 1.00x (E40), each part (token rows,
# padding rows) paying alone. The plain 128-row launch is left out: at T = 2048 it was 0.98x.
DISCARD_CONSUMED = True
# Where a single launch's CTAs claim their next tile late (once the current tile's loads are all
# issued) instead of as the current tile starts: where the tile-loop model (taskgraph.py,
# tile_loop_us) predicts the loop claimed ahead at least this much longer at either end of a band's
# T range. A CTA that claims a tile ahead holds it behind its current tile's wait and MMAs: a long
# tile can then run after another long tile while other SMs have none (Mixtral-8x7B's down tiles,
# K = 14336, 250-320 us: 3-7 SMs ending 60-80 us after the rest at T = 172 and 380, H100
# profiles), and a down tile that waits for its M tile's gate/up tiles holds the tile behind it
# for that wait too (E40: about 3 tiles per SM). Claiming late, measured on an H200 (CUDA graphs,
# 3 interleaved rounds, best round's median, the same bits; docs/perf.md): Mixtral 1.050x /
# 1.102x / 1.089x / 1.080x / 1.042x / 1.003x / 1.025x at T = 172 / 298 / 380 / 550 / 651 / 1000 /
# 1800, 0.95-1.02x at 729 over three runs; E40 K6 H1536 I640 1.099x / 1.048x / 0.999x / 0.996x
# at T = 64 / 256 / 1024 / 2048; E256 1.000x / 0.999x, E128 and E64 0.997-1.005x and
# 0.991-1.002x (E64 0.93-0.97x in the per-round medians at T = 2048-4096). The model, tiles'
# times spread +-15%: Mixtral 1.20x at T <= 467, E40 1.17x at T <= 746; E64, E128, E256 and
# E16 K4 at most 1.01x. Not modelled with a shared expert's tiles (claimed ahead there).
# Override claim_late sets it either way.
CLAIM_LATE_MIN_GAIN = 1.05
TILE_TIME_SPREAD = 0.15  # each tile's time within +-15% of its kind's cost in the model
TILE_TIME_DRAWS = 4  # the model's gain is the mean over this many seeded draws


def claims_late(spec: MoESpec, target: Target, served: list) -> tuple[bool, str]:
    """Whether the single launches of `spec` claim late by default (override claim_late), and
    the model's figure behind it. `served`: (lowest T, highest T, fused kernel params) of each
    band of the single launch."""
    if spec.shared_intermediate or not served:
        return False, ""
    gain, at = max((claim_late_gain(spec, p, target, t, TILE_TIME_SPREAD, TILE_TIME_DRAWS), t)
                   for lo, hi, p in served for t in (lo, hi))
    return gain >= CLAIM_LATE_MIN_GAIN, f"the tile-loop model: {gain:.2f}x at T = {at}"


def served_ranges(kernels: list, bands: list, top: int) -> list:
    """(lowest T, highest T, params) of each single launch by the bands of T it serves (`bands`:
    (highest T, token rows of its swapped tiles or 0 for the plain launch)); without bands the
    plain launch serves T up to `top`."""
    fused = {k.name: k.params for k in kernels if k.params.get("fused") and k.stage == "gemm"}
    if not bands:
        return [(1, top, fused["gemm_fused"])] if "gemm_fused" in fused else []
    out, lo = [], 1
    for hi, rows in bands:
        out.append((lo, hi, fused[f"gemm_fused_n{rows}" if rows else "gemm_fused"]))
        lo = hi + 1
    return out


# Where h's lines leave L2: in bands of at least this many rows a tile, from the M tile's last down
# tile as soon as it is stored (h's last readers are the tile's down tiles); in smaller bands from
# the combine tasks with y's, later (override discard_h_early: true or false, every band). Where h
# and y outgrow what L2 keeps beside the weight stream, lines dropped sooner are written back less
# often. Measured on two H100s against the combine's drops (CUDA graphs, 4 interleaved rounds,
# per-round median, the same bits): E64 K8 H2048 I1024 1.000x / 0.999x at T = 64 (16-row tiles),
# 1.008x / 1.000x at 256 (48), 1.006x / 1.008x at 512 (96), 1.011x / 1.004x at 1024 (160); E40 K6
# H1536 I640 0.997x / 0.994x at T = 64 (16), 1.009x / 0.996x at 320 (64).
DISCARD_H_EARLY_ROWS = 96


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


def down_tiles(hidden: int, tile_n: int) -> int:
    """A single launch's down tiles per M tile: each is two tile_n-wide halves (fused_gemm)."""
    return hidden // (2 * tile_n)


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
                  n2_tiles=down_tiles(H, p["tile_n"]), used_slot=used_slot, s_size=S, shared_slot=shared_slot,
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
