"""The torch ops' schemas, fake implementations and autograd formulas, on the CPU: a stand-in
variant (its Plan, no kernels) registers the ops, and fake tensors run forward and backward
through autograd, so the shapes of every saved tensor and gradient are checked without a GPU."""
import types

import pytest

from mokgen.ir import PRESETS, MoESpec

torch = pytest.importorskip("torch")

SPECS = [PRESETS["olmoe"], PRESETS["deepseek-v2-lite"], MoESpec(experts=40, topk=6, hidden=1536, intermediate=640)]


def stand_in_ops(spec, suffix):
    from mokgen.runtime import ops as O
    from mokgen.runtime import variant as V
    from mokgen.schedule.plan import make_plan

    v = types.SimpleNamespace(name=f"{spec.variant}_{suffix}", spec=spec, plan=make_plan(spec).to_dict())
    v.saved_shapes = lambda T: V.Variant.saved_shapes(v, T)
    return O.register_ops(v)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
@pytest.mark.parametrize("train", [True, False], ids=["forward_train", "forward_recompute"])
def test_autograd_through_the_ops_on_fake_tensors(spec, train):
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = stand_in_ops(spec, f"cpu{int(train)}")
    E, K, H, I, S = spec.experts, spec.topk, spec.hidden, spec.intermediate, spec.shared_intermediate
    with FakeTensorMode():
        def leaf(*shape, dtype=torch.bfloat16):
            return torch.empty(*shape, dtype=dtype).requires_grad_(True)

        T = 333
        x, w = leaf(T, H), leaf(T, K, dtype=torch.float32)
        ids = torch.empty(T, K, dtype=torch.int32)
        params = [leaf(E, I, H), leaf(E, I, H), leaf(E, H, I)]
        shared = [leaf(S, H), leaf(S, H), leaf(H, S)] if S else [None, None, None]
        if train:
            outs = ops.forward_train(x, ids, w, *params, *shared)
            shapes = ops.variant.saved_shapes(T)
            assert [tuple(o.shape) for o in outs[1:3]] == [shapes["ga"], shapes["gb"]]
            assert not any(o.requires_grad for o in outs[1:])  # saved for the backward, not differentiable
            out = outs[0]
        else:
            out = ops.forward(x, ids, w, *params, *shared)
        out.float().sum().backward()
        leaves = [x, w] + params + ([t for t in shared] if S else [])
        assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)


def test_expert_parallel_module_holds_its_ranks_experts(monkeypatch):
    """mokgen.MoE(group=...) holds E/W experts per rank and a replicated router; sizes the
    group cannot split are refused before any allocation."""
    import torch.distributed as dist

    import mokgen
    from mokgen.ir import SpecError

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    m = mokgen.MoE(256, 128, 8, 2, group=object(), reference=True)
    assert m.w_gate.shape == (4, 128, 256) and m.w_down.shape == (4, 256, 128) and m.router.weight.shape == (8, 256)
    assert "expert parallel over 2 ranks (4 experts here)" in repr(m)
    with pytest.raises(SpecError):
        mokgen.MoE(256, 128, 7, 2, group=object(), reference=True)


@pytest.mark.parametrize("saved", [True, False], ids=["saved", "recompute"])
def test_expert_parallel_autograd_hands_the_backward_what_the_forward_saved(saved):
    """The expert-parallel autograd function: the training forward's SwiGLU inputs (or none,
    recompute) and the peer workspace reach the backward; its gradients reach the inputs."""
    from mokgen.runtime import _ExpertParallelMoE

    ga, gb = torch.randn(6, 3), torch.randn(6, 3)
    calls = {}

    class StandIn:
        def forward(self, x, *rest, peers):
            calls["forward"] = peers
            return x * 2

        def forward_train(self, x, *rest, peers):
            calls["forward_train"] = peers
            return x * 2, ga, gb, torch.empty(0), torch.empty(0)

        def backward(self, dout, x, ids, w, wg, wu, wd, sg, su, sd, saved=None, peers=None):
            calls["backward"] = (saved, peers)
            return dout * 2, torch.ones_like(w), torch.ones_like(wg), torch.ones_like(wu), torch.ones_like(wd), \
                None, None, None

    x, w = torch.randn(4, 8, requires_grad=True), torch.rand(4, 2, requires_grad=True)
    wg, wu, wd = (torch.randn(2, 3, 8, requires_grad=True), torch.randn(2, 3, 8, requires_grad=True),
                  torch.randn(2, 8, 3, requires_grad=True))
    ids = torch.zeros(4, 2, dtype=torch.int32)
    out = _ExpertParallelMoE.apply(StandIn(), "the workspace", saved, x, ids, w, wg, wu, wd, None, None, None)
    out.sum().backward()
    assert ("forward_train" if saved else "forward") in calls and calls["backward"][1] == "the workspace"
    kept = calls["backward"][0]
    assert (kept is not None and torch.equal(kept[0], ga) and torch.equal(kept[1], gb)) if saved else kept is None
    assert torch.equal(x.grad, torch.full_like(x, 2.0)) and torch.equal(wd.grad, torch.ones_like(wd))


