"""How one grouped GEMM is tiled: the routed row tile, a GEMM's tile shape, pipeline depth,
epilogue sub-tiles and register split, and the swapped tiles' legal shapes (the weights' rows
the wgmma's M, the token rows its N). make_plan (plan.py) and GemmMaker (gemms.py) ask here;
every number is the target's or a measured constant named below."""
from __future__ import annotations

from ..ir import MoESpec
from .records import WARPGROUP_THREADS, WGMMA_ROWS, PlanError
from .target import Target


# Epilogue staging buffers of a GEMM (`<gemm>.epi_stages` overrides). Measured on H200,
# E64 K8 H2048 I1024 at T=16384, three runs: 2 buffers instead of 4 made gate/up 3-8% and
# down 1-6% faster (T=4096 and E256 K8 H7168 I2048: within 1%); 8 was slower.
EPI_STAGES = 2


# bf16 K step of one TMA box row: 64 elements = 128 bytes, the 128-byte swizzle width.
TILE_K = 64
# Shared memory kept back for mbarriers and alignment padding.
SMEM_RESERVE = 2048
# The token count the cost model assumes when a decision depends on T (one build
# serves every T; this only picks among legal choices).
NOMINAL_TOKENS = 8192


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
