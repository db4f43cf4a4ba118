"""Golden tests of the FP8 kernels on the GPU (docs/fp8.md): each against its float64
emulation from the same quantised operands (mokgen/fp8.py), the emulation rounded to bf16 as
the kernel rounds its output. They need the FP8 variants built (benchmarks/build_gpu_variants.py)."""
import pytest

from mokgen.ir import MoESpec
from mokgen.schedule.fp8 import FP8_GEMMS

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

FP8_SHAPES = [(8, 2, 1024, 512), (64, 8, 2048, 1024)]
# The rows' quantiser also at a hidden size of 9 scale blocks, not a whole number of a warp's
# steps of 4 blocks (templates/quantize_rows_fp8.py.j2; benchmarks/build_gpu_variants.py builds it)
ROWS_SHAPES = FP8_SHAPES + [(8, 2, 1152, 512)]
# Builds with Plan overrides the GEMM golden tests also run (benchmarks/build_gpu_variants.py
# builds them under generated/experiments/<name>): None is the default build.
FP8_EXPERIMENTS = {"fp8_cluster": {"gemm_gateup_fp8.cluster": 2, "gemm_down_fp8.cluster": 2},
                   # 128 x 128 tiles (two block accumulators per warpgroup) in every forward and dgrad
                   # GEMM, where the default takes 128 x 256
                   "fp8_narrow": {f"{g}.tile_n": 128 for g in FP8_GEMMS},
                   # a tail unit (tokens in its M tile's first half only) loads all of A in every forward
                   # and dgrad GEMM, as every unit does, where the default loads half
                   "fp8_full_tail": {f"{g}.half_tail": 0 for g in FP8_GEMMS}}
BUILDS = [None, *FP8_EXPERIMENTS]


