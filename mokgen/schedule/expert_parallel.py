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
                 position; the last CTA raises the source's returns flag. Overlapped, the
                 down GEMM's launch does it: each stored down tile counts itself in
                 down_ready[m], and the launch's last CTAs (from the start) and every other
                 CTA (once it has no tile left) return M tile after M tile as they complete;
                 else the return kernel runs after the down GEMM
    wait_returns wait until every rank has returned this rank's rows (bounded)
    combine      out[t] = sum_k w[t,k] * ep_ret[pos[t,k]] in k order: bitwise deterministic

The backward (exchange_kernels(backward=True), backward.ep_backward_steps) runs the same protocol
with a new epoch: each pair's x row, dout row and weight out, the recompute GEMM waiting per
M tile beside the send, each row's input gradient and d_topk_weights entry back beside the
weight-gradient GEMMs.

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
from ..ir.graph import RC, C, T
from .records import VEC, Buffer, KernelArg, KernelPlan, PlanError, _expr
from .single_launch import dispatch_phase, fused_misfit
from .target import Target

# The symmetric regions (one symmetric allocation each); ep_peers[r, w] is region r's
# address on rank w. Peers store into them; the owner reads them. The backward's (ep_grad:
# output-gradient rows, ep_recv_w / ep_ret_w: a float per row each way) are made by the
# first forward under autograd (0 in ep_peers until then).
REGIONS = ("ep_counts", "ep_flags", "ep_recv", "ep_ret", "ep_ready", "ep_grad", "ep_recv_w", "ep_ret_w")
BACKWARD_REGIONS = REGIONS[5:]
# Rows of ep_flags: which message a flag announces.
FLAG_KINDS = ("counts", "rows", "returns")
# ep_state entries (per rank, on the device): the call's epoch, the send and return kernels'
# finished-CTA counters, this rank's index in the group (set when the workspace is made).
STATE = ("epoch", "sent", "returned", "rank")
# Error code of an expert-parallel wait that timed out: EP_ERROR + kind * 4096 + peer rank;
# kind OVERFLOW_KIND: that rank would have received more rows than the workspace holds.
EP_ERROR = 1 << 20
OVERFLOW_KIND = len(FLAG_KINDS)
# Threads of the exchange kernels' CTAs, and the most ranks one wait kernel watches.
EP_THREADS = 256
# The backward's exchange kernels: 512 threads. Measured on 2 H200s (E64 K8 H2048 I1024, 8192
# tokens per rank, forward + backward, each build in one run, docs/perf.md): 256 / 512 / 1024
# threads 6.71 / 6.48 / 6.55 ms; the send beside the recompute GEMM moved 222 / 279 / 296 GB/s
# on 24 SMs, the return beside the weight gradients 76 / 94 / 131 GB/s on 9, while 1024 slowed
# the GEMMs beside them most. The forward's send: 2.00 / 2.03 / 2.07 ms, so it keeps 256.
EP_BWD_THREADS = 512
MAX_WORLD = 1024
# Plan overrides clusters and profiling builds are not generated for several GPUs yet.
UNSUPPORTED = ("cluster_m", "profile", "dispatch_chunked")
# Copies that run beside a GEMM (the forward's send beside gate/up; the backward's send
# beside the recompute GEMM and its return beside the weight gradients) take a few SMs, the
# GEMM the rest: how many, the cost model below decides (Plan overrides comm_sms,
# bwd_send_sms, bwd_return_sms set them). Measured before the model, on 2 H200s (E64 K8 H2048
# I1024, 8192 tokens per rank, each build timed in one run, docs/perf.md): the forward with 8 /
# 16 / 32 / 48 send SMs and the serial path took 2.58 / 2.13 / 2.35 / 2.52 / 2.44 ms.
MIN_GEMM_SMS = 8


def comm_threads(overrides: dict, backward: bool = False) -> int:
    """Threads of the exchange kernels' CTAs (a warp copies one row at a time: more warps per
    SM, more rows in flight). Plan override comm_threads (both directions)."""
    n = overrides.get("comm_threads", EP_BWD_THREADS if backward else EP_THREADS)
    if n not in (128, 256, 512, 1024):
        raise PlanError(f"comm_threads={n} must be 128, 256, 512 or 1024")
    return n


def check_ep_overrides(overrides: dict) -> None:
    for key in UNSUPPORTED:
        if overrides.get(key) and not (key == "cluster_m" and overrides[key] == 1):
            raise PlanError(f"plan override {key} is not generated for world_size > 1 yet")


