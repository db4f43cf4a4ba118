"""The machines mokgen plans for: numbers read off the hardware or measured on it.

Datasheet numbers are leads; the measured ones (DESIGN.md section 4) are what the
cost model uses. One record per arch; nothing else in mokgen hard-codes them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Target:
    name: str
    arch: str
    sms: int
    smem_per_block: int  # bytes a CTA may use (opt-in maximum)
    max_threads_per_block: int
    max_regs_per_thread: int
    # measured ceilings (H200, torch 2.11)
    dense_bf16_tflops: float  # torch 8192^3
    gemm_ceiling_tflops: float  # CuTe-DSL Hopper persistent GEMM, the practical ceiling
    copy_gbs: float  # device-to-device copy, bytes read + written
    nvlink_peer_gbs: float  # one peer, symmetric-memory copy
    # Relative GEMM speed by M tile (128: two consumer warpgroups; 64: one): measured
    # E64 K8 H2048 I1024 T=16384 GEMM time 2.68 vs 3.36 ms (docs/perf.md, v0.2).
    row_tile_efficiency: dict = None
    # mokgen's own kernels as measured (docs/perf.md, v0.3), for the task-graph cost model:
    grouped_gemm_tflops: float = 0.0  # persistent grouped GEMM, E64 K8 H2048 I1024 T=16384
    dispatch_scan_gbs: float = 0.0  # one dispatch CTA scanning the routed ids
    scatter_over_count: float = 1.0  # scatter task time / count task time
    launch_gap_us: float = 0.0  # launch + drain between two dependent kernels
    # Device-initiated stores into a peer (the expert-parallel exchange, 16 B per lane, a
    # warp per row): the rate one SM sustains, and the link's ceiling for such stores.
    peer_store_gbs_per_sm: float = 0.0
    peer_store_gbs: float = 0.0

    regs_per_sm: int = 65536

    def register_pool(self, threads: int) -> int:
        """The registers a CTA of `threads` threads holds (one CTA per SM): each thread's launch
        count, rounded down to a multiple of 8, times the threads. setmaxnreg only moves registers
        within this pool: an increase past it waits for ever (384 threads: 168 each, 64512, not
        the SM's 65536; a 48 / 232 split hung)."""
        return min(self.max_regs_per_thread, self.regs_per_sm // threads) // 8 * 8 * threads

    def check_register_split(self, what: str, producer_regs: int, producer_threads: int, consumer_regs: int,
                             consumer_threads: int) -> None:
        need = producer_regs * producer_threads + consumer_regs * consumer_threads
        pool = self.register_pool(producer_threads + consumer_threads)
        if need > pool:
            raise ValueError(f"{what}: the register split {producer_regs} / {consumer_regs} needs {need} registers, "
                             f"a CTA of {producer_threads + consumer_threads} threads holds {pool}")

    def to_dict(self) -> dict:
        return asdict(self)


H200 = Target(
    name="h200",
    arch="sm_90a",
    sms=132,
    smem_per_block=227 * 1024,
    max_threads_per_block=1024,
    max_regs_per_thread=255,
    dense_bf16_tflops=701.0,
    gemm_ceiling_tflops=916.0,
    copy_gbs=4245.0,
    nvlink_peer_gbs=373.0,
    row_tile_efficiency={64: 0.8, 128: 1.0},
    grouped_gemm_tflops=680.0,  # gate/up 663, down 709 TFLOP/s
    dispatch_scan_gbs=11.4,  # count: 524 KB of ids in 46 us per expert CTA
    scatter_over_count=1.41,  # 65 us / 46 us
    launch_gap_us=5.0,
    # Measured on 2 H200s (docs/perf.md, expert parallelism v2): the send on 16 SMs beside the
    # gate/up GEMM moved 134 MB in 0.710 ms (189 GB/s, 11.8 per SM); the return on all 132 SMs
    # 343 GB/s.
    peer_store_gbs_per_sm=11.8,
    peer_store_gbs=343.0,
)

TARGETS = {"sm_90a": H200}


def target_for(arch: str) -> Target:
    try:
        return TARGETS[arch]
    except KeyError:
        raise ValueError(f"no target description for arch {arch!r}; known: {', '.join(TARGETS)}") from None
