import dataclasses
import json
import math
import random
import re

import pytest
import sympy

from mokgen.ir import PRESETS, MoESpec, forward_graph
from mokgen.schedule import H200, Plan, PlanError, choose_gemm_tiling, make_plan
from mokgen.schedule.gemms import SWAP_GATHER_LAG, SWAP_GATHER_LAG_MAX_ROWS
from mokgen.schedule.plan import check_plan
from mokgen.schedule.single_launch import L2_EVICT_LAST, SWAP_ROWS, per_gemm_bands, spilled_tile
from mokgen.schedule.tiling import SWAP_ACC_MAX

SPECS = list(PRESETS.values()) + [MoESpec(experts=40, topk=6, hidden=1536, intermediate=640),
                                  MoESpec(experts=1, topk=1, hidden=64, intermediate=64)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
def test_plan_is_deterministic_and_round_trips(spec):
    a, b = make_plan(spec), make_plan(spec)
    assert a.to_json() == b.to_json()
    again = Plan.from_dict(a.to_dict())
    assert again.to_json() == a.to_json()
    check_plan(again, forward_graph(spec))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
def test_plan_invariants(spec):
    p = make_plan(spec)
    assert p.sm_roles["compute"] == H200.sms and p.queues == []
    for k in p.kernels:
        assert k.block <= 1024 and k.block % 32 == 0
        assert k.smem_bytes <= H200.smem_per_block
        if k.template == "grouped_gemm_persistent.py.j2":
            prm = k.params
            accs = 2 if prm["epilogue"] == "swiglu" else 1
            # accumulator registers per thread stay within the 128-register budget (swapped
            # tiles: SWAP_ACC_MAX, check_swap_tiling)
            assert prm["tile_m"] * prm["tile_n"] * accs // (128 * prm["mma_warpgroups"]) <= (
                SWAP_ACC_MAX if prm.get("swap") else 128)
            # (the single launch's bands by T lay their rows out in their own tiles)
            assert prm["tile_m"] == (int(k.name.split("_")[2][1:]) if k.name.startswith("gemm_fused_n") else p.row_tile)
            assert bool(prm.get("swap")) == k.name.startswith("gemm_fused_n")
    for entry, steps in p.steps.items():
        assert all(any(k.name == s for k in p.kernels) for s in steps)
    assert p.steps["forward"][-1] == "combine"
    assert ("shared_gateup" in p.steps["forward"]) == bool(spec.shared_intermediate)


def test_register_splits_stay_within_the_ctas_pool():
    # setmaxnreg moves registers within what a CTA was given at launch: 384 threads hold 168
    # each (64512), not the SM's 65536; a 48 / 232 split waited for ever on the GPU
    assert H200.register_pool(384) == 168 * 384
    H200.check_register_split("GEMM", 40, 128, 232, 256)
    H200.check_register_split("GEMM", 56, 128, 224, 256)
    with pytest.raises(ValueError, match="holds 64512"):
        H200.check_register_split("GEMM", 48, 128, 232, 256)
    for spec in SPECS + [MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, dtype="fp8")]:
        for k in make_plan(spec).kernels:
            prm = k.params
            if "producer_regs" in prm and "consumer_regs" in prm:
                consumers = k.block - 128
                assert prm["producer_regs"] * 128 + prm["consumer_regs"] * consumers <= H200.register_pool(k.block), k.name


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
def test_routed_row_bound_holds_for_any_routing(spec):
    """The padded row buffer sized from T alone holds every possible routing."""
    p = make_plan(spec)
    T = sympy.Symbol("T", integer=True, nonnegative=True)
    tiles = {b.name: b for b in p.buffers}["tile_expert"]
    rng = random.Random(0)
    E, K = spec.local_experts, spec.topk
    for tokens in (1, 7, 1000, 4097):
        m_tiles = int(sympy.sympify(tiles.shape[0], locals={"T": T}).subs(T, tokens))
        for _ in range(20):
            counts = [0] * E
            for _ in range(tokens):
                for e in rng.sample(range(E), K):
                    counts[e] += 1
            assert sum(math.ceil(c / p.row_tile) for c in counts) <= m_tiles


EP2 = MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, world_size=2, topology="nvlink")


def test_expert_parallel_plan_moves_rows_through_peer_queues():
    p = make_plan(EP2)
    fwd = p.steps["forward"]
    # the exchange brackets the GEMMs; nothing waits before it has published
    assert fwd[:5] == ["dispatch_count", "dispatch_scatter", "ep_publish", "ep_layout", "ep_send"]
    # the send runs beside gate/up, whose producer waits for each expert's rows
    assert fwd[-4:] == ["gemm_gateup", "gemm_down", "ep_wait_returns", "combine"]
    # the down GEMM returns its rows itself: its last CTAs from the start, per M tile
    down = p.kernel("gemm_down").params
    assert down["ep_return"] and down["sms"] == 132 and p.kernel("gemm_down").grid == "(132,)"
    assert 1 <= down["return_ctas"] <= 124 and "down_ready" in {a.tensor for a in p.kernel("gemm_down").args}
    assert "down_ready" in {a.tensor for a in p.kernel("ep_layout").args}  # zeroed per call there
    assert make_plan(EP2, overrides={"return_sms": 30}).kernel("gemm_down").params["return_ctas"] == 30
    assert p.side_stream[0] == "ep_send" and p.kernel("gemm_gateup").params["ep_ready"]
    assert p.kernel("gemm_gateup").params["sms"] + p.kernel("ep_send").params["comm_ctas"] == 132
    serial = make_plan(EP2, overrides={"ep_overlap": False})
    assert "ep_wait_rows" in serial.steps["forward"] and not serial.side_stream
    assert "ep_return" in serial.steps["forward"] and not serial.kernel("gemm_down").params.get("ep_return")
    assert not serial.kernel("gemm_gateup").params.get("ep_ready")
    assert "forward_fused" not in serial.steps  # the single launch sends and returns inside the GEMMs
    mem = {b.name: b.memory for b in p.buffers}
    assert {n for n, m in mem.items() if m == "symmetric"} == {"ep_counts", "ep_flags", "ep_recv", "ep_ret", "ep_ready",
                                                               "ep_grad", "ep_recv_w", "ep_ret_w"}
    assert mem["h"] == mem["y"] == mem["tile_expert"] == "persistent" and mem["pos"] == "call"
    assert mem["ep_ready"] == "symmetric"
    # what a rank receives is bounded by the workspace's RC (default W*C*K), what it sends by C
    shapes = {b.name: b.shape for b in p.buffers}
    assert "RC" in shapes["ep_recv"][0] and "C" not in shapes["ep_recv"][0].replace("RC", "")
    assert shapes["ep_ret"][0] == "8*C" and "RC" in shapes["ga"][0]
    # dispatch groups by global expert, one row per tile; the GEMMs see local experts
    assert p.kernel("dispatch_count").params["experts"] == 64 and p.kernel("dispatch_count").params["tile_m"] == 1
    assert p.kernel("gemm_gateup").params["groups"] == 32 and not p.kernel("gemm_gateup").params["gather_a"]
    assert p.kernel("combine").params["experts"] == 64
    n = p.kernel("ep_send").params["comm_ctas"]
    assert p.sm_roles == {"compute": 132 - n, "communication": n} and len(p.queues) == 3
    assert p.kernel("dispatch_scatter").params["order_world"] == 2
    assert any("expert parallel over 2 GPUs" in d for d in p.decisions)
    assert json.loads(Plan.from_dict(json.loads(p.to_json())).to_json()) == json.loads(p.to_json())


def test_expert_parallel_gate_up_launch_can_send_its_rows_itself():
    """Plan override gemm_sends: no send kernel and no second stream in the forward; the gate/up
    GEMMs (forward and training) run on every SM, their first CTAs send the rows."""
    p = make_plan(EP2, overrides={"gemm_sends": True})
    default = make_plan(EP2)
    for entry, gemm in (("forward", "gemm_gateup"), ("forward_train", "gemm_gateup_train")):
        assert "ep_send" not in p.steps[entry] and "ep_send" in default.steps[entry]
        k = p.kernel(gemm)
        assert k.params["send_in_gemm"] and k.params["ep_ready"] and k.params["sms"] == 132 and k.grid == "(132,)"
        assert k.params["send_ctas"] == default.kernel("ep_send").params["comm_ctas"]
        assert {"x", "send_token", "send_expert", "send_shift", "counts", "sent", "ep_peers"} <= \
            {a.tensor for a in k.args}
    assert "ep_send" not in p.side_stream and "ep_send_bwd_grad" in p.side_stream
    assert any(d.startswith("send inside gemm_gateup") for d in p.decisions)
    assert "gemm_sends" not in str(default.decisions) and not default.kernel("gemm_gateup").params.get("send_in_gemm")