def received_tiles(spec: MoESpec, row_tile: int):
    """Bound on the receive layout's M tiles: RC rows (the workspace's receive bound, at most
    every rank's C*K), each local expert's segment padded to the row tile."""
    return sympy.ceiling(RC / row_tile) + spec.local_experts


def overlapped(overrides: dict) -> bool:
    return overrides.get("ep_overlap", True)


def gemm_returns(overrides: dict) -> bool:
    """Whether the down GEMM's launch returns the rows (overlapped runs only; Plan override
    gemm_returns: false keeps the return kernel after it)."""
    return overlapped(overrides) and overrides.get("gemm_returns", True)


def gemm_sends(overrides: dict) -> bool:
    """Whether the gate/up GEMM's launch sends the rows itself (overlapped runs only; Plan
    override gemm_sends: true; the default keeps the send kernel on the second stream)."""
    return overlapped(overrides) and overrides.get("gemm_sends", False)


def overlap_split(copy_bytes: float, gemm_flops: float, tail: float, target: Target) -> tuple[int, str]:
    """(SMs for a copy of copy_bytes that runs beside a GEMM of gemm_flops, why). The cost
    model: n SMs store at min(n * the per-SM peer store rate, the link's ceiling); the GEMM
    runs at its measured rate on the other SMs; the pair ends when the GEMM ends, or when the
    copy ends plus the GEMM's share that waits on the last rows (tail). Both grow with T
    alike, so the choice does not depend on T; the smallest n with the least time wins."""
    gemm_s = gemm_flops / (target.grouped_gemm_tflops * 1e12)

    def times(n):
        copy_s = copy_bytes / (min(n * target.peer_store_gbs_per_sm, target.peer_store_gbs) * 1e9)
        gemm_n = gemm_s * target.sms / (target.sms - n)
        return max(gemm_n, copy_s + tail * gemm_n), copy_s, gemm_n

    n = min(range(1, target.sms - MIN_GEMM_SMS + 1), key=lambda n: (round(times(n)[0] * 1e12), n))
    total, copy_s, gemm_n = times(n)
    return n, (f"cost model: {n} SMs store at {min(n * target.peer_store_gbs_per_sm, target.peer_store_gbs):.0f} GB/s "
               f"(measured {target.peer_store_gbs_per_sm} GB/s per SM, {target.peer_store_gbs:.0f} at most), the "
               f"GEMM at {target.grouped_gemm_tflops:.0f} TFLOP/s on {target.sms - n}: per 1000 tokens the copy takes "
               f"{copy_s * 1e6:.1f} us, the GEMM {gemm_n * 1e6:.1f} us, together {total * 1e6:.1f} us")


def _per_token(spec: MoESpec, rows_per_pair: int) -> float:
    """Bytes one token's pairs send to other ranks (uniform routing: (W-1)/W of them)."""
    W = spec.world_size
    return spec.topk * (W - 1) / W * rows_per_pair * spec.hidden * 2


def _sms_override(overrides: dict, key: str, target: Target) -> int | None:
    if key not in overrides:
        return None
    n = overrides[key]
    if not 1 <= n <= target.sms - MIN_GEMM_SMS:
        raise PlanError(f"{key}={n} must be in [1, {target.sms - MIN_GEMM_SMS}] (the GEMM beside it keeps at least "
                        f"{MIN_GEMM_SMS} SMs)")
    return n


def comm_ctas(spec: MoESpec, target: Target, overrides: dict) -> tuple[int, str]:
    """CTAs (one per SM) of the forward's send. Overlapped, the send runs beside the gate/up
    GEMM on SMs the GEMM leaves free; else it runs alone on every SM. `comm_sms` overrides."""
    n = _sms_override(overrides, "comm_sms", target)
    if n is not None:
        return n, "set by override comm_sms"
    if not overlapped(overrides):
        return target.sms, (f"send/return as separate launches: all {target.sms} SMs, {EP_THREADS // 32} rows of "
                            f"{spec.hidden * 2} B in flight per SM")
    K, H, I = spec.topk, spec.hidden, spec.intermediate
    return overlap_split(1000 * _per_token(spec, 1), 1000 * 2 * K * H * 2 * I, 1 / spec.local_experts, target)


def peer_rows_params(spec: MoESpec) -> dict:
    """What templates/ep_rows.py.j2 renders from: the peer-memory layout and the row width."""
    return dict(world=spec.world_size, local_experts=spec.local_experts, hidden=spec.hidden, vec=VEC,
                regions=list(REGIONS), flag_kinds=list(FLAG_KINDS), state=list(STATE))


