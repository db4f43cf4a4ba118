"""FP8 (e4m3, block scales): the quantisation, its transposed copies, the float64 emulation of
the layer the FP8 kernels will compute, and the spec (CPU)."""
import math
import subprocess
import sys

import pytest

from mokgen.ir import MoESpec, SpecError
from mokgen.schedule.plan import PlanError, make_plan

torch = pytest.importorskip("torch")


def weights(E, I, H, seed=0):
    g = torch.Generator().manual_seed(seed)
    wg = (torch.randn(E, I, H, generator=g) / math.sqrt(H)).bfloat16()
    wu = (torch.randn(E, I, H, generator=g) / math.sqrt(H)).bfloat16()
    wd = (torch.randn(E, H, I, generator=g) / math.sqrt(I)).bfloat16()
    return wg, wu, wd


def test_rows_quantise_per_128_with_the_block_max_at_448():
    from mokgen.fp8 import E4M3_MAX, FP8Error, dequantize_rows, quantize_rows

    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    x[3, :128] = 0.0  # an all-zero block: scale 1, values 0
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 4) and s.dtype == torch.float32
    assert s[3, 0] == 1.0 and (q[3, :128].float() == 0).all()
    assert torch.allclose(q.float().abs().reshape(64, 4, 128).amax(-1)[s != 1.0], torch.tensor(E4M3_MAX))
    err = ((dequantize_rows(q, s) - x.double()).norm() / x.double().norm()).item()
    assert 0.01 < err < 0.04  # 3 mantissa bits: about 2.6% rms on Gaussian values
    with pytest.raises(FP8Error, match="multiple of 128"):
        quantize_rows(torch.randn(4, 200))
    x[0, 0] = float("nan")
    with pytest.raises(FP8Error, match="NaN"):
        quantize_rows(x)


def test_the_transposed_copies_are_the_same_blocks():
    from mokgen.fp8 import quantize_blocks, quantize_experts

    from mokgen.fp8 import interleave_gate_up, split_gate_up

    wg, wu, wd = weights(3, 256, 384)
    ex = quantize_experts(wg, wu, wd)
    assert ex.gate_up.scales.shape == (3, 4, 3) and ex.down.scales.shape == (3, 3, 2)
    w13 = interleave_gate_up(wg, wu)
    assert torch.equal(w13[:, :64], wg[:, :64]) and torch.equal(w13[:, 64:128], wu[:, :64])
    assert torch.equal(w13[:, 128:192], wg[:, 64:128])
    g, u = split_gate_up(w13.transpose(1, 2))  # columns of a product with it come apart again
    assert torch.equal(g, wg.transpose(1, 2)) and torch.equal(u, wu.transpose(1, 2))
    for t, w in ((ex.gate_up_t, w13), (ex.down_t, wd)):
        q, s = quantize_blocks(w.transpose(1, 2).contiguous())  # quantising w^T afresh gives the same
        assert torch.equal(t.values.view(torch.uint8), q.view(torch.uint8)) and torch.equal(t.scales, s)


def test_weights_quantise_the_same_a_chunk_at_a_time_and_refuse_nan_in_any_chunk(monkeypatch):
    """quantize_experts takes its experts a chunk at a time (gate and up interleaved per chunk):
    one matrix a chunk gives the bits of all at once, and a NaN in the last chunk still raises."""
    import mokgen.fp8 as fp8

    wg, wu, wd = weights(5, 256, 384)
    whole = fp8.quantize_experts(wg, wu, wd)
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", 256 * 384)
    parts = fp8.quantize_experts(wg, wu, wd)
    for name in ("gate_up", "down", "gate_up_t", "down_t"):
        a, b = getattr(whole, name), getattr(parts, name)
        assert torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8)) and torch.equal(a.scales, b.scales)
    wu[4, 255, 383] = float("inf")
    with pytest.raises(fp8.FP8Error, match="NaN or Inf"):
        fp8.quantize_experts(wg, wu, wd)


