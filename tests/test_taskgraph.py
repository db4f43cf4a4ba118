import pytest

from mokgen.ir import PRESETS, MoESpec
from mokgen.schedule import H200, make_plan
from mokgen.schedule.taskgraph import simulate, task_costs_us, tile_loop_us

SPECS = [PRESETS["olmoe"], PRESETS["deepseek-v3"], MoESpec(experts=40, topk=6, hidden=1536, intermediate=640)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
def test_plan_carries_the_fused_task_graph(spec):
    tg = make_plan(spec).task_graph
    names = [k["name"] for k in tg["kinds"]]
    routed = [n for n in names if not n.startswith("shared")]
    assert routed == ["route", "count", "scatter", "gateup", "down", "combine"]
    if spec.shared_intermediate:  # shared gate/up right after the routed gate/up, shared down after down
        assert names.index("shared_gateup") == 4 and names.index("shared_down") == names.index("down") + 1
    assert ("shared_gateup" in names) == bool(spec.shared_intermediate)
    prios = [k["priority"] for k in tg["kinds"]]
    assert prios == sorted(prios)
    assert all(k["fill"] == k["name"].startswith("shared") for k in tg["kinds"])
    assert tg["sm_roles"]["compute"] == H200.sms
    counters = {c["name"] for c in tg["counters"]}
    kinds = {k["name"]: k for k in tg["kinds"]}
    if spec.shared_intermediate:  # the combine waits for every down tile (and the shared expert's)
        assert {"counted", "placed", "h_ready", "y_done"} <= counters
        assert kinds["combine"]["waits_on"].startswith("y_done")
    else:  # the early combine: each task waits for the M tiles of its token's rows
        assert {"counted", "placed", "h_ready"} <= counters and "y_done" not in counters
        assert kinds["down"]["signals"] == "h_ready[m] += 1" and "token's" in kinds["combine"]["waits_on"]


def test_expert_parallel_task_graph_has_the_exchange_tasks():
    """The expert-parallel forward's tasks in launch order: count and scatter over the global
    experts, publish between them, layout after every rank's counts, then send, the GEMM tiles
    (gate/up waiting for every rank's rows of its expert), and the combine after the returns;
    the single launch still claims its GEMM tiles gate/up before down."""
    from mokgen.schedule.taskgraph import fused_tile_order

    plan = make_plan(MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, world_size=2, topology="nvlink"))
    tg = plan.task_graph
    kinds = {k["name"]: k for k in tg["kinds"]}
    assert list(kinds) == ["count", "publish", "scatter", "layout", "send", "gateup", "down", "combine"]
    assert [k["priority"] for k in tg["kinds"]] == list(range(8))
    assert kinds["count"]["count"] == kinds["layout"]["count"] == "64" and kinds["count"]["waits_on"] == "-"
    assert "every rank's counts flag" in kinds["layout"]["waits_on"] and "2 ranks" in kinds["gateup"]["waits_on"]
    assert kinds["publish"]["role"] == kinds["send"]["role"] == "communication"
    assert kinds["send"]["count"] == f"{plan.kernel('gemm_fused').params['send_ctas']} CTAs"
    assert {"laid", "ready", "flags", "h_ready"} <= {c["name"] for c in tg["counters"]}
    assert fused_tile_order(tg) == ["gateup", "down"]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
def test_cost_model_and_simulated_schedule(spec):
    plan = make_plan(spec)
    params = {k.name: k.params for k in plan.kernels}
    for T in (64, 4096):
        costs = task_costs_us(spec, params, H200, T)
        assert all(c > 0 for c in costs.values())
        fused = simulate(spec, params, H200, T)
        multi = simulate(spec, params, H200, T, fused=False)
        assert 0 < fused["makespan_us"] <= multi["makespan_us"]
        ends = {}
        for sm, start, end, kind in fused["events"]:
            assert 0 <= sm < H200.sms and end > start
            ends.setdefault(kind, []).append((start, end))
        # dependencies hold in the simulated timeline
        assert min(s for s, _ in ends["scatter"]) >= max(e for _, e in ends["count"]) - 1e-9
        assert min(s for s, _ in ends["combine"]) >= max(e for _, e in ends["down"]) - 1e-9
    # the model matches the measured multi-kernel E64 forward at T=16384 within 15%
    if spec.variant == PRESETS["olmoe"].variant:
        assert abs(simulate(spec, params, H200, 16384, fused=False)["makespan_us"] - 3000) / 3000 < 0.15


