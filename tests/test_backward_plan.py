"""The backward in the IR and the Plan (CPU only: no kernels run)."""
import pytest

from mokgen.ir import PRESETS, T, MoESpec, backward_graph
from mokgen.schedule import make_plan

ROUTED = [PRESETS["olmoe"], PRESETS["qwen3-30b-a3b"], MoESpec(experts=40, topk=6, hidden=1536, intermediate=640)]


@pytest.mark.parametrize("spec", ROUTED, ids=lambda s: s.variant)
def test_backward_graph_produces_every_gradient_from_the_forward_inputs(spec):
    g = backward_graph(spec)  # checks that every stage reads only what exists before it
    assert set(g.outputs) == {"dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"}
    assert set(g.inputs) == {"x", "topk_ids", "topk_weights", "w_gate", "w_up", "w_down", "dout"}
    for w in ("w_gate", "w_up", "w_down"):
        assert g.tensors[f"d_{w}"].shape == g.tensors[w].shape
    # Twice the forward's GEMM work, plus the recomputed gate/up (2/3 of a forward).
    fwd = 6 * spec.topk * spec.hidden * spec.intermediate
    assert g.flops().subs(T, 1) == 2 * fwd + 4 * spec.topk * spec.hidden * spec.intermediate


@pytest.mark.parametrize("spec", ROUTED, ids=lambda s: s.variant)
def test_backward_kernels_bind_the_weights_as_stored(spec):
    """The dgrad GEMMs read w_down and w_gate/w_up in their own layout (MN-major B, no
    transposed copies), the weight gradients come out in the weights' shapes, and the
    backward dispatches again first (which zeroes every tile counter)."""
    p = make_plan(spec)
    E, H, I = spec.experts, spec.hidden, spec.intermediate
    steps = p.steps["backward_recompute"]
    assert steps[:2] == ["dispatch_count", "dispatch_scatter"]
    # With what the training forward saved, the backward neither dispatches nor recomputes;
    # the runtime zeroes its tile counters instead.
    assert p.steps["backward"] == [s for s in steps[2:] if s != "bwd_recompute"]
    assert p.zeroed == {"backward": ["tile_counters"]}
    train = p.steps["forward_train"]
    assert "gemm_gateup_train" in train and p.kernel("gemm_gateup_train").params["epilogue"] == "swiglu_save"
    assert [a.tensor for a in p.kernel("gemm_gateup_train").args if a.name.startswith("c")] == ["h", "ga", "gb"]
    args = {k: {a.name: a for a in p.kernel(k).args} for k in steps}
    assert args["bwd_dgrad_down"]["b0"].shape == [E, H, I] and p.kernel("bwd_dgrad_down").params["b_major"] == "mn"
    dg = p.kernel("bwd_dgrad_gateup")
    assert dg.params["split_k"] and dg.params["b_major"] == "mn"
    assert [args["bwd_dgrad_gateup"][b].tensor for b in ("a", "a1", "b0", "b1")] == ["da", "db", "w_gate", "w_up"]
    for name, grad, shape in (("wgrad_down", "d_w_down", [E, H, I]), ("wgrad_gate", "d_w_gate", [E, I, H]),
                              ("wgrad_up", "d_w_up", [E, I, H])):
        k = p.kernel(name)
        assert k.params["wgrad"] and args[name]["c"].tensor == grad and args[name]["c"].shape == shape
        assert args[name]["tile_expert"].tensor == "counts"
        assert k.params["row_align"] % k.params["tile_k"] == 0  # each group's rows start on a K step
    slots = sorted(p.kernel(k).params["sched_slot"] for k in steps if k.startswith(("bwd_", "wgrad_"))
                   and "sched_slot" in p.kernel(k).params)
    assert len(set(slots)) == 6  # one tile counter per backward GEMM
    assert p.kernel("gemm_gateup_train").params["sched_slot"] not in slots
    assert any(d.startswith("backward:") for d in p.decisions)


def test_shared_expert_backward_and_where_there_is_none():
    p = make_plan(PRESETS["deepseek-v2-lite"])
    for entry in ("backward", "backward_recompute", "forward_train"):
        assert entry in p.steps
    b = p.steps["backward"]
    assert {"bwd_shared_dgrad_down", "bwd_shared_swiglu", "bwd_shared_dgrad_gateup", "wgrad_shared_down",
            "wgrad_shared_gate", "wgrad_shared_up"} <= set(b)
    assert b.index("bwd_shared_dgrad_gateup") < b.index("bwd_combine")  # the combine adds dx_shared
    assert [a.tensor for a in p.kernel("bwd_combine").args if a.name == "ys"] == ["dx_shared"]
    for w in ("wgrad_shared_down", "wgrad_shared_gate", "wgrad_shared_up"):
        assert p.kernel(w).params["all_rows"] and p.kernel(w).params["groups"] == 1
    assert "shared_gateup_train" in p.steps["forward_train"]
    assert "backward" not in make_plan(PRESETS["olmoe"], overrides={"profile": True}).steps
    assert "backward" not in make_plan(PRESETS["olmoe"], overrides={"fuse_gemms": True}).steps


def test_rendered_backward_modules():
    from mokgen.codegen.render import render

    files = render(make_plan(PRESETS["olmoe"]))
    assert "stride=(1, N_SIZE, N_SIZE * B_K)" in files["bwd_dgrad_down.py"]  # MN-major B
    assert "K_HALF_TILES" in files["bwd_dgrad_gateup.py"] and "tma_a1" in files["bwd_dgrad_gateup.py"]
    assert "tma_c2" in files["bwd_recompute.py"] and "silu" not in files["bwd_recompute.py"].split('"""', 2)[2]
    for w in ("wgrad_down", "wgrad_gate", "wgrad_up"):
        assert "ROW_ALIGN" in files[f"{w}.py"] and "k_tiles_now > 0" in files[f"{w}.py"]
    assert "warp_reduction_sum" in files["bwd_swiglu.py"]
    assert "weights" not in files["bwd_combine.py"].split("import cutlass.cute as cute", 1)[1]