def fp8_variant(shape, experiment=None):
    import mokgen
    from mokgen.runtime import variants_root

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    E, K, H, I = shape
    spec = MoESpec(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8")
    path = variants_root() / ("experiments/" + experiment if experiment else "") / spec.variant
    if not (path / "build").is_dir():
        pytest.skip(f"{path} is not built (benchmarks/build_gpu_variants.py)")
    return mokgen.load(spec) if experiment is None else mokgen.load(path)


def routed_case(shape, T, routing, seed, experiment=None):
    """A golden case's variant, the layer's bf16 inputs (make_inputs) for this routing, dispatch's
    row layout of its pairs, and a generator for more."""
    from mokgen.verify import make_inputs

    v = fp8_variant(shape, experiment)
    E, K, H, I = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    inputs = make_inputs(MoESpec(experts=E, topk=K, hidden=H, intermediate=I), T, routing, g)
    return v, inputs, row_layout(inputs[1].cpu(), E), g


def tile_counters(v):
    """The GEMMs' unit counters, zeroed (in a forward, dispatch zeroes them)."""
    n = int(next(b for b in v.plan["buffers"] if b["name"] == "tile_counters")["shape"][0])
    return torch.zeros(n, dtype=torch.int32, device="cuda")


def row_layout(ids, E, tile_m=128):
    """dispatch's layout of the pairs: each expert's rows in (token, slot) order from a
    multiple of tile_m; (rows, tile_expert, expert of each used row or -1)."""
    counts = torch.bincount(ids[ids >= 0].long().flatten(), minlength=E).tolist()
    tiles = [(c + tile_m - 1) // tile_m for c in counts]
    tile_expert = [e for e in range(E) for _ in range(tiles[e])]
    rows = sum(tiles) * tile_m
    row_expert = torch.full((rows,), -1, dtype=torch.long)
    start = 0
    for e in range(E):
        row_expert[start:start + counts[e]] = e
        start += tiles[e] * tile_m
    # one unused M tile past the used ones (-1), as dispatch leaves them; its rows are allocated
    row_expert = torch.cat([row_expert, torch.full((tile_m,), -1, dtype=torch.long)])
    return rows + tile_m, torch.tensor(tile_expert + [-1], dtype=torch.int32), row_expert


def token_rows(row_expert):
    """row_token as far as the plain GEMMs read it (a half_tail build: which rows hold tokens):
    0 on a row with a pair, -1 on padding."""
    return torch.where(row_expert >= 0, 0, -1).to(torch.int32).cuda()


def pair_rows(ids, row_expert, E):
    """dispatch's tables for a routing: row_token [rows] (each expert's pairs in (token, slot)
    order from its first row; -1 on padding rows) and pos [T, K] (the pairs' rows; left
    unwritten, -7 here, for pairs without a row: kernels must not read it for them)."""
    row_token = torch.full((len(row_expert),), -1, dtype=torch.int32)
    pos = torch.full(tuple(ids.shape), -7, dtype=torch.int32)
    for e in range(E):
        pairs = (ids.cpu() == e).nonzero()
        if pairs.numel():
            first = (row_expert == e).nonzero()[0, 0].item()
            row_token[first:first + len(pairs)] = pairs[:, 0].to(torch.int32)
            pos[pairs[:, 0], pairs[:, 1]] = torch.arange(first, first + len(pairs), dtype=torch.int32)
    return row_token.cuda(), pos.cuda()


def check_plain_gemm(v, entry, names, a, weights, tile_expert, row_expert):
    """Run one of the plain FP8 GEMMs (bf16 C = A @ B[e]^T per used M tile, templates/
    grouped_gemm_fp8.py.j2) on A [rows, K] (float; padding rows zero), quantised per row, and
    weights (FP8Weights [E, N, K]); poisoned C; against the float64 emulation rounded to bf16
    within EMULATION_TOLERANCE (no requantisation after it). names: the A, B and C tensors."""
    from mokgen.fp8 import EMULATION_TOLERANCE, FP8Weights, _blockwise_matmul, quantize_rows
    from mokgen.reference import rel_error

    a_name, b_name, c_name = names
    rows, N = a.shape[0], weights.values.shape[1]
    a_q, a_s = quantize_rows(a)
    c = torch.full((rows, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    v.run(entry, {a_name: a_q, a_name[:-2] + "_scales": a_s, b_name: weights.values,
                  b_name[:-2] + "_scales": weights.scales, "tile_counters": tile_counters(v),
                  "tile_expert": tile_expert.cuda(), "row_token": token_rows(row_expert), c_name: c},
          torch.device("cuda"))
    torch.cuda.synchronize()
    ref = torch.zeros(rows, N, dtype=torch.float64, device="cuda")
    used = torch.zeros(rows, dtype=torch.bool, device="cuda")
    for m, e in enumerate(tile_expert.tolist()):
        if e >= 0:
            sl = slice(m * 128, (m + 1) * 128)
            used[sl] = True
            ref[sl] = _blockwise_matmul(a_q[sl], a_s[sl], FP8Weights(weights.values[e], weights.scales[e]))
    assert not torch.isnan(c[used].float()).any(), "unwritten rows of used M tiles"
    err = rel_error(c[used], ref[used].to(torch.bfloat16).double())
    assert err <= EMULATION_TOLERANCE, f"relative error {err:.2e} against the bf16-rounded emulation"


@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("T", [1, 1000, 4096])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b or "default")
def test_down_gemm_fp8_golden(shape, T, routing, build):
    from mokgen.fp8 import FP8Weights, quantize_blocks

    E, K, H, I = shape
    v, (_, ids, _, _, _, wd, _), (rows, tile_expert, row_expert), g = routed_case(shape, T, routing,
                                                                                  T * 7 + len(routing), build)
    h = torch.randn(rows, I, device="cuda", generator=g)
    h[row_expert.cuda() < 0] = 0.0  # padding rows hold zeros
    check_plain_gemm(v, "gemm_down_fp8", ("h_q", "w_down_q", "y"), h, FP8Weights(*quantize_blocks(wd)), tile_expert,
                     row_expert)


@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("T", [1, 1000, 4096])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
@pytest.mark.parametrize("which", ["down", "gateup"])
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b or "default")
def test_dgrad_gemms_fp8_golden(shape, T, routing, which, build):
    """The backward's FP8 data gradients over the transposed weight copies of quantize_experts:
    dh = dy @ w_down (B = down_t) and dxs = [da | db] @ [w_gate; w_up] (B = gate_up_t, the
    2I columns interleaved per 64 as the gate/up GEMM writes them)."""
    from mokgen.fp8 import quantize_experts

    E, K, H, I = shape
    v, (_, ids, _, wg, wu, wd, _), (rows, tile_expert, row_expert), g = routed_case(shape, T, routing,
                                                                                    T * 19 + len(routing), build)
    experts = quantize_experts(wg, wu, wd)
    k_size = H if which == "down" else 2 * I
    a = torch.randn(rows, k_size, device="cuda", generator=g)
    a[row_expert.cuda() < 0] = 0.0
    if which == "down":
        check_plain_gemm(v, "bwd_dgrad_down_fp8", ("dy_q", "w_down_t_q", "dh"), a, experts.down_t, tile_expert,
                         row_expert)
    else:
        check_plain_gemm(v, "bwd_dgrad_gateup_fp8", ("dab_q", "w13_t_q", "dxs"), a, experts.gate_up_t,
                         tile_expert, row_expert)


@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("T", [1, 1000, 4096])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b or "default")
def test_gate_up_gemm_fp8_golden(shape, T, routing, build):
    """h in e4m3 with its 1 x 128 scales, from the routed rows of x in e4m3 and the interleaved
    gate/up weights, against the emulation (float64 products, SwiGLU, quantised from fp32):
    the scales within 2e-3 and h dequantised within REQUANTIZED_TOLERANCE (the tensor cores'
    accumulation moves ~1% of h's codes one step), and h as close to the exact (unquantised,
    float64) SwiGLU as the emulation's own h."""
    from mokgen.fp8 import (REQUANTIZED_TOLERANCE, FP8Weights, split_gate_up, _blockwise_matmul, dequantize_rows, interleave_gate_up,
                            quantize_blocks, quantize_rows, swiglu_quantized)
    from mokgen.reference import rel_error

    E, K, H, I = shape
    v, (_, ids, _, wg, wu, _, _), (rows, tile_expert, row_expert), g = routed_case(shape, T, routing,
                                                                                   T * 11 + len(routing), build)
    x_rows = torch.randn(rows, H, device="cuda", generator=g)
    x_rows[row_expert.cuda() < 0] = 0.0  # padding rows: zeros (scale 1)
    xq, xs = quantize_rows(x_rows)
    w_q, w_s = quantize_blocks(interleave_gate_up(wg, wu))
    h_q = torch.full((rows, I), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    h_s = torch.full((rows, I // 128), float("nan"), device="cuda")
    v.run("gemm_gateup_fp8", dict(x_rows_q=xq, x_rows_scales=xs, w13_q=w_q, w13_scales=w_s, tile_counters=tile_counters(v),
                                  tile_expert=tile_expert.cuda(), row_token=token_rows(row_expert), h_q=h_q,
                                  h_scales=h_s), torch.device("cuda"))
    torch.cuda.synchronize()
    used = torch.zeros(rows, dtype=torch.bool, device="cuda")
    ref_q = torch.zeros(rows, I, dtype=torch.float8_e4m3fn, device="cuda")
    ref_s = torch.ones(rows, I // 128, device="cuda")
    exact = torch.zeros(rows, I, dtype=torch.float64, device="cuda")
    for m, e in enumerate(tile_expert.tolist()):
        if e >= 0:
            sl = slice(m * 128, (m + 1) * 128)
            used[sl] = True
            a13 = _blockwise_matmul(xq[sl], xs[sl], FP8Weights(w_q[e], w_s[e]))
            ref_q[sl], ref_s[sl] = swiglu_quantized(a13)
            ga, gb = split_gate_up(a13)
            exact[sl] = ga / (1.0 + torch.exp(-ga)) * gb
    got_s = h_s[used]
    if not used.any():
        return  # (every slot dropped: no M tile is used)
    assert not torch.isnan(got_s).any(), "unwritten h scales in used M tiles"
    # a scale is its block's amax / 448, so it carries the tensor cores' accumulation error
    # (measured up to 1.1e-3; mokgen/fp8.py, REQUANTIZED_TOLERANCE)
    scale_err = ((got_s - ref_s[used]).abs() / ref_s[used]).max().item()
    assert scale_err <= 2e-3, f"h scales: largest relative difference {scale_err:.2e}"
    got = dequantize_rows(h_q[used], h_s[used])
    assert not torch.isnan(got).any(), "unwritten h in used M tiles"
    err = rel_error(got, dequantize_rows(ref_q[used], ref_s[used]))
    assert err <= REQUANTIZED_TOLERANCE, f"relative error {err:.2e} against the emulation"
    # (e4m3's own rounding of h: 2.26% both; the kernel's codes may not be systematically worse)
    ours, emulated = rel_error(got, exact[used]), rel_error(dequantize_rows(ref_q[used], ref_s[used]), exact[used])
    assert ours <= emulated * 1.01 + 1e-12, f"h: {ours:.4e} from the exact SwiGLU, the emulation {emulated:.4e}"


@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("T", [1, 1000, 4096])
@pytest.mark.parametrize("shape", ROWS_SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
def test_quantize_rows_fp8_golden(shape, T, routing):
    """The routed rows of x in dispatch's order, in e4m3 with 1 x 128 scales, as
    mokgen.fp8.quantize_rows of those rows (zeros and scale 1 on padding rows): bit for bit (both
    divide in IEEE fp32). Each token is quantised once and stored to its rows; empty slots (the
    dropped routing) have none."""
    from mokgen.fp8 import quantize_rows

    E, K, H, I = shape
    v, (x, ids, _, _, _, _, _), (rows, tile_expert, row_expert), g = routed_case(shape, T, routing,
                                                                                 T * 13 + len(routing))
    row_token, pos = pair_rows(ids, row_expert, E)
    xq = torch.full((rows, H), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    xs = torch.full((rows, H // 128), float("nan"), device="cuda")
    v.run("quantize_rows_fp8", dict(x=x, topk_ids=ids, pos=pos, row_token=row_token,
                                    tile_expert=tile_expert.cuda(), x_rows_q=xq, x_rows_scales=xs),
          torch.device("cuda"))
    torch.cuda.synchronize()
    used = torch.repeat_interleave(tile_expert >= 0, 128)[:rows].cuda()
    src = torch.where((row_token >= 0)[:, None], x[row_token.clamp(min=0).long()].float(), 0.0)
    want_q, want_s = quantize_rows(src[used])
    assert not torch.isnan(xs[used]).any(), "unwritten scales"
    assert torch.equal(xs[used], want_s), "scales"
    assert torch.equal(xq[used].view(torch.uint8), want_q.view(torch.uint8)), "e4m3 values"


@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("T", [1, 7, 1000, 4096])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b or "default")
def test_fp8_forward_golden(shape, T, routing, build):
    """mokgen.moe_fp8, the whole FP8 forward (dispatch, the rows in e4m3, gate/up, down,
    combine), poisoned workspace and output: against the float64 emulation from the same
    quantised operands within REQUANTIZED_TOLERANCE (h is quantised again), and against the bf16 layer's float64 reference within the
    FP8 tolerance."""
    import mokgen
    from mokgen.fp8 import FP8_TOLERANCE, REQUANTIZED_TOLERANCE, moe_fp8_emulated, quantize_experts
    from mokgen.reference import moe_reference, rel_error

    v, (x, ids, w, wg, wu, wd, _), _, _ = routed_case(shape, T, routing, T * 17 + len(routing), build)
    experts = quantize_experts(wg, wu, wd)
    v.poison = True
    try:
        # (an experiment's build is not the one mokgen.moe_fp8 finds: its variant runs it)
        out = mokgen.moe_fp8(x, ids, w, experts) if build is None else v.forward_fp8(x, ids, w, experts)
    finally:
        v.poison = False
    mokgen.check_errors()
    assert not torch.isnan(out.float()).any(), "unwritten output rows"
    err = rel_error(out, moe_fp8_emulated(x, ids, w, experts).to(torch.bfloat16).double())
    assert err <= REQUANTIZED_TOLERANCE, f"relative error {err:.2e} against the emulation"
    assert rel_error(out, moe_reference(x, ids, w, wg, wu, wd)) <= FP8_TOLERANCE


@pytest.mark.parametrize("routing", ["uniform", "dropped"])
@pytest.mark.parametrize("T", [1, 1000])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b or "default")
def test_recompute_gemm_fp8_golden(shape, T, routing, build):
    """The backward's recompute of the gate/up products (bf16, interleaved): the plain GEMM over
    the interleaved weights."""
    from mokgen.fp8 import FP8Weights, interleave_gate_up, quantize_blocks

    E, K, H, I = shape
    v, (_, ids, _, wg, wu, _, _), (rows, tile_expert, row_expert), g = routed_case(shape, T, routing,
                                                                                   T * 23 + len(routing), build)
    x_rows = torch.randn(rows, H, device="cuda", generator=g)
    x_rows[row_expert.cuda() < 0] = 0.0
    check_plain_gemm(v, "bwd_recompute_fp8", ("x_rows_q", "w13_q", "a13"), x_rows,
                     FP8Weights(*quantize_blocks(interleave_gate_up(wg, wu))), tile_expert, row_expert)


@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("T", [1, 7, 1000, 4096])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b or "default")
def test_fp8_backward_data_golden(shape, T, routing, build):
    """The FP8 backward's data gradients (dx, d_topk_weights; Variant.backward_data_fp8:
    dispatch, x and dout in e4m3, the products recomputed, dh, the SwiGLU backward writing
    [da | db] in e4m3, dx's rows, their sum per token), poisoned outputs and workspace: against
    the float64 emulation of the same quantisation within REQUANTIZED_TOLERANCE, and against
    float64 autograd of the bf16 layer within FP8_TOLERANCE."""
    import mokgen
    from mokgen.fp8 import FP8_TOLERANCE, REQUANTIZED_TOLERANCE, moe_fp8_backward_data_emulated, quantize_experts
    from mokgen.reference import moe_reference_backward, rel_error
    from mokgen.verify import dot_error_scales, gradient_error

    v, (x, ids, w, wg, wu, wd, _), _, g = routed_case(shape, T, routing, T * 29 + len(routing), build)
    experts = quantize_experts(wg, wu, wd)
    dout = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    v.poison = True
    try:
        dx, dw = v.backward_data_fp8(dout, x, ids, w, experts)
    finally:
        v.poison = False
    mokgen.check_errors()
    v.check_errors()
    assert not torch.isnan(dx.float()).any() and not torch.isnan(dw).any(), "unwritten gradients"
    scale = dot_error_scales(dout, x, ids, wg, wu, wd)
    emu_dx, emu_dw = moe_fp8_backward_data_emulated(dout, x, ids, w, experts)
    err = rel_error(dx, emu_dx.to(torch.bfloat16).double())
    assert err <= REQUANTIZED_TOLERANCE, f"dx: relative error {err:.2e} against the emulation"
    err = gradient_error("d_topk_weights", dw, emu_dw, scale)
    assert err <= REQUANTIZED_TOLERANCE, f"d_topk_weights: relative error {err:.2e} against the emulation"
    if routing == "dropped":
        assert (dw[ids < 0] == 0).all(), "an empty slot's d_topk_weights is not 0"
    pairs = int(((ids >= 0) & (ids < shape[0])).sum())
    if pairs == 0:  # (nothing routed: zeros, and no graph for autograd to differentiate)
        assert not dx.any() and not dw.any()
        return
    ref = moe_reference_backward(dout, x, ids, w, wg, wu, wd)
    assert rel_error(dx, ref["dx"]) <= FP8_TOLERANCE
    # d_topk_weights holds one number per pair: with a handful of pairs, e4m3's rounding error
    # (6.5% rms) is a small sample, and the float64 emulation itself measures up to 10.7% (9
    # pairs, 30 seeds); the emulation comparison above is what checks the kernels there.
    if pairs >= 256:
        assert gradient_error("d_topk_weights", dw, ref["d_topk_weights"], scale) <= FP8_TOLERANCE


@pytest.mark.parametrize("routing", ["uniform", "dropped"])
@pytest.mark.parametrize("T", [7, 1000])
def test_moe_fp8_autograd_gives_the_fp8_backward_data_gradients(T, routing):
    """mokgen.moe_fp8 under autograd: x.grad and topk_weights.grad are the FP8 backward's data
    gradients (against their float64 emulation within REQUANTIZED_TOLERANCE); the FP8 experts
    are frozen (no gradient reaches them)."""
    import mokgen
    from mokgen.fp8 import REQUANTIZED_TOLERANCE, moe_fp8_backward_data_emulated, quantize_experts
    from mokgen.reference import rel_error
    from mokgen.verify import dot_error_scales, gradient_error

    shape = FP8_SHAPES[1]
    _, (x, ids, w, wg, wu, wd, _), _, g = routed_case(shape, T, routing, T * 31 + len(routing))
    experts = quantize_experts(wg, wu, wd)
    dout = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = mokgen.moe_fp8(xr, ids, wr, experts)
    assert out.requires_grad and torch.equal(out.detach(), mokgen.moe_fp8(x, ids, w, experts))
    out.backward(dout)
    emu_dx, emu_dw = moe_fp8_backward_data_emulated(dout, x, ids, w, experts)
    assert rel_error(xr.grad, emu_dx.to(torch.bfloat16).double()) <= REQUANTIZED_TOLERANCE
    scale = dot_error_scales(dout, x, ids, wg, wu, wd)
    assert gradient_error("d_topk_weights", wr.grad, emu_dw, scale) <= REQUANTIZED_TOLERANCE


@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("T", [1, 1000, 4096])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
def test_quantize_cols_fp8_golden(shape, T, routing):
    """The weight gradients' operand copies (quantize_x_t_fp8, quantize_dout_t_fp8): x's routed
    rows, gathered, in e4m3 with one scale per 128-row block of each column, each block's
    values contiguous: bit for bit mokgen.fp8.quantize_cols of those rows (zeros on padding
    rows), in every used M tile."""
    from mokgen.fp8 import quantize_cols

    E, K, H, I = shape
    v, (x, ids, _, _, _, _, _), (rows, tile_expert, row_expert), g = routed_case(shape, T, routing,
                                                                                 T * 37 + len(routing))
    # Values that test the quantiser's division (a reciprocal and one corrected step): a column
    # of negative zeros (-0 in e4m3), quotients that are exactly 448 or an e4m3 rounding tie
    # (0.796875 / 0.75 = 1.0625), and one that underflows fp32.
    x[:, 3] = -0.0
    x[:, 5] = 0.796875
    x[0, 5] = 336.0
    x[-1, 6] = 1e-30
    row_token, _ = pair_rows(ids, row_expert, E)
    mt = tile_expert.shape[0]
    src = torch.where((row_token >= 0)[:, None], x[row_token.clamp(min=0).long()].float(), 0.0)
    want_q, want_s = quantize_cols(src)
    used = (tile_expert >= 0).cuda()
    for entry, name in (("quantize_x_t_fp8", "x"), ("quantize_dout_t_fp8", "dout")):
        out = "xt" if name == "x" else "doutt"
        q = torch.full((mt, H, 128), float("nan"), device="cuda").to(torch.float8_e4m3fn)
        s = torch.full((mt, H), float("nan"), device="cuda")
        v.run(entry, {name: x, "row_token": row_token, "tile_expert": tile_expert.cuda(), f"{out}_q": q,
                      f"{out}_scales": s}, torch.device("cuda"))
        torch.cuda.synchronize()
        assert not torch.isnan(s[used]).any(), f"{entry}: unwritten scales"
        assert torch.equal(s[used], want_s[used]), f"{entry}: scales"
        assert torch.equal(q[used].view(torch.uint8), want_q[used].view(torch.uint8)), f"{entry}: e4m3 values"


@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("T", [1, 1000, 4096])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
@pytest.mark.parametrize("which", ["down", "gateup"])
def test_wgrad_gemms_fp8_golden(shape, T, routing, which):
    """The FP8 weight-gradient GEMMs: per expert, the sum over its M tiles of the transposed
    operands' tile products (rows in e4m3 with one scale per 128-row block of each column),
    poisoned C: against wgrad_emulated rounded to bf16 within EMULATION_TOLERANCE, and zeros
    for an expert without rows."""
    from mokgen.fp8 import EMULATION_TOLERANCE, interleave_gate_up, quantize_cols, wgrad_emulated
    from mokgen.reference import rel_error

    E, K, H, I = shape
    v, (_, ids, _, _, _, _, _), (rows, tile_expert, row_expert), g = routed_case(shape, T, routing,
                                                                                 T * 41 + len(routing))
    n1, n2, a, b = (H, I, "doutt", "hwt") if which == "down" else (2 * I, H, "dabt", "xt")
    real = (row_expert >= 0).cuda()[:, None]
    a_rows = torch.where(real, torch.randn(rows, n1, device="cuda", generator=g), 0.0)
    b_rows = torch.where(real, torch.randn(rows, n2, device="cuda", generator=g), 0.0)
    a_t, b_t = quantize_cols(a_rows), quantize_cols(b_rows)
    # (gate/up: C's rows are w_gate's and w_up's interleaved per 64; the kernel writes them apart)
    outs = {"d_w_down": (E, n1, n2)} if which == "down" else {"d_w_gate": (E, I, H), "d_w_up": (E, I, H)}
    outs = {k: torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda") for k, shape in outs.items()}
    v.run(f"wgrad_{which}_fp8", {f"{a}_q": a_t[0], f"{a}_scales": a_t[1], f"{b}_q": b_t[0], f"{b}_scales": b_t[1],
                                 "tile_expert": tile_expert.cuda(), "tile_counters": tile_counters(v), **outs},
          torch.device("cuda"))
    torch.cuda.synchronize()
    got = outs["d_w_down"] if which == "down" else interleave_gate_up(outs["d_w_gate"], outs["d_w_up"])
    assert not torch.isnan(got.float()).any(), "unwritten tiles"
    want = wgrad_emulated(a_t, b_t, tile_expert, E)
    empty = [e for e in range(E) if not (tile_expert == e).any()]
    assert all(not got[e].any() for e in empty), "an expert without rows got a non-zero gradient"
    err = rel_error(got, want.to(torch.bfloat16).double())
    assert err <= EMULATION_TOLERANCE, f"relative error {err:.2e} against the bf16-rounded emulation"


@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("T", [1, 7, 1000, 4096])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b or "default")
def test_fp8_backward_golden(shape, T, routing, build):
    """Every gradient of the FP8 layer (Variant.backward_fp8: the data gradients' chain, the
    weight gradients' operands quantised per 128-row block of each column, the FP8 weight-
    gradient GEMMs), poisoned outputs and workspace: against the float64 emulation of the same
    quantisation within REQUANTIZED_TOLERANCE, and (with enough pairs to be a fair sample of
    e4m3's rounding) against float64 autograd of the bf16 layer within FP8_TOLERANCE; zeros for
    an expert without rows."""
    import mokgen
    from mokgen.fp8 import FP8_TOLERANCE, REQUANTIZED_TOLERANCE, moe_fp8_backward_emulated, quantize_experts
    from mokgen.reference import moe_reference_backward
    from mokgen.verify import dot_error_scales, gradient_error

    E = shape[0]
    v, (x, ids, w, wg, wu, wd, _), _, g = routed_case(shape, T, routing, T * 43 + len(routing), build)
    experts = quantize_experts(wg, wu, wd)
    dout = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    v.poison = True
    try:
        got = v.backward_fp8(dout, x, ids, w, experts)
    finally:
        v.poison = False
    mokgen.check_errors()
    v.check_errors()
    assert not [k for k, t in got.items() if torch.isnan(t.float()).any()], "unwritten gradients"
    scale = dot_error_scales(dout, x, ids, wg, wu, wd)
    want = moe_fp8_backward_emulated(dout, x, ids, w, experts)
    for k in want:
        ref = want[k] if k == "d_topk_weights" else want[k].to(torch.bfloat16).double()
        err = gradient_error(k, got[k], ref, scale)
        assert err <= REQUANTIZED_TOLERANCE, f"{k}: relative error {err:.2e} against the emulation"
    for e in range(E):
        if not (ids == e).any():
            assert not got["d_w_down"][e].any() and not got["d_w_gate"][e].any(), f"expert {e} has no rows"
    pairs = int(((ids >= 0) & (ids < E)).sum())
    if pairs >= 256:
        ref = moe_reference_backward(dout, x, ids, w, wg, wu, wd)
        for k in want:
            assert gradient_error(k, got[k], ref[k], scale) <= FP8_TOLERANCE, k


@pytest.mark.parametrize("routing", ["uniform", "dropped"])
@pytest.mark.parametrize("T", [7, 1000])
def test_moe_fp8_train_autograd_gives_every_fp8_gradient(T, routing):
    """mokgen.moe_fp8_train over bf16 weights under autograd: the output is moe_fp8's with the
    experts quantised from them, and x, topk_weights and the three weights get the FP8
    backward's gradients (Variant.backward_fp8, against its float64 emulation); bad weights are
    refused before any launch."""
    import mokgen
    from mokgen.fp8 import REQUANTIZED_TOLERANCE, moe_fp8_backward_emulated, quantize_experts
    from mokgen.runtime.checks import InputError
    from mokgen.verify import dot_error_scales, gradient_error

    shape = FP8_SHAPES[1]
    _, (x, ids, w, wg, wu, wd, _), _, g = routed_case(shape, T, routing, T * 47 + len(routing))
    experts = quantize_experts(wg, wu, wd)
    dout = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    leaves = [t.clone().requires_grad_() for t in (x, w, wg, wu, wd)]
    out = mokgen.moe_fp8_train(leaves[0], ids, leaves[1], *leaves[2:])
    assert torch.equal(out.detach(), mokgen.moe_fp8(x, ids, w, experts))
    out.backward(dout)
    want = moe_fp8_backward_emulated(dout, x, ids, w, experts)
    scale = dot_error_scales(dout, x, ids, wg, wu, wd)
    for leaf, k in zip(leaves, ("dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down")):
        ref = want[k] if k == "d_topk_weights" else want[k].to(torch.bfloat16).double()
        assert gradient_error(k, leaf.grad, ref, scale) <= REQUANTIZED_TOLERANCE, k
    with pytest.raises(InputError, match="w_down must"):
        mokgen.moe_fp8_train(x, ids, w, wg, wu, wd.transpose(1, 2))
    # quantised once (per optimizer step), passed in: the same output and gradients, bit for bit
    once = mokgen.quantize_experts_fp8(wg, wu, wd, ids.shape[1])
    again = [t.clone().requires_grad_() for t in (x, w, wg, wu, wd)]
    out2 = mokgen.moe_fp8_train(again[0], ids, again[1], *again[2:], experts=once)
    out2.backward(dout)
    assert torch.equal(out2.detach(), out.detach())
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(again, leaves))
    with pytest.raises(InputError, match="quantised from these weights"):
        mokgen.moe_fp8_train(x, ids, w, wg[:-1], wu[:-1], wd[:-1], experts=once)


def test_fp8_over_two_gpus_golden():
    """mokgen.moe_fp8(..., group=) on 2 GPUs (tests/fp8_ep_worker.py under torchrun): each GPU
    the FP8 layer of half the experts, tokens crossing through NCCL."""
    from mokgen.runtime import variants_root

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spec = MoESpec(experts=32, topk=8, hidden=2048, intermediate=1024, dtype="fp8")  # each GPU's half of E64
    if not (variants_root() / spec.variant / "build").is_dir():
        pytest.skip(f"{spec.variant} is not built (benchmarks/build_gpu_variants.py)")
    from test_multinode_gpu import run_workers

    run_workers("fp8_ep_worker.py", "FP8 EP golden: PASS")


def test_fp8_over_two_ranks_sharing_one_gpu_golden():
    """The same golden worker with both ranks on one GPU, their group over gloo: the levels'
    exchanges, the FP8 layer across nodes under autograd and its collective error path,
    checked where one GPU is all there is (tests/ep_worker.start_golden)."""
    from mokgen.runtime import variants_root

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    spec = MoESpec(experts=32, topk=8, hidden=2048, intermediate=1024, dtype="fp8")
    if not (variants_root() / spec.variant / "build").is_dir():
        pytest.skip(f"{spec.variant} is not built (benchmarks/build_gpu_variants.py)")
    from test_multinode_gpu import run_workers

    run_workers("fp8_ep_worker.py", "FP8 EP golden: PASS", MOKGEN_TEST_RANKS_SHARE_GPU="1")


def test_fp8_weight_gradients_of_the_last_experts_at_e256_h7168():
    """The weight gradients of the DeepSeek-V3 layer, whose gradient matrices together pass 2^31
    elements (each expert's is addressed from a 64-bit base): tokens routed to the last six
    experts only (two slots of each token empty); their gradients against the float64
    emulation of those experts, and every other expert's exactly zero (a wrapped 32-bit
    offset wrote the last experts' tiles over the first ones' and beyond)."""
    import dataclasses

    import mokgen
    from mokgen.fp8 import REQUANTIZED_TOLERANCE, moe_fp8_backward_emulated, quantize_experts
    from mokgen.verify import dot_error_scales, gradient_error

    shape = (256, 8, 7168, 2048)
    E, K, H, I = shape
    v = fp8_variant(shape)
    g = torch.Generator(device="cuda").manual_seed(7168)
    T, first = 300, E - 6
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(6, device="cuda", generator=g) for _ in range(T)])  # every expert once
    ids = torch.cat([ids, torch.full((T, K - ids.shape[1]), -1, device="cuda")], 1).to(torch.int32)
    ids[ids >= 0] += first
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=g), -1)
    wg, wu = (torch.randn(E, I, H, device="cuda", generator=g).to(torch.bfloat16) / H ** 0.5 for _ in range(2))
    wd = torch.randn(E, H, I, device="cuda", generator=g).to(torch.bfloat16) / I ** 0.5
    experts = quantize_experts(wg, wu, wd)
    dout = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    got = v.backward_fp8(dout, x, ids, w, experts)
    mokgen.check_errors()
    for k in ("d_w_gate", "d_w_up", "d_w_down"):
        assert not got[k][:first].any(), f"{k}: an expert without rows got a non-zero gradient"
    last = dataclasses.replace(experts, **{f.name: dataclasses.replace(
        getattr(experts, f.name), values=getattr(experts, f.name).values[first:],
        scales=getattr(experts, f.name).scales[first:]) for f in dataclasses.fields(experts)})
    local = torch.where(ids >= 0, ids - first, ids)
    want = moe_fp8_backward_emulated(dout, x, local, w, last)
    scale = dot_error_scales(dout, x, local, wg[first:], wu[first:], wd[first:])
    for k in ("dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"):
        ref = want[k] if k == "d_topk_weights" else want[k].to(torch.bfloat16).double()
        mine = got[k][first:] if k.startswith("d_w") else got[k]
        assert gradient_error(k, mine, ref, scale) <= REQUANTIZED_TOLERANCE, k


@pytest.mark.parametrize("shape", FP8_SHAPES + [(256, 8, 7168, 2048)], ids=lambda s: "e{}k{}h{}i{}".format(*s))
def test_quantize_experts_kernels_give_the_bits_of_quantize_experts(shape):
    """Variant.quantize_experts_fp8 (the Plan's quantize_experts kernels, which mokgen.moe_fp8_train
    runs on every call) against mokgen.fp8.quantize_experts: the same e4m3 values and scales,
    transposed copies included, with an all-zero block (scale 1), a block of one large value, and
    negative zeros, an e4m3 rounding tie and an fp32 underflow among the quotients.
    At E256 H7168 each projection passes 2^31 elements (64-bit offsets per expert)."""
    from mokgen.fp8 import quantize_experts

    E, K, H, I = shape
    # the bf16 weights, the kernels' FP8 copies (both orientations: as many bytes) and the reference's,
    # beside one chunk's fp32 temporaries (mokgen.fp8 quantises 1 GiB at a time)
    need = 3 * (3 * E * I * H * 2) + (4 << 30)
    if torch.cuda.get_device_properties(0).total_memory < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of GPU memory")
    v = fp8_variant(shape)
    g = torch.Generator(device="cuda").manual_seed(E + H)
    wg, wu = (torch.randn(E, I, H, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    wd = torch.randn(E, H, I, device="cuda", generator=g).to(torch.bfloat16)
    wg[E - 1, :64, :128] = 0.0  # (with w_up's rows 0..63 below: the stored block (0, 0) of the last expert)
    wu[E - 1, :64, :128] = 0.0
    wd[0, 128:256, 128:256] = 0.0
    wd[E - 1, 5, 7] = 3e4
    # for the division (a reciprocal and one corrected step): negative zeros, a quotient that is an
    # e4m3 rounding tie (0.796875 / (336 / 448) = 1.0625), one that underflows fp32
    wd[0, 256:384, :128] = 0.796875
    wd[0, 256, 0] = 336.0
    wd[0, 257, :64] = -0.0
    wd[0, 258, 0] = 1e-30
    wg[0, 0, :16] = -0.0
    got = v.quantize_experts_fp8(wg, wu, wd)
    want = quantize_experts(wg, wu, wd)
    for name in ("gate_up", "down", "gate_up_t", "down_t"):
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8)), f"{name}: e4m3 values differ"
        assert torch.equal(a.scales, b.scales), f"{name}: scales differ"
    assert got.gate_up.scales[E - 1, 0, 0] == 1.0 and got.down.scales[0, 1, 1] == 1.0
    del got, want, wg, wu, wd
    torch.cuda.empty_cache()  # about 70 GB at E256: the tests after it, and their child processes, need it


@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("T", [1, 1000, 4096])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b or "default")
def test_fp8_training_forward_saves_the_products_the_backward_would_recompute(shape, T, routing, build):
    """forward_fp8(save=True) (the training forward: the gate/up GEMM also stores the products
    before SwiGLU) gives the forward's output bit for bit, and backward_fp8 from the saved
    products every gradient of the backward that recomputes them, bit for bit."""
    from mokgen.fp8 import quantize_experts

    v, (x, ids, w, wg, wu, wd, _), _, g = routed_case(shape, T, routing, T * 53 + len(routing), build)
    experts = quantize_experts(wg, wu, wd)
    dout = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    out, a13 = v.forward_fp8(x, ids, w, experts, save=True)
    assert torch.equal(out, v.forward_fp8(x, ids, w, experts))
    saved = v.backward_fp8(dout, x, ids, w, experts, a13=a13.clone())
    recomputed = v.backward_fp8(dout, x, ids, w, experts)
    for k in recomputed:
        assert torch.equal(saved[k], recomputed[k]), f"{k} differs from the recomputing backward's"


