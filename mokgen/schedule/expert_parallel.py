"""Expert parallelism over NVLink: the Plan's send_peers and return stages as device-initiated
peer stores (templates/ep_exchange.py.j2), and the workspace they move rows through.

Each of the W ranks owns E/W experts. A call runs, on every rank, on one stream, with no
host synchronisation and no collective library:

    dispatch     group the rank's (token, slot) pairs by global expert (send order)
    publish      store the rank's per-expert counts into every peer's ep_counts, then raise
                 its flag there (release, system scope)
    layout       wait for every rank's counts (acquire, bounded); from the full W x E count
                 matrix compute where each of this rank's rows lands on its owner and the
                 receive layout of the local experts: by local expert, then source rank, then
                 send order, each expert padded to the GEMM M tile
    send         store each row x[t] into its owner's ep_recv, local-expert-major; the store
                 that completes an expert raises its ready flag on the owner (and the last
                 CTA the owner's rows flag). It runs on a second stream on a few SMs, beside:
    GEMMs        gate/up + SwiGLU (whose producer waits per M tile for its expert's ready
                 flags from every rank) and down over ep_recv (TMA, no gather). With
                 ep_overlap: false, wait_rows waits for every rank's rows flag first.
    return       store each result row into its source rank's ep_ret, at the row's send
                 position; the last CTA raises the source's returns flag
    wait_returns wait until every rank has returned this rank's rows (bounded)
    combine      out[t] = sum_k w[t,k] * ep_ret[pos[t,k]] in k order: bitwise deterministic

Flags hold the call's epoch (a per-rank counter on the device, raised by publish), so they
never need resetting and a CUDA graph replays correctly. ep_counts is double-buffered by
epoch parity: a rank starts call n+1 only after its call n has received every peer's
returns, which each peer sends after reading the counts of call n. The row regions need no
second buffer for the same reason (a peer's rows of call n+1 arrive only after this rank's
call n GEMMs have read ep_recv).
"""
from __future__ import annotations

import sympy

from ..ir import MoESpec
from ..ir.graph import C, T
from .plan import Buffer, KernelArg, KernelPlan, PlanError, _expr
from .target import Target

# The symmetric regions (one symmetric allocation each); ep_peers[r, w] is region r's
# address on rank w. Peers store into them; the owner reads them. The backward's (ep_grad:
# output-gradient rows, ep_recv_w / ep_ret_w: a float per row each way) are made by the
# first backward call (0 in ep_peers until then).
REGIONS = ("ep_counts", "ep_flags", "ep_recv", "ep_ret", "ep_ready", "ep_grad", "ep_recv_w", "ep_ret_w")
BACKWARD_REGIONS = REGIONS[5:]
# Rows of ep_flags: which message a flag announces.
FLAG_KINDS = ("counts", "rows", "returns")
# ep_state entries (per rank, on the device): the call's epoch, the send and return kernels'
# finished-CTA counters, this rank's index in the group (set when the workspace is made).
STATE = ("epoch", "sent", "returned", "rank")
# Error code of an expert-parallel wait that timed out: EP_ERROR + kind * 4096 + peer rank.
EP_ERROR = 1 << 20
# Threads of the exchange kernels' CTAs, and the most ranks one wait kernel watches.
EP_THREADS = 256
MAX_WORLD = 1024
# Plan overrides this module reads; a fused launch, clusters and profiling builds are not
# generated for several GPUs yet.
UNSUPPORTED = ("fuse_gemms", "cluster_m", "profile", "dispatch_chunked")
# Send overlapped with the gate/up GEMM (Plan override ep_overlap: false runs them one after
# the other on all SMs): the send kernel takes this many SMs, the GEMM the rest. Measured on
# 2 H200s (E64 K8 H2048 I1024, each build timed in one run, docs/perf.md): at 8192 tokens per
# rank 8 / 16 / 32 / 48 SMs and the serial path took 2.58 / 2.13 / 2.35 / 2.52 / 2.44-2.47 ms.
OVERLAP_COMM_CTAS = 16


def check_ep_overrides(overrides: dict) -> None:
    for key in UNSUPPORTED:
        if overrides.get(key) and not (key == "cluster_m" and overrides[key] == 1):
            raise PlanError(f"plan override {key} is not generated for world_size > 1 yet")


def received_tiles(spec: MoESpec, row_tile: int):
    """Bound on the receive layout's M tiles: every rank's C*K rows could come to one rank,
    and each local expert's segment is padded to the row tile."""
    return sympy.ceiling(spec.world_size * C * spec.topk / row_tile) + spec.local_experts