def test_blockwise_products_equal_the_dequantised_product():
    from mokgen.fp8 import FP8Weights, _blockwise_matmul, dequantize_rows, quantize_blocks, quantize_rows

    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(37, 384, generator=g), torch.randn(256, 384, generator=g)
    aq, as_ = quantize_rows(a)
    bw = FP8Weights(*quantize_blocks(b))
    got = _blockwise_matmul(aq, as_, bw)
    want = dequantize_rows(aq, as_) @ bw.dequantize().t()
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def small_layer(routing, seed):
    """E8 K2 H512 I256, 96 tokens: the weights, x, ids and weights (dropped: token 0 and every
    third token's first slot empty), and the generator."""
    E, K, H, I, T = 8, 2, 512, 256, 96
    wg, wu, wd = weights(E, I, H)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    w, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), K, -1)
    ids = ids.int()
    if routing == "dropped":
        ids[::3, 0] = -1
        ids[0] = -1
    return wg, wu, wd, x, ids, w, g


@pytest.mark.parametrize("routing", ["uniform", "dropped"])
def test_the_emulated_fp8_layer_is_within_its_tolerance_of_the_reference(routing):
    from mokgen.fp8 import FP8_TOLERANCE, moe_fp8_emulated, quantize_experts
    from mokgen.reference import moe_reference, rel_error

    wg, wu, wd, x, ids, w, _ = small_layer(routing, 3)
    out = moe_fp8_emulated(x, ids, w, quantize_experts(wg, wu, wd))
    ref = moe_reference(x, ids, w, wg, wu, wd)
    err = rel_error(out, ref)
    assert 0.03 < err < FP8_TOLERANCE  # e4m3's rounding shows, and stays in its bound
    if routing == "dropped":
        assert (out[0] == 0).all()  # a token with every slot empty gets zeros