def return_ctas(spec: MoESpec, target: Target, overrides: dict) -> tuple[int, str]:
    """CTAs of the down GEMM's launch that return rows from the start (the others join once
    they have no tile left): the cost model, the return beside the down GEMM. `return_sms`
    overrides."""
    n = _sms_override(overrides, "return_sms", target)
    if n is not None:
        return n, "set by override return_sms"
    K, H, I = spec.topk, spec.hidden, spec.intermediate
    return overlap_split(1000 * _per_token(spec, 1), 1000 * 2 * K * H * I, 1 / spec.local_experts, target)


def return_in_gemm(down: KernelPlan, spec: MoESpec, target: Target, overrides: dict, slot: int) -> tuple[int, str]:
    """Make the down GEMM return its rows itself (templates/grouped_gemm_persistent.py.j2,
    ep_return): one launch of target.sms CTAs, the last n of which return M tiles from the
    start; the others claim GEMM tiles, then return too. Each stored down tile raises
    down_ready[m]; an M tile's rows leave once all its N tiles are stored."""
    n, why = return_ctas(spec, target, overrides)
    W = spec.world_size
    down.params = dict(down.params, ep_return=True, return_ctas=n, return_slot=slot, sms=target.sms,
                       ep_rows=peer_rows_params(spec))
    down.args += [KernelArg("down_ready", "down_ready", "i32", ["MT"]),
                  KernelArg("recv_off", "recv_off", "i32", [spec.local_experts, W + 1]),
                  KernelArg("src_start", "src_start", "i32", [W, spec.local_experts]),
                  KernelArg("peers", "ep_peers", "i64", [len(REGIONS), W]),
                  KernelArg("ep_state", "ep_state", "i32", [len(STATE)])]
    down.grid = f"({target.sms},)"
    return n, why


def fused_misfit_ep(spec: MoESpec, overrides: dict, tile_n: int) -> str | None:
    """Why the single launch (send, gate/up, down, return in one kernel) is not built for this
    expert-parallel layer whose gate/up tiles are tile_n wide (None: it is)."""
    if not overlapped(overrides) or not gemm_returns(overrides):
        return "the single launch sends and returns inside the GEMM launch: it needs ep_overlap and gemm_returns"
    if spec.shared_intermediate:
        return "the expert-parallel single launch does not run a shared expert's tiles yet"
    if 2 * tile_n != 32 * VEC:
        return (f"the single launch returns a down tile's rows one 16-byte piece per lane: it needs {2 * tile_n}-wide "
                f"down tiles to be {32 * VEC} wide")
    return fused_misfit(spec.hidden, spec.intermediate, 0, tile_n)


# The single launch: the rows of a down tile a consumer lane loads before it stores them to
# their source ranks (16 bytes each).
RETURN_ROW_BATCH = 8


def fused_combines(overrides: dict) -> bool:
    """Whether the single launch also waits for the returned rows and combines them (Plan
    override ep_fused_combine: true); by default ep_wait_returns and the combine kernel run
    after it. Measured on 2 H200s (E64 K8 H2048 I1024, each build in one run, twice, from a
    CUDA graph; docs/perf.md): combining inside took 0.244 / 0.242-0.250 / 0.377-0.380 ms at 64 /
    256 / 1024 tokens per rank, the kernels after it 0.234-0.236 / 0.234-0.248 / 0.377-0.380:
    inside, one warp reduces a token (the combine kernel gives it a CTA) and most of the
    launch's warps have no token at small T."""
    return overrides.get("ep_fused_combine", False)


