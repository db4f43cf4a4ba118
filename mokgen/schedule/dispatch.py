"""The send stage on one GPU: dispatch_count, then dispatch_scatter (positions, the row ->
token table, the tile table), per expert or O(T*K) by chunks of (token, slot) pairs; the
parameters the single launch's own dispatch phase reuses (single_launch.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import sympy

from ..ir import MoESpec
from ..ir.graph import T
from .records import Buffer, KernelArg, KernelPlan, _expr
from .status import BAD_IDS_CODE
from .target import Target

if TYPE_CHECKING:
    from .plan import Counters


# Routed pairs each dispatch thread ranks per step: fewer block barriers per pair.
DISPATCH_ITEMS = 4


# The id of an empty slot: a dropped (token, slot) pair, which gets no row and contributes
# nothing (its d_topk_weights entry is 0); the layer over several nodes marks the slots of other
# nodes' experts so.
EMPTY_ID = -1


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