def test_expert_parallel_backward_exchanges_again_and_runs_on_the_received_rows():
    p = make_plan(EP2)
    bwd = p.steps["backward_recompute"]
    assert bwd[:5] == ["dispatch_count", "dispatch_scatter", "ep_publish", "ep_layout_bwd", "ep_send_bwd"]
    assert bwd[-2:] == ["ep_wait_returns", "bwd_combine"]
    # the send runs beside the recompute GEMM, which waits per M tile for its rows; the return
    # beside the weight gradients, each on the SMs the cost model gives it
    assert "ep_wait_rows" not in bwd and bwd.index("bwd_recompute") < bwd.index("ep_return_bwd") < bwd.index("wgrad_down")
    assert {"ep_send_bwd", "ep_send_bwd_grad", "ep_send_bwd_x", "ep_return_bwd"} <= set(p.side_stream)
    send, ret = p.kernel("ep_send_bwd").params["comm_ctas"], p.kernel("ep_return_bwd").params["return_ctas"]
    assert p.kernel("bwd_recompute").params["ep_ready"] and p.kernel("bwd_recompute").params["sms"] == 132 - send
    assert all(p.kernel(w).params["sms"] == 132 - ret for w in ("wgrad_down", "wgrad_gate", "wgrad_up"))
    assert any(d.startswith(f"backward send (recompute path): {send} SMs") and "cost model" in d for d in p.decisions)
    # ep_overlap: false runs each copy alone on every SM, the GEMMs after ep_wait_rows
    serial = make_plan(EP2, overrides={"ep_overlap": False})
    sb = serial.steps["backward_recompute"]
    assert sb.index("ep_send_bwd") < sb.index("ep_wait_rows") < sb.index("bwd_recompute") and not serial.side_stream
    assert serial.kernel("ep_send_bwd").params["comm_ctas"] == 132 and not serial.kernel("bwd_recompute").params.get("ep_ready")
    assert make_plan(EP2, overrides={"bwd_send_sms": 40}).kernel("ep_send_bwd").params["comm_ctas"] == 40
    # the saved path: the training forward stores the SwiGLU inputs (received rows by TMA, waiting
    # per M tile like gate/up); its backward sends the dout rows and weights first, beside dgrad
    # of down (which waits per M tile), then the x rows, which only the gate/up weight
    # gradients wait for
    train = p.kernel("gemm_gateup_train")
    assert p.steps["forward_train"][p.steps["forward"].index("gemm_gateup")] == "gemm_gateup_train"
    assert train.params["ep_ready"] and not train.params["gather_a"] and train.args[0].tensor == "ep_recv"
    bs = p.steps["backward"]
    assert "bwd_recompute" not in bs and bs.index("ep_send_bwd_grad") < bs.index("ep_send_bwd_x") < bs.index("bwd_dgrad_down")
    assert bs.index("wgrad_down") < bs.index("ep_wait_rows") < bs.index("wgrad_gate")
    assert p.kernel("bwd_dgrad_down").params["ep_ready"]
    grad, xs = p.kernel("ep_send_bwd_grad"), p.kernel("ep_send_bwd_x")
    assert [a.tensor for a in grad.args[:3]] == ["dout", "pos", "topk_weights"] and not grad.params["signal_rows"]
    assert xs.args[0].tensor == "x" and not xs.params["count_ready"] and xs.params["signal_rows"]
    assert grad.module == "ep_bwd_grad" and xs.module == "ep_bwd_x"
    # more rows in flight per SM for the backward's copies (measured); comm_threads sets both
    assert p.kernel("ep_send_bwd").block == 512 and p.kernel("ep_send").block == 256
    assert make_plan(EP2, overrides={"comm_threads": 1024}).kernel("ep_return_bwd").block == 1024
    with pytest.raises(PlanError, match="comm_threads"):
        make_plan(EP2, overrides={"comm_threads": 300})
    # nothing of the forward's layout is used: the forward entries never touch the backward's regions
    forward_tensors = {a.tensor for n in p.steps["forward"] for a in p.kernel(n).args}
    assert not forward_tensors & {"ep_grad", "ep_recv_w", "ep_ret_w", "d_rows", "ga"}
    send = p.kernel("ep_send_bwd")
    assert send.module == "ep_bwd" and send.params["bwd"]
    assert [a.tensor for a in send.args[:4]] == ["x", "dout", "pos", "topk_weights"]
    assert p.kernel("ep_layout_bwd").params["zero_padding"] == ["ep_recv", "ep_grad"]
    assert [a.tensor for a in p.kernel("ep_return_bwd").args[:2]] == ["dxs", "d_rows"]
    # received rows by TMA, no gathers; the weight gradients count the received rows
    assert not p.kernel("bwd_recompute").params["gather_a"] and p.kernel("bwd_recompute").args[0].tensor == "ep_recv"
    assert p.kernel("bwd_dgrad_down").args[0].tensor == "ep_grad"
    for name, operand in (("wgrad_down", "ep_grad"), ("wgrad_gate", "ep_recv"), ("wgrad_up", "ep_recv")):
        k = p.kernel(name)
        assert operand in {a.tensor for a in k.args} and not k.params["gather_mn"]
        assert "recv_counts" in {a.tensor for a in k.args}
    assert p.kernel("bwd_swiglu").params["ep"]
    combine = p.kernel("bwd_combine")
    assert combine.params["dweights"] and combine.params["experts"] == 64
    assert [a.tensor for a in combine.args][-2:] == ["ep_ret_w", "d_topk_weights"]


def test_communication_sms_come_from_the_cost_model():
    """The copy beside a GEMM gets the SMs where the two finish together: fewer and the copy
    is late, more and the GEMM slows; the choice does not depend on T (both scale with it)."""
    from mokgen.schedule.expert_parallel import overlap_split

    t = H200
    n, why = overlap_split(134e6, 550e9, 0.0, t)
    copy = lambda k: 134e6 / (min(k * t.peer_store_gbs_per_sm, t.peer_store_gbs) * 1e9)
    gemm = lambda k: 550e9 / (t.grouped_gemm_tflops * 1e12) * t.sms / (t.sms - k)
    assert copy(n) <= gemm(n) and copy(n - 1) > gemm(n - 1) and "cost model" in why
    assert overlap_split(2 * 134e6, 2 * 550e9, 0.0, t)[0] == n
    # more bytes per FLOP need more SMs; the forward's send for the bench layer is in the
    # measured sweet spot (8 SMs: 2.58 ms, 16: 2.13, 32: 2.35 at 8192 tokens per rank)
    assert overlap_split(2 * 134e6, 550e9, 0.0, t)[0] > n
    assert 10 <= make_plan(EP2).kernel("ep_send").params["comm_ctas"] <= 20


def test_expert_parallel_plans_for_an_nvl72_domain_and_takes_comm_sms():
    p = make_plan(MoESpec(experts=288, topk=8, hidden=7168, intermediate=2048, shared_intermediate=2048,
                          world_size=72, topology="nvlink"), overrides={"comm_sms": 16})
    assert p.kernel("ep_send").params["world"] == 72 and p.kernel("ep_send").params["comm_ctas"] == 16
    assert p.kernel("ep_wait_returns").block == 96  # one thread per rank, whole warps
    assert p.steps["forward"].index("shared_down") < p.steps["forward"].index("gemm_gateup")
    with pytest.raises(PlanError, match="comm_sms"):
        make_plan(EP2, overrides={"comm_sms": 500})
    with pytest.raises(PlanError, match="not generated for world_size > 1"):
        make_plan(EP2, overrides={"cluster_m": 2})
    with pytest.raises(PlanError, match="fuse_gemms: true is not generated for several GPUs"):
        make_plan(EP2, overrides={"fuse_gemms": True})