def overlapped(overrides: dict) -> bool:
    return overrides.get("ep_overlap", True)


def comm_ctas(spec: MoESpec, target: Target, overrides: dict) -> tuple[int, str]:
    """CTAs (one per SM) of the send and return kernels. Overlapped, the send runs beside the
    gate/up GEMM on SMs the GEMM leaves free; else both run alone on every SM. `comm_sms`
    overrides."""
    if "comm_sms" in overrides:
        n = overrides["comm_sms"]
        if not 1 <= n <= target.sms - (8 if overlapped(overrides) else 0):
            raise PlanError(f"comm_sms={n} must be in [1, {target.sms}] (and leave 8 SMs to the GEMM when the "
                            "send overlaps it)")
        return n, "set by override comm_sms"
    row_bytes = spec.hidden * 2
    if overlapped(overrides):
        return OVERLAP_COMM_CTAS, (f"the send shares the GPU with the gate/up GEMM: {OVERLAP_COMM_CTAS} SMs send "
                                   f"(rows of {row_bytes} B, {EP_THREADS // 32} warps each), the GEMM keeps "
                                   f"{target.sms - OVERLAP_COMM_CTAS}")
    return target.sms, (f"send/return as separate launches: all {target.sms} SMs, {EP_THREADS // 32} rows of "
                        f"{row_bytes} B in flight per SM; the peer link moves {target.nvlink_peer_gbs:.0f} GB/s per "
                        "peer")


def overlap_gemm(gateup: KernelPlan, spec: MoESpec, target: Target, overrides: dict) -> None:
    """Make the gate/up GEMM wait per M tile for its rows (ep_ready) and leave the send's SMs
    free: its persistent grid takes the others."""
    ctas, _ = comm_ctas(spec, target, overrides)
    sms = target.sms - ctas
    gateup.params = dict(gateup.params, ep_ready=True, ep_world=spec.world_size, sms=sms,
                         ep_rows_error=EP_ERROR + FLAG_KINDS.index("rows") * 4096)
    at = next(i for i, a in enumerate(gateup.args) if a.name == "tile_counter") + 1
    gateup.args[at:at] = [KernelArg("ready", "ep_ready", "i32", [spec.local_experts, spec.world_size]),
                          KernelArg("state", "ep_state", "i32", [len(STATE)])]
    gateup.grid = gateup.grid.replace(f"min({target.sms},", f"min({sms},")


def ep_buffers(spec: MoESpec, row_tile: int) -> list[Buffer]:
    """The peer workspace: made once per (variant, group) at a capacity of C tokens per rank."""
    W, E, El, K, H = spec.world_size, spec.experts, spec.local_experts, spec.topk, spec.hidden
    rows = _expr(received_tiles(spec, row_tile) * row_tile)
    return [
        Buffer("ep_counts", "i32", ["2", str(W), str(E)], memory="symmetric"),
        Buffer("ep_flags", "i32", [str(len(FLAG_KINDS)), str(W)], memory="symmetric"),
        Buffer("ep_recv", "bf16", [rows, str(H)], memory="symmetric"),
        Buffer("ep_ret", "bf16", [_expr(C * K), str(H)], memory="symmetric"),
        # ready[l, r] = epoch: rank r's rows of local expert l are all here (the GEMM waits)
        Buffer("ep_ready", "i32", [str(El), str(W)], memory="symmetric"),
        Buffer("ep_peers", "i64", [str(len(REGIONS)), str(W)], memory="persistent"),
        Buffer("ep_state", "i32", [str(len(STATE))], memory="persistent"),
        Buffer("recv_off", "i32", [str(El), str(W + 1)], memory="persistent"),
        Buffer("src_start", "i32", [str(W), str(El)], memory="persistent"),
        Buffer("recv_counts", "i32", [str(El)], memory="persistent"),  # received rows per local expert
        # the rank's own rows in send order (dispatch with a one-row tile): token and expert
        Buffer("send_token", "i32", [_expr(T * K + E)]),
        Buffer("send_expert", "i32", [_expr(T * K + E)]),
        Buffer("send_shift", "i32", [str(E)]),
        Buffer("sent", "i32", [str(E)]),  # rows of each expert stored so far (the send counts)
    ]


