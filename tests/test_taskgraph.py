import pytest

from mokgen.ir import PRESETS, MoESpec
from mokgen.schedule import H200, make_plan
from mokgen.schedule.taskgraph import simulate, task_costs_us

SPECS = [PRESETS["olmoe"], PRESETS["deepseek-v3"], MoESpec(experts=40, topk=6, hidden=1536, intermediate=640)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
def test_plan_carries_the_fused_task_graph(spec):
    tg = make_plan(spec).task_graph
    names = [k["name"] for k in tg["kinds"]]
    assert names[:5] == ["route", "count", "scatter", "gateup", "down"] and names[-1] == "combine"
    assert ("shared_gateup" in names) == bool(spec.shared_intermediate)
    prios = [k["priority"] for k in tg["kinds"]]
    assert prios == sorted(prios)
    assert all(k["fill"] == k["name"].startswith("shared") for k in tg["kinds"])
    assert tg["sm_roles"]["compute"] == H200.sms
    counters = {c["name"] for c in tg["counters"]}
    assert {"counted", "placed", "h_ready", "y_done"} <= counters


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