def test_expert_parallel_small_calls_run_one_launch_then_wait_and_combine():
    """Up to fused_max_tokens tokens per rank the forward is one GEMM launch that dispatches,
    publishes, lays out, sends, computes gate/up and down and returns, then the wait and the
    combine; no second stream. Override dispatch_in_launch: false keeps dispatch, publish and
    layout as kernels before it; the layout then zeroes the launch's per-M-tile counts and
    writes its tile range."""
    p = make_plan(EP2)
    assert p.steps["forward_fused"] == ["gemm_fused", "ep_wait_returns", "combine"]
    apart = make_plan(EP2, overrides={"dispatch_in_launch": False})
    assert apart.steps["forward_fused"] == ["dispatch_count", "dispatch_scatter", "ep_publish", "ep_layout",
                                            "gemm_fused", "ep_wait_returns", "combine"]
    assert "dispatch" not in apart.kernel("gemm_fused").params
    # in the launch: the dispatch kernels' params (global experts, send order) and the layout
    # kernel's (the same template code renders both)
    k = p.kernel("gemm_fused")
    d, lay = k.params["dispatch"], k.params["ep_layout"]
    assert d["experts"] == 64 and d["order_world"] == 2 and d["tile_m"] == 1 and not d["fused"]
    assert d["threads"] == k.params["threads"] and d["sync_counters"] == 5
    kernel_layout = p.kernel("ep_layout").params
    assert all(kernel_layout[key] == lay[key] for key in ("experts", "tile_m", "status_slot", "wait_timeout_ns",
                                                          "ep_error", "ep_overflow", "h_ready", "used_slot"))
    assert lay["used_slot"] == k.params["used_slot"] and not lay["down_ready"] and not lay["zero_padding"]
    # the template's argument order: after the return's tables, the routing, the launch's
    # counters, the count matrix, the receive counts and the flags
    assert [a.tensor for a in k.args][-7:] == ["ep_state", "topk_ids", "pos", "launch_sync", "ep_counts",
                                               "recv_counts", "ep_flags"]
    assert {b.name: b.memory for b in p.buffers}["launch_sync"] == "state"
    assert any(x.startswith("gemm_fused also dispatches, publishes and lays out") for x in p.decisions)
    assert p.fused_max_tokens > 0 and not set(p.steps["forward_fused"]) & set(p.side_stream)
    k = p.kernel("gemm_fused")
    assert k.params["fused"] and k.params["ep_ready"] and k.params["send_in_gemm"] and k.params["ep_return"]
    assert k.params["return_ctas"] == 0 and k.params["sms"] == 132 and k.grid == "(132,)"
    assert not k.params["combine"]
    # ep_fused_combine: it also waits for the returned rows and combines them (global ids, the returned rows)
    inside = make_plan(EP2, overrides={"ep_fused_combine": True})
    assert inside.steps["forward_fused"][-1] == "gemm_fused"
    kc = inside.kernel("gemm_fused")
    assert kc.params["combine"] and kc.params["combine_experts"] == 64
    names_c = [a.tensor for a in kc.args]
    assert names_c.index("h_ready") < names_c.index("out") < names_c.index("ep_ret") < names_c.index("recv_off")
    assert k.params["send_ctas"] == p.kernel("ep_send").params["comm_ctas"]
    # the template's argument order: ..., h, the send's tables, y, h_ready, the return's tables
    names = [a.tensor for a in k.args]
    assert names.index("h") < names.index("send_token") < names.index("y") < names.index("h_ready") \
        < names.index("recv_off") and names.count("ep_peers") == 1 and names[0] == "ep_recv"
    assert "down_ready" not in names  # each down tile returns its own part: nothing to count
    # wavefront order: about two rounds of the launch's CTAs of gate/up tiles ahead of the down tiles
    assert k.params["wave_lag"] == 33 and k.params["tile_n"] == 128
    layout = p.kernel("ep_layout")
    assert "h_ready" in {a.tensor for a in layout.args} and layout.params["used_slot"] == k.params["used_slot"]
    assert not p.kernel("dispatch_scatter").params["fused"]  # (dispatch makes the send order here)
    mem = {b.name: b.memory for b in p.buffers}
    assert mem["h_ready"] == mem["down_ready"] == "persistent"
    assert any(d.startswith("gemm_fused (expert parallel") for d in p.decisions)
    # left out: on request, without overlap, and (for now) with a shared expert
    off = make_plan(EP2, overrides={"fuse_gemms": False})
    assert "forward_fused" not in off.steps and "gemm_fused" not in {x.name for x in off.kernels}
    assert "h_ready" not in {a.tensor for a in off.kernel("ep_layout").args}
    shared = make_plan(MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=512,
                               world_size=2, topology="nvlink"))
    assert "forward_fused" not in shared.steps and any("shared expert's tiles" in d for d in shared.decisions)
    assert "forward_fused" not in make_plan(EP2, overrides={"gemm_returns": False}).steps
    # overrides of the single launch where there is none are refused, not ignored
    with pytest.raises(PlanError, match="ep_fused_combine: this Plan has no single launch"):
        make_plan(EP2, overrides={"fuse_gemms": False, "ep_fused_combine": True})
    with pytest.raises(PlanError, match="ep_fused_combine: the layer is not expert parallel"):
        make_plan(MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024), overrides={"ep_fused_combine": True})
    with pytest.raises(PlanError, match="gemm_fused.wave_lag: this Plan has no single launch"):
        make_plan(EP2, overrides={"ep_overlap": False, "gemm_fused.wave_lag": 4})
    with pytest.raises(PlanError, match="wave_lag"):
        make_plan(EP2, overrides={"gemm_fused.wave_lag": -1})


def test_tiling_decisions():
    t = choose_gemm_tiling(1024, 2048, "swiglu", H200)
    assert (t["tile_m"], t["tile_n"], t["tile_k"]) == (128, 128, 64) and t["stages"] == 4
    t = choose_gemm_tiling(2048, 1024, "store", H200)
    assert t["tile_n"] == 256
    assert choose_gemm_tiling(640, 1536, "swiglu", H200)["tile_n"] == 128
    assert choose_gemm_tiling(1536 + 64, 640, "store", H200)["tile_n"] == 64


def test_gather_lag_that_would_deadlock_is_refused():
    spec = PRESETS["olmoe"]
    stages = make_plan(spec).kernel("gemm_gateup").params["stages"]
    assert 1 <= make_plan(spec).kernel("gemm_gateup").params["gather_lag"] <= stages - 2
    with pytest.raises(PlanError, match="deadlock"):
        make_plan(spec, overrides={"gemm_gateup.gather_lag": stages - 1})


def test_swapped_tiles_gather_lag():
    """Swapped tiles of up to SWAP_GATHER_LAG_MAX_ROWS token rows keep two gathered stages in
    flight where their stages allow it (never more than stages - 2); the band's override sets it
    and an illegal one is refused."""
    spec = PRESETS["olmoe"]
    plan = make_plan(spec)
    for k in plan.kernels:
        p = k.params
        if p.get("swap"):
            want = SWAP_GATHER_LAG if p["tile_m"] <= SWAP_GATHER_LAG_MAX_ROWS else 1
            assert p["gather_lag"] == min(want, max(p["stages"] - 2, 1)), k.name
            assert 1 <= p["gather_lag"] <= max(p["stages"] - 2, 1)
    assert plan.kernel("gemm_fused_n64").params["gather_lag"] == 2
    assert plan.kernel("gemm_fused_n160").params["gather_lag"] == 1
    assert make_plan(spec, overrides={"gemm_fused_n96.gather_lag": 2}).kernel("gemm_fused_n96_routed").params["gather_lag"] == 2
    with pytest.raises(PlanError, match="deadlock"):
        make_plan(spec, overrides={"gemm_fused_n160.gather_lag": 3})


def test_swapped_tiles_weights_evict_first():
    """The swapped tiles (an expert's rows in one tile: each weight byte read once) load their
    weights evict-first in L2; the plain launch, whose experts' second M tiles reuse the weights
    from L2, does not; override weights_evict_first: false turns it off."""
    spec = PRESETS["olmoe"]
    marked = {k.name for k in make_plan(spec).kernels if k.params.get("weights_evict_first")}
    assert marked == {k.name for k in make_plan(spec).kernels if k.params.get("swap") and k.params.get("fused")}
    assert "gemm_fused_n160_routed" in marked and "gemm_fused" not in marked
    assert not any(k.params.get("weights_evict_first")
                   for k in make_plan(spec, overrides={"weights_evict_first": False}).kernels)
    with pytest.raises(PlanError):
        make_plan(spec, overrides={"weights_evict_first": 1})


def test_swapped_tiles_rows_evict_last():
    """The swapped tiles' h and y rows (read again by the down tiles and the combine) are loaded and
    stored evict-last in L2; the plain launch's are not; override rows_evict_last: false turns it off."""
    spec = PRESETS["olmoe"]
    plan = make_plan(spec)
    marked = {k.name for k in plan.kernels if k.params.get("rows_evict_last")}
    assert marked == {k.name for k in plan.kernels if k.params.get("swap") and k.params.get("fused")}
    assert "gemm_fused_n64_routed" in marked and "gemm_fused" not in marked
    assert {k.params["rows_l2_policy"] for k in plan.kernels if k.name in marked} == {L2_EVICT_LAST}
    assert any("evict-last" in d for d in plan.decisions)
    assert not any(k.params.get("rows_evict_last") for k in make_plan(spec, overrides={"rows_evict_last": False}).kernels)
    with pytest.raises(PlanError):
        make_plan(spec, overrides={"rows_evict_last": "yes"})


def test_discard_consumed_marks_the_swapped_tiles_early_combines():
    """The single launch's swapped bands (and their routing twins) drop the y lines their early
    combine read last, and h's (in the larger bands as soon as an M tile's down tiles are stored);
    the plain 128-row launch, a layer with a shared expert (no early combine) and the per-GEMM
    kernels do not; override discard_consumed: false turns it off."""
    spec = PRESETS["olmoe"]
    plan = make_plan(spec)
    marked = {k.name for k in plan.kernels if k.params.get("discard_consumed")}
    assert marked == {k.name for k in plan.kernels if k.params.get("combine_early") and k.params.get("swap")}
    assert {"gemm_fused_n16", "gemm_fused_n160", "gemm_fused_n48_routed"} <= marked and "gemm_fused" not in marked
    assert {k.params["discard_what"] for k in plan.kernels if k.name in marked} == {"all"}
    # h's lines by the M tile's last down tile in the bands of 96 rows and more, by the combine in
    # the smaller; discard_h_early: true or false decides for every band.
    early = {k.name for k in plan.kernels if k.params.get("discard_h_early")}
    assert early == {k.name for k in plan.kernels if k.name in marked and k.params["tile_m"] >= 96}
    assert {"gemm_fused_n96", "gemm_fused_n160_routed"} <= early and "gemm_fused_n80" not in early
    for value in (True, False):
        forced = make_plan(spec, overrides={"discard_h_early": value})
        assert {k.name for k in forced.kernels if k.params.get("discard_h_early")} == (marked if value else set())
        assert {k.name for k in forced.kernels if k.params.get("discard_consumed")} == marked
    assert any("discard.global.L2" in d for d in plan.decisions)
    off = make_plan(spec, overrides={"discard_consumed": False})
    assert not any(k.params.get("discard_consumed") for k in off.kernels)
    shared = MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=768)
    assert not any(k.params.get("discard_consumed") for k in make_plan(shared).kernels)
    with pytest.raises(PlanError):
        make_plan(spec, overrides={"discard_consumed": 1})
    with pytest.raises(PlanError):
        make_plan(spec, overrides={"discard_what": "some"})
    with pytest.raises(PlanError):
        make_plan(spec, overrides={"discard_h_early": "yes"})