def make_single_launch(fused: KernelPlan, spec: MoESpec, target: Target, send_ctas: int, overrides: dict) -> str:
    """Turn the fused gate/up + down launch (built from a gate/up GEMM that waits per M tile for
    its rows, overlap_gemm) into the expert-parallel single launch, everything after layout:
    its first send_ctas CTAs
    send this rank's rows (send_in_gemm), every CTA then takes tiles, claimed in wavefront order
    (the gate/up tiles of wave_lag M tiles ahead of the down tiles: about two rounds of the
    launch's CTAs, so a down tile rarely waits), and each down tile's CTA returns the tile's
    columns of its rows itself once they are stored (ep_return per tile: no return CTAs, no
    counter, no wait); then it waits for the returned rows and combines them (a CTA counts its
    returns before it waits, so no rank's wait depends on another's). One launch of
    target.sms CTAs, all resident, so no CTA that sends or that others wait on is ever held out.
    Returns the Plan's decision text."""
    W = spec.world_size
    send_in_gemm(fused, spec, target, send_ctas)
    # (check_overrides has checked an override's value)
    wave_lag = overrides.get("gemm_fused.wave_lag", -(-2 * target.sms // (spec.intermediate // fused.params["tile_n"])))
    combine = fused_combines(overrides)
    fused.params = dict(fused.params, ep_return=True, return_ctas=0, ep_rows=peer_rows_params(spec),
                        wave_lag=wave_lag, return_row_batch=RETURN_ROW_BATCH, combine=combine,
                        combine_experts=spec.experts, ep_returns_error=EP_ERROR + FLAG_KINDS.index("returns") * 4096)
    K, H = spec.topk, spec.hidden
    if combine:
        fused.args += [KernelArg("ids", "topk_ids", "i32", ["T", K]),
                       KernelArg("weights", "topk_weights", "f32", ["T", K]), KernelArg("pos", "pos", "i32", ["T", K]),
                       KernelArg("out", "out", "bf16", ["T", H]), KernelArg("ret_rows", "ep_ret", "bf16", ["M", H]),
                       KernelArg("ep_flags", "ep_flags", "i32", [len(FLAG_KINDS), W])]
    fused.args += [KernelArg("recv_off", "recv_off", "i32", [spec.local_experts, W + 1]),
                   KernelArg("src_start", "src_start", "i32", [W, spec.local_experts]),
                   KernelArg("ep_state", "ep_state", "i32", [len(STATE)])]  # (peers: among the send's arguments)
    fused.warp_roles = fused.warp_roles + [f"CTAs 0..{send_ctas - 1}: every warp first sends rows to the owners",
                                           "consumer warps, after each down tile: return its columns of its rows"
                                           + ("; once no tile is left and the rows are back: combine token rows"
                                              if combine else "")]
    return (f"gemm_fused (expert parallel; calls up to the fused path's token bound): one launch of {target.sms} CTAs "
            f"between layout and combine: its first {send_ctas} CTAs send this rank's rows, then every CTA takes "
            f"tiles in wavefront order (gate/up tiles {wave_lag} M tiles ahead of the down tiles, about two rounds "
            "of the launch's CTAs: a gate/up tile waits for its expert's rows from every rank, a down tile on "
            "h_ready); each down tile's consumer warps return its columns of its rows to their source ranks once "
            "its stores are complete, so the return is spread over the down tiles with no CTA set aside and "
            "nothing to wait for; then each CTA counts itself and the last raises the returns flags"
            + ("; once every rank's returns flag holds the call's epoch (acquire, system scope, bounded) the "
               "consumer warps combine token rows t = CTA, CTA + grid, ... in the combine kernel's fixed k order"
               if combine else "; the wait and the combine are kernels after it (measured faster than combining "
               "inside it; override ep_fused_combine: true combines inside)"))


def send_in_gemm(gateup: KernelPlan, spec: MoESpec, target: Target, ctas: int) -> None:
    """Make a gate/up GEMM that waits per M tile for its rows (overlap_gemm) send this rank's
    rows itself (templates/grouped_gemm_persistent.py.j2, send_in_gemm): one launch of
    target.sms CTAs, the first ctas of which store the rows into their owners' ep_recv (the
    send kernel's code, templates/ep_rows.py.j2) and then take tiles like the others, so no
    SM idles once the rows are out and no second stream is needed."""
    _, [[source, region]], weights, count_ready, _ = FORWARD_SEND  # (the GEMM names its source send_x)
    gateup.params = dict(gateup.params, send_in_gemm=True, send_ctas=ctas, sms=target.sms,
                         ep_rows=peer_rows_params(spec),
                         ep_send=dict(rows=[["send_x", region]], weights=weights, count_ready=count_ready))
    # after the output h (the single launch's y comes after them; templates/grouped_gemm_persistent.py.j2)
    at = next(i for i, a in enumerate(gateup.args) if a.name == "c") + 1
    gateup.args[at:at] = [KernelArg("send_x", source, "bf16", ["T", spec.hidden])] + send_table_args(spec)
    gateup.grid = f"({target.sms},)"


def send_table_args(spec: MoESpec) -> list[KernelArg]:
    """A send's arguments after its rows: the rank's send order (token, expert), each expert's
    shift on its owner, the rows per expert, the counts so far, the peers' region addresses."""
    E = spec.experts
    return [KernelArg("send_token", "send_token", "i32", ["R"]), KernelArg("send_expert", "send_expert", "i32", ["R"]),
            KernelArg("send_shift", "send_shift", "i32", [E]), KernelArg("counts", "counts", "i32", [E]),
            KernelArg("sent", "sent", "i32", [E]), KernelArg("peers", "ep_peers", "i64", [len(REGIONS), spec.world_size])]


def backward_comm_ctas(spec: MoESpec, target: Target, overrides: dict) -> dict:
    """The backward's copies beside GEMMs, (n, why) each: "send" (x and dout rows, recompute
    path) beside the recompute GEMM; "send_grad" (dout rows) beside dgrad of down and
    "send_x" (x rows) beside dgrad of gate/up (saved path); "return" (input-gradient rows)
    beside the three weight-gradient GEMMs. "forward_send": the forward's (comm_ctas)."""
    K, H, I = spec.topk, spec.hidden, spec.intermediate
    out = {"forward_send": comm_ctas(spec, target, overrides)[0]}
    for key, rows, flops, tail in (("send", 2, 2 * K * H * 2 * I, 1 / spec.local_experts),
                                   ("send_grad", 1, 2 * K * H * I, 1 / spec.local_experts),
                                   ("send_x", 1, 2 * K * H * 2 * I, 0.0),
                                   ("return", 1, 3 * 2 * K * H * I, 0.0)):
        n = _sms_override(overrides, f"bwd_{key}_sms", target)
        out[key] = (n, f"set by override bwd_{key}_sms") if n is not None else \
            overlap_split(1000 * _per_token(spec, rows), 1000 * flops, tail, target)
    return out


def overlap_gemm(gemm: KernelPlan, spec: MoESpec, target: Target, ctas: int) -> None:
    """Make a GEMM over the received rows wait per M tile for its rows (ep_ready) and leave the
    send's ctas SMs free."""
    gemm.params = dict(gemm.params, ep_ready=True, ep_world=spec.world_size,
                       ep_rows_error=EP_ERROR + FLAG_KINDS.index("rows") * 4096)
    at = next(i for i, a in enumerate(gemm.args) if a.name == "tile_counter") + 1
    gemm.args[at:at] = [KernelArg("ready", "ep_ready", "i32", [spec.local_experts, spec.world_size]),
                        KernelArg("state", "ep_state", "i32", [len(STATE)])]
    leave_sms(gemm, target, ctas)


def leave_sms(gemm: KernelPlan, target: Target, ctas: int) -> None:
    """A persistent GEMM's grid on all SMs but ctas (a copy runs on those beside it)."""
    sms = target.sms - ctas
    gemm.params = dict(gemm.params, sms=sms)
    gemm.grid = gemm.grid.replace(f"min({target.sms},", f"min({sms},")


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
        # down_ready[m]: the down GEMM's stored N tiles of M tile m (it returns the tile's rows then)
        Buffer("down_ready", "i32", [_expr(received_tiles(spec, row_tile))], memory="persistent"),
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
               wait_timeout_ns: int, overrides: dict,
               used_slot: int | None = None) -> tuple[list[KernelPlan], list[str], list[dict], int]:
    """(kernels, decisions, queues, communication CTAs) of the forward's exchange stages.
    used_slot: the Plan has the single launch; layout writes its number of used M tiles there
    and zeroes its per-M-tile counts (h_ready)."""
    W, E, El, K, H = spec.world_size, spec.experts, spec.local_experts, spec.topk, spec.hidden
    if W > MAX_WORLD:
        raise PlanError(f"world_size={W}: at most {MAX_WORLD} ranks are planned")
    ctas, why = comm_ctas(spec, target, overrides)
    kernels = exchange_kernels(spec, target, row_tile, n_counters, status_slot, wait_timeout_ns, ctas,
                               threads=comm_threads(overrides), down_ready=gemm_returns(overrides),
                               used_slot=used_slot)
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
        f"communication: {ctas} CTAs send; {why}; " + ("the down GEMM returns its rows itself (see below)"
                                                         if gemm_returns(overrides) else
                                                         f"the return runs after the down GEMM on all {target.sms} SMs"),
        order,
        f"receive layout: by local expert, then source rank, then the source's send order, each expert padded to "
        f"{row_tile} rows: fixed by the counts alone, so the same routing always gives the same rows and bits",
        f"peer workspace per rank for C tokens per rank and RC received rows (default W*C*K: all ranks' rows could "
        f"go to one; a call over a smaller RC is dropped on every rank and reported): ep_recv {rows} x {H} bf16, "
        f"ep_ret {_expr(C * K)} x {H} bf16, h and y as ep_recv; made once per process group and reused",
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


def forward_steps(spec: MoESpec, target: Target, row_tile: int, n_counters: int, status_slot: int,
                  wait_timeout_ns: int, overrides: dict, used_slot: int | None, laid_out: str | None, steps: dict,
                  decisions: list, returns: tuple[int, str] | None,
                  send_ctas: int | None) -> tuple[list[KernelPlan], dict, list[dict], list[str]]:
    """The forward's exchange kernels (ep_kernels) and the forward entries' step lists: the
    single launch's (used_slot: the Plan has it; laid_out: it lays the rows out itself) and
    the per-GEMM path's, whose send runs on a second stream when overlapped. returns: the down
    GEMM returns its rows itself (its CTAs, why). (kernels, SM roles, queues, side stream)."""
    ks, why, queues, ctas = ep_kernels(spec, target, row_tile, n_counters, status_slot, wait_timeout_ns, overrides,
                                       used_slot)
    decisions += why
    sm_roles = ({"compute": target.sms - ctas, "communication": ctas} if overlapped(overrides)
                else {"compute": target.sms, "communication": ctas, "shared": "time-sliced: separate launches"})
    shared_steps = ["shared_gateup", "shared_down"] if spec.shared_intermediate else []
    # The shared expert's GEMMs run while the peers' rows are in flight; overlapped, the
    # send runs on the second stream and gate/up waits per M tile instead of ep_wait_rows.
    sends = gemm_sends(overrides)  # the gate/up launch sends the rows itself
    head = ["dispatch_count", "dispatch_scatter", "ep_publish", "ep_layout"] + ([] if sends else ["ep_send"]) \
        + shared_steps
    side_stream: list[str] = []
    if used_slot is not None:  # small calls: the single launch (dispatches, lays out,) sends, computes and returns
        steps["forward_fused"] = ([] if laid_out else ["dispatch_count", "dispatch_scatter", "ep_publish",
                                                       "ep_layout"]) + ["gemm_fused"] \
            + ([] if fused_combines(overrides) else ["ep_wait_returns", "combine"])
    if overlapped(overrides):  # the send beside gate/up, which waits per M tile
        steps["forward"] = head + ["gemm_gateup", "gemm_down"] + ([] if returns else ["ep_return"]) \
            + ["ep_wait_returns", "combine"]
        if returns:
            decisions.append(f"return inside gemm_down: its last {returns[0]} CTAs return M tiles from the start, the "
                             "others once they have no tile left; an M tile's rows leave when its N tiles are "
                             f"stored (down_ready, release/acquire at GPU scope, bounded); {returns[1]}")
        side_stream = [] if sends else ["ep_send"]
        if sends:
            decisions.append(f"send inside gemm_gateup: its first {send_ctas} CTAs store this rank's rows into "
                             "their owners' ep_recv, then take GEMM tiles like the others")
    else:
        steps["forward"] = head + ["ep_wait_rows", "gemm_gateup", "gemm_down", "ep_return", "ep_wait_returns",
                                   "combine"]
    return ks, sm_roles, queues, side_stream


def backward_exchange(spec: MoESpec, target: Target, row_tile: int, n_counters: int, status_slot: int,
                      wait_timeout_ns: int, overrides: dict, forward: list) -> tuple:
    """The backward's exchange kernels, the SMs of its copies that run beside GEMMs (None
    unless overlapped: one after the other), and the forward's steps (backward_kernels'
    `exchange`)."""
    split = backward_comm_ctas(spec, target, overrides) if overlapped(overrides) else None
    common = (spec, target, row_tile, n_counters, status_slot, wait_timeout_ns)
    threads = comm_threads(overrides, backward=True)
    sends = {what: exchange_kernels(*common, split[f"send_{what}"][0] if split else target.sms, backward=True,
                                    threads=threads, send=what)
             for what in ("grad", "x")}
    return (exchange_kernels(*common, split["send"][0] if split else target.sms, backward=True,
                             return_ctas=split["return"][0] if split else target.sms, threads=threads)
            + sends["grad"] + sends["x"], split, forward)


def layout_params(spec: MoESpec, row_tile: int, status_slot: int, wait_timeout_ns: int, used_slot: int | None,
                  backward: bool = False, down_ready: bool = False) -> dict:
    """What templates/ep_layout_phase.py.j2 (publish and layout) renders from: the same in the
    layout kernel and in the single launch that lays out itself. used_slot: the single
    launch's used M tiles go there, and layout zeroes its per-M-tile counts (h_ready)."""
    return dict(experts=spec.experts, tile_m=row_tile, status_slot=status_slot, wait_timeout_ns=wait_timeout_ns,
                ep_error=EP_ERROR, ep_overflow=EP_ERROR + OVERFLOW_KIND * 4096,
                zero_padding=["ep_recv", "ep_grad"] if backward else [], down_ready=down_ready,
                h_ready=used_slot is not None, used_slot=used_slot or 0)


def layout_in_launch(fused: KernelPlan, spec: MoESpec, dparams: dict, layout: dict, overrides: dict,
                     buffers: list) -> str | None:
    """Make the expert-parallel single launch (make_single_launch) dispatch, publish and lay
    out too (templates/gemm_dispatch_in_launch.py.j2, dispatch_in_launch): one launch from the
    routing to the returned rows. Its CTAs count the global experts, CTA 0 publishes the
    counts, they place the same experts in the send order, wait for every rank's counts and
    lay out the same experts (the dispatch, publish and layout kernels' code, so the same
    positions and bits), each phase ordered by a launch-wide counter (bounded waits). Plan
    override dispatch_in_launch: false keeps those four kernels before it. Returns the Plan's
    decision text, or None when it stays apart."""
    if not overrides.get("dispatch_in_launch", True):
        return None
    K, W = spec.topk, spec.world_size
    sync = dispatch_phase(fused, dparams, buffers, fused_tables=False)
    fused.params["ep_layout"] = dict(layout, h_ready=True, down_ready=False, zero_padding=[])
    combine = fused.params.get("combine")
    fused.args += ([] if combine else [KernelArg("ids", "topk_ids", "i32", ["T", K]),
                                       KernelArg("pos", "pos", "i32", ["T", K])]) \
        + [sync, KernelArg("ep_counts", "ep_counts", "i32", [2, W, spec.experts]),
           KernelArg("recv_counts", "recv_counts", "i32", [spec.local_experts])] \
        + ([] if combine else [KernelArg("ep_flags", "ep_flags", "i32", [len(FLAG_KINDS), W])])
    fused.warp_roles = ["all warps first: count, publish (CTA 0), place and lay out every grid-th global expert"] \
        + fused.warp_roles
    return ("gemm_fused also dispatches, publishes and lays out: its CTAs count every grid-th global expert, CTA 0 "
            "stores the counts into every rank and raises the counts flags, the CTAs place the same experts in "
            "the send order, wait for every rank's counts (acquire, system scope, bounded) and lay out the same "
            "experts (the dispatch, publish and layout kernels' code: the same positions and bits); launch-wide "
            "counters order the phases (bounded waits), so a small expert-parallel call is the launch, the wait "
            "for the returned rows and the combine")


# What a send moves (Plan module, rows as (tensor, region), weights, whether it counts each
# expert's rows for the ready flags, whether it raises the rows flag). The forward's: x rows.
FORWARD_SEND = ("ep", [["x", "ep_recv"]], False, True, True)
# The backward's:
#   all:  the recompute path's one send: x and dout rows and the weights;
#   grad: the saved path's first send, dout rows and weights, which dgrad_down waits for per M tile;
#   x:    its second, the x rows, which only the weight gradients need (after ep_wait_rows).
BACKWARD_SENDS = {
    "all": ("ep_bwd", [["x", "ep_recv"], ["dout", "ep_grad"]], True, True, True),
    "grad": ("ep_bwd_grad", [["dout", "ep_grad"]], True, True, False),
    "x": ("ep_bwd_x", [["x", "ep_recv"]], False, False, True),
}


def exchange_kernels(spec: MoESpec, target: Target, row_tile: int, n_counters: int, status_slot: int,
                     wait_timeout_ns: int, ctas: int, backward: bool = False,
                     return_ctas: int | None = None, threads: int = EP_THREADS,
                     down_ready: bool = False, send: str = "all", used_slot: int | None = None) -> list[KernelPlan]:
    """The exchange kernels (templates/ep_exchange.py.j2), of the forward or of the backward.
    The backward's (module ep_bwd: layout, send and return, named *_bwd) also move each row's
    output gradient and routing weight to the expert's rank, zero the received padding rows,
    and return each row's d_topk_weights entry; it takes publish and the waits from the
    forward's module. send (backward only, BACKWARD_SENDS): "grad" or "x" give that send
    kernel alone (ep_send_bwd_grad, ep_send_bwd_x), in a module of its own."""
    W, E, El, K, H = spec.world_size, spec.experts, spec.local_experts, spec.topk, spec.hidden
    wait_threads = 32 * -(-W // 32)
    module, send_rows, send_weights, count_ready, signal_rows = BACKWARD_SENDS[send] if backward else FORWARD_SEND
    params = dict(peer_rows_params(spec),
                  **layout_params(spec, row_tile, status_slot, wait_timeout_ns, used_slot, backward, down_ready),
                  topk=K, threads=threads, comm_ctas=ctas, return_ctas=return_ctas or target.sms,
                  wait_threads=wait_threads, bwd=backward,
                  send_rows=send_rows, send_weights=send_weights, count_ready=count_ready, signal_rows=signal_rows)
    *_, sent, peers = send_table_args(spec)
    state = KernelArg("state", "ep_state", "i32", [len(STATE)])
    flags = KernelArg("flags", "ep_flags", "i32", [len(FLAG_KINDS), W])
    counters = KernelArg("tile_counters", "tile_counters", "i32", [n_counters])
    recv_off = KernelArg("recv_off", "recv_off", "i32", [El, W + 1])
    src_start = KernelArg("src_start", "src_start", "i32", [W, El])
    suffix = ("_bwd" if send == "all" else f"_bwd_{send}") if backward else ""

    def k(name, entry, args, grid, block, roles):
        stage = "send_peers" if entry in ("publish", "layout", "send", "wait_rows") else "return"
        return KernelPlan(name + suffix, stage, module, "ep_exchange.py.j2", entry, params,
                          args, grid=grid, block=block, warp_roles=roles)

    row_args = [KernelArg(src, src, "bf16", ["T", H]) for src, _ in send_rows]
    if send_weights:
        row_args += [KernelArg("pos", "pos", "i32", ["T", K]), KernelArg("weights", "topk_weights", "f32", ["T", K])]
    moved = " and ".join(f"the {src} rows into {region}" for src, region in send_rows) + (
        ", the weights into ep_recv_w" if send_weights else "")
    send_kernel = k("ep_send", "send", row_args + send_table_args(spec) + [state, counters],
                    f"({ctas},)", threads,
                    [f"every warp: blocks of 32 rows, 16 B per lane: {moved}, on the owners"
                     + ("; per block a fence (system scope) and per-expert counts; the add that completes an expert "
                        "raises its ready flag on the owner" if count_ready else "")
                     + ("; the last CTA raises each owner's rows flag" if signal_rows else "")])
    if backward and send != "all":
        return [send_kernel]
    kernels = [
        k("ep_layout", "layout",
          [KernelArg("ep_counts", "ep_counts", "i32", [2, W, E]), flags, state, counters,
           KernelArg("send_shift", "send_shift", "i32", [E]), recv_off, src_start,
           KernelArg("tile_expert", "tile_expert", "i32", ["MT"]), KernelArg("row_token", "row_token", "i32", ["M"]),
           sent, peers, KernelArg("recv_counts", "recv_counts", "i32", [El])]
          + ([KernelArg("down_ready", "down_ready", "i32", ["MT"])] if down_ready else [])
          + ([KernelArg("h_ready", "h_ready", "i32", ["MT"])] if used_slot is not None else []),
          f"({E},)", threads,
          ["all warps: wait for every rank's counts, then for global expert e: where this rank's rows of e land "
           "on e's owner; the owner's CTAs also write the receive layout (tile table, valid rows, segments)"
           + ("; and zero the padding rows of ep_recv and ep_grad" if backward else "")]),
        send_kernel,
        k("ep_return", "return_rows",
          [KernelArg("y", "dxs" if backward else "y", "bf16", ["M", H])]
          + ([KernelArg("yw", "d_rows", "f32", ["M"])] if backward else [])
          + [KernelArg("row_token", "row_token", "i32", ["M"]),
             KernelArg("tile_expert", "tile_expert", "i32", ["MT"]), recv_off, src_start, peers, state, counters],
          f"({return_ctas or target.sms},)", threads,
          ["every warp: one received row at a time, stored back into its source rank's ep_ret at its send "
           "position" + (" (its d_topk_weights entry into ep_ret_w)" if backward else "")
           + "; the last CTA raises each source's returns flag"]),
    ]
    if not backward:
        kernels[0:0] = [k("ep_publish", "publish", [KernelArg("counts", "counts", "i32", [E]), peers, state], "(1,)",
                          threads, ["all threads: store this rank's counts into every peer's ep_counts; then one "
                                       "thread per peer raises the counts flag (release, system scope)"])]
        kernels[-1:-1] = [k("ep_wait_rows", "wait_rows", [flags, state, counters], "(1,)", wait_threads,
                            ["one thread per rank: spin (acquire, system scope, bounded) until its rows flag holds "
                             "this epoch"])]
        kernels.append(k("ep_wait_returns", "wait_returns", [flags, state, counters], "(1,)", wait_threads,
                         ["one thread per rank: spin (acquire, system scope, bounded) until its returns flag holds "
                          "this epoch"]))
    return kernels