def test_fp8_module_keeps_its_quantised_experts_until_the_weights_change(monkeypatch):
    """mokgen.MoE(dtype="fp8") quantises its experts once and again only after an optimizer
    step (any torch.optim optimizer, even one whose update the version counters miss), an
    in-place update of w_gate, w_up or w_down, or requantize(); sizes FP8 cannot block and an
    expert-parallel group are refused up front."""
    import mokgen
    import mokgen.runtime as runtime
    from mokgen.ir import SpecError

    made = []

    def quantize(w_gate, w_up, w_down, topk):  # (a stand-in: the kernels need a GPU)
        made.append((w_gate.clone(), w_up.clone(), w_down.clone()))
        return object()

    monkeypatch.setattr(runtime, "quantize_experts_fp8", quantize)
    m = mokgen.MoE(256, 128, 8, 2, dtype="fp8")
    assert "dtype=fp8" in repr(m) and m.spec.dtype == "fp8"
    first = m.fp8_experts()
    assert m.fp8_experts() is first and len(made) == 1
    with torch.no_grad():
        m.w_up.mul_(2)  # an in-place update, as an optimizer makes
    second = m.fp8_experts()
    assert second is not first and len(made) == 2 and torch.equal(made[-1][1], m.w_up.detach())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for p in (m.w_gate, m.w_up, m.w_down):
        p.grad = torch.ones_like(p)
    opt.step()
    assert m.fp8_experts() is not second and len(made) == 3 and torch.equal(made[-1][0], m.w_gate.detach())
    assert m.fp8_experts() is m.fp8_experts() and len(made) == 3

    class ThroughData(torch.optim.Optimizer):  # updates its parameters past their version counters
        def __init__(self, params):
            super().__init__(params, {})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(1.0)

    versions = [p._version for p in (m.w_gate, m.w_up, m.w_down)]
    ThroughData([m.w_down]).step()
    assert [p._version for p in (m.w_gate, m.w_up, m.w_down)] == versions  # (the counters missed it)
    assert m.fp8_experts() is not None and len(made) == 4 and torch.equal(made[-1][2], m.w_down.detach())
    m.requantize()
    m.fp8_experts()
    assert len(made) == 5
    with pytest.raises(SpecError, match="multiple of 128"):
        mokgen.MoE(1088, 128, 8, 2, dtype="fp8")
    with pytest.raises(ValueError, match="dtype='fp8'"):
        mokgen.MoE(256, 128, 8, 2).fp8_experts()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
def test_saved_shapes_are_the_buffers_and_the_tile_table_covers_every_row(spec):
    """The fake implementation's saved tensors have the runtime buffers' shapes at every T
    (where a band of swapped tiles lays out more rows than the per-GEMM path, both grow), and
    the per-GEMM tile table has an entry for every row_token row: the kernels that walk all rows
    (the SwiGLU backward, the x-row copy) read tile_expert[r // row_tile] before anything else
    (at T = 1000 it once had 128 entries for 18240 rows, and the backward faulted)."""
    from mokgen.runtime import variant as V
    from mokgen.schedule.plan import make_plan

    plan = make_plan(spec).to_dict()
    v = types.SimpleNamespace(name="stand-in", spec=spec, plan=plan)
    fns = V.call_buffer_fns(plan)
    for T in sorted({*range(1, 2200, 13), *(top for top, _ in plan.get("launch_bands", [])),
                     *(top + 1 for top, _ in plan.get("launch_bands", []))}):
        real = {name: shape for name, _, shape, _ in V.buffer_shapes_at(fns, T)}
        fake = V.Variant.saved_shapes(v, T)
        for name in ("ga", "gb", "pos", "row_token", "tile_expert", "counts"):
            assert tuple(fake[name]) == real[name], (T, name)
        assert real["tile_expert"][0] * plan["row_tile"] >= real["row_token"][0], T


