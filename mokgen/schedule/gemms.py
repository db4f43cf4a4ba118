"""The Plan's grouped GEMM kernels (templates/grouped_gemm_persistent.py.j2): GemmMaker makes
every routed, shared-expert and backward GEMM in one Plan's context; its tiling comes from
tiling.py."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir import MoESpec
from .backward import COPY_BATCH_CONSUMER, COPY_BATCH_PRODUCER, COPY_CLAIM_ROWS, WGRAD_TILE_M
from .records import VEC, KernelArg, KernelPlan, PlanError
from .status import STATUS_POLL_NS
from .target import Target
from .tiling import choose_gemm_tiling

if TYPE_CHECKING:
    from .plan import Counters


# Tile-scheduler slots per CTA: the producer claims one tile ahead of the one it loads, so
# it publishes tile i + 1 while readers may still hold tile i.
SCHED_STAGES = 2


# Gathered stages in flight per producer warp in swapped tiles of up to SWAP_GATHER_LAG_MAX_ROWS
# token rows (where their stages allow it): the weight loads of the next stages are issued by
# a warp that also gathers, and one gathered stage in flight held them back. Measured on H200
# (CUDA graphs, 4 interleaved rounds, the same bits), lag 2 against 1: 64-row tiles 1.009x at
# E64 T = 256, 1.036x at E40 T = 426, level at E40 T = 320 (lag 3 0.992x at E64); 96-row tiles
# mixed (1.018x at E64 T = 512, 0.963x at E40 T = 640), so they keep 1; 160-row tiles 0.993x
# at E64 T = 1024, where L2's throughput bounds the tile (docs/perf.md).
SWAP_GATHER_LAG = 2
SWAP_GATHER_LAG_MAX_ROWS = 64


def class_name(kernel: str) -> str:
    """The generated class of a kernel: gemm_fused_n32 -> GemmFusedN32."""
    return "".join(p.capitalize() for p in kernel.split("_"))


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
