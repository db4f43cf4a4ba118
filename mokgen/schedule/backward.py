"""The backward's part of the Plan: the training forward's and the backward's kernels
(backward_graph's stages: dgrad of down, SwiGLU backward, dgrad of gate/up, the reverse
combine, the weight gradients as grouped GEMMs over tokens), what the training forward saves,
and whether a Plan has the backward at all. make_plan (plan.py) calls backward_kernels with its
GemmMaker, so these GEMMs are planned exactly as the forward's are.
"""
from __future__ import annotations

from ..ir import MoESpec
from .records import SHARED_ROWS, VEC, WGMMA_ROWS, Buffer, KernelArg, KernelPlan, simt_threads
from .target import Target

# What the training forward hands to autograd for the backward: the SwiGLU inputs (routed,
# shared) and dispatch's tables.
SAVED_FOR_BACKWARD = ("ga", "gb", "sa", "sb", "pos", "row_token", "tile_expert", "counts")
# An expert-parallel training forward saves the SwiGLU inputs only: its receive layout lives in
# the peer workspace, which later layers reuse, so the backward lays the rows out again.
EP_SAVED_FOR_BACKWARD = ("ga", "gb", "sa", "sb")
# The backward's grouped GEMMs, in launch order (each has a tile-counter slot).
BACKWARD_GEMMS = ["gemm_gateup_train", "bwd_recompute", "bwd_dgrad_down", "bwd_dgrad_gateup", "wgrad_down",
                  "wgrad_gate", "wgrad_up"]
SHARED_BACKWARD_GEMMS = ["shared_gateup_train", "bwd_shared_recompute", "bwd_shared_dgrad_down",
                         "bwd_shared_dgrad_gateup", "wgrad_shared_down", "wgrad_shared_gate", "wgrad_shared_up"]
# M tile of the weight-gradient GEMMs (over H or I): both MMA warpgroups.
WGRAD_TILE_M = 2 * WGMMA_ROWS
# The x rows the gate/up weight gradients read in dispatch order (xs) are copied by
# bwd_dgrad_gateup's otherwise idle warps (its producer warpgroup's warps 1..3 from the start,
# its consumer warps once they have no tile left), beside the MMAs instead of in a
# bandwidth-bound kernel of their own (E64 K8 H2048 I1024, T=16384: 1.07 GB read and written).
# Rows per claim (one atomicAdd per warp), and the 16-byte loads each lane keeps in flight:
# producer warps run with few registers (setmaxnreg), consumer warps with many.
COPY_CLAIM_ROWS = 8
COPY_BATCH_PRODUCER = 4
COPY_BATCH_CONSUMER = 8
# Rows (token, slot pairs) per CTA of the SwiGLU backward: one warp each.
SWIGLU_BWD_WARPS = 8


def backward_decision(plan: dict) -> str:
    """The decision that says whether (and how) a Plan (as a dict) has the backward."""
    return next((d for d in plan.get("decisions", []) if d.startswith("backward:")), "backward: not in the Plan")


def backward_support(spec: MoESpec, overrides: dict, paths: str) -> tuple[bool, str]:
    """(whether the Plan has the backward entry points, why)."""
    if overrides.get("profile"):
        return False, "backward: not in a profiling build (it times the forward)"
    if paths == "fused":
        return False, "backward: not with fuse_gemms: true (the training forward runs the per-GEMM path)"
    if spec.world_size > 1:
        return True, ("backward: generated (expert parallel); autograd saves the inputs and the SwiGLU inputs in "
                      "the receive layout (2 x rows x I bf16, rows bounded by the workspace's receive bound), or with "
                      "recompute the inputs only; the backward exchanges again (each pair's dout row, weight and x "
                      "row go to the expert's rank) and returns each pair's input gradient and d_topk_weights entry")
    return True, ("backward: generated; autograd saves the forward's inputs and the SwiGLU inputs (x @ w_gate^T, "
                  "x @ w_up^T in dispatch order), or, with recompute, the inputs only (dispatch runs again either "
                  "way, and the SwiGLU inputs are then recomputed by one gate/up GEMM)")