def test_show_png(tmp_path):
    pytest.importorskip("matplotlib")
    from mokgen.show import draw_schedule

    out = draw_schedule(make_plan(PRESETS["deepseek-v3"]).to_dict(), tmp_path / "s.png", 1024)
    assert out.exists() and out.stat().st_size > 10_000


def test_show_prices_a_fused_gemm_plan_like_the_two_gemms_it_runs():
    from mokgen.ir import PRESETS
    from mokgen.schedule import make_plan
    from mokgen.show import format_plan

    plain = make_plan(PRESETS["olmoe"])
    fused = make_plan(PRESETS["olmoe"], overrides={"fuse_gemms": True})
    assert "gemm_fused" in format_plan(fused.to_dict())
    assert fused.task_graph == plain.task_graph  # the same model: same tiles, same rates


def test_the_single_launch_claims_its_tiles_in_the_task_graph_order():
    from mokgen.ir import MoESpec
    from mokgen.schedule.plan import make_plan
    from mokgen.schedule.taskgraph import fused_tile_order

    spec = MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=768)
    plan = make_plan(spec)
    order = fused_tile_order(plan.task_graph)
    assert order == ["gateup", "shared_gateup", "down", "shared_down"]
    assert plan.kernel("gemm_fused").params["tile_order"] == order
    # A task graph in which down tiles would be claimed before the gate/up tiles they wait
    # on is refused: a tile may only wait on tiles claimed before it.
    bad = dict(plan.task_graph, kinds=[dict(k, priority=9) if k["name"] == "gateup" else k
                                       for k in plan.task_graph["kinds"]])
    with pytest.raises(ValueError, match="down tiles wait on gateup tiles"):
        fused_tile_order(bad)


@pytest.mark.parametrize("used_m,lag", [(0, 33), (1, 33), (32, 33), (33, 33), (100, 33), (100, 1), (7, 3)])
def test_wavefront_order_claims_every_tile_once_and_each_down_tile_after_its_gate_up_tiles(used_m, lag):
    from mokgen.schedule.taskgraph import wavefront_tile

    ng, nd = 8, 8
    order = [wavefront_tile(t, used_m, ng, nd, lag) for t in range(used_m * (ng + nd))]
    assert sorted(order) == sorted([("gateup", m, n) for m in range(used_m) for n in range(ng)]
                                   + [("down", m, n) for m in range(used_m) for n in range(nd)])
    seen = {}
    for i, (kind, m, n) in enumerate(order):
        if kind == "down":
            assert seen.get(m, 0) == ng, (i, m)  # all its gate/up tiles were claimed before
        else:
            seen[m] = seen.get(m, 0) + 1
    if used_m > lag:  # the first down tile comes after lag M tiles of gate/up tiles, not after all
        assert order.index(("down", 0, 0)) == (lag + 1) * ng


def test_tile_loop_model_claims():
    """The tile-loop model (taskgraph.tile_loop_us): every tile's work is done either way and
    nothing ends before its share of the SMs allows; a down tile starts after its M tile's gate/up
    tiles; claimed ahead, E40's three tiles an SM hold some down tiles behind a wait (longer), where
    uniform tiles of equal cost (OLMoE) schedule the same; the same answer every call."""
    for claim_late in (False, True):
        # 1 SM: every tile in a row, the sum of their costs
        assert tile_loop_us(3, 2, 4, 5.0, 1.0, 1, claim_late) == pytest.approx(3 * (2 * 5.0 + 4 * 1.0))
        # as many SMs as gate/up tiles: one wave of them, then the down tiles
        assert tile_loop_us(2, 4, 8, 10.0, 3.0, 8, claim_late) == pytest.approx(10.0 + 2 * 3.0)
    e40 = (40, 5, 6, 24.3, 10.1, 132)
    assert tile_loop_us(*e40, claim_late=False) > 1.1 * tile_loop_us(*e40, claim_late=True)
    olmoe = (64, 8, 8, 32.4, 16.2, 132)
    assert tile_loop_us(*olmoe, claim_late=False) == pytest.approx(tile_loop_us(*olmoe, claim_late=True))
    tile_loop_us.cache_clear()
    a = tile_loop_us(*olmoe, claim_late=False, spread=0.15, seed=3)
    tile_loop_us.cache_clear()
    assert tile_loop_us(*olmoe, claim_late=False, spread=0.15, seed=3) == a