def test_the_package_entry_points_take_what_the_runtime_takes():
    """mokgen.moe_fp8 and the other wrappers at the package's top pass every keyword of their
    mokgen.runtime function through (a keyword added to one and not the other is a TypeError
    at a user's first call)."""
    import inspect

    import mokgen
    import mokgen.runtime as runtime

    for name in ("moe_fp8", "moe_fp8_train", "quantize_experts_fp8", "moe_routed"):  # (route takes a spec)
        top, inner = (inspect.signature(getattr(m, name)).parameters for m in (mokgen, runtime))
        if any(p.kind == p.VAR_KEYWORD for p in top.values()):
            continue
        assert list(top) == list(inner), (name, list(top), list(inner))


@pytest.mark.parametrize("mode", ["train", "recompute", "no_backward_saved", "no_grad"])
def test_eager_layer_hands_each_gradient_to_its_input(mode):
    """ops.layer in eager mode (runtime/eager.py, no custom op): the training forward's saved
    tensors reach the backward (none with recompute, or where the Plan saves nothing), each
    gradient the backward returns lands on its input, and without autograd the inference
    forward runs alone."""
    spec = MoESpec(experts=4, topk=2, hidden=128, intermediate=64, shared_intermediate=64)
    ops = stand_in_ops(spec, f"eager_{mode}")
    ga, gb = torch.randn(6, 3), torch.randn(6, 3)
    calls = {}

    class StandIn:
        has_backward = mode != "no_backward_saved"

        def forward(self, x, *rest):
            calls["forward"] = True
            return x * 2

        def forward_train(self, x, *rest):
            calls["forward_train"] = True
            return x * 2, ga, gb

        def backward(self, dout, x, ids, w, wg, wu, wd, sg, su, sd, saved=None):
            calls["backward"] = saved
            return (dout * 3, torch.full_like(w, 4.0), *(torch.full_like(t, 5.0 + i) for i, t in
                                                         enumerate((wg, wu, wd, sg, su, sd))))

    ops.variant = StandIn()
    T, H, I, S = 5, spec.hidden, spec.intermediate, spec.shared_intermediate
    x, w = torch.randn(T, H, requires_grad=True), torch.rand(T, 2, requires_grad=True)
    weights = [torch.randn(*s, requires_grad=True) for s in ((4, I, H), (4, I, H), (4, H, I), (S, H), (S, H), (H, S))]
    ids = torch.zeros(T, 2, dtype=torch.int32)
    with torch.set_grad_enabled(mode != "no_grad"):
        out = ops.layer(x, ids, w, *weights, recompute=mode == "recompute")
    if mode == "no_grad":
        assert calls == {"forward": True} and not out.requires_grad
        return
    assert ("forward_train" in calls) == (mode == "train") and ("forward" in calls) != (mode == "train")
    out.backward(torch.ones_like(out))
    saved = calls["backward"]
    assert (saved is not None and [torch.equal(a, b) for a, b in zip(saved, (ga, gb))] == [True, True]) \
        if mode == "train" else saved is None
    assert torch.equal(x.grad, torch.full_like(x, 3.0)) and torch.equal(w.grad, torch.full_like(w, 4.0))
    assert [float(p.grad.flatten()[0]) for p in weights] == [5.0, 6.0, 7.0, 8.0, 9.0, 10.0]