def backward_kernels(gemm, spec: MoESpec, target: Target, row_tile: int, buffers: list, steps: dict,
                     decisions: list, rows: str, exchange: tuple | None = None, copy_slot: int | None = None) -> list:
    """The training forward's and the backward's kernels (backward_graph's stages) and their
    step lists: steps["forward_train"] (the per-GEMM forward whose gate/up GEMMs also store
    the SwiGLU inputs), steps["backward"] (reads them) and steps["backward_recompute"]
    (recomputes them). The backward dispatches again, then per expert kind (routed, shared):
    dgrad of down, SwiGLU backward, dgrad of gate/up; the reverse combine; the weight
    gradients.

    Expert parallel (exchange: the backward's exchange kernels, and the SMs of its copies that
    run beside GEMMs, or None: one after the other): the routed kernels run on the rows this
    rank receives, whose x and dout rows arrive contiguous (TMA, no gather) with their
    weights; the backward lays the rows out again (later layers reuse the workspace), see
    ep_backward_steps."""
    E, H, I, S = spec.local_experts, spec.hidden, spec.intermediate, spec.shared_intermediate
    ep = spec.world_size > 1
    buffers += [Buffer(n, "bf16", [rows, str(I)]) for n in ("ga", "gb", "g", "da", "db", "hw")]
    buffers += [Buffer(n, "bf16", [rows, str(H)]) for n in (("dxs",) if ep else ("xs", "dxs"))]
    if ep:
        buffers.append(Buffer("d_rows", "f32", [rows]))  # each received row's d_topk_weights entry
    # the routed kernels' x and dout rows: gathered from the tokens, or (expert parallel) received
    x_rows, dout_rows, gather = ("ep_recv", "ep_grad", False) if ep else ("x", "dout", True)
    train = gemm(
        "gemm_gateup_train", "gemm_gateup", "ep_recv" if ep else "x", ("w_gate", "w_up"), ("h", "ga", "gb"), I, H,
        "swiglu_save", "Routed gate/up projection with the SwiGLU epilogue, storing the "
        "SwiGLU inputs too (the training forward).", gather_a=not ep)
    ks = [
        gemm("bwd_recompute", "recompute", x_rows, ("w_gate", "w_up"), ("ga", "gb"), I, H, "pair",
             "Backward: the SwiGLU inputs recomputed, both products stored.",
             gather_a=gather, clustered=False),
        gemm("bwd_dgrad_down", "dgrad_down", dout_rows, ("w_down",), "g", I, H, "store",
             "Backward: the down projection's input gradient (unweighted), dout rows "
             + ("received." if ep else "gathered."), gather_a=gather, b_major="mn", clustered=False),
        swiglu_backward("bwd_swiglu", spec, row_tile, ep=ep),
        gemm("bwd_dgrad_gateup", "dgrad_gateup", ("da", "db"), ("w_gate", "w_up"), "dxs", H, 2 * I, "store",
             "Backward: the gate/up projections' input gradient"
             + ("." if ep else "; its idle warps copy the x rows into dispatch order (xs) meanwhile."),
             b_major="mn", split_k=True, clustered=False, copy_rows=None if ep else ("x", "xs", copy_slot)),
    ]
    # wgrad_down gathers its dout rows (the producer, by cp.async: a 128-wide A tile, 8 copies
    # per thread and stage); wgrad_gate/up read the x rows bwd_dgrad_gateup copies into
    # dispatch order (xs) by TMA. Measured on H200, E64 K8 H2048 I1024, T=16384: gathering their
    # 256-wide B tiles too (16 copies per thread and stage) made each 0.41 ms slower, more
    # than the copy costs (docs/perf.md).
    # Expert parallel: both read the received rows by TMA (their padding rows zeroed by layout).
    counts = "recv_counts" if ep else "counts"
    wgrads = [("wgrad_down", dout_rows, "hw", "d_w_down", H, I, E, "M", counts, "" if ep else "a"),
              ("wgrad_gate", "da", x_rows if ep else "xs", "d_w_gate", I, H, E, "M", counts, ""),
              ("wgrad_up", "db", x_rows if ep else "xs", "d_w_up", I, H, E, "M", counts, "")]
    if S:  # the shared expert: the same kernels with one group over all T tokens, nothing gathered
        train_s = gemm("shared_gateup_train", "shared_gateup", "x", ("ws_gate", "ws_up"), ("hs", "sa", "sb"), S, H,
                       "swiglu_save", "Shared expert gate/up projection storing the SwiGLU inputs too (the "
                       "training forward).", rows=SHARED_ROWS, routed=False)
        buffers += [Buffer(n, "bf16", ["T", str(S)]) for n in ("sa", "sb", "gs", "das", "dbs", "hsb")]
        buffers.append(Buffer("dx_shared", "bf16", ["T", str(H)]))
        ks += [
            gemm("bwd_shared_recompute", "shared_recompute", "x", ("ws_gate", "ws_up"), ("sa", "sb"), S, H, "pair",
                 "Backward: the shared expert's SwiGLU inputs recomputed.", rows=SHARED_ROWS, routed=False),
            gemm("bwd_shared_dgrad_down", "shared_dgrad_down", "dout", ("ws_down",), "gs", S, H, "store",
                 "Backward: the shared down projection's input gradient.", rows=SHARED_ROWS, routed=False,
                 b_major="mn"),
            swiglu_backward("bwd_shared_swiglu", spec, row_tile, shared=True),
            gemm("bwd_shared_dgrad_gateup", "shared_dgrad_gateup", ("das", "dbs"), ("ws_gate", "ws_up"), "dx_shared",
                 H, 2 * S, "store", "Backward: the shared gate/up projections' input gradient.", rows=SHARED_ROWS,
                 routed=False, b_major="mn", split_k=True),
        ]
        wgrads += [("wgrad_shared_down", "dout", "hsb", "d_ws_down", H, S, 1, "T", None, ""),
                   ("wgrad_shared_gate", "das", "x", "d_ws_gate", S, H, 1, "T", None, ""),
                   ("wgrad_shared_up", "dbs", "x", "d_ws_up", S, H, 1, "T", None, "")]
    ks.append(reverse_combine(spec, target))
    for name, a, b, c, m, n, groups, m_sym, counts, gathered in wgrads:  # (counts: the tensor of rows per group)
        k = gemm(name, name, a, (b,), c, n, 64, "store", f"Backward: the weight gradient {c}, "
                 + ("one expert's rows contracted per tile." if counts else "all T token rows contracted per tile."),
                 rows=(counts or "shared_tiles", m_sym, f"{groups}*ceil({m}/{WGRAD_TILE_M})", groups),
                 wgrad_m=m, clustered=False, gather_mn=gathered)
        if not counts:  # one group: its rows are A's rows (T), no counts to read
            k.params["all_rows"] = True
        ks.append(k)
    if ep:
        return ep_backward_steps([train] + ([train_s] if S else []) + ks, *exchange, spec, target, steps, decisions)
    steps["backward_recompute"] = ["dispatch_count", "dispatch_scatter"] + [k.name for k in ks]
    # With the training forward's saved tensors (SAVED_FOR_BACKWARD) the backward neither
    # dispatches again nor recomputes; its tile counters start at zero (the runtime zeroes them).
    steps["backward"] = [k.name for k in ks if not k.name.endswith("recompute")]
    steps["forward_train"] = ["dispatch_count", "dispatch_scatter", "gemm_gateup_train", "gemm_down"] + (
        ["shared_gateup_train", "shared_down"] if S else []) + ["combine"]
    decisions.append(
        "backward: dispatch again (the forward's positions, deterministic); bwd_dgrad_down gathers dout rows against "
        "w_down read MN-major (no transposed copy); bwd_swiglu (one warp per row, fixed shuffle order) writes "
        "d_topk_weights = <g, h>, da, db, hw = w h (zeros on padding rows, so the weight gradients contract nothing "
        "there, whatever dout rows wgrad_down gathers for them); bwd_dgrad_gateup runs K over da|db against "
        "w_gate|w_up, and its idle warps (the producer warpgroup's warps 1..3, then the consumers once no tile is "
        "left) copy the x rows into dispatch order (xs, zeros on padding rows) for wgrad_gate/up, rows claimed from "
        "a counter; "
        "bwd_combine sums dx over k in order" + (" and adds the shared expert's" if S else "") + "; wgrad_* contract "
        "each expert's rows in order in one CTA per output tile: every gradient is bitwise deterministic")
    decisions.append("forward_train (autograd's forward): the per-GEMM path whose gate/up GEMMs also store x @ w^T "
                     "of gate and up (bf16, the bits the backward's recompute GEMMs give: same tile and K order); "
                     "with them and dispatch's tables saved, the backward (steps backward) neither dispatches nor "
                     "recomputes; steps backward_recompute start from the inputs alone, for callers that save memory")
    return [train] + ([train_s] if S else []) + ks


