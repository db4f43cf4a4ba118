"""Golden checks of a built variant on the GPU (used by `mokgen verify` and the tests).

Inputs are fresh random every run; routing is uniform (softmax top-k of random
logits) or skewed (half the experts never chosen, one expert chosen by every
token); every workspace buffer and the output are poisoned with NaN first, so an
unwritten row fails.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from .reference import dot_error_scales, moe_reference, rel_error

TOLERANCE = 1e-2  # DESIGN.md: bf16 relative error bound against float64
# uniform; skewed (the upper half of the experts empty, one hot expert); dropped (uniform with
# about a third of the slots empty, id -1, and token 0 with every slot empty)
ROUTINGS = ("uniform", "skewed", "dropped")


def make_inputs(spec, tokens: int, routing: str = "uniform", gen: torch.Generator | None = None,
                device: str = "cuda"):
    """x, topk_ids (int32), topk_weights (fp32), w_gate, w_up, w_down, (ws_gate, ws_up, ws_down)."""
    if gen is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(random.SystemRandom().randrange(2**31))
    return (*make_tokens(spec, tokens, routing, gen, device), *make_weights(spec, gen, device))


def make_tokens(spec, tokens: int, routing: str, gen: torch.Generator, device: str = "cuda"):
    """x [T, H] bf16, topk_ids [T, K] int32 over the spec's local experts, topk_weights [T, K] fp32."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    E, K, H = spec.local_experts, spec.topk, spec.hidden
    x = (torch.randn(tokens, H, device=device, generator=gen)).to(torch.bfloat16)
    logits = torch.randn(tokens, E, device=device, generator=gen)
    if routing == "skewed":
        logits[:, E // 2:] = -1e4  # the upper half of the experts gets no token
        logits[:, min(3, E - 1)] = 1e4  # one hot expert gets every token
    w, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float().contiguous()
    if routing == "dropped":  # empty slots: a capacity-limited router's dropped pairs
        ids = torch.where(torch.rand(ids.shape, device=device, generator=gen) < 1 / 3, -1, ids)
        ids[:1] = -1
    return x, ids.to(torch.int32).contiguous(), w


def make_weights(spec, gen: torch.Generator, device: str = "cuda"):
    """w_gate, w_up [E, I, H], w_down [E, H, I] of the spec's local experts and (ws_gate, ws_up,
    ws_down) of its shared expert (Nones without one), bf16, scaled to keep activations O(1)."""
    E, H, I, S = spec.local_experts, spec.hidden, spec.intermediate, spec.shared_intermediate

    def randn(*shape, scale):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(torch.bfloat16)

    wg, wu = randn(E, I, H, scale=1 / math.sqrt(H)), randn(E, I, H, scale=1 / math.sqrt(H))
    wd = randn(E, H, I, scale=1 / math.sqrt(I))
    shared = (None, None, None)
    if S:
        shared = (randn(S, H, scale=1 / math.sqrt(H)), randn(S, H, scale=1 / math.sqrt(H)),
                  randn(H, S, scale=1 / math.sqrt(S)))
    return wg, wu, wd, shared


def run_poisoned(variant, inputs):
    """Forward with NaN-poisoned workspace and output; returns the output."""
    x, ids, w, wg, wu, wd, (sg, su, sd) = inputs
    variant.poison = True
    out = torch.full_like(x, float("nan"))
    try:
        variant.forward(x, ids, w, wg, wu, wd, sg, su, sd, out=out)
    finally:
        variant.poison = False
    torch.cuda.synchronize()
    return out


@dataclass
class CheckResult:
    tokens: int
    routing: str
    rel_error: float
    unwritten: bool
    tolerance: float = TOLERANCE

    @property
    def ok(self) -> bool:
        return not self.unwritten and self.rel_error <= self.tolerance


def check_forward(variant, tokens: int, routing: str, gen=None) -> CheckResult:
    inputs = make_inputs(variant.spec, tokens, routing, gen)
    out = run_poisoned(variant, inputs)
    x, ids, w, wg, wu, wd, (sg, su, sd) = inputs
    ref = moe_reference(x, ids, w, wg, wu, wd, sg, su, sd)
    return CheckResult(tokens, routing, rel_error(out, ref), bool(torch.isnan(out).any()))


def check_forward_fp8(variant, tokens: int, routing: str, gen=None) -> CheckResult:
    """An FP8 variant's forward (dtype fp8; poisoned workspace and output) against the float64
    emulation from the same quantised operands, rounded to bf16 as the kernels round
    (mokgen/fp8.py: REQUANTIZED_TOLERANCE, as h is quantised again)."""
    import dataclasses

    from .fp8 import REQUANTIZED_TOLERANCE, moe_fp8_emulated, quantize_experts

    x, ids, w, wg, wu, wd, _ = make_inputs(dataclasses.replace(variant.spec, dtype="bf16"), tokens, routing, gen)
    experts = quantize_experts(wg, wu, wd)
    out = torch.full_like(x, float("nan"))
    variant.poison = True
    try:
        variant.forward_fp8(x, ids, w, experts, out=out)
    finally:
        variant.poison = False
    torch.cuda.synchronize()
    emulated = moe_fp8_emulated(x, ids, w, experts).to(torch.bfloat16).double()
    return CheckResult(tokens, routing, rel_error(out, emulated), bool(torch.isnan(out).any()), REQUANTIZED_TOLERANCE)


def check_backward_fp8(variant, tokens: int, routing: str, gen=None) -> "BackwardResult":
    """Every gradient of an FP8 variant as mokgen.moe_fp8_train computes it (the experts
    quantised by the variant's kernels, the training forward saving the gate/up products,
    Variant.backward_fp8 from them; poisoned outputs) against the float64 emulation of the
    same quantisation (mokgen/fp8.py: REQUANTIZED_TOLERANCE, as [da | db] is quantised
    again). The result's torch_errors are 0 (no PyTorch counterpart of this quantisation), so
    `ok` means within the tolerance."""
    import dataclasses

    from .fp8 import REQUANTIZED_TOLERANCE, moe_fp8_backward_emulated

    x, ids, w, wg, wu, wd, _ = make_inputs(dataclasses.replace(variant.spec, dtype="bf16"), tokens, routing, gen)
    dout = torch.randn(x.shape, device=x.device, generator=gen).to(x.dtype)
    experts = variant.quantize_experts_fp8(wg, wu, wd)
    variant.poison = True
    try:
        _, a13 = variant.forward_fp8(x, ids, w, experts, save=True)
        got = variant.backward_fp8(dout, x, ids, w, experts, a13=a13)
    finally:
        variant.poison = False
    torch.cuda.synchronize()
    want = moe_fp8_backward_emulated(dout, x, ids, w, experts)
    scale = dot_error_scales(dout, x, ids, wg, wu, wd)
    errors = {k: gradient_error(k, got[k], want[k] if k == "d_topk_weights" else want[k].to(torch.bfloat16).double(),
                                scale) for k in want}
    return BackwardResult(tokens, routing, errors, [k for k in want if torch.isnan(got[k].float()).any()],
                          {k: 0.0 for k in errors}, REQUANTIZED_TOLERANCE)


GRADIENTS = ("dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down")
SHARED_GRADIENTS = ("d_ws_gate", "d_ws_up", "d_ws_down")
# Above the bf16 bound, a gradient still passes when within this factor of PyTorch's bf16 error.
TORCH_SLACK = 1.5


@dataclass
class BackwardResult:
    tokens: int
    routing: str
    rel_errors: dict  # gradient name -> relative error against float64 autograd
    unwritten: list  # gradients holding NaN (an unwritten element: outputs start poisoned)
    torch_errors: dict  # the same for PyTorch's bf16 autograd (torch grouped_mm) on the same inputs
    tolerance: float = TOLERANCE  # the bound a gradient must keep (or stay within TORCH_SLACK of torch's)

    @property
    def failures(self) -> dict:
        """Gradients above the bf16 bound (1e-2) that are also more than TORCH_SLACK times less
        accurate than PyTorch's bf16 autograd on the same inputs. The second clause matters only for tiny
        gradients: d_topk_weights of a few tokens holds a few dot products of thousands of
        bf16 terms, whose relative error has a heavy tail (a dot near zero) for any bf16
        implementation."""
        return {k: e for k, e in self.rel_errors.items()
                if e > self.tolerance and e > TORCH_SLACK * self.torch_errors[k]}

    @property
    def ok(self) -> bool:
        return not self.unwritten and not self.failures


def run_backward_poisoned(variant, inputs, dout, saved: bool = True):
    """The generated backward with NaN-poisoned workspace and gradients. saved: the SwiGLU
    inputs come from the training forward (else the backward recomputes them)."""
    x, ids, w, wg, wu, wd, shared = inputs
    variant.poison = True
    try:
        kept = variant.forward_train(x, ids, w, wg, wu, wd, *shared)[1:] if saved else None
        grads = variant.backward(dout, x, ids, w, wg, wu, wd, *shared, saved=kept)
    finally:
        variant.poison = False
    torch.cuda.synchronize()
    return {k: g for k, g in zip(GRADIENTS + SHARED_GRADIENTS, grads) if g is not None}


def reference_backward_bytes(spec, tokens: int) -> int:
    """About the GPU memory moe_reference_backward takes at T = tokens: every weight as a
    float64 leaf and its float64 gradient (16 bytes an element), x, dout, dx and the output in
    float64, and every expert's float64 intermediates (its rows' gate, up, SwiGLU, output and
    their gradients: autograd keeps them all until the backward). E256 K8 H7168 I2048: about
    180 GB, more than one GPU holds."""
    weights = spec.experts * 3 * spec.hidden * spec.intermediate + 3 * spec.hidden * spec.shared_intermediate
    rows = tokens * spec.topk
    return 16 * weights + 8 * tokens * spec.hidden * 6 + 8 * rows * (spec.intermediate * 6 + spec.hidden * 2)


def free_gpu_bytes() -> int:
    """What torch can still allocate on the current GPU: free device memory and its own cached
    blocks."""
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def check_backward(variant, tokens: int, routing: str, gen=None, saved: bool = True) -> BackwardResult:
    """Every gradient of the generated backward against float64 autograd of the reference."""
    from .reference import moe_reference_backward

    inputs = make_inputs(variant.spec, tokens, routing, gen)
    x, ids, w, wg, wu, wd, shared = inputs
    dout = torch.randn(x.shape, device=x.device, generator=gen).to(x.dtype)
    got = run_backward_poisoned(variant, inputs, dout, saved)
    ref = moe_reference_backward(dout, x, ids, w, wg, wu, wd, *shared)
    scale = dot_error_scales(dout, x, ids, wg, wu, wd)
    return BackwardResult(tokens, routing, {k: gradient_error(k, got[k], ref[k], scale) for k in got},
                          [k for k in got if torch.isnan(got[k]).any()],
                          {k: gradient_error(k, v, ref[k], scale) for k, v in torch_backward(inputs, dout).items()})


def gradient_error(name: str, got, ref, dot_scale) -> float:
    """rel_error, except for d_topk_weights, whose entries are dot products <dout[t], y[t,k]>
    of thousands of terms: ||got - ref|| over the larger of ||ref|| and ||dot_scale||
    (dot_error_scales: the size the terms' rounding errors add up to). With a few tokens,
    cancellation can make ||ref|| small and the plain relative error large for any bf16
    implementation; a wrong answer is still off by about its own size."""
    err = rel_error(got, ref)
    if name != "d_topk_weights" or not math.isfinite(err):
        return err
    ref_norm = ref.double().norm().item()
    return err * ref_norm / max(ref_norm, dot_scale.norm().item(), 1e-300)


def torch_backward(inputs, dout) -> dict:
    """PyTorch's bf16 autograd of the layer (torch grouped_mm, mokgen.module.experts_torch)."""
    from .module import experts_torch

    x, ids, w, wg, wu, wd, shared = inputs
    params = (x, w, wg, wu, wd) + (shared if shared[0] is not None else ())
    leaves = [t.detach().clone().requires_grad_(True) for t in params]
    # An empty slot (-1) becomes expert 0 at weight 0: it adds nothing and gets no gradient. (Left
    # empty, its row sits past torch._grouped_mm's last group, unwritten, and that memory's
    # values reach dx through the SwiGLU's backward: a token with every slot empty got dx ~1e13.)
    empty = ids < 0
    weights = torch.where(empty, 0.0, leaves[1])
    out = experts_torch(leaves[0], torch.where(empty, 0, ids), weights, *leaves[2:5], shared=leaves[5:] or None)
    out.backward(dout)
    return dict(zip(GRADIENTS + SHARED_GRADIENTS, (t.grad for t in leaves)))