def ep_backward_buffers(spec: MoESpec, row_tile: int) -> list[Buffer]:
    """The backward's regions: the received rows' output gradients and routing weights, and the
    d_topk_weights entries going back."""
    rows = _expr(received_tiles(spec, row_tile) * row_tile)
    return [Buffer("ep_grad", "bf16", [rows, str(spec.hidden)], memory="symmetric"),
            Buffer("ep_recv_w", "f32", [rows], memory="symmetric"),
            Buffer("ep_ret_w", "f32", [_expr(C * spec.topk)], memory="symmetric")]


def ep_kernels(spec: MoESpec, target: Target, row_tile: int, n_counters: int, status_slot: int,
               wait_timeout_ns: int, overrides: dict) -> tuple[list[KernelPlan], list[str], list[dict], int]:
    """(kernels, decisions, queues, communication CTAs) of the forward's exchange stages."""
    W, E, El, K, H = spec.world_size, spec.experts, spec.local_experts, spec.topk, spec.hidden
    if W > MAX_WORLD:
        raise PlanError(f"world_size={W}: at most {MAX_WORLD} ranks are planned")
    ctas, why = comm_ctas(spec, target, overrides)
    kernels = exchange_kernels(spec, target, row_tile, n_counters, status_slot, wait_timeout_ns, ctas)
    rows = _expr(received_tiles(spec, row_tile) * row_tile)
    order = ("send order local-expert-major (every rank sends every owner's local expert 0 first, then 1, ...): "
             "each owner's GEMM walks its M tiles in that order")
    if overlapped(overrides):
        order += ("; the send runs on a second stream beside gemm_gateup, whose producer waits per M tile "
                  "(acquire, system scope, bounded) until every rank's rows of its expert are stored")
    decisions = [
        f"expert parallel over {W} GPUs ({spec.topology}, P2P stores, no multicast): {El} experts per rank; rows "
        "move by device-initiated stores into the owner's symmetric memory, flags carry the call's epoch "
        "(release/acquire at system scope, bounded waits); no host sync and no collective library in the layer",
        f"communication: {ctas} CTAs send; {why}; the return runs after the down GEMM on all {target.sms} SMs",
        order,
        f"receive layout: by local expert, then source rank, then the source's send order, each expert padded to "
        f"{row_tile} rows: fixed by the counts alone, so the same routing always gives the same rows and bits",
        f"peer workspace per rank for C tokens per rank: ep_recv {rows} x {H} bf16 (all ranks' rows could go to "
        f"one), ep_ret {_expr(C * K)} x {H} bf16, h and y as ep_recv; made once per process group and reused",
    ]
    queues = [
        dict(name="ep_recv", direction="to the expert's owner", slot_bytes=2 * H, slots=rows,
             order="local expert, source rank, send order", flag=f"ep_flags[{FLAG_KINDS.index('rows')}, source]"),
        dict(name="ep_ret", direction="back to the token's rank", slot_bytes=2 * H, slots=_expr(C * K),
             order="the source's send order", flag=f"ep_flags[{FLAG_KINDS.index('returns')}, owner]"),
        dict(name="ep_counts", direction="to every rank", slot_bytes=4 * E, slots=str(2 * W),
             order="epoch parity, source rank", flag=f"ep_flags[{FLAG_KINDS.index('counts')}, source]"),
    ]
    return kernels, decisions, queues, ctas