def ep_backward_steps(ks: list, exchange: list, split: dict | None, forward: list, spec: MoESpec, target: Target,
                      steps: dict, decisions: list) -> list:
    """The expert-parallel training entry points. Both dispatch and publish the counts again (a
    new epoch; the same counts give the same receive layout), run the routed kernels on the
    received rows, return each row's input gradient and d_topk_weights entry beside the weight
    gradients, and end with the reverse combine.

    forward_train: the forward, its gate/up GEMM also storing the SwiGLU inputs (ga, gb, in the
    receive layout, sized by the workspace capacity). backward (with them): the dout rows and
    weights go out first, beside bwd_dgrad_down, which waits per M tile for them; the x rows
    after them, beside the SwiGLU backward and bwd_dgrad_gateup; only the gate/up weight
    gradients need them (ep_wait_rows). backward_recompute (inputs only): x rows, dout rows
    and weights in one send beside bwd_recompute, which waits per M tile. With split None
    (ep_overlap: false) each copy runs alone on every SM."""
    from . import expert_parallel

    by_name = {k.name: k for k in ks}
    shared = [k.name for k in ks if "shared" in k.name and not k.name.endswith("_train")]
    shared_kept = [n for n in shared if not n.endswith("recompute")]
    wgrads = ["wgrad_down", "wgrad_gate", "wgrad_up"]
    tail = ["ep_return_bwd"] + wgrads + ["ep_wait_returns", "bwd_combine"]
    head = ["dispatch_count", "dispatch_scatter", "ep_publish", "ep_layout_bwd"]
    steps["forward_train"] = [{"gemm_gateup": "gemm_gateup_train", "shared_gateup": "shared_gateup_train"}.get(n, n)
                              for n in forward]
    routed = ["bwd_dgrad_down", "bwd_swiglu", "bwd_dgrad_gateup"]
    if split:
        expert_parallel.overlap_gemm(by_name["gemm_gateup_train"], spec, target, split["forward_send"])
        if "ep_send" not in forward:  # the forward's gate/up launch sends its rows: the training one too
            expert_parallel.send_in_gemm(by_name["gemm_gateup_train"], spec, target, split["forward_send"])
        expert_parallel.overlap_gemm(by_name["bwd_recompute"], spec, target, split["send"][0])
        # dgrad_down waits per M tile for the dout rows; in the recompute path they are all
        # there by then (bwd_recompute waited for the same flags), so the wait costs nothing
        expert_parallel.overlap_gemm(by_name["bwd_dgrad_down"], spec, target, split["send_grad"][0])
        for name in wgrads:
            expert_parallel.leave_sms(by_name[name], target, split["return"][0])
        steps["backward_recompute"] = head + ["ep_send_bwd"] + shared + ["bwd_recompute"] + routed + tail
        steps["backward"] = head + ["ep_send_bwd_grad", "ep_send_bwd_x"] + shared_kept + routed + \
            ["ep_return_bwd", "wgrad_down", "ep_wait_rows", "wgrad_gate", "wgrad_up", "ep_wait_returns", "bwd_combine"]
        decisions += [
            f"backward send (saved path): {split['send_grad'][0]} SMs move the dout rows and weights beside "
            f"bwd_dgrad_down; {split['send_grad'][1]}; then {split['send_x'][0]} SMs the x rows beside the SwiGLU "
            f"backward and bwd_dgrad_gateup; {split['send_x'][1]}",
            f"backward send (recompute path): {split['send'][0]} SMs beside bwd_recompute (x and dout rows); "
            f"{split['send'][1]}",
            f"backward return: {split['return'][0]} SMs beside the weight gradients; {split['return'][1]}"]
    else:
        steps["backward_recompute"] = head + ["ep_send_bwd"] + shared + ["ep_wait_rows", "bwd_recompute"] + routed \
            + tail
        steps["backward"] = head + ["ep_send_bwd"] + shared_kept + ["ep_wait_rows"] + routed + tail
    decisions.append(
        "backward (expert parallel): autograd's forward saves the SwiGLU inputs in the receive layout (ga, gb); the "
        "backward dispatches and publishes again (the same counts, the same layout), stores each pair's dout row "
        "into the expert's rank's ep_grad, its weight into ep_recv_w and its x row into ep_recv; there "
        "bwd_dgrad_down (dout rows by TMA), bwd_swiglu per received row (d_topk_weights entry into d_rows), "
        "bwd_dgrad_gateup; ep_return_bwd stores each row's input gradient into the source's ep_ret and its "
        "d_rows entry into ep_ret_w" + (" beside" if split else ", then") + " wgrad_*, which contract the received "
        "rows (padding rows zeroed by ep_layout_bwd); bwd_combine sums dx over k in order"
        + (" plus the shared expert's" if spec.shared_intermediate else "") + " and gathers d_topk_weights: every "
        "gradient bitwise deterministic. recompute=True saves the inputs only and recomputes ga, gb there "
        "(bwd_recompute)")
    return exchange + ks