def test_single_launches_claim_late_where_the_tile_loop_model_says():
    """A single launch (the bands and the routing twins too) claims its next tile once its current
    tile's loads are issued where the tile-loop model predicts the loop claimed ahead at least
    CLAIM_LATE_MIN_GAIN longer somewhere in the T it serves (Mixtral-8x7B, E40 K6: measured faster,
    docs/perf.md); elsewhere (OLMoE, E256, E32), with a shared expert, and in the per-GEMM and
    dispatch kernels, a tile ahead. Override claim_late turns it on or off."""
    from mokgen.schedule.single_launch import CLAIM_LATE_MIN_GAIN

    def late(spec, **ov):
        return {k.name for k in make_plan(spec, overrides=ov).kernels if k.params.get("claim_late")}

    def fused(spec):
        return {k.name for k in make_plan(spec).kernels if k.name.startswith("gemm_fused")}

    mixtral, olmoe = PRESETS["mixtral-8x7b"], PRESETS["olmoe"]
    e40 = MoESpec(experts=40, topk=6, hidden=1536, intermediate=640)
    plan = make_plan(mixtral)
    assert late(mixtral) == fused(mixtral) and late(e40) == fused(e40)
    assert {"gemm_fused", "gemm_fused_routed", "gemm_fused_n64", "gemm_fused_n160_routed"} <= late(mixtral)
    why = next(d for d in plan.decisions if "claims its next tile" in d)
    gain = float(why.split("the tile-loop model: ")[1].split("x")[0])
    assert gain >= CLAIM_LATE_MIN_GAIN
    for spec in (olmoe, MoESpec(experts=256, topk=8, hidden=7168, intermediate=2048),
                 MoESpec(experts=32, topk=8, hidden=2048, intermediate=1024), PRESETS["deepseek-v2-lite"]):
        assert late(spec) == set(), spec
    assert late(mixtral, claim_late=False) == set()
    assert late(olmoe, claim_late=True) == fused(olmoe)
    assert late(EP2) == set() and late(EP2, claim_late=True) == {"gemm_fused"}
    with pytest.raises(PlanError, match="true or false"):
        make_plan(mixtral, overrides={"claim_late": 1})


def test_weight_pairs_where_two_k_blocks_fit():
    """Weight pairs (the TMA thread loads two 64-wide K blocks' weights together) go to the swapped
    tiles of 64-wide K blocks whose every K is a whole number of pairs and whose stages leave one
    to spare beside the lagged gathers (else the producer would wait on itself); never to the
    16- and 32-row tiles' 128-wide K blocks nor the plain launch. Override weight_pairs: true asks for
    them wherever they fit, false for none."""
    spec = PRESETS["olmoe"]

    def paired(plan):
        return {k.name for k in plan.kernels if k.params.get("weight_pairs")}

    on = make_plan(spec, overrides={"weight_pairs": True})
    assert paired(on) == {f"gemm_fused_n{n}{t}" for n in (48, 64, 80, 96, 112, 144, 160) for t in ("", "_routed")}
    for k in on.kernels:
        if k.params.get("weight_pairs"):
            assert k.params["tile_k"] == 64 and k.params["gather_lag"] <= k.params["stages"] - 3
    assert any("two 64-wide K blocks" in d for d in on.decisions)
    # By default where measured to pay: tiles of up to 64 token rows in layers with a long weight
    # stream (not E40 K6 H1536 I640, 1.5 gate/up tiles per SM).
    assert paired(make_plan(spec)) == {f"gemm_fused_n{n}{t}" for n in (48, 64) for t in ("", "_routed")}
    e40 = MoESpec(experts=40, topk=6, hidden=1536, intermediate=640)
    assert not paired(make_plan(e40)) and "gemm_fused_n64" in paired(make_plan(e40, overrides={"weight_pairs": True}))
    assert not paired(make_plan(spec, overrides={"weight_pairs": False}))
    # A lag that leaves no stage to spare, and an odd number of K blocks, keep single loads.
    lagged = make_plan(spec, overrides={"weight_pairs": True, "gemm_fused_n64.gather_lag": 3})
    assert "gemm_fused_n64" not in paired(lagged) and "gemm_fused_n96" in paired(lagged)
    odd = MoESpec(experts=64, topk=8, hidden=2048, intermediate=576)  # 9 K blocks of 64 in the down tiles
    assert not paired(make_plan(odd, overrides={"weight_pairs": True}))
    with pytest.raises(PlanError):
        make_plan(spec, overrides={"weight_pairs": 1})


def test_combine_early_waits_per_token():
    """By default (override combine_early: true) every single launch that combines (the bands and their routing
    twins) claims its combine tasks from a tile counter of its own and waits per token for the
    down tiles of its rows (counted in h_ready); not with a shared expert (every token needs all
    of ys) nor over several GPUs (the returned rows have their own wait)."""
    spec = PRESETS["olmoe"]
    on = make_plan(spec)  # (the default)
    early = [k for k in on.kernels if k.params.get("combine_early")]
    combining = [k for k in on.kernels if k.params.get("fused") and k.params.get("combine")]
    assert early and early == combining
    slots = int(next(b for b in on.buffers if b.name == "tile_counters").shape[0])
    (slot,) = {k.params["combine_slot"] for k in early}
    taken = {k.params[key] for k in on.kernels for key in ("sched_slot", "used_slot", "done_slot") if key in k.params}
    assert slot < slots - 1 and slot not in taken  # a counter of its own, before the status slot
    assert any("waits until the M tiles of the token's rows" in d for d in on.decisions)
    assert not [k for k in make_plan(spec, overrides={"combine_early": False}).kernels if k.params.get("combine_early")]
    shared = MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=768)
    assert not [k for k in make_plan(shared, overrides={"combine_early": True}).kernels
                if k.params.get("combine_early")]
    with pytest.raises(PlanError):
        make_plan(spec, overrides={"combine_early": "yes"})


def test_overrides_are_checked_and_recorded():
    spec = PRESETS["olmoe"]
    p = make_plan(spec, overrides={"gemm_down.tile_n": 128}, override_source="a test")
    assert p.kernel("gemm_down").params["tile_n"] == 128 and p.overrides == {"gemm_down.tile_n": 128}
    assert any("from a test" in d for d in p.decisions)
    for bad in ({"gemm_down.tile_m": 64}, {"gemm_down.raster": "x"}, {"row_tile": 96}, {"gemm_gateup.tile_n": 256}):
        with pytest.raises(PlanError):
            make_plan(spec, overrides=bad)


def test_tuning_candidates_and_record(tmp_path):
    import json

    from mokgen.codegen.build import resolve_plan
    from mokgen.tune import candidates, record_path, winner

    spec = PRESETS["olmoe"]
    cands = candidates(spec)
    assert cands[0] == {} and len(cands) == len({json.dumps(c, sort_keys=True) for c in cands})
    for c in cands:
        make_plan(spec, overrides=c)  # every candidate is a legal Plan
    assert winner(tmp_path, spec) is None and resolve_plan(spec, tmp_path).overrides == {}
    path = record_path(tmp_path, spec.variant)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(dict(format=1, spec=spec.to_dict(), winner=cands[1], device="H200", tokens=[4096])))
    plan = resolve_plan(spec, tmp_path)
    assert plan.overrides == cands[1] and any("tuning/" in d for d in plan.decisions)
    assert resolve_plan(spec, tmp_path, overrides={}).overrides == {}


def test_tune_survives_failing_candidates(tmp_path):
    import json

    from mokgen.tune import run, tuning_dir

    spec = PRESETS["olmoe"]
    root = tuning_dir(tmp_path, spec.variant)
    root.mkdir(parents=True)
    (root / "candidates.json").write_text(json.dumps([{}, {"gemm_down.tile_n": 128}]))
    lines = []
    with pytest.raises(RuntimeError, match="no candidate passed"):
        run(spec, tmp_path, [64], log=lines.append, timeout_s=120)
    assert len(lines) == 2 and all("FAILED" in line for line in lines)


