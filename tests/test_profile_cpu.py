"""mokgen profile's reading of a single launch's task records (no GPU: synthetic rows)."""
from mokgen.ir import PRESETS, MoESpec
from mokgen.profile import format_summary, single_launch_kinds, summarize
from mokgen.schedule import make_plan


def _rows(sms: int, tiles: int, used_tiles: int, phase_ctas: int, combine_ctas: int) -> list:
    """[sm, start_ns, end_ns] rows as a launch leaves them: phases per CTA, then tiles; unused rows zero."""
    rows = [[0, 0, 0] for _ in range(2 * sms + tiles)]
    for c in range(phase_ctas):
        rows[c] = [c, 1000, 5000]
    for c in range(combine_ctas):
        rows[sms + c] = [c, 200_000, 203_000]
    for t in range(used_tiles):
        rows[2 * sms + t] = [t % sms, 6000 + 10 * t, 40_000 + 10 * t]
    return rows


def test_single_launch_records_split_by_phase_and_tile_kind():
    plan = make_plan(PRESETS["olmoe"], overrides={"profile": True})
    p = plan.kernel("gemm_fused_n32").params
    sms = plan.target["sms"]
    n_gateup, n_down = p["n_size"] // p["tile_n"], p["n2_tiles"]
    used = 64  # M tiles with rows: the first used * n_gateup tiles are gate/up, then the down tiles
    rows = _rows(sms, 200 * (n_gateup + n_down), used * (n_gateup + n_down), sms, 128)
    kinds = single_launch_kinds("gemm_fused_n32", p, rows, 64)
    assert list(kinds) == ["gemm_fused_n32 dispatch", "gemm_fused_n32 gate/up tiles",
                           "gemm_fused_n32 down tiles", "gemm_fused_n32 combine"]
    assert len(kinds["gemm_fused_n32 dispatch"]) == sms and len(kinds["gemm_fused_n32 combine"]) == 128
    assert len(kinds["gemm_fused_n32 gate/up tiles"]) == used * n_gateup
    assert len(kinds["gemm_fused_n32 down tiles"]) == used * n_down
    # in us from the launch's start, as collect returns them
    records = {k: [(sm, (s - 1000) / 1e3, (e - 1000) / 1e3) for sm, s, e in r] for k, r in kinds.items()}
    s = summarize(records, sms)
    assert s["kernels"]["gemm_fused_n32 dispatch"]["start_us"] == 0.0
    assert s["span_us"] == (203_000 - 1000) / 1e3
    assert "gemm_fused_n32 combine" in format_summary("olmoe", 64, s)
    # the tail: one group for the launch's tiles of both kinds; the dispatch and combine are not tiles
    assert list(s["tails"]) == ["gemm_fused_n32"]
    ends = {}
    for k in ("gemm_fused_n32 gate/up tiles", "gemm_fused_n32 down tiles"):
        for sm, _, e in records[k]:
            ends[sm] = max(ends.get(sm, e), e)
    t = s["tails"]["gemm_fused_n32"]
    assert t["last_end_us"] == max(ends.values()) and t["first_end_us"] == min(ends.values())
    assert abs(t["mean_before_last_us"] - (max(ends.values()) - sum(ends.values()) / len(ends))) < 1e-9
    assert "tail of gemm_fused_n32" in format_summary("olmoe", 64, s)


def test_tail_groups_per_gemm_kernels_apart():
    from mokgen.profile import tile_groups

    records = {"dispatch_count": [(0, 0.0, 1.0)], "gemm_gateup": [(0, 1.0, 5.0), (1, 1.0, 9.0)],
               "gemm_down": [(0, 9.0, 12.0)], "combine": [(1, 12.0, 13.0)]}
    assert sorted(tile_groups(records)) == ["gemm_down", "gemm_gateup"]
    s = summarize(records, 2)
    assert s["tails"]["gemm_gateup"] == dict(first_end_us=5.0, last_end_us=9.0, mean_before_last_us=2.0)


def test_profile_counts_each_kinds_tiles_per_sm():
    """Which SMs ran how many tiles of each kind, SMs with none included: an SM with two long down
    tiles while another has none is what made Mixtral's single launch lose at T = 380."""
    records = {"gemm_fused dispatch": [(0, 0.0, 1.0), (1, 0.0, 1.0), (2, 0.0, 1.0)],
               "gemm_fused gate/up tiles": [(0, 1.0, 5.0), (1, 1.0, 5.0), (2, 1.0, 9.0)],
               "gemm_fused down tiles": [(0, 5.0, 30.0), (0, 30.0, 50.0), (1, 5.0, 30.0)]}
    s = summarize(records, 3)
    assert s["per_sm"] == {"gemm_fused gate/up tiles": {1: 3}, "gemm_fused down tiles": {0: 1, 1: 1, 2: 1}}
    text = format_summary("mixtral", 380, s)
    assert "gemm_fused down tiles per SM: 0 on 1 SM, 1 on 1 SM, 2 on 1 SM" in text
    assert "dispatch per SM" not in text


def test_single_launch_with_a_shared_expert_splits_its_tiles_too():
    spec = MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=768)
    plan = make_plan(spec, overrides={"profile": True})
    p = plan.kernel("gemm_fused").params
    sms, T = plan.target["sms"], 64
    per_m = {"gateup": p["n_size"] // p["tile_n"], "down": p["n2_tiles"],
             "shared_gateup": p["s_size"] // p["tile_n"], "shared_down": p["n2_tiles"]}
    used, shared_m = 16, -(-T // p["tile_m"])
    n = {t: per_m[t] * (shared_m if t.startswith("shared") else used) for t in p["tile_order"]}
    rows = _rows(sms, sum(n.values()) + 50, sum(n.values()), 72, 32)
    kinds = single_launch_kinds("gemm_fused", p, rows, T)
    labels = {"gateup": "gate/up tiles", "down": "down tiles", "shared_gateup": "shared gate/up tiles",
              "shared_down": "shared down tiles"}
    for t in p["tile_order"]:
        assert len(kinds[f"gemm_fused {labels[t]}"]) == n[t], t
    assert len(kinds["gemm_fused dispatch"]) == 72 and len(kinds["gemm_fused combine"]) == 32