def swiglu_backward(name: str, spec: MoESpec, row_tile: int, shared: bool = False, ep: bool = False) -> KernelPlan:
    """The SwiGLU backward (templates/swiglu_backward.py.j2) of the routed experts (rows in
    dispatch order: weights, d_topk_weights, padding rows) or of the shared expert (rows = tokens)."""
    K, H, width = spec.topk, spec.hidden, spec.shared_intermediate if shared else spec.intermediate
    threads = SWIGLU_BWD_WARPS * 32
    R, names = ("T", ("gs", "sa", "sb", "das", "dbs", "hsb")) if shared else ("M", ("g", "ga", "gb", "da", "db", "hw"))
    if ep:  # received rows: the weight arrived with the row, d_topk_weights goes back with it
        args = [KernelArg("row_token", "row_token", "i32", ["M"]), KernelArg("tile_expert", "tile_expert", "i32", ["MT"]),
                KernelArg("weights", "ep_recv_w", "f32", ["M"])]
    elif shared:
        args = []
    else:
        args = [KernelArg("row_token", "row_token", "i32", ["M"]),
                              KernelArg("tile_expert", "tile_expert", "i32", ["MT"]),
                              KernelArg("pos", "pos", "i32", ["T", K]),
                              KernelArg("weights", "topk_weights", "f32", ["T", K])]
    args += [KernelArg(a, t, "bf16", [R, width]) for a, t in zip(("g", "ga", "gb"), names[:3])]
    args += [KernelArg(a, t, "bf16", [R, width]) for a, t in zip(("da", "db", "hw"), names[3:])]
    if ep:
        args.append(KernelArg("d_weights", "d_rows", "f32", ["M"]))
    elif not shared:
        args.append(KernelArg("d_weights", "d_topk_weights", "f32", ["T", K]))
    return KernelPlan(name, "swiglu_backward", name, "swiglu_backward.py.j2", "main",
                      dict(topk=K, hidden=H, intermediate=width, threads=threads, vec=VEC, tile_m=row_tile,
                           shared=shared, ep=ep),
                      args, grid=f"(ceil({R}/{SWIGLU_BWD_WARPS}),)", block=threads,
                      warp_roles=["every warp: one row at a time" + ("" if shared else
                                                                      "; padding rows get zeros")])


