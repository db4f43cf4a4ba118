"""The torch ops' schemas, fake implementations and autograd formulas, on the CPU: a stand-in
variant (its Plan, no kernels) registers the ops, and fake tensors run forward and backward
through autograd, so the shapes of every saved tensor and gradient are checked without a GPU."""
import types

import pytest

from mokgen.ir import PRESETS, MoESpec

torch = pytest.importorskip("torch")

SPECS = [PRESETS["olmoe"], PRESETS["deepseek-v2-lite"], MoESpec(experts=40, topk=6, hidden=1536, intermediate=640)]


def stand_in_ops(spec, suffix):
    from mokgen.runtime import variant as V
    from mokgen.schedule.plan import make_plan

    v = types.SimpleNamespace(name=f"{spec.variant}_{suffix}", spec=spec, plan=make_plan(spec).to_dict())
    v.saved_shapes = lambda T: V.Variant.saved_shapes(v, T)
    return V._register_ops(v)


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