def test_a_stopped_tuning_run_resumes_after_the_candidates_it_timed(tmp_path):
    """mokgen tune keeps each candidate's result in progress.json as it goes; the next run on the
    same GPU, T and candidates keeps those and times only the rest (here the second candidate,
    which fails: no build), then writes the record atomically and drops the progress file. A
    progress file from other candidates is not trusted, and a torn record is a clear error."""
    import json

    from mokgen.schedule.records import PlanError
    from mokgen.tune import progress_path, record_path, run, tuning_dir, winner

    spec = PRESETS["olmoe"]
    root = tuning_dir(tmp_path, spec.variant)
    root.mkdir(parents=True)
    cands = [{}, {"gemm_down.tile_n": 128}]
    (root / "candidates.json").write_text(json.dumps(cands))
    first = dict(overrides={}, eligible=True, ms={"64": 0.2}, rel_err=1e-3, score_ms=0.2)
    progress_path(tmp_path, spec.variant).write_text(
        json.dumps(dict(device="no GPU", tokens=[64], candidates=cands, results=[first])))
    lines = []
    record = run(spec, tmp_path, [64], log=lines.append, timeout_s=120)
    assert "timed before, kept" in lines[0] and "FAILED" in lines[1]
    assert record["winner"] == {} and record["candidates"][0] == first and not record["candidates"][1]["eligible"]
    assert not progress_path(tmp_path, spec.variant).exists()
    assert json.loads(record_path(tmp_path, spec.variant).read_text())["winner"] == {}
    assert not list(record_path(tmp_path, spec.variant).parent.glob(".*.tmp"))
    # other candidates than the progress file's: every one timed again (both fail here)
    progress_path(tmp_path, spec.variant).write_text(
        json.dumps(dict(device="no GPU", tokens=[64], candidates=[{}], results=[first])))
    lines = []
    with pytest.raises(RuntimeError, match="no candidate passed"):
        run(spec, tmp_path, [64], log=lines.append, timeout_s=120)
    assert "timed again" in lines[0] and sum("FAILED" in line for line in lines) == 2
    record_path(tmp_path, spec.variant).write_text('{"format": 1, "spec"')
    with pytest.raises(PlanError, match="not a readable tuning record"):
        winner(tmp_path, spec)


def test_tune_paths_points_ranges_and_record(tmp_path):
    """`mokgen tune --paths`: points in every band of the single launch, at most PATHS_STEP apart;
    a point gives the T of its band nearest to it to the per-GEMM path where that was faster by
    more than PATHS_MARGIN with the same bits; the record applies on top of the candidate
    search's winner only where it was measured against that winner's Plan."""
    import json

    from mokgen.codegen.build import resolve_plan
    from mokgen.show import format_plan
    from mokgen.tune import (PATHS_STEP, path_tokens, paths_record_path, per_gemm_ranges, plan_key, record_path,
                             run_paths, winner)

    spec = PRESETS["mixtral-8x7b"]
    bands = make_plan(spec).launch_bands
    pts = path_tokens(bands)
    assert pts == sorted(set(pts)) and pts[-1] <= bands[-1][0]
    a = 0
    for b, _ in bands:  # every band has a point, and its points are at most PATHS_STEP apart
        mine = [t for t in pts if a < t <= b]
        assert mine and all(y / x <= PATHS_STEP * 1.01 for x, y in zip(mine, mine[1:])), (a, b, mine)
        a = b

    def point(T, entry, ms, forward, same=True):
        return dict(T=T, entry=entry, ms={entry: ms, "forward": forward}, same_bits=same)
    toy = [[34, "a"], [82, "b"], [2048, "c"]]
    got = per_gemm_ranges(toy, [point(20, "a", 1, 1.1), point(30, "a", 1, 0.9), point(60, "b", 1, 0.97),
                                point(100, "c", 1, 0.5), point(500, "c", 1, 0.5, same=False),
                                point(1500, "c", 1, 0.99)])
    assert got == [[26, 300]]  # (0.99: within the margin; other bits: never)
    assert per_gemm_ranges(toy, []) == []

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    path = paths_record_path(tmp_path, spec.variant, h100)
    assert path.name == f"{spec.variant}.paths.h100-80gb-hbm3.json"
    path.parent.mkdir(parents=True)
    rec = dict(format=1, spec=spec.to_dict(), device=h100, base_overrides={}, per_gemm_tokens=[[340, 440]])
    # measured in other kernels than today's Plan gives (a default changed since): stale, not applied
    for key in (None, "0" * 16):
        path.write_text(json.dumps({**rec, "plan_key": key}))
        with pytest.warns(UserWarning, match="tune .* --paths. again"):
            assert winner(tmp_path, spec) is None
    rec["plan_key"] = plan_key(spec, {})
    path.write_text(json.dumps(rec))
    assert winner(tmp_path, spec) == ({"per_gemm_tokens_on": {h100: [[340, 440]]}},
                                      f"tuning/{path.name} ({h100})")
    # one record per GPU model; mokgen 0.1's unnamed record is read first, a named one of its GPU replaces it
    paths_record_path(tmp_path, spec.variant, h200).write_text(json.dumps({**rec, "device": h200,
                                                                          "per_gemm_tokens": [[700, 900]]}))
    (tmp_path / "tuning" / f"{spec.variant}.paths.json").write_text(json.dumps({**rec, "per_gemm_tokens": [[1, 9]]}))
    assert winner(tmp_path, spec)[0] == {"per_gemm_tokens_on": {h100: [[340, 440]], h200: [[700, 900]]}}
    plan = resolve_plan(spec, tmp_path).to_dict()
    assert plan["launch_bands"] == make_plan(spec).to_dict()["launch_bands"]  # as planned on other GPUs
    assert forward_entry_of(plan, 400, h100) == forward_entry_of(plan, 800, h200) == "forward"
    assert forward_entry_of(plan, 800, h100) == forward_entry_of(plan, 400, h200) == forward_entry_of(plan, 400) \
        != "forward"
    assert any(h200 in line and "700-900" in line for line in format_plan(plan).splitlines())
    # a candidate winner other than the Plan the paths were measured in: the paths record is not applied
    for p in (tmp_path / "tuning").glob("*.paths.*"):
        p.unlink()
    record_path(tmp_path, spec.variant).write_text(json.dumps(dict(
        format=1, spec=spec.to_dict(), winner={"fused_small": False}, device="H100", tokens=[4096])))
    assert winner(tmp_path, spec)[0] == {"fused_small": False}
    path.write_text(json.dumps({**rec, "base_overrides": {"fused_small": False},
                                "plan_key": plan_key(spec, {"fused_small": False})}))
    assert winner(tmp_path, spec)[0] == {"fused_small": False, "per_gemm_tokens_on": {h100: [[340, 440]]}}
    with pytest.raises(PlanError, match="per_gemm_tokens_on"):
        make_plan(spec, overrides={"per_gemm_tokens_on": {h100: [[5, 1]]}})
    with pytest.raises(FileNotFoundError, match="not built"):
        run_paths(spec, tmp_path / "nothing")


def forward_entry_of(plan, tokens: int, gpu: str = "another GPU") -> str:
    """The entry a call of `tokens` takes on GPU model `gpu` (the runtime's bands_on_this_gpu)."""
    from mokgen.runtime.variant import bands_on_this_gpu, forward_entry

    return forward_entry(bands_on_this_gpu(plan if isinstance(plan, dict) else plan.to_dict(), gpu), tokens)


@pytest.mark.parametrize("spec", [PRESETS["olmoe"], MoESpec(experts=16, topk=4, hidden=1024, intermediate=512,
                                                            shared_intermediate=768)], ids=lambda s: s.variant)
def test_gemm_tile_schedulers_have_their_own_counter_zeroed_before_them(spec):
    p = make_plan(spec)
    # (the fused launch's routing twin shares its slot: one of the two runs per call)
    twins = tuple(k.name for k in p.kernels if k.name.startswith("gemm_fused_"))
    gemms = [k for k in p.kernels if k.template == "grouped_gemm_persistent.py.j2" and k.name not in twins]
    for twin in twins:
        if twin in {k.name for k in p.kernels}:
            assert p.kernel(twin).params["sched_slot"] == p.kernel("gemm_fused").params["sched_slot"]
    slots = [k.params["sched_slot"] for k in gemms]
    counters = next(b for b in p.buffers if b.name == "tile_counters")
    # One counter per GEMM (both forward paths' GEMMs), the fused launch's used-M-tile and
    # shared-tile counts, then the launch's error code (status_slot).
    assert sorted(slots) == list(range(len(gemms)))
    fused = p.kernel("gemm_fused").params
    assert fused["used_slot"] == len(gemms) and fused["status_slot"] == int(counters.shape[0]) - 1
    assert {k.params["status_slot"] for k in gemms} == {int(counters.shape[0]) - 1}
    assert p.fused_max_tokens > 0
    # status: the runtime's launch behind every call that mirrors the error code to host memory
    assert p.kernel("status_mirror").params["status_slot"] == fused["status_slot"]
    assert set(p.steps) == {"forward", "forward_fused", "forward_routed", "route", "route_backward", "status"} | (
        {"forward_train", "backward", "backward_recompute"}) | (
        {f"forward{r}_n{n}" for n in SWAP_ROWS for r in ("", "_routed")} if not spec.shared_intermediate
        else set())
    for entry, forward in p.steps.items():
        if entry.startswith("route") or entry == "status":
            continue
        if "tile_counters" in p.zeroed.get(entry, ()):  # zeroed by the runtime before the entry's kernels
            assert "dispatch_count" not in forward
            continue
        if len(forward) == 1 and forward[0] in ("gemm_fused",) + twins:  # it dispatches: its CTA 0 zeroes them first
            assert p.kernel(forward[0]).params["dispatch"]
            continue
        zeroing = [s for s in forward if any(a.tensor == "tile_counters" for a in p.kernel(s).args)
                   and p.kernel(s).template in ("dispatch.py.j2", "dispatch_chunked.py.j2")]
        assert zeroing[0] == "dispatch_count"
        assert all(forward.index("dispatch_count") < forward.index(k.name) for k in gemms if k.name in forward)
    # Routed GEMMs find half-empty tiles through row_token; the shared expert's through T.
    for k in gemms:
        assert k.params["valid_rows"] == ("counts" if k.name.startswith("wgrad") else
                                          "m_rows" if "shared" in k.name else "row_token")
        # (A weight-gradient GEMM takes row_token when it gathers an operand's rows.)
        assert any(a.tensor == "row_token" for a in k.args) == (k.params["valid_rows"] == "row_token"
                                                                or bool(k.params.get("gather_mn")))


