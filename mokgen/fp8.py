"""FP8 on Hopper: e4m3 values with fp32 block scales, as DeepSeek-V3 trains.

Hopper has no MXFP8 (hardware block scales); its counterpart is e4m3 with scales kept beside
the values and applied by the kernel:

- activations: one scale per 1 x 128 block (a row's 128 consecutive values along K), so a
  token's row is quantised on its own, where it is produced;
- weights: one scale per 128 x 128 block, quantised ahead of time by `quantize_experts`.
  A square block is the same block read along either dimension, so the transposed copies the
  backward reads (w^T, contracting over the other dimension) are the same values and scales
  transposed: nothing is quantised twice.

A block's scale is amax / 448 (the largest finite e4m3), so the block's largest magnitude
maps to 448; an all-zero block gets scale 1. Values round to nearest even on the cast.

`moe_fp8_emulated` is the layer the FP8 kernels compute, emulated in float64 from the same
quantised operands: x quantised per 1 x 128, gate/up products summed per 128-wide K block,
each block's partial sum times its two scales (the kernels' fp32 promotion, at least every
128 of K, as in DeepGEMM), SwiGLU, the hidden activation quantised per 1 x 128, the down
product likewise, y rounded to bf16 as the down GEMM stores it, the weighted sum over the
slots. The golden tests compare the kernels with
it (EMULATION_TOLERANCE, or REQUANTIZED_TOLERANCE past h's quantisation: the tensor cores'
accumulation moves a few of h's codes one step) and with the float64 reference of the bf16
layer (FP8_TOLERANCE, what e4m3's 3 mantissa bits allow; docs/fp8.md). The quantisation of a
row is bit-exact between torch and the kernels (IEEE division both).

Needs torch (float8_e4m3fn); no CuTe-DSL.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .ir.spec import E4M3_MAX, FP8_INTERLEAVE, FP8_BLOCK as BLOCK  # (activations: 1 x BLOCK scale blocks; weights: BLOCK x BLOCK)

E4M3 = torch.float8_e4m3fn
# Relative error (||out - ref|| / ||ref||) of the FP8 layer against the float64 reference of
# the bf16 layer that the golden tests allow. e4m3 keeps 3 mantissa bits: one rounding of a
# Gaussian operand costs 2.6% rms (measured, per 1 x 128 and per 128 x 128 block alike).
# Five operands are rounded on the way to the output (x, w_gate, w_up, h, w_down) and their
# errors add in quadrature: sqrt(5) x 2.6% = 5.8%; the CPU emulation measures 6.3% on every
# shape tried (docs/fp8.md). 8% leaves room for skewed routing; a wrong kernel is off by 100%.
FP8_TOLERANCE = 8e-2
# Between an FP8 GEMM whose output is not quantised again (the down projection) and its float64
# emulation from the same quantised operands, the emulation's output rounded to bf16 as the
# kernel rounds its own: only the accumulation differs (it moves a few outputs by one bf16
# step). Measured 8.2e-4 - 8.4e-4.
EMULATION_TOLERANCE = 1e-3
# Where a kernel's output is quantised to e4m3 again (h, written by the gate/up GEMM) and
# everything downstream of it (the whole forward). Hopper's FP8 tensor cores do not accumulate
# in full fp32 (about 14 mantissa bits within a chain of QGMMA; the kernels promote to fp32
# every 128 of K, as DeepGEMM does), so a 128-wide block's partial sum differs from float64 by
# up to ~1e-3 relative: h's scales move by up to 1.1e-3 (measured), and about 1% of h's e4m3
# codes land one step (6-12% of the value) from the emulation's, those whose value lies that
# close to a rounding boundary. That is 3.3e-3 on h and 4-6e-3 on the layer's output (measured
# on H200; docs/fp8.md). The kernel's h is as close to the exact SwiGLU as the emulation's
# (2.262% both). A wrong row or block is off by O(1).
REQUANTIZED_TOLERANCE = 1e-2
# The same bound for the output of fewer than FEW_TOKENS tokens drawn fresh on every run: a
# token's output sums K x I values of h, and which of them land one e4m3 step away varies from
# token to token, so one token's relative error spreads widely around the mean (measured on
# H200 at E64 K8 H2048 I1024, one token: 2.6e-3 to 1.01e-2 over 8 draws; 513 or more tokens:
# 4.2e-3 to 4.9e-3 over 26). A wrong row or block is still off by O(1).
FEW_TOKENS = 64
FEW_TOKENS_REQUANTIZED_TOLERANCE = 2e-2


def requantized_tolerance(tokens: int) -> float:
    """REQUANTIZED_TOLERANCE, or its bound for fewer than FEW_TOKENS tokens drawn fresh."""
    return REQUANTIZED_TOLERANCE if tokens >= FEW_TOKENS else FEW_TOKENS_REQUANTIZED_TOLERANCE


class FP8Error(ValueError):
    """A tensor the FP8 quantisation cannot take (one-line message)."""


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """The block scale: amax / 448 in fp32; 1 for an all-zero block."""
    amax = amax.float()
    # (a tensor divisor: torch divides by a Python scalar as a product with its reciprocal,
    # which can land one ulp away from the kernels' IEEE division)
    return torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 128) -> (e4m3 [..., K], fp32 scales [..., K / 128]): one
    scale per 1 x 128 block of a row."""
    K = x.shape[-1]
    if K % BLOCK:
        raise FP8Error(f"the last dimension ({K}) must be a multiple of {BLOCK} for 1 x {BLOCK} blocks")
    if not torch.isfinite(x).all():
        raise FP8Error("cannot quantise NaN or Inf values to e4m3")
    blocks = x.float().reshape(*x.shape[:-1], K // BLOCK, BLOCK)
    scale = _scale(blocks.abs().amax(-1))
    q = (blocks / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.reshape(x.shape), scale


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (both multiples of 128) -> (e4m3 [..., N, K], fp32 scales
    [..., N / 128, K / 128]): one scale per 128 x 128 block."""
    N, K = w.shape[-2:]
    lead = w.shape[:-2]
    flat = w.reshape(-1, N, K)
    q, scale = _quantize_blocks_chunked(flat.shape[0], N, K, lambda i, j: flat[i:j], w.device)
    return q.reshape(w.shape), scale.reshape(*lead, N // BLOCK, K // BLOCK)


# What the weights' quantiser takes at a time: 2^28 elements, 1 GiB in fp32.
CHUNK_ELEMENTS = 1 << 28


def _quantize_blocks_chunked(n: int, N: int, K: int, matrices, device) -> tuple[torch.Tensor, torch.Tensor]:
    """n matrices [N, K], matrices(i, j) giving those from i to j as [j - i, N, K], quantised a
    chunk at a time (each chunk's fp32 copy within 1 GiB): neither an fp32 copy of all of them
    nor a finiteness mask of all of them need fit beside the weights (at E256 H7168 the gate/up
    pair alone is 15 GB in bf16), and one matrix at a time would be thousands of small launches.
    A NaN or Inf anywhere raises FP8Error once every chunk is done (one read-back)."""
    if N % BLOCK or K % BLOCK:
        raise FP8Error(f"the last two dimensions ({N}, {K}) must be multiples of {BLOCK} for {BLOCK} x {BLOCK} blocks")
    q = torch.empty(n, N, K, dtype=E4M3, device=device)
    scale = torch.empty(n, N // BLOCK, K // BLOCK, device=device)
    finite = torch.ones((), dtype=torch.bool, device=device)
    chunk = max(1, CHUNK_ELEMENTS // (N * K))
    for i in range(0, n, chunk):
        j = min(n, i + chunk)
        blocks = matrices(i, j).float().reshape(-1, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
        finite &= torch.isfinite(blocks).all()
        scale[i:j] = _scale(blocks.abs().amax(dim=(-3, -1)))
        q[i:j] = (blocks / scale[i:j][:, :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).reshape(-1, N, K)
    if not bool(finite):
        raise FP8Error("cannot quantise NaN or Inf values to e4m3")
    return q, scale


def quantize_cols(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, N] (M a multiple of 128) -> (e4m3 [M / 128, N, 128], fp32 scales [M / 128, N]):
    one scale per 128-row block of each column, the block's values contiguous (K-major for a
    GEMM that contracts over the rows: the weight gradients; templates/quantize_cols_fp8.py.j2)."""
    M, N = rows.shape
    if M % BLOCK:
        raise FP8Error(f"the rows ({M}) must be a multiple of {BLOCK} for {BLOCK} x 1 blocks")
    q, s = quantize_rows(rows.reshape(M // BLOCK, BLOCK, N).transpose(1, 2).contiguous())
    return q, s.squeeze(-1)


def wgrad_emulated(a_t: tuple, b_t: tuple, tile_expert: torch.Tensor, experts: int) -> torch.Tensor:
    """The FP8 weight-gradient GEMM (templates/grouped_gemm_fp8_wgrad.py.j2) in float64: a_t, b_t
    the transposed operands (quantize_cols: e4m3 [MT, N, 128], scales [MT, N]) of rows in
    dispatch's layout; per expert e, the sum over its M tiles t (tile_expert[t] = e) of the
    tile's product A_t^T-blocks @ B_t, each operand times its per-column scales (promoted per
    tile). Returns [experts, N1, N2]; an expert without tiles gets zeros."""
    (aq, as_), (bq, bs) = a_t, b_t
    out = torch.zeros(experts, aq.shape[1], bq.shape[1], dtype=torch.float64, device=aq.device)
    for t, e in enumerate(tile_expert.tolist()):
        if e >= 0:
            a = aq[t].double() * as_[t].double()[:, None]  # [N1, 128]
            b = bq[t].double() * bs[t].double()[:, None]  # [N2, 128]
            out[e] += a @ b.t()
    return out


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    K = q.shape[-1]
    return (q.to(dtype).reshape(*q.shape[:-1], K // BLOCK, BLOCK) * scale.to(dtype)[..., None]).reshape(q.shape)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    N, K = q.shape[-2:]
    lead = q.shape[:-2]
    blocks = q.to(dtype).reshape(*lead, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    return (blocks * scale.to(dtype)[..., :, None, :, None]).reshape(q.shape)


@dataclass(frozen=True)
class FP8Weights:
    """One projection's weights [E, N, K] as e4m3 with 128 x 128 block scales [E, N/128, K/128].
    `t()` is the transposed copy [E, K, N] the backward reads: the same values and scales."""
    values: torch.Tensor
    scales: torch.Tensor

    def t(self) -> "FP8Weights":
        return FP8Weights(self.values.transpose(-1, -2).contiguous(), self.scales.transpose(-1, -2).contiguous())

    def dequantize(self, dtype=torch.float64) -> torch.Tensor:
        return dequantize_blocks(self.values, self.scales, dtype)


# w_gate and w_up are stored interleaved per this many rows (one 128-row block of the stored
# matrix holds 64 gate columns and the same 64 up columns), so that one 128-wide GEMM tile
# yields both inputs of 64 columns of SwiGLU (templates/grouped_gemm_fp8.py.j2, gate/up).
INTERLEAVE = FP8_INTERLEAVE


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """[E, I, H] twice -> [E, 2I, H]: rows 128 j .. 128 j + 63 are w_gate's rows 64 j .., the next
    64 the same rows of w_up."""
    E, I, H = w_gate.shape
    g = w_gate.reshape(E, I // INTERLEAVE, INTERLEAVE, H)
    u = w_up.reshape(E, I // INTERLEAVE, INTERLEAVE, H)
    return torch.stack([g, u], 2).reshape(E, 2 * I, H)


def split_gate_up(a13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse along the last dimension: [..., 2I] (interleaved columns) -> gate, up [..., I]."""
    *lead, two_i = a13.shape
    v = a13.reshape(*lead, two_i // (2 * INTERLEAVE), 2, INTERLEAVE)
    return v[..., 0, :].reshape(*lead, two_i // 2), v[..., 1, :].reshape(*lead, two_i // 2)


@dataclass(frozen=True)
class FP8Experts:
    """The experts' projections in FP8 (`quantize_experts`): gate_up [E, 2I, H] (w_gate and
    w_up interleaved per 64 rows, see INTERLEAVE) and down [E, H, I], with the transposed
    copies of the backward: gate_up_t [E, H, 2I] (dx = [da | db] @ [w_gate; w_up], the same
    interleaving of the I dimension) and down_t [E, I, H] (dh = dy @ w_down contracts over H)."""
    gate_up: FP8Weights
    down: FP8Weights
    gate_up_t: FP8Weights
    down_t: FP8Weights


def quantize_experts(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> FP8Experts:
    """w_gate, w_up [E, I, H], w_down [E, H, I] (bf16 or fp32; H and I multiples of 128) ->
    FP8Experts. Run once per weight update, ahead of the layer's calls."""
    if w_gate.shape != w_up.shape or w_gate.dim() != 3:
        raise FP8Error(f"w_gate and w_up must both be [E, I, H], got {list(w_gate.shape)} and {list(w_up.shape)}")
    E, I, H = w_gate.shape
    if tuple(w_down.shape) != (E, H, I):
        raise FP8Error(f"w_down must be [E, H, I] = {[E, H, I]}, got {list(w_down.shape)}")
    # interleaved a chunk of experts at a time, inside the quantiser: no bf16 copy of both whole
    gate_up = FP8Weights(*_quantize_blocks_chunked(
        E, 2 * I, H, lambda i, j: interleave_gate_up(w_gate[i:j], w_up[i:j]), w_gate.device))
    down = FP8Weights(*quantize_blocks(w_down))
    return FP8Experts(gate_up, down, gate_up.t(), down.t())


def _blockwise_matmul(a_q, a_s, b: FP8Weights) -> torch.Tensor:
    """a [M, K] (e4m3, 1 x 128 scales) times b^T (b [N, K], 128 x 128 scales) in float64, one
    partial product per 128-wide K block times its two scales, summed over the blocks: the
    kernels' promotion of each block's accumulator."""
    M, K = a_q.shape
    N = b.values.shape[0]
    kb = K // BLOCK
    a = a_q.double().reshape(M, kb, BLOCK)
    w = b.values.double().reshape(N, kb, BLOCK)
    partial = torch.einsum("mkb,nkb->kmn", a, w)  # [kb, M, N]
    s_a = a_s.double().t()[:, :, None]  # [kb, M, 1]
    s_b = b.scales.double().repeat_interleave(BLOCK, 0).t()[:, None, :]  # [kb, 1, N]
    return (partial * s_a * s_b).sum(0)


def _pairs_by_expert(topk_ids, experts: FP8Experts):
    """(expert, tokens, slots, pick) per expert with pairs, pick(p) its FP8Weights of a projection p."""
    ids = topk_ids.long()
    for e in range(experts.gate_up.values.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel():
            yield e, tok, slot, lambda p, e=e: FP8Weights(p.values[e], p.scales[e])


def moe_fp8_emulated(x, topk_ids, topk_weights, experts: FP8Experts) -> torch.Tensor:
    """The FP8 layer in float64 from its quantised operands (returns float64 [T, H]): for every
    (token, slot) pair with an id in range, w * (q(silu(q(x) Wg^T) * (q(x) Wu^T)) Wd^T), the
    products blockwise as above, q() the 1 x 128 quantisation of a row."""
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    if T == 0:
        return out
    xq, xs = quantize_rows(x)
    for _, tok, slot, pick in _pairs_by_expert(topk_ids, experts):
        hq, hs = swiglu_quantized(_blockwise_matmul(xq[tok], xs[tok], pick(experts.gate_up)))
        y = _blockwise_matmul(hq, hs, pick(experts.down)).to(torch.bfloat16).double()  # (y is stored in bf16)
        out.index_add_(0, tok, y * topk_weights.double()[tok, slot, None])
    return out


def join_gate_up(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The inverse of split_gate_up: gate, up [..., I] -> [..., 2I] interleaved per INTERLEAVE columns."""
    *lead, i = a.shape
    return torch.stack([a.reshape(*lead, i // INTERLEAVE, INTERLEAVE), b.reshape(*lead, i // INTERLEAVE, INTERLEAVE)],
                       -2).reshape(*lead, 2 * i)


def _swiglu_backward(a13, g, w):
    """(da, db, w h, <g, h>) in float64 of rows: a13 [rows, 2I] interleaved, g [rows, I], w [rows]."""
    a, b = (t.double() for t in split_gate_up(a13))
    g, w = g.double(), w.double()[:, None]
    sig = torch.sigmoid(a)
    silu = a * sig
    h = silu * b
    return g * w * b * sig * (1.0 + a * (1.0 - sig)), g * w * silu, w * h, (g * h).sum(-1)


def moe_fp8_backward_data_emulated(dout, x, topk_ids, topk_weights, experts: FP8Experts):
    """The FP8 backward's data gradients (dx [T, H], d_topk_weights [T, K], float64), emulated
    as the kernels compute them: dout and x quantised per 1 x 128 row block; per expert, the
    gate/up products recomputed blockwise and stored in bf16, g = dout @ w_down blockwise (over
    the transposed copy) in bf16, the SwiGLU backward (templates/swiglu_backward_fp8.py.j2: h
    = silu(a) b, <g, h> for the routing weight, da = w g b silu'(a) and db = w g silu(a)
    quantised from fp32 per 1 x 128 block), dx's rows = [da | db] @ [w_gate; w_up] blockwise in
    bf16, summed over each token's slots."""
    got = _backward_emulated(dout, x, topk_ids, topk_weights, experts, weight_gradients=False)
    return got["dx"], got["d_topk_weights"]


def moe_fp8_backward_emulated(dout, x, topk_ids, topk_weights, experts: FP8Experts) -> dict:
    """Every gradient of the FP8 layer (Variant.backward_fp8) in float64: the data gradients as
    moe_fp8_backward_data_emulated, and the weight gradients as the kernels compute them: per
    expert, its rows in dispatch's layout ((token, slot) order, zero rows up to a multiple of
    128) of dout, w h (bf16), [da | db] (bf16) and x, each quantised per 128-row block of each
    column (quantize_cols), d_w_down = dout^T (w h) and [d_w_gate; d_w_up] = [da | db]^T x
    summed over the blocks (wgrad_emulated); w_gate's and w_up's rows de-interleaved."""
    return _backward_emulated(dout, x, topk_ids, topk_weights, experts, weight_gradients=True)


def _backward_emulated(dout, x, topk_ids, topk_weights, experts: FP8Experts, weight_gradients: bool) -> dict:
    """The two emulations above: each expert's products and SwiGLU backward computed once."""
    T, H = x.shape
    E, two_i, _ = experts.gate_up.values.shape
    f64 = dict(dtype=torch.float64, device=x.device)
    got = dict(dx=torch.zeros(T, H, **f64), d_topk_weights=torch.zeros(topk_ids.shape, **f64))
    d_w13, d_w_down = torch.zeros(E, two_i, H, **f64), torch.zeros(E, H, two_i // 2, **f64)
    if T:
        xq, xs = quantize_rows(x)
        dq, ds = quantize_rows(dout)
        bf16 = lambda t: t.to(torch.bfloat16)  # noqa: E731  (the kernels store bf16)
        for e, tok, slot, pick in _pairs_by_expert(topk_ids, experts):
            a13 = bf16(_blockwise_matmul(xq[tok], xs[tok], pick(experts.gate_up))).double()
            g = bf16(_blockwise_matmul(dq[tok], ds[tok], pick(experts.down_t))).double()
            da, db, hw, dot = _swiglu_backward(a13, g, topk_weights[tok, slot])
            got["d_topk_weights"][tok, slot] = dot
            dab_q, dab_s = quantize_rows(join_gate_up(da, db).float())
            got["dx"].index_add_(0, tok, bf16(_blockwise_matmul(dab_q, dab_s, pick(experts.gate_up_t))).double())
            if weight_gradients:
                pad = -len(tok) % BLOCK

                def cols(rows):  # the rows padded to 128 and quantised per 128-row block of each column
                    return quantize_cols(torch.cat([rows.float(), rows.new_zeros(pad, rows.shape[1]).float()]))

                one = torch.zeros((len(tok) + pad) // BLOCK, dtype=torch.int32)
                d_w_down[e] = wgrad_emulated(cols(dout[tok]), cols(bf16(hw.float())), one, 1)[0]
                d_w13[e] = wgrad_emulated(cols(bf16(join_gate_up(da, db).float())), cols(x[tok]), one, 1)[0]
    if weight_gradients:
        gate, up = split_gate_up(d_w13.transpose(1, 2))
        got.update(d_w_gate=gate.transpose(1, 2), d_w_up=up.transpose(1, 2), d_w_down=d_w_down)
    return got


def swiglu_quantized(a13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate/up kernel's epilogue from its float64 products [rows, 2I] (interleaved): h =
    silu(gate) * up, then h in e4m3 with 1 x 128 scales, quantised from fp32 as the kernel does."""
    a, b = split_gate_up(a13)
    return quantize_rows((a / (1.0 + torch.exp(-a)) * b).float())