def test_eager_route_hands_the_logits_their_gradient():
    """ops.routing in eager mode: differentiable in the logits through the weights (the
    route's backward gets the weights' gradient in fp32 and the ids route returned); without
    autograd, the variant's route alone."""
    ops = stand_in_ops(MoESpec(experts=4, topk=2, hidden=128, intermediate=64), "eager_route")
    seen = {}

    class StandIn:
        def route(self, logits):
            return torch.zeros(logits.shape[0], 2, dtype=torch.int32), logits[:, :2].softmax(-1)

        def route_backward(self, logits, ids, d_weights):
            seen["d_weights"] = (d_weights.dtype, ids.dtype)
            return torch.full_like(logits, 7.0)

    ops.variant = StandIn()
    logits = torch.randn(3, 4, requires_grad=True)
    ids, weights = ops.routing(logits)
    assert not ids.requires_grad and weights.requires_grad
    weights.sum().backward()
    assert seen["d_weights"] == (torch.float32, torch.int32) and torch.equal(logits.grad, torch.full_like(logits, 7.0))
    with torch.no_grad():
        ids, weights = ops.routing(logits)
    assert not weights.requires_grad


def test_each_variant_object_runs_its_own_kernels_through_its_ops():
    """Two Variant objects of one name (an experiment's build beside the normal one) share the
    custom ops torch.library registers once per name; a call through either one's ops (eager
    or a custom op) runs that object's entries, whichever was made last. (The ops once followed
    the last object made, so the normal build's calls ran an experiment's kernels.)"""
    import copy

    spec = MoESpec(experts=4, topk=2, hidden=128, intermediate=64)
    ops_a, ops_b = stand_in_ops(spec, "two_objects"), stand_in_ops(spec, "two_objects")
    ran = []

    class StandIn:
        has_backward = True

        def __init__(self, tag):
            self.tag = tag

        def forward(self, x, *rest):
            ran.append(self.tag)
            return x + 0

    ops_a.variant, ops_b.variant = StandIn("a"), StandIn("b")
    x, w = torch.randn(3, 128), torch.rand(3, 2)
    ids = torch.zeros(3, 2, dtype=torch.int32)
    weights = [torch.randn(4, 64, 128), torch.randn(4, 64, 128), torch.randn(4, 128, 64)]
    ops_a.layer(x, ids, w, *weights)
    ops_b.layer(x, ids, w, *weights)
    ops_a.forward(x, ids, w, *weights)  # the custom op, taken for a
    ops_b.forward(x, ids, w, *weights)
    ops_a.layer(x, ids, w, *weights)
    assert ran == ["a", "b", "a", "b", "a"]
    assert copy.deepcopy(ops_a) is ops_a and copy.copy(ops_b) is ops_b


def test_the_module_pickles_without_its_loaded_ops():
    """torch.save(module) and copy.deepcopy keep mokgen.MoE's parameters and settings and leave
    out what belongs to this process (the generated ops, the FP8 copy of the experts), which
    the first forward after loading finds or quantises again."""
    import copy
    import io

    import mokgen

    m = mokgen.MoE(256, 128, 8, 2, shared_intermediate=128, recompute=True)
    m._ops = m._routed_ops = lambda: None  # (stand-ins for the loaded ops: a lambda cannot be pickled)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    for again in (torch.load(buf, weights_only=False), copy.deepcopy(m)):
        assert again._ops is None and again._routed_ops is None and again.recompute and again.spec == m.spec
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), m.state_dict().values()))
    assert m._ops is not None  # (the original keeps its own)


def test_the_module_takes_other_float_input_under_autocast_only_and_routes_in_fp32():
    """mokgen.MoE under torch.autocast casts its float input to bf16 as autocast casts a
    matmul's inputs, returns bf16, and keeps its router in fp32 (the same routing, so the same
    output as bf16 input without autocast); without autocast, fp32 input is a clear error."""
    import mokgen
    from mokgen.runtime.checks import InputError

    torch.manual_seed(0)
    m = mokgen.MoE(256, 128, 8, 2, shared_intermediate=128, reference=True)
    x = torch.randn(2, 5, 256)
    with pytest.raises(InputError, match="bf16 input.*float32.*autocast"):
        m(x)
    want = m(x.bfloat16())
    xg = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m(xg)
        logits = m.router(xg.reshape(-1, 256).float())
    assert got.dtype == torch.bfloat16 and got.shape == x.shape and torch.equal(got, want)
    assert logits.dtype == torch.bfloat16  # (what the router would have done inside autocast)
    got.float().sum().backward()
    assert xg.grad.dtype == torch.float32 and m.router.weight.grad is not None