def reverse_combine(spec: MoESpec, target: Target) -> KernelPlan:
    """dx[t] = sum over k in order of the input gradients of t's rows (+ the shared expert's)."""
    K, H, S = spec.topk, spec.hidden, spec.shared_intermediate
    ep = spec.world_size > 1  # the rows came back into ep_ret, with their d_topk_weights in ep_ret_w
    threads = simt_threads(H, target)
    args = [KernelArg("ids", "topk_ids", "i32", ["T", K]), KernelArg("pos", "pos", "i32", ["T", K]),
            KernelArg("y", "ep_ret" if ep else "dxs", "bf16", ["M", H])]
    if S:
        args.append(KernelArg("ys", "dx_shared", "bf16", ["T", H]))
    args.append(KernelArg("out", "dx", "bf16", ["T", H]))
    if ep:
        args += [KernelArg("yw", "ep_ret_w", "f32", ["M"]), KernelArg("d_weights", "d_topk_weights", "f32", ["T", K])]
    return KernelPlan("bwd_combine", "reduce", "bwd_combine", "combine.py.j2", "main",
                      dict(experts=spec.experts if ep else spec.local_experts, topk=K, hidden=H, threads=threads,
                           vec=VEC, shared=bool(S), weighted=False, dweights=ep),
                      args, grid="(T,)", block=threads, warp_roles=["all warps: one token row, fixed k order"])
