import sympy

from mokgen.ir import PRESETS, T, forward_graph


def test_forward_stages_and_symbolic_shapes():
    spec = PRESETS["olmoe"]
    g = forward_graph(spec)
    assert [s.name for s in g.stages] == ["send", "gemm_gateup", "gemm_down", "reduce"]
    assert [s.kind for s in g.stages] == ["send", "gemm", "gemm", "reduce"]
    assert g.tensors["xs"].shape == (8 * T, 2048)
    assert g.tensors["out"].shape == (T, 2048)
    assert g.tensors["w_down"].shape == (64, 2048, 1024)
    # DESIGN.md: forward FLOPs 6*T*K*H*I
    assert sympy.simplify(g.flops() - 6 * T * 8 * 2048 * 1024) == 0


def test_shared_expert_and_fused_route_stages():
    spec = PRESETS["deepseek-v3"]
    g = forward_graph(spec, fused_route=True)
    names = [s.name for s in g.stages]
    assert names[0] == "route" and "shared_gateup" in names and "shared_down" in names
    assert "ys" in g.stage("reduce").inputs
    assert g.flops(routed_only=False) - g.flops() == 6 * T * spec.hidden * spec.shared_intermediate


def test_graph_check_catches_ordering_errors():
    import pytest

    g = forward_graph(PRESETS["olmoe"])
    g.stages.reverse()
    with pytest.raises(ValueError, match="before anything produces them"):
        g.check()
