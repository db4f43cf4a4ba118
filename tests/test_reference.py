import pytest
import torch

from mokgen.ir import MoESpec
from mokgen.reference import moe_reference, moe_reference_backward, rel_error, route_reference


def small(T=9, E=5, K=2, H=16, I=8, S=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    logits = torch.randn(T, E, generator=g)
    ids, w = route_reference(logits, K, True)
    ws = [torch.randn(E, I, H, generator=g).bfloat16() * 0.3 for _ in range(2)]
    wd = torch.randn(E, H, I, generator=g).bfloat16() * 0.3
    shared = [None] * 3
    if S:
        shared = [torch.randn(S, H, generator=g).bfloat16(), torch.randn(S, H, generator=g).bfloat16(),
                  torch.randn(H, S, generator=g).bfloat16()]
    return x, ids, w.float(), ws[0], ws[1], wd, shared


def test_reference_matches_a_dense_formulation():
    x, ids, w, wg, wu, wd, _ = small()
    out = moe_reference(x, ids, w, wg, wu, wd)
    dense = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            xt = x[t].double()
            h = torch.nn.functional.silu(wg[e].double() @ xt) * (wu[e].double() @ xt)
            dense[t] += w[t, k].double() * (wd[e].double() @ h)
    assert rel_error(out, dense) < 1e-12


def test_route_reference_topk_and_renormalisation():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0]])
    ids, w = route_reference(logits, 2, False)
    assert ids.tolist() == [[1, 3]]  # tie goes to the lower id first
    ids, w = route_reference(logits, 3, True)
    assert abs(w.sum().item() - 1) < 1e-12


def test_backward_reference_d_topk_weights_is_dot_with_y():
    x, ids, w, wg, wu, wd, shared = small(S=8)
    dout = torch.randn(x.shape, dtype=torch.float64)
    g = moe_reference_backward(dout, x, ids, w, wg, wu, wd, *shared)
    assert set(g) == {"dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down", "d_ws_gate", "d_ws_up", "d_ws_down"}
    t, k = 3, 1
    e = int(ids[t, k])
    y = moe_reference(x[t:t + 1], torch.tensor([[e]]), torch.ones(1, 1), wg, wu, wd)
    assert torch.allclose(g["d_topk_weights"][t, k], (dout[t] * y[0]).sum())


def test_backward_reference_of_a_call_with_every_slot_empty():
    # (mokgen verify --routing dropped at T=1 empties the only token's slots: the reference has
    # no graph then, and every gradient is zero)
    x, ids, w, wg, wu, wd, _ = small(T=1)
    g = moe_reference_backward(torch.randn(x.shape, dtype=torch.float64), x, torch.full_like(ids, -1), w, wg, wu, wd)
    assert all(not t.any() for t in g.values()) and g["d_w_down"].shape == wd.shape


def test_rel_error_never_passes_nan():
    ref = torch.ones(4)
    assert rel_error(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref) == float("inf")


@pytest.mark.parametrize("shared", [0, 128])
def test_torch_baselines_compute_the_layer(shared):
    # The bench's baselines must compute what the generated op computes, shared expert included.
    from mokgen.bench import torch_grouped_mm, torch_loop
    from mokgen.verify import make_inputs

    spec = MoESpec(experts=4, topk=2, hidden=128, intermediate=64, shared_intermediate=shared)
    x, ids, w, wg, wu, wd, (sg, su, sd) = make_inputs(spec, 33, "skewed", torch.Generator().manual_seed(0),
                                                      device="cpu")
    ref = moe_reference(x, ids, w, wg, wu, wd, sg, su, sd)
    ws = (torch.cat([sg, su]), sd) if shared else None
    assert rel_error(torch_loop(x, ids, w, wg, wu, wd, ws), ref) < 1e-2
    assert rel_error(torch_grouped_mm(x, ids, w, torch.cat([wg, wu], 1), wd, 64, ws), ref) < 1e-2


def test_reference_backward_memory_estimate():
    """`mokgen verify` reports a backward as not checked, before any GPU work, where its float64
    reference (every weight and its gradient in float64) would not fit: E256 K8 H7168 I2048's
    takes about 180 GB, more than an H200 holds; E64 K8 H2048 I1024's about 9 GB at T = 4096."""
    from mokgen.ir import MoESpec
    from mokgen.verify import reference_backward_bytes

    e256 = MoESpec(experts=256, topk=8, hidden=7168, intermediate=2048)
    assert reference_backward_bytes(e256, 1) >= 16 * 256 * 3 * 7168 * 2048 > 141 * 2**30
    olmoe = MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024)
    assert 16 * 64 * 3 * 2048 * 1024 < reference_backward_bytes(olmoe, 4096) < 16 * 2**30
    assert reference_backward_bytes(olmoe, 16384) > reference_backward_bytes(olmoe, 4096)