def test_profiling_build_gives_every_forward_kernel_a_task_record_buffer():
    spec = MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=768)
    plain, prof = make_plan(spec), make_plan(spec, overrides={"profile": True})
    assert not any(b.name.startswith("prof_") for b in plain.buffers)
    bufs = {b.name: b for b in prof.buffers}
    for name in prof.steps["forward"]:
        k = prof.kernel(name)
        assert k.params.get("profile") and k.args[-1].name == "prof" and k.args[-1].tensor == f"prof_{name}"
        assert bufs[f"prof_{name}"].init == "zeros" and bufs[f"prof_{name}"].shape[1] == "3"
    assert not prof.kernel("route").params.get("profile")  # not part of the forward
    # Every forward path records: the per-GEMM kernels, the single launch, its bands by T (not
    # the routing twins, which run the same tiles).
    assert prof.steps["forward_fused"] == ["gemm_fused"] and prof.kernel("gemm_fused").params["profile"]
    assert not prof.kernel("gemm_fused_routed").params["profile"]
    assert "prof_gemm_fused" in bufs and "prof_gemm_fused_routed" not in bufs
    olmoe = make_plan(PRESETS["olmoe"], overrides={"profile": True})
    small = olmoe.kernel("gemm_fused_n32")
    assert small.params["profile"] and small.args[-1].tensor == "prof_gemm_fused_n32"
    assert not olmoe.kernel("gemm_fused_n32_routed").params["profile"]
    rows = sympy.sympify(next(b for b in olmoe.buffers if b.name == "prof_gemm_fused_n32").shape[0])
    assert rows.subs("T", 64) == (math.ceil(64 * 8 / 32) + 64) * (1024 // small.params["tile_n"]
                                                                  + small.params["n2_tiles"]) + 2 * olmoe.target["sms"]
    # One row per task: GEMM tiles bound the routed and shared GEMMs' records.
    rows = sympy.sympify(bufs["prof_gemm_down"].shape[0])
    k = prof.kernel("gemm_down")
    assert rows.subs("T", 1000) == (math.ceil(1000 * 4 / prof.row_tile) + 16) * math.ceil(1024 / k.params["tile_n"])
    with pytest.raises(PlanError, match="true or false"):
        make_plan(spec, overrides={"profile": 1})


def test_single_launch_combine_spreads_each_row_over_warps():
    """The single launch's combine may split a token row into parts of 32 lanes x VEC columns
    (any divisor of hidden / 256 in bf16), so a small call's few rows reach every CTA's warps;
    expert parallel keeps whole rows."""
    from mokgen.schedule.records import VEC
    from mokgen.schedule.single_launch import combine_parts

    assert 32 * VEC == 256 and combine_parts(2048) == [1, 2, 4, 8] and combine_parts(1536) == [1, 2, 3, 6]
    assert combine_parts(32 * VEC + 64) == [1]  # not a whole number of parts: whole rows only
    p = make_plan(PRESETS["olmoe"])
    for name in ("gemm_fused", "gemm_fused_n32", "gemm_fused_routed", "gemm_fused_n32_routed"):
        assert p.kernel(name).params["combine_parts"] == [1, 2, 4, 8], name
    ep = make_plan(MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, world_size=2, topology="nvlink"),
                   overrides={"ep_fused_combine": True})
    assert ep.kernel("gemm_fused").params["combine"] and ep.kernel("gemm_fused").params["combine_parts"] == [1]
    # how far a lane's pieces are unrolled: the Plan's constant, or the override, in every launch that combines
    from mokgen.schedule.single_launch import COMBINE_UNROLL

    names = ("gemm_fused", "gemm_fused_n32", "gemm_fused_routed", "gemm_fused_n32_routed")
    assert all(p.kernel(n).params["combine_unroll"] == COMBINE_UNROLL for n in names)
    four = make_plan(PRESETS["olmoe"], overrides={"combine_unroll": 4})
    assert all(four.kernel(n).params["combine_unroll"] == 4 for n in names)
    assert "combine_unroll" not in four.kernel("gemm_gateup").params
    for bad in (0, 9, True):
        with pytest.raises(PlanError, match="combine_unroll"):
            make_plan(PRESETS["olmoe"], overrides={"combine_unroll": bad})


def test_small_launch_counts_every_expert_in_each_cta():
    """The launches of small calls (up to 48 rows per expert on average, and their routing twins)
    count every expert's pairs in each CTA; the others dispatch by chunks of pairs, with a
    launch-wide counter; the override sets both."""
    names = ("gemm_fused", "gemm_fused_routed", "gemm_fused_n32", "gemm_fused_n32_routed")
    p = make_plan(PRESETS["olmoe"])
    assert [p.kernel(n).params["dispatch"]["local_count"] for n in names] == [False, False, True, True]
    assert p.kernel("gemm_fused_n64").params["dispatch"]["local_count"]  # (T <= 375: 47 rows per expert)
    assert not p.kernel("gemm_fused_n96").params["dispatch"]["local_count"]
    for value in (True, False):
        q = make_plan(PRESETS["olmoe"], overrides={"launch_local_count": value})
        assert all(q.kernel(n).params["dispatch"]["local_count"] is value for n in names)
    with pytest.raises(PlanError, match="launch_local_count"):
        make_plan(PRESETS["olmoe"], overrides={"launch_local_count": 1})
    # The 128-row launch counts and places by chunks of pairs; launch_chunked sets that for every
    # single launch, or leaves each CTA an expert (the phases before it).
    assert [bool(p.kernel(n).params["dispatch"].get("chunk")) for n in names] == [True, True, False, False]
    every = make_plan(PRESETS["olmoe"], overrides={"launch_chunked": True})
    assert all(every.kernel(n).params["dispatch"]["chunk"] == every.kernel(n).block for n in names)
    assert not any(every.kernel(n).params["dispatch"]["local_count"] for n in names)
    hist = next(b for b in every.buffers if b.name == "launch_hist")  # sized by the smaller chunk
    assert sympy.sympify(hist.shape[0]).subs("T", 100) == math.ceil(800 / every.kernel("gemm_fused").block)
    experts = make_plan(PRESETS["olmoe"], overrides={"launch_chunked": False})
    assert not any(experts.kernel(n).params["dispatch"].get("chunk") for n in names)
    assert [experts.kernel(n).params["dispatch"]["local_count"] for n in names] == [False, False, True, True]
    with pytest.raises(PlanError, match="launch_chunked"):
        make_plan(PRESETS["olmoe"], overrides={"launch_chunked": "yes"})