# Debug builds whose waits give up after half a second: the first stage of each CTA of one GEMM is
# never given its TMA bytes, so its consumers wait for a load that never lands. (overrides, the
# Variant method that runs that GEMM, the kernel the error must name)
FP8_BROKEN_BUILDS = {
    "fp8_forward_stall": ({"gemm_down_fp8.debug_break": 1, "wait_timeout_ms": 500}, "forward_fp8",
                          "gemm_down_fp8"),
    "fp8_wgrad_stall": ({"wgrad_down_fp8.debug_break": 1, "wait_timeout_ms": 500}, "backward_fp8",
                        "wgrad_down_fp8"),
}


def fp8_debug_dir(name):
    from mokgen.codegen import default_out

    return default_out() / "debug" / name


@pytest.mark.parametrize("broken", sorted(FP8_BROKEN_BUILDS))
def test_a_stalled_fp8_gemm_fails_fast_instead_of_hanging(broken):
    """Every wait of the FP8 GEMMs is bounded: a stage that never fills ends the call with
    KernelTimeout naming the GEMM, within the bound, and the CUDA context still works."""
    from stall_check import assert_fails_fast

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    overrides, method, kernel = FP8_BROKEN_BUILDS[broken]
    E, K, H, I = FP8_SHAPES[0]
    path = fp8_debug_dir(broken) / MoESpec(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8").variant
    if not (path / "build").is_dir():
        pytest.skip(f"{path} is not built (benchmarks/build_gpu_variants.py)")
    call = "v.forward_fp8(x, ids, w, experts)" if method == "forward_fp8" else \
        "v.backward_fp8(torch.randn_like(x), x, ids, w, experts)"
    assert_fails_fast(
        "from mokgen.fp8 import quantize_experts\n"
        "from mokgen.verify import make_inputs\n"
        f"v = mokgen.load({str(path)!r})\n"
        "x, ids, w, wg, wu, wd, _ = make_inputs(dataclasses.replace(v.spec, dtype='bf16'), 1000, 'uniform')\n"
        "experts = quantize_experts(wg, wu, wd)\n",
        call, "good.forward_fp8(x, ids, w, experts)", (kernel,))


@pytest.mark.parametrize("shared", [0, 256], ids=["routed", "shared256"])
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_moe_module_in_fp8_is_the_fp8_layer_over_its_bf16_weights(shared, recompute):
    """mokgen.MoE(dtype="fp8") under autograd: its output and every gradient (x, the router,
    the experts, the shared expert) are, bit for bit, those of route + mokgen.moe_fp8_train over
    the same parameters (+ the shared expert in bf16), golden against the float64 reference of
    the bf16 block within FP8_TOLERANCE; its FP8 experts are kept over micro-batches and
    quantised again after the optimizer's step, as mokgen.fp8.quantize_experts would."""
    import copy

    import mokgen
    from mokgen.fp8 import FP8_TOLERANCE, quantize_experts
    from mokgen.module import route_torch
    from mokgen.reference import expert_ffn, moe_reference, rel_error

    fp8_variant(FP8_SHAPES[0])  # (skips without a GPU or the build)
    E, K, H, I = FP8_SHAPES[0]
    torch.manual_seed(11 + shared)
    m = mokgen.MoE(H, I, E, K, shared_intermediate=shared, device="cuda", dtype="fp8", recompute=recompute)
    twin = copy.deepcopy(m)
    T = 333
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    dout = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = m(xa)
    out.backward(dout)
    ids, w = route_torch(twin.router(xb.float()), K, False)
    want = mokgen.moe_fp8_train(xb, ids, w, twin.w_gate, twin.w_up, twin.w_down)
    if shared:
        want = want + expert_ffn(xb, twin.ws_gate, twin.ws_up, twin.ws_down)
    want.backward(dout)
    assert torch.equal(out.detach(), want.detach())
    assert torch.equal(xa.grad, xb.grad)
    for (name, p), q in zip(m.named_parameters(), twin.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
    sh = (m.ws_gate, m.ws_up, m.ws_down) if shared else ()
    ref = moe_reference(x.double(), ids, w.detach().double(), *(t.detach().double() for t in (m.w_gate, m.w_up,
                                                                                             m.w_down, *sh)))
    assert rel_error(out.detach(), ref) <= FP8_TOLERANCE
    # a second micro-batch reuses the FP8 experts; the optimizer's step makes new ones
    kept = m.fp8_experts()
    m(x).float().sum().backward()
    assert m.fp8_experts() is kept
    torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True).step()
    fresh = m.fp8_experts()
    assert fresh is not kept
    expect = quantize_experts(m.w_gate.detach(), m.w_up.detach(), m.w_down.detach())
    for part in ("gate_up", "down", "gate_up_t", "down_t"):
        a, b = getattr(fresh, part), getattr(expect, part)
        assert torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8)) and torch.equal(a.scales, b.scales)


def test_a_group_of_one_rank_is_the_one_gpu_fp8_layer():
    """moe_fp8(group=) and moe_fp8_train(group=) over a process group of one rank: the one-GPU
    layer, output and every gradient bit for bit (no spec over one node of one GPU is needed)."""
    import torch.distributed as dist
    from test_rendezvous_cpu import free_port

    import mokgen
    from mokgen.fp8 import quantize_experts

    shape = FP8_SHAPES[0]
    _, (x, ids, w, wg, wu, wd, _), _, g = routed_case(shape, 300, "uniform", 300)
    dout = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        res = []
        for grp in (None, dist.group.WORLD):
            leaves = [t.clone().requires_grad_() for t in (x, w, wg, wu, wd)]
            out = mokgen.moe_fp8_train(leaves[0], ids, leaves[1], *leaves[2:], group=grp)
            out.backward(dout)
            with torch.no_grad():
                plain = mokgen.moe_fp8(x, ids, w, quantize_experts(wg, wu, wd), group=grp)
            res.append([out.detach(), plain] + [t.grad for t in leaves])
        assert all(torch.equal(a, b) for a, b in zip(*res))
    finally:
        dist.destroy_process_group()