def exchange_kernels(spec: MoESpec, target: Target, row_tile: int, n_counters: int, status_slot: int,
                     wait_timeout_ns: int, ctas: int, backward: bool = False) -> list[KernelPlan]:
    """The exchange kernels (templates/ep_exchange.py.j2), of the forward or of the backward.
    The backward's (module ep_bwd: layout, send and return, named *_bwd) also move each row's
    output gradient and routing weight to the expert's rank, zero the received padding rows,
    and return each row's d_topk_weights entry; it takes publish and the waits from the
    forward's module."""
    W, E, El, K, H = spec.world_size, spec.experts, spec.local_experts, spec.topk, spec.hidden
    sent = KernelArg("sent", "sent", "i32", [E])
    wait_threads = 32 * -(-W // 32)
    params = dict(world=W, experts=E, local_experts=El, topk=K, hidden=H, tile_m=row_tile, threads=EP_THREADS,
                  comm_ctas=ctas, return_ctas=target.sms, wait_threads=wait_threads, vec=8, status_slot=status_slot,
                  wait_timeout_ns=wait_timeout_ns, ep_error=EP_ERROR, regions=list(REGIONS),
                  flag_kinds=list(FLAG_KINDS), state=list(STATE), bwd=backward,
                  zero_padding=["ep_recv", "ep_grad"] if backward else [])
    peers = KernelArg("peers", "ep_peers", "i64", [len(REGIONS), W])
    state = KernelArg("state", "ep_state", "i32", [len(STATE)])
    flags = KernelArg("flags", "ep_flags", "i32", [len(FLAG_KINDS), W])
    counters = KernelArg("tile_counters", "tile_counters", "i32", [n_counters])
    recv_off = KernelArg("recv_off", "recv_off", "i32", [El, W + 1])
    src_start = KernelArg("src_start", "src_start", "i32", [W, El])
    suffix = "_bwd" if backward else ""

    def k(name, entry, args, grid, block, roles):
        stage = "send_peers" if entry in ("publish", "layout", "send", "wait_rows") else "return"
        return KernelPlan(name + suffix, stage, "ep_bwd" if backward else "ep", "ep_exchange.py.j2", entry, params,
                          args, grid=grid, block=block, warp_roles=roles)

    grad_args = [KernelArg("dout", "dout", "bf16", ["T", H]), KernelArg("pos", "pos", "i32", ["T", K]),
                 KernelArg("weights", "topk_weights", "f32", ["T", K])] if backward else []
    kernels = [
        k("ep_layout", "layout",
          [KernelArg("ep_counts", "ep_counts", "i32", [2, W, E]), flags, state, counters,
           KernelArg("send_shift", "send_shift", "i32", [E]), recv_off, src_start,
           KernelArg("tile_expert", "tile_expert", "i32", ["MT"]), KernelArg("row_token", "row_token", "i32", ["M"]),
           sent, peers, KernelArg("recv_counts", "recv_counts", "i32", [El])],
          f"({E},)", EP_THREADS,
          ["all warps: wait for every rank's counts, then for global expert e: where this rank's rows of e land "
           "on e's owner; the owner's CTAs also write the receive layout (tile table, valid rows, segments)"
           + ("; and zero the padding rows of ep_recv and ep_grad" if backward else "")]),
        k("ep_send", "send",
          [KernelArg("x", "x", "bf16", ["T", H])] + grad_args +
          [KernelArg("send_token", "send_token", "i32", ["R"]),
           KernelArg("send_expert", "send_expert", "i32", ["R"]), KernelArg("send_shift", "send_shift", "i32", [E]),
           KernelArg("counts", "counts", "i32", [E]), sent, peers, state, counters],
          f"({ctas},)", EP_THREADS,
          ["every warp: blocks of 32 rows, 16 B per lane, stored into the owners' ep_recv"
           + (" (and the dout rows into ep_grad, the weights into ep_recv_w)" if backward else "")
           + "; per block a fence (system scope) and per-expert counts; the add that completes an expert raises "
           "its ready flag on the owner; the last CTA raises each owner's rows flag"]),
        k("ep_return", "return_rows",
          [KernelArg("y", "dxs" if backward else "y", "bf16", ["M", H])]
          + ([KernelArg("yw", "d_rows", "f32", ["M"])] if backward else [])
          + [KernelArg("row_token", "row_token", "i32", ["M"]),
             KernelArg("tile_expert", "tile_expert", "i32", ["MT"]), recv_off, src_start, peers, state, counters],
          f"({target.sms},)", EP_THREADS,
          ["every warp: one received row at a time, stored back into its source rank's ep_ret at its send "
           "position" + (" (its d_topk_weights entry into ep_ret_w)" if backward else "")
           + "; the last CTA raises each source's returns flag"]),
    ]
    if not backward:
        kernels[0:0] = [k("ep_publish", "publish", [KernelArg("counts", "counts", "i32", [E]), peers, state], "(1,)",
                          EP_THREADS, ["all threads: store this rank's counts into every peer's ep_counts; then one "
                                       "thread per peer raises the counts flag (release, system scope)"])]
        kernels[-1:-1] = [k("ep_wait_rows", "wait_rows", [flags, state, counters], "(1,)", wait_threads,
                            ["one thread per rank: spin (acquire, system scope, bounded) until its rows flag holds "
                             "this epoch"])]
        kernels.append(k("ep_wait_returns", "wait_returns", [flags, state, counters], "(1,)", wait_threads,
                         ["one thread per rank: spin (acquire, system scope, bounded) until its returns flag holds "
                          "this epoch"]))
    return kernels