def test_fused_gemms_plan_links_the_tiles_through_counters():
    spec = PRESETS["olmoe"]
    p = make_plan(spec, overrides={"fuse_gemms": True})
    assert p.steps["forward"] == ["gemm_fused"]  # it dispatches and combines too: one launch
    assert "combine" not in [k.name for k in p.kernels]  # nothing unused is built
    k = p.kernel("gemm_fused")
    assert [a.tensor for a in k.args] == ["x", "row_token", "w_gate", "w_up", "tile_expert", "tile_counters",
                                          "w_down", "h", "y", "h_ready", "topk_ids", "topk_weights", "pos", "out",
                                          "counts", "launch_sync", "launch_hist", "status_host"]  # (its last CTA mirrors the status)
    sync = next(b for b in p.buffers if b.name == "launch_sync")
    assert sync.memory == "state" and sync.shape == ["5"]  # counted, placed, passed, routed, laid out (EP)
    # Its dispatch phase runs by chunks of pairs, one step of the launch's threads each (E64 K8:
    # T*K <= 2048*8 pairs fit one chunk per SM), with one histogram row per chunk.
    assert k.params["dispatch"]["chunk"] == k.block and not k.params["dispatch"]["local_count"]
    hist = next(b for b in p.buffers if b.name == "launch_hist")
    assert sympy.sympify(hist.shape[0]).subs("T", 1000) == math.ceil(8000 / k.block) and hist.shape[1] == "65"
    assert any("every grid-th chunk of 384 pairs" in d for d in p.decisions)
    by_expert = make_plan(spec, overrides={"fuse_gemms": True, "launch_chunked": False})
    assert "chunk" not in by_expert.kernel("gemm_fused").params["dispatch"]
    assert not any(b.name == "launch_hist" for b in by_expert.buffers)
    assert any("every grid-th expert's pairs" in d for d in by_expert.decisions)
    # The chunks' scratch lives in the launch's A stages: where it would not fit (E1024's 64-row
    # launch), the launch dispatches by experts.
    wide = make_plan(MoESpec(experts=1024, topk=8, hidden=2048, intermediate=1024)).kernel("gemm_fused")
    assert "chunk" not in wide.params["dispatch"]
    routed = p.kernel("gemm_fused_routed")
    assert p.steps["forward_routed"] == ["gemm_fused_routed"] and routed.params["route"]["experts"] == spec.experts
    assert [a.tensor for a in routed.args] == [a.tensor for a in k.args][:-1] + ["logits", "status_host"]
    assert k.params["dispatch"]["experts"] == spec.experts and k.params["dispatch"]["threads"] == k.block
    assert any(d.startswith("gemm_fused also dispatches") for d in p.decisions)
    # dispatch_in_launch: false keeps the two dispatch kernels before the launch.
    apart = make_plan(spec, overrides={"fuse_gemms": True, "dispatch_in_launch": False})
    assert apart.steps["forward"] == ["dispatch_count", "dispatch_scatter", "gemm_fused"]
    assert "dispatch" not in apart.kernel("gemm_fused").params
    assert not any(b.name == "launch_sync" for b in apart.buffers)
    with pytest.raises(PlanError, match="dispatch_in_launch: this Plan has no single launch"):
        make_plan(spec, overrides={"fuse_gemms": False, "dispatch_in_launch": True})
    with pytest.raises(PlanError, match="true or false"):
        make_plan(spec, overrides={"dispatch_in_launch": 1})
    broken = make_plan(spec, overrides={"fuse_gemms": True, "debug_break_dispatch": True})
    assert broken.kernel("gemm_fused").params["dispatch"]["debug_break"]
    with pytest.raises(PlanError, match="does not dispatch"):
        make_plan(spec, overrides={"dispatch_in_launch": False, "debug_break_dispatch": True})
    assert k.params["fused"] and k.params["n2_tiles"] == spec.hidden // (2 * k.params["tile_n"])
    # Where the launch does not dispatch, dispatch_scatter zeroes h_ready and publishes the
    # number of used M tiles.
    assert [a.tensor for a in apart.kernel("dispatch_scatter").args][-2:] == ["tile_counters", "h_ready"]
    counters = next(b for b in p.buffers if b.name == "tile_counters")
    assert k.params["combine"] and k.params["done_slot"] == k.params["used_slot"] + 1
    # (then the early combine's task counter and the count of finished CTAs)
    assert k.params["combine_slot"] == k.params["used_slot"] + 2 and k.params["finished_slot"] == k.params["used_slot"] + 3
    assert int(counters.shape[0]) == k.params["used_slot"] + 5 == k.params["status_slot"] + 1
    # A profiling build is the same launch (it dispatches and combines): each CTA records its
    # dispatch and combine phases in the rows before the tiles'.
    prof = make_plan(spec, overrides={"fuse_gemms": True, "profile": True})
    assert prof.steps["forward"] == ["gemm_fused"] and prof.kernel("gemm_fused").params["combine"]
    rows = sympy.sympify(next(b for b in prof.buffers if b.name == "prof_gemm_fused").shape[0])
    m_tiles = math.ceil(1000 * spec.topk / prof.row_tile) + spec.experts
    n_tiles = spec.intermediate // k.params["tile_n"] + k.params["n2_tiles"]
    assert rows.subs("T", 1000) == m_tiles * n_tiles + 2 * prof.target["sms"]
    cands = __import__("mokgen.tune", fromlist=["candidates"]).candidates(spec)
    assert {"fuse_gemms": True} in cands and {"cluster_m": 2} in cands and {"dispatch_chunked": False} in cands
    assert {"row_tile": 64 if p.row_tile == 128 else 128} in cands  # (small calls may pay for the other)
    with pytest.raises(PlanError, match="multiple of"):
        make_plan(MoESpec(experts=8, topk=2, hidden=192, intermediate=128), overrides={"fuse_gemms": True})


def test_fused_launch_runs_the_shared_experts_tiles_too():
    spec = MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=768)
    p = make_plan(spec, overrides={"fuse_gemms": True})
    assert p.steps["forward"] == ["gemm_fused"]
    assert not any(k.name.startswith("shared_") for k in p.kernels)
    k = p.kernel("gemm_fused")
    assert [a.tensor for a in k.args][-13:-8] == ["ws_gate", "ws_up", "ws_down", "hs", "ys"]
    assert k.params["s_size"] == 768 and k.params["shared_slot"] == k.params["used_slot"] + 1
    counters = next(b for b in p.buffers if b.name == "tile_counters")
    assert int(counters.shape[0]) == k.params["status_slot"] + 1 == k.params["done_slot"] + 3 == k.params["shared_slot"] + 4
    assert not k.params.get("combine_early") and k.params["finished_slot"] == k.params["done_slot"] + 1
    tasks = make_plan(spec, overrides={"fuse_gemms": True, "profile": True}).buffers
    prof = next(b for b in tasks if b.name == "prof_gemm_fused")  # room for the shared tiles' records
    assert int(sympy.sympify(prof.shape[0]).subs("T", 128)) >= 9 * (512 // 128 + 4) + (768 // 128 + 4)
    with pytest.raises(PlanError, match="shared expert"):
        make_plan(MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=192),
                  overrides={"fuse_gemms": True})


def test_cluster_plan_pairs_an_experts_m_tiles():
    p = make_plan(PRESETS["olmoe"], overrides={"cluster_m": 2})
    assert p.kernel("gemm_gateup").params["cluster_m"] == 2 and p.kernel("gemm_down").params["cluster_m"] == 2
    assert p.kernel("dispatch_scatter").params["tile_align"] == 2
    bound = sympy.sympify(next(b for b in p.buffers if b.name == "tile_expert").shape[0])
    assert all(int(bound.subs("T", t)) % 2 == 0 for t in (1, 7, 1000, 16384))
    with pytest.raises(PlanError):
        make_plan(PRESETS["olmoe"], overrides={"cluster_m": 2, "fuse_gemms": True})
    with pytest.raises(PlanError):
        make_plan(PRESETS["olmoe"], overrides={"cluster_m": 3})


def test_single_launch_tiles_by_tokens():
    """The single launch's tiles by T (launch_bands): swapped tiles of the fewest token rows that
    hold an expert's rows (mean r = T*K/E, plus SWAP_SPREAD sqrt(r)), the plain launch where its
    128 rows do; past the largest, the swapped tile of least modelled cost that some experts spill
    out of, while one holds r - SPILL_SPREAD sqrt(r), then the plain launch; each band a launch of
    its own with its routing twin, one shared tile table."""
    from mokgen.runtime.variant import forward_entry, routed_entry

    spec = PRESETS["olmoe"]
    p = make_plan(spec)
    assert p.launch_bands == [[69, "forward_n16"], [165, "forward_n32"], [268, "forward_n48"], [375, "forward_n64"],
                              [484, "forward_n80"], [595, "forward_n96"], [707, "forward_n112"],
                              [821, "forward_fused"], [935, "forward_n144"], [1300, "forward_n160"],
                              [2048, "forward_fused"]]
    plan = p.to_dict()
    assert [forward_entry(plan, t) for t in (1, 64, 70, 165, 166, 256, 300, 512, 700, 800, 900, 1024, 1200, 1301,
                                             2048, 2049)] == [
        "forward_n16", "forward_n16", "forward_n32", "forward_n32", "forward_n48", "forward_n48", "forward_n64",
        "forward_n96", "forward_n112", "forward_fused", "forward_n144", "forward_n160", "forward_n160",
        "forward_fused", "forward_fused", "forward"]
    assert routed_entry(plan, 64) == "forward_routed_n16" and routed_entry(plan, 800) == "forward_routed"
    for n in (16, 32, 48, 64, 80, 96, 112, 144, 160):
        k = p.kernel(f"gemm_fused_n{n}").params
        assert p.steps[f"forward_n{n}"] == [f"gemm_fused_n{n}"]
        assert p.steps[f"forward_routed_n{n}"] == [f"gemm_fused_n{n}_routed"]
        assert k["swap"] and k["tile_m"] == n == k["row_align"] == k["dispatch"]["tile_m"] and k["tile_n"] == 128
        assert k["mma_warpgroups"] == 2 and 2 * n // 2 <= SWAP_ACC_MAX
        # (weight rows 256 bytes a stage where three such stages fit: the 32-row tiles)
        assert (k["tile_k"], k["stages"], k["epi_stages"]) == ((128, 3, 1) if n <= 32 else (64, k["stages"], 2))
        # (the epilogue stores 32 token rows at a time, 16 where 32 do not divide the tile's)
        assert k["epi_tile"] == [128, 32 if n % 32 == 0 else 16]
        tables = {a.name: a.tensor for a in p.kernel(f"gemm_fused_n{n}").args}
        assert tables["tile_expert"] == "tile_expert_w" and tables["h_ready"] == "h_ready_w"
        assert p.kernel(f"gemm_fused_n{n}_routed").params["route"]["experts"] == spec.experts
    sizes = {b.name: sympy.sympify(b.shape[0]) for b in p.buffers}
    assert sizes["tile_expert_w"] == sizes["h_ready_w"] == sympy.sympify("ceiling(T/2) + 64")
    # The row buffers hold the rows the per-GEMM path lays out and those of the band serving T,
    # no more (a small call's workspace stays small).
    from mokgen.runtime.variant import forward_entry as entry

    for t in (1, 64, 69, 70, 165, 166, 300, 500, 700, 900, 1000, 1050, 1051, 1300, 1301, 2048, 16384):
        band = entry(plan, t)
        n = int(band[len("forward_n"):]) if band.startswith("forward_n") else 128
        want = max((math.ceil(t * 8 / 128) + 64) * 128, (math.ceil(t * 8 / n) + 64) * n)
        assert sizes["h"].subs("T", t) == sizes["ga"].subs("T", t) == want, t
    # A layer with few weight tiles per SM takes tiles no larger than the plain launch's, by mean rows.
    e40 = make_plan(MoESpec(experts=40, topk=6, hidden=1536, intermediate=640))
    assert e40.launch_bands == [[106, "forward_n16"], [213, "forward_n32"], [320, "forward_n48"],
                                [426, "forward_n64"], [533, "forward_n80"], [640, "forward_n96"],
                                [746, "forward_n112"], [2048, "forward_fused"]]
    assert make_plan(spec, overrides={"swap_rows": [64]}).launch_bands == [[375, "forward_n64"], [2048, "forward_fused"]]
    # Past the largest tile, experts spill: the swapped tile the model costs least of those that hold
    # r - SPILL_SPREAD sqrt(r) (olmoe's 160 rows up to T = 1300 above; mixtral-8x7b's up to T = 650, measured
    # 1.40x / 1.11x the plain launch at 540 / 650); the plain launch's own band keeps it (mixtral lost there).
    assert make_plan(PRESETS["mixtral-8x7b"]).launch_bands[-4:] == [[410, "forward_fused"], [467, "forward_n144"],
                                                                   [650, "forward_n160"], [2048, "forward_fused"]]
    assert spilled_tile(spec, 1350 * 8 / 64, {112, 144, 160}) is None
    assert spilled_tile(spec, 1300 * 8 / 64, {112, 144, 160}) == 160
    # Where there are none: a shared expert, several GPUs, one forced path, dispatch kernels
    # before the launch, the wavefront experiment, the overrides.
    for s, ov in [(MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=768), {}),
                  (MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, world_size=2, topology="nvlink"), {}),
                  (spec, {"fuse_gemms": True}), (spec, {"fuse_gemms": False}), (spec, {"dispatch_in_launch": False}),
                  (spec, {"gemm_fused.wave_lag": 33}), (spec, {"fused_small": False}), (spec, {"swap_rows": []}),
                  (MoESpec(experts=8, topk=2, hidden=384, intermediate=192), {})]:  # (128-row weight tiles)
        q = make_plan(s, overrides=ov)
        assert q.launch_bands == [] and not any(e.startswith("forward_n") for e in q.steps), (s.variant, ov)
        assert not any(k.name.startswith("gemm_fused_n") for k in q.kernels)
    with pytest.raises(PlanError, match="true or false"):
        make_plan(spec, overrides={"fused_small": 0})
    for bad in (32, [40], [8], [192], [True]):
        with pytest.raises(PlanError, match="swap_rows"):
            make_plan(spec, overrides={"swap_rows": bad})
    # (a tuner's candidates: one warpgroup of 64 weight rows, measured 0.96-0.99x at T <= 375)
    narrow = make_plan(spec, overrides={"gemm_fused_n64.tile_n": 64}).kernel("gemm_fused_n64").params
    assert (narrow["mma_warpgroups"], narrow["tile_k"], narrow["stages"], narrow["n2_tiles"]) == (1, 128, 4, 16)
    with pytest.raises(PlanError, match="swapped tiles: N tile 256"):
        make_plan(spec, overrides={"gemm_fused_n64.tile_n": 256})