def test_the_fp8_spec_plans_its_forward(tmp_path):
    s = MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, dtype="fp8")
    assert s.variant == "e64_k8_h2048_i1024_fp8_sm90a"
    with pytest.raises(SpecError, match="multiple of 128"):
        MoESpec(experts=64, topk=8, hidden=2048, intermediate=960, dtype="fp8")
    plan = make_plan(s)
    assert plan.steps["forward"] == ["dispatch_count", "dispatch_scatter", "quantize_rows_fp8", "gemm_gateup_fp8",
                                     "gemm_down_fp8", "combine"]
    assert plan.steps["backward_data"] == ["dispatch_count", "dispatch_scatter", "quantize_rows_fp8",
                                           "quantize_dout_fp8", "bwd_recompute_fp8", "bwd_dgrad_down_fp8",
                                           "swiglu_backward_fp8", "bwd_dgrad_gateup_fp8", "bwd_combine"]
    assert plan.row_tile == 128 and "backward" not in plan.steps
    buffers = {b.name: b for b in plan.buffers}
    assert buffers["x_rows_q"].dtype == "e4m3" and buffers["x_rows_q"].shape[0] == buffers["y"].shape[0]
    bound = {a.tensor for k in plan.kernels for a in k.args}
    assert {"w13_q", "w13_scales", "w_down_q", "w_down_scales", "x", "topk_ids", "topk_weights", "out"} <= bound
    with pytest.raises(PlanError, match="one per node.*--nodes 2"):
        make_plan(MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, dtype="fp8", world_size=2,
                          topology="nvlink"))
    # over 2 GPUs, one per node: the node-local layer is the one-GPU FP8 variant of each GPU's experts
    r = subprocess.run([sys.executable, "-m", "mokgen.cli", "build", "--dtype", "fp8", "--world-size", "2",
                        "--topology", "nvlink", "--nodes", "2", "--no-compile", "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "e32_k8_h2048_i1024_fp8_sm90a" / "gemm_down_fp8.py").exists()
    assert (tmp_path / "e64_k8_h2048_i1024_fp8_w2nvlink_n2_sm90a" / "hierarchy.json").exists()
    r = subprocess.run([sys.executable, "-m", "mokgen.cli", "build", "--dtype", "fp8", "--no-compile", "--out",
                        str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0 and (tmp_path / s.variant / "gemm_down_fp8.py").exists(), r.stderr
    r = subprocess.run([sys.executable, "-m", "mokgen.cli", "show", str(tmp_path / s.variant)], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "quantize_rows_fp8 -> gemm_gateup_fp8" in r.stdout \
        and "every gradient (Variant.backward_fp8)" in r.stdout, \
        r.stderr


def test_moe_fp8_refuses_bad_input_before_any_launch():
    import mokgen
    from mokgen.fp8 import quantize_experts
    from mokgen.runtime import InputError

    E, I, H = 4, 128, 256
    wg, wu, wd = weights(E, I, H)
    experts = quantize_experts(wg, wu, wd)
    x = torch.randn(3, H).bfloat16()
    ids, w = torch.zeros(3, 2, dtype=torch.int32), torch.full((3, 2), 0.5)
    with pytest.raises(InputError, match="FP8Experts"):
        mokgen.moe_fp8(x, ids, w, (wg, wu, wd))
    with pytest.raises(InputError, match="CUDA"):
        mokgen.moe_fp8(x, ids, w, experts)


def test_the_fp8_plan_decides_its_k_loops_and_unit_counters_and_checks_overrides():
    """128 x 128 tiles: the K loop is unrolled whole while a unit's K blocks fit the instruction
    cache (E64: gate/up 2 x 16, down 8), a runtime loop past it (E256 H7168: gate/up 2 x 56);
    128 x 256 tiles: a runtime loop of FP8_WIDE_UNROLL blocks (unrolled whole, it spilled).
    Overrides replace that and nothing else is accepted; each GEMM claims its units from its own
    slot of the tile_counters that dispatch zeroes."""
    from mokgen.schedule.fp8 import FP8_UNROLLED_K_BLOCKS, FP8_WIDE_UNROLL

    narrow = {f"{g}.tile_n": 128 for g in ("gemm_gateup_fp8", "gemm_down_fp8")}

    def gemms(spec, overrides=None):
        plan = make_plan(spec, overrides=overrides)
        return plan, {k.name: k for k in plan.kernels}

    e64 = MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, dtype="fp8")
    plan, k = gemms(e64, narrow)
    assert k["gemm_gateup_fp8"].params["k_unroll"] == 0 and k["gemm_down_fp8"].params["k_unroll"] == 0
    plan, k = gemms(e64)
    assert k["gemm_gateup_fp8"].params["k_unroll"] == FP8_WIDE_UNROLL == k["gemm_down_fp8"].params["k_unroll"]
    slots = {k[n].params["sched_slot"] for n in ("gemm_gateup_fp8", "gemm_down_fp8")}
    assert len(slots) == 2
    counters = next(b for b in plan.buffers if b.name == "tile_counters")
    assert all(0 <= s < int(counters.shape[0]) for s in slots)
    assert all(any(a.tensor == "tile_counters" for a in k[n].args) for n in ("gemm_gateup_fp8", "gemm_down_fp8",
                                                                             "dispatch_count"))
    big = MoESpec(experts=256, topk=8, hidden=7168, intermediate=2048, dtype="fp8")
    plan, k = gemms(big, narrow)
    assert 2 * 7168 // 128 > FP8_UNROLLED_K_BLOCKS and k["gemm_gateup_fp8"].params["k_unroll"] == 1
    assert k["gemm_down_fp8"].params["k_unroll"] == 0 and any("K loop" in d for d in plan.decisions)
    plan, k = gemms(big, {"gemm_gateup_fp8.k_unroll": 4})
    assert k["gemm_gateup_fp8"].params["k_unroll"] == 4 and plan.overrides == {"gemm_gateup_fp8.k_unroll": 4}
    with pytest.raises(PlanError, match="takes the overrides"):
        make_plan(big, overrides={"row_tile": 64})
    with pytest.raises(PlanError, match="integer >= 0"):
        make_plan(big, overrides={"gemm_down_fp8.k_unroll": -1})


def test_fp8_gemms_take_128_x_256_tiles_where_n_allows():
    """Two weight tiles per unit where N is a multiple of 256 (fewer stages in the same shared
    memory, no stash for gate/up), 128 x 128 where it is not or where a cluster is asked for;
    the override tile_n picks, and an impossible one is refused."""
    def params(spec, overrides=None):
        return {k.name: k.params for k in make_plan(spec, overrides=overrides).kernels}

    p = params(MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, dtype="fp8"))
    gemms = ("gemm_gateup_fp8", "gemm_down_fp8", "bwd_recompute_fp8", "bwd_dgrad_down_fp8", "bwd_dgrad_gateup_fp8")
    assert all(p[g]["b_tiles"] == 2 and p[g]["stages"] == 4 for g in gemms)
    odd = MoESpec(experts=8, topk=2, hidden=1152, intermediate=512, dtype="fp8")  # H: 9 weight tiles
    p = params(odd)
    assert p["gemm_down_fp8"]["b_tiles"] == 1 and p["gemm_down_fp8"]["stages"] == 6
    assert p["gemm_gateup_fp8"]["b_tiles"] == 2
    with pytest.raises(PlanError, match="not a multiple of 256"):
        params(odd, {"gemm_down_fp8.tile_n": 256})
    with pytest.raises(PlanError, match="128 or 256"):
        params(odd, {"gemm_down_fp8.tile_n": 192})
    p = params(odd, {"gemm_gateup_fp8.cluster": 2})
    assert p["gemm_gateup_fp8"]["b_tiles"] == 1 and p["gemm_gateup_fp8"]["cluster_n"] == 2
    with pytest.raises(PlanError, match="do not take clusters"):
        params(odd, {"gemm_gateup_fp8.cluster": 2, "gemm_gateup_fp8.tile_n": 256})


def test_fp8_half_tail_units_take_row_token_last_and_only_wide_tiles():
    """half_tail (per GEMM): the kernel's tail units load half of A, so it takes row_token as its
    last argument (after the training gate/up's products); only 128 x 256 tiles take it."""
    from mokgen.schedule.fp8 import FP8_GEMMS as gemms, FP8_HALF_TAIL

    spec = MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, dtype="fp8")
    for on in (0, 1):
        kernels = {k.name: k for k in make_plan(spec, overrides={f"{g}.half_tail": on for g in gemms}).kernels}
        for name in (*gemms, "gemm_gateup_fp8_train"):
            k = kernels[name]
            assert k.params["half_tail"] == bool(on), name
            assert (k.args[-1].name == "row_token") == bool(on), name
        train = [a.name for a in kernels["gemm_gateup_fp8_train"].args]
        assert train[-2:] == (["products", "row_token"] if on else ["c_scales", "products"])
    assert all(k.params.get("half_tail", False) == bool(FP8_HALF_TAIL) for k in make_plan(spec).kernels
               if k.name in gemms)
    odd = MoESpec(experts=8, topk=2, hidden=1152, intermediate=512, dtype="fp8")  # the down GEMM: 128-wide tiles
    with pytest.raises(PlanError, match="only wide tiles"):
        make_plan(odd, overrides={"gemm_down_fp8.half_tail": 1})
    with pytest.raises(PlanError, match="0 or 1"):
        make_plan(spec, overrides={"gemm_down_fp8.half_tail": 2})
    # a debug build's stall sits in the full-tile load: the default yields to it, an override is refused
    broken = {k.name: k for k in make_plan(spec, overrides={"gemm_down_fp8.debug_break": 1}).kernels}
    assert not broken["gemm_down_fp8"].params["half_tail"]
    assert broken["gemm_gateup_fp8"].params["half_tail"] == bool(FP8_HALF_TAIL)
    with pytest.raises(PlanError, match="debug_break"):
        make_plan(spec, overrides={"gemm_down_fp8.debug_break": 1, "gemm_down_fp8.half_tail": 1})


def test_fp8_clusters_are_an_override_that_needs_paired_units():
    from mokgen.schedule.fp8 import cluster_n

    spec = MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, dtype="fp8")
    plan = make_plan(spec)
    assert all(k.params.get("cluster_n", 1) == 1 for k in plan.kernels)
    plan = make_plan(spec, overrides={"gemm_down_fp8.cluster": 2})
    assert {k.name: k.params.get("cluster_n") for k in plan.kernels}["gemm_down_fp8"] == 2
    with pytest.raises(PlanError, match="1 or 2"):
        make_plan(spec, overrides={"gemm_down_fp8.cluster": 4})
    with pytest.raises(PlanError, match="do not pair up"):
        cluster_n("gemm_gateup_fp8", 3, {"gemm_gateup_fp8.cluster": 2})


@pytest.mark.parametrize("routing", ["uniform", "dropped"])
def test_the_emulated_fp8_backward_data_is_within_its_tolerance_of_float64_autograd(routing):
    """dx and d_topk_weights of the FP8 backward's emulation (x, dout, the weights, and
    [da | db] rounded to e4m3; the products stored in bf16) against float64 autograd of the
    bf16 layer: e4m3's rounding shows and stays within FP8_TOLERANCE (measured 6.2-6.8% on
    three shapes and three routings)."""
    from mokgen.fp8 import FP8_TOLERANCE, join_gate_up, moe_fp8_backward_data_emulated, quantize_experts, split_gate_up
    from mokgen.reference import moe_reference_backward, rel_error
    from mokgen.verify import dot_error_scales, gradient_error

    a, b = torch.randn(3, 256), torch.randn(3, 256)
    assert all(torch.equal(p, q) for p, q in zip(split_gate_up(join_gate_up(a, b)), (a, b)))
    wg, wu, wd, x, ids, w, g = small_layer(routing, 5)
    dout = torch.randn(x.shape, generator=g).bfloat16()
    dx, dw = moe_fp8_backward_data_emulated(dout, x, ids, w, quantize_experts(wg, wu, wd))
    ref = moe_reference_backward(dout, x, ids, w, wg, wu, wd)
    assert 0.03 < rel_error(dx, ref["dx"]) < FP8_TOLERANCE
    err = gradient_error("d_topk_weights", dw, ref["d_topk_weights"], dot_error_scales(dout, x, ids, wg, wu, wd))
    assert 0.01 < err < FP8_TOLERANCE
    if routing == "dropped":
        assert (dx[0] == 0).all() and (dw[ids < 0] == 0).all()


def test_quantize_cols_blocks_each_columns_128_rows_contiguously():
    """quantize_cols: one scale per 128-row block of a column, the block's e4m3 values
    contiguous ([M / 128, N, 128]), each block exactly quantize_rows of that column slice."""
    from mokgen.fp8 import FP8Error, dequantize_rows, quantize_cols, quantize_rows

    rows = torch.randn(256, 384, generator=torch.Generator().manual_seed(7))
    rows[128:, 3] = 0.0  # an all-zero block: scale 1
    q, s = quantize_cols(rows)
    assert q.shape == (2, 384, 128) and s.shape == (2, 384) and s[1, 3] == 1.0
    for m, n in ((0, 0), (1, 5), (1, 383)):
        qq, ss = quantize_rows(rows[128 * m:128 * (m + 1), n][None])
        assert torch.equal(q[m, n].view(torch.uint8), qq[0].view(torch.uint8)) and s[m, n] == ss[0, 0]
    back = dequantize_rows(q, s[..., None]).transpose(1, 2).reshape(256, 384)
    assert (back - rows.double()).norm() / rows.norm() < 0.04
    with pytest.raises(FP8Error, match="multiple of 128"):
        quantize_cols(rows[:100])


def test_wgrad_emulation_is_the_blockwise_product_over_each_experts_rows():
    """wgrad_emulated: per expert, (its rows of A, dequantised)^T @ (its rows of B, dequantised),
    in float64; zeros for an expert without M tiles."""
    from mokgen.fp8 import dequantize_rows, quantize_cols, wgrad_emulated

    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(384, 256, generator=g), torch.randn(384, 128, generator=g)
    tile_expert = torch.tensor([0, 0, 2], dtype=torch.int32)
    a_t, b_t = quantize_cols(a), quantize_cols(b)
    got = wgrad_emulated(a_t, b_t, tile_expert, 3)

    def rows(t):  # the dequantised rows back in [M, N]
        return dequantize_rows(t[0], t[1][..., None]).transpose(1, 2).reshape(-1, t[0].shape[1])

    da, db = rows(a_t), rows(b_t)
    assert torch.allclose(got[0], da[:256].t() @ db[:256], rtol=1e-12, atol=1e-9)
    assert torch.allclose(got[2], da[256:].t() @ db[256:], rtol=1e-12, atol=1e-9)
    assert not got[1].any()


@pytest.mark.parametrize("routing", ["uniform", "dropped"])
def test_the_emulated_fp8_weight_gradients_are_within_their_tolerance_of_float64_autograd(routing):
    """d_w_gate, d_w_up, d_w_down of the FP8 backward's emulation (the weight gradients' operands
    quantised per 128-row block of each column, in dispatch's layout) against float64 autograd:
    e4m3's rounding shows and stays within FP8_TOLERANCE (measured 6.0-6.6% on two shapes);
    w_gate's and w_up's rows come apart right (a mixed-up interleave is off by ~100%)."""
    from mokgen.fp8 import FP8_TOLERANCE, moe_fp8_backward_emulated, quantize_experts
    from mokgen.reference import moe_reference_backward, rel_error

    wg, wu, wd, x, ids, w, g = small_layer(routing, 9)
    dout = torch.randn(x.shape, generator=g).bfloat16()
    got = moe_fp8_backward_emulated(dout, x, ids, w, quantize_experts(wg, wu, wd))
    ref = moe_reference_backward(dout, x, ids, w, wg, wu, wd)
    for k in ("dx", "d_w_gate", "d_w_up", "d_w_down"):
        assert 0.03 < rel_error(got[k], ref[k]) < FP8_TOLERANCE, k


def test_moe_fp8_train_refuses_bad_input_before_quantising():
    """mokgen.moe_fp8_train checks its inputs before it quantises anything or launches a kernel."""
    import mokgen
    from mokgen.runtime.checks import InputError

    E, I, H, T = 4, 256, 128, 8
    wg, wu = torch.zeros(E, I, H, dtype=torch.bfloat16), torch.zeros(E, I, H, dtype=torch.bfloat16)
    wd = torch.zeros(E, H, I, dtype=torch.bfloat16)
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    ids = torch.zeros(T, 2, dtype=torch.int32)
    with pytest.raises(InputError, match="CUDA"):  # (the rest of the checks need a GPU: test_fp8_gpu.py)
        mokgen.moe_fp8_train(x, ids, torch.zeros(T, 2), wg, wu, wd)


def test_quantize_experts_fp8_refuses_bad_weights_before_any_launch():
    """mokgen.quantize_experts_fp8 (the GPU quantisers) checks devices, dtypes, shapes and the
    128-multiples of the block scales before it looks for a variant or launches anything."""
    import mokgen
    from mokgen.runtime.checks import InputError

    E, I, H = 4, 256, 128
    wg, wu = torch.zeros(E, I, H, dtype=torch.bfloat16), torch.zeros(E, I, H, dtype=torch.bfloat16)
    wd = torch.zeros(E, H, I, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="CUDA"):
        mokgen.quantize_experts_fp8(wg, wu, wd, 2)
    with pytest.raises(InputError, match="3-d"):
        mokgen.quantize_experts_fp8(wg[0], wu, wd, 2)