def test_per_gemm_tokens_gives_measured_ranges_of_t_to_the_per_gemm_path():
    """Override per_gemm_tokens (what `mokgen tune --paths` measures): the bands cut at the ranges'
    edges, the ranges served by "forward", the rest as the model has them; the kernels and the
    row buffers (sized by the model's bands) unchanged."""
    from mokgen.runtime.variant import forward_entry

    spec = PRESETS["mixtral-8x7b"]
    base = make_plan(spec)
    p = make_plan(spec, overrides={"per_gemm_tokens": [[340, 440], [651, 2048]]})
    assert p.launch_bands[-6:] == [[297, "forward_n96"], [339, "forward_n112"], [440, "forward"],
                                   [467, "forward_n144"], [650, "forward_n160"], [2048, "forward"]]
    assert p.launch_bands[:-6] == base.launch_bands[:-6]
    assert [k.name for k in p.kernels] == [k.name for k in base.kernels] and p.buffers == base.buffers
    assert forward_entry(p.to_dict(), 339) == "forward_n112" and forward_entry(p.to_dict(), 340) == "forward"
    assert forward_entry(p.to_dict(), 700) == "forward" == forward_entry(p.to_dict(), 4096)
    assert per_gemm_bands([[34, "a"], [82, "b"]], [[20, 30]]) == [[19, "a"], [30, "forward"], [34, "a"], [82, "b"]]
    assert per_gemm_bands([[34, "a"], [82, "b"]], [[1, 5000]]) == [[82, "forward"]]
    assert per_gemm_bands([[34, "a"], [82, "b"]], []) == [[34, "a"], [82, "b"]]
    for bad in ([[5, 3]], [[1, 10], [10, 20]], "x", [[1, True]], [[0, 4]], [[1, 2, 3]]):
        with pytest.raises(PlanError, match="per_gemm_tokens must be"):
            make_plan(spec, overrides={"per_gemm_tokens": bad})
    with pytest.raises(PlanError, match="no single launch served by T"):
        make_plan(spec, overrides={"per_gemm_tokens": [[1, 2]], "fuse_gemms": False})


def test_every_entrys_last_kernel_mirrors_its_error_code():
    """Every single launch that dispatches itself on one GPU (the bands and their routing twins)
    takes the runtime's pinned host word and a counter of finished CTAs, so its entry is one
    launch with no status_mirror behind it; so do the per-GEMM path's last kernels, the combine
    (its first thread, as it starts) and the backward's last GEMM (its last CTA, counting in the
    same slot, which the runtime zeroes before the backward). status_mirror stays for the
    entries whose last kernel cannot (FP8's weight gradients) and those with side-stream
    kernels (expert parallel). Override mirror_status: false keeps the launch behind every entry."""
    from mokgen.runtime.variant import mirrored_entries

    spec = PRESETS["olmoe"]
    plan = make_plan(spec)
    mirrored = {k.name for k in plan.kernels if k.params.get("mirror_status")}
    fused = {n for entry, names in plan.steps.items()
             if re.fullmatch(r"forward_(fused|routed|n\d+|routed_n\d+)", entry) for n in names}
    assert mirrored == fused | {"combine", "wgrad_up"}
    finished = {plan.kernel(n).params["finished_slot"] for n in mirrored - {"combine"}}
    assert len(finished) == 1
    for name in fused:
        k = plan.kernel(name)
        assert k.args[-1].tensor == "status_host"
        assert k.params["finished_slot"] not in {k.params["sched_slot"], k.params["used_slot"], k.params["done_slot"]}
    assert [a.tensor for a in plan.kernel("combine").args][-2:] == ["tile_counters", "status_host"]
    assert plan.kernel("combine").params["status_slot"] == plan.kernel("status_mirror").params["status_slot"]
    assert plan.kernel("wgrad_up").args[-1].tensor == "status_host"
    assert plan.zeroed["backward"] == ["tile_counters"]  # (the finished count starts at 0)
    entries = mirrored_entries(plan.to_dict())
    assert entries == {e for e in plan.steps if e not in ("route", "route_backward", "status")}
    assert "status_mirror" in {k.name for k in plan.kernels}  # (a build from before, the entries above)
    fp8 = make_plan(dataclasses.replace(spec, dtype="fp8"))
    assert {"forward", "forward_train", "backward_data"} <= mirrored_entries(fp8.to_dict())
    assert "backward_fp8" not in mirrored_entries(fp8.to_dict())  # (its weight gradients' GEMM cannot)
    ep = make_plan(dataclasses.replace(spec, world_size=2, topology="nvlink"))
    assert not {"forward", "forward_train", "backward"} & mirrored_entries(ep.to_dict())  # (side streams)
    # (its backward ends in bwd_combine: no counter of finished CTAs is kept for it)
    ep_off = make_plan(dataclasses.replace(spec, world_size=2, topology="nvlink"), overrides={"mirror_status": False})
    assert [b.shape for b in ep.buffers if b.name == "tile_counters"] == \
        [b.shape for b in ep_off.buffers if b.name == "tile_counters"]
    off = make_plan(spec, overrides={"mirror_status": False})
    assert not [k for k in off.kernels if k.params.get("mirror_status")]
    # (and no counter of finished CTAs is kept for it)
    counters = {b.name: b.shape for b in off.buffers}["tile_counters"]
    assert int(counters[0]) == int({b.name: b.shape for b in plan.buffers}["tile_counters"][0]) - 1


def test_each_planning_constant_is_decided_in_one_module():
    """One place decides each thing: no constant (a top-level UPPER_CASE name) of the planning
    modules is assigned in two of them; a module that needs another's imports it."""
    import ast
    from pathlib import Path

    import mokgen.schedule

    where: dict = {}
    for path in sorted(Path(mokgen.schedule.__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Name) and t.id.isupper() and len(t.id) > 1:
                    where.setdefault(t.id, []).append(path.name)
    twice = {name: files for name, files in where.items() if len(files) > 1}
    assert not twice, f"constants assigned in more than one planning module: {twice}"
    assert len(where) > 50  # (the scan sees the modules' constants)
