"""The FP8 layer's calls (docs/fp8.md): mokgen.moe_fp8 over quantised experts,
mokgen.moe_fp8_train over bf16 master weights, mokgen.quantize_experts_fp8; their input checks
(before any launch), the FP8 variant's lookup, their autograd Functions, and the layer over a
process group of one GPU per node (rail.py under autograd, multinode.py's levels otherwise)."""
from __future__ import annotations

import torch

from ..ir import MoESpec
from .checks import InputError, check_ids_in_range, check_tensor
from .eager import needs_grad


def moe_fp8(x, topk_ids, topk_weights, experts, *, check_ids: bool = True, group=None):
    """The layer with FP8 experts (docs/fp8.md): experts = mokgen.fp8.quantize_experts(w_gate,
    w_up, w_down); x bf16 is quantised per 1 x 128 block of each routed row inside the layer,
    h likewise in the gate/up GEMM's epilogue; bf16 out. One GPU, no shared expert. Checks as
    mokgen.moe (ids in [0, E) or -1).

    Differentiable in x and topk_weights (the generated FP8 backward's data gradients,
    recomputing the forward's products; nothing is saved but the inputs): the experts are
    frozen (quantised weights have no gradient; mokgen.moe_fp8_train takes the bf16 weights).

    group: expert parallelism over the process group's W GPUs, one GPU per node: experts are
    this rank's E/W experts, topk_ids global; tokens cross between GPUs through NCCL, each GPU
    runs the FP8 layer of its experts (docs/multinode.md's levels). Collective: every rank
    calls it, and under autograd every rank runs its backward (mokgen/runtime/rail.py). A group
    of one rank is the one-GPU layer."""
    group = _several(group)
    if group is not None:
        v, topk_ids, W = _fp8_group_call(x, topk_ids, topk_weights, experts, group)
        return _fp8_over_group(x, topk_ids, topk_weights, None, experts, v, group, W, check_ids)
    v, topk_ids = _fp8_call(x, topk_ids, topk_weights, experts, check_ids)
    if needs_grad(x, topk_weights):
        return _MoEFP8.apply(x, topk_weights, topk_ids, experts, v)
    return v.forward_fp8(x, topk_ids, topk_weights, experts)


def moe_fp8_train(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, experts=None, check_ids: bool = True,
                  recompute: bool = False, group=None):
    """The FP8 layer over bf16 master weights, for training: the experts are quantised on each
    call by the variant's kernels (the same bits as mokgen.fp8.quantize_experts, with the
    backward's transposed copies; a NaN or Inf weight gives NaN outputs, as in bf16), the forward and
    backward run the generated FP8 kernels (docs/fp8.md), and the result is differentiable in
    x, topk_weights, w_gate, w_up and w_down (their gradients in the weights' dtype). One GPU,
    no shared expert; w_gate, w_up [E, I, H] and w_down [E, H, I] bf16, contiguous, on x's GPU.

    experts: these masters already quantised (mokgen.quantize_experts_fp8, or
    mokgen.fp8.quantize_experts), to quantise once per optimizer step rather than once per
    micro-batch when gradients accumulate over several; they must be the current weights'
    (only their shapes are checked).

    Under autograd the forward saves the inputs and the gate/up products (the routed rows x 2I,
    bf16), which the backward reads; recompute=True saves only the inputs, and the backward
    recomputes the products with one more FP8 GEMM (the same bits).

    group: expert parallelism over the process group's W GPUs, one GPU per node, as
    mokgen.moe_fp8(group=): w_gate, w_up, w_down (and experts) are this rank's E/W experts,
    topk_ids global; their gradients are this rank's experts' (mokgen/runtime/rail.py).
    Collective: every rank calls forward and backward. A group of one rank is the one-GPU layer."""
    group = _several(group)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_cuda:
        raise InputError(f"x must be a 2-d CUDA tensor [T, H], got "
                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
                         + (" on the CPU" if isinstance(x, torch.Tensor) and not x.is_cuda else ""))
    E, I, H = _check_fp8_masters(w_gate, w_up, w_down, x.device)
    check_tensor("x", x, torch.bfloat16, (None, H), x.device)  # (before quantising anything)
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise InputError(f"topk_ids must be 2-d [T, K], got {getattr(topk_ids, 'shape', type(topk_ids).__name__)}")
    v = None
    if experts is None:
        v = _fp8_variant(E, topk_ids.shape[1], H, I)
        with torch.no_grad():
            experts = v.quantize_experts_fp8(w_gate, w_up, w_down)
    if group is None:
        v, topk_ids = _fp8_call(x, topk_ids, topk_weights, experts, check_ids, variant=v)
    else:
        v, topk_ids, W = _fp8_group_call(x, topk_ids, topk_weights, experts, group, variant=v)
    if experts.gate_up.values.shape[0] != E or experts.down.values.shape[1:] != (H, I):
        raise InputError(f"experts hold [E, H, I] = {list(experts.down.values.shape)}, the weights "
                         f"{[E, H, I]}: pass the experts quantised from these weights")
    if group is not None:
        return _fp8_over_group(x, topk_ids, topk_weights, (w_gate, w_up, w_down), experts, v, group, W, check_ids,
                               recompute)
    if needs_grad(x, topk_weights, w_gate, w_up, w_down):
        return _MoEFP8Train.apply(x, topk_weights, w_gate, w_up, w_down, topk_ids, experts, v, bool(recompute))
    return v.forward_fp8(x, topk_ids, topk_weights, experts)


def _fp8_over_group(x, topk_ids, topk_weights, masters, experts, v, group, W: int, check_ids: bool,
                    recompute: bool = False):
    """The FP8 layer over the group's W GPUs, one per node (checked inputs, v the node-local
    variant). masters: this rank's bf16 (w_gate, w_up, w_down), whose gradients the backward
    gives too (moe_fp8_train), or None (moe_fp8: frozen experts). Under autograd the rail's
    forward and backward (runtime/rail.py); else docs/multinode.md's levels, the own tokens
    overlapping the exchange."""
    E, two_i, H = experts.gate_up.values.shape
    weights = masters or (None, None, None)
    if needs_grad(x, topk_weights, *weights):
        from .rail import FP8NodeLayer, moe_over_rail

        layer = FP8NodeLayer(v, experts, weight_gradients=masters is not None, recompute=recompute)
        return moe_over_rail(x, topk_ids, topk_weights, *weights, layer, E * W, group, check_ids)
    from .multinode import moe_multinode

    return moe_multinode(x, topk_ids, topk_weights, None, None, None, (E, topk_ids.shape[1], H, two_i // 2, 0),
                         group, W, check_ids, fp8_local=lambda xs, ids, w: v.forward_fp8(xs, ids, w, experts))


def _several(group):
    """group, or None where it has one rank (its layer is the one-GPU layer: no rows cross)."""
    if group is None:
        return None
    import torch.distributed as dist

    return group if dist.get_world_size(group) > 1 else None


def _fp8_group_call(x, topk_ids, topk_weights, experts, group, variant=None):
    """_fp8_call for the FP8 layer over a process group (ids global: their range is checked
    over the group, on the device, by the layer's first collective); also checks the sizes
    over the group's W GPUs, one per node. Returns (variant, topk_ids as int32, W)."""
    import torch.distributed as dist

    from .multinode import levels_spec

    v, topk_ids = _fp8_call(x, topk_ids, topk_weights, experts, check_ids=False, variant=variant)
    W = dist.get_world_size(group)
    E, two_i, H = experts.gate_up.values.shape
    levels_spec(E * W, topk_ids.shape[1], H, two_i // 2, W, W)
    return v, topk_ids, W


def _fp8_call(x, topk_ids, topk_weights, experts, check_ids: bool, variant=None):
    """Check an FP8 layer call's inputs (before any launch) and find its variant (unless the
    caller has: variant); returns (variant, topk_ids as int32)."""
    from ..fp8 import BLOCK, FP8Experts

    if not isinstance(experts, FP8Experts):
        raise InputError(f"experts must be mokgen.fp8.FP8Experts (from mokgen.fp8.quantize_experts), got "
                         f"{type(experts).__name__}")
    if isinstance(topk_ids, torch.Tensor) and topk_ids.dtype == torch.int64:
        topk_ids = topk_ids.to(torch.int32)
    gu, down = experts.gate_up, experts.down
    if gu.values.dim() != 3 or down.values.dim() != 3:
        raise InputError("experts' gate_up must be [E, 2I, H] and down [E, H, I]")
    E, two_i, H = gu.values.shape
    I = two_i // 2
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_cuda:
        raise InputError(f"x must be a 2-d CUDA tensor [T, {H}], got "
                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    check_tensor("x", x, torch.bfloat16, (None, H), x.device)
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise InputError(f"topk_ids must be 2-d [T, K], got {getattr(topk_ids, 'shape', type(topk_ids).__name__)}")
    check_tensor("topk_ids", topk_ids, torch.int32, (x.shape[0], topk_ids.shape[1]), x.device)
    check_tensor("topk_weights", topk_weights, torch.float32, (x.shape[0], topk_ids.shape[1]), x.device)
    for name, w, shape in (("gate_up", gu, (E, 2 * I, H)), ("down", down, (E, H, I))):
        if w.values.dtype != torch.float8_e4m3fn or tuple(w.values.shape) != shape or not w.values.is_contiguous():
            raise InputError(f"experts.{name} must be contiguous e4m3 {list(shape)}, got {w.values.dtype} "
                             f"{list(w.values.shape)}")
        want = (shape[0], shape[1] // BLOCK, shape[2] // BLOCK)
        if w.scales.dtype != torch.float32 or tuple(w.scales.shape) != want or not w.scales.is_contiguous():
            raise InputError(f"experts.{name} scales must be contiguous fp32 {list(want)}, got {w.scales.dtype} "
                             f"{list(w.scales.shape)}")
        if w.values.device != x.device or w.scales.device != x.device:
            raise InputError(f"experts.{name} is on {w.values.device}, x is on {x.device}: all inputs must be on one GPU")
    v = variant or _fp8_variant(E, topk_ids.shape[1], H, I)
    if check_ids:
        check_ids_in_range(topk_ids, E, x)
    return v, topk_ids


def quantize_experts_fp8(w_gate, w_up, w_down, topk: int):
    """w_gate, w_up [E, I, H] and w_down [E, H, I] (bf16, contiguous, on one GPU) as
    mokgen.fp8.FP8Experts, by the FP8 variant's kernels for this top-K (the same bits as
    mokgen.fp8.quantize_experts): for mokgen.moe_fp8, and for moe_fp8_train(experts=) to
    quantise once per optimizer step."""
    if not isinstance(w_gate, torch.Tensor) or w_gate.dim() != 3 or not w_gate.is_cuda:
        raise InputError(f"w_gate must be a 3-d CUDA tensor [E, I, H], got {getattr(w_gate, 'shape', type(w_gate))}")
    E, I, H = _check_fp8_masters(w_gate, w_up, w_down, w_gate.device)
    with torch.no_grad():
        return _fp8_variant(E, topk, H, I).quantize_experts_fp8(w_gate, w_up, w_down)


def _check_fp8_masters(w_gate, w_up, w_down, device) -> tuple:
    """The bf16 master weights an FP8 layer is quantised from: shapes, dtype, contiguity and
    device, and sizes of whole 128 x 128 blocks. Returns (E, I, H)."""
    from ..fp8 import BLOCK

    if not isinstance(w_gate, torch.Tensor) or w_gate.dim() != 3:
        raise InputError(f"w_gate must be [E, I, H], got {getattr(w_gate, 'shape', type(w_gate).__name__)}")
    E, I, H = w_gate.shape
    check_tensor("w_gate", w_gate, torch.bfloat16, (E, I, H), device)
    check_tensor("w_up", w_up, torch.bfloat16, (E, I, H), device)
    check_tensor("w_down", w_down, torch.bfloat16, (E, H, I), device)
    if H % BLOCK or I % BLOCK:
        raise InputError(f"the weights cannot be quantised to e4m3 blocks: H={H} and I={I} must be multiples of "
                         f"{BLOCK}")
    return E, I, H


def _fp8_variant(E, K, H, I):
    """The FP8 layer's variant for these sizes (built, or built now); sizes a spec refuses are
    the caller's InputError."""
    from . import _find_built, load  # (the package's loaded variants)

    try:
        return _find_built(dict(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8", world_size=1)) or \
            load(MoESpec(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8"))
    except Exception as e:
        if e.__class__.__name__ == "SpecError":
            raise InputError(f"these shapes cannot be generated in fp8: {e}") from None
        raise


class _MoEFP8(torch.autograd.Function):
    """mokgen.moe_fp8 under autograd: the forward's FP8 kernels, then the FP8 backward's data
    gradients (Variant.backward_data_fp8: dx and d_topk_weights). The experts get none."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_ids, experts, variant):
        ctx.save_for_backward(x, topk_weights, topk_ids)
        ctx.experts, ctx.variant = experts, variant
        return variant.forward_fp8(x, topk_ids, topk_weights, experts)

    @staticmethod
    def backward(ctx, dout):
        x, topk_weights, topk_ids = ctx.saved_tensors
        dout = dout.to(torch.bfloat16).contiguous()
        dx, d_weights = ctx.variant.backward_data_fp8(dout, x, topk_ids, topk_weights, ctx.experts)
        return (dx if ctx.needs_input_grad[0] else None, d_weights if ctx.needs_input_grad[1] else None,
                None, None, None)


class _MoEFP8Train(torch.autograd.Function):
    """mokgen.moe_fp8_train under autograd: the FP8 forward, then every gradient of the FP8
    backward (Variant.backward_fp8), the weights' in their own dtype."""

    @staticmethod
    def forward(ctx, x, topk_weights, w_gate, w_up, w_down, topk_ids, experts, variant, recompute):
        # the training forward also returns the gate/up products, which the backward reads
        # instead of recomputing them (a13: the routed rows x 2I in bf16); with recompute, the
        # plain forward, and the backward recomputes them
        if recompute:
            out, a13 = variant.forward_fp8(x, topk_ids, topk_weights, experts), None
        else:
            out, a13 = variant.forward_fp8(x, topk_ids, topk_weights, experts, save=True)
        ctx.save_for_backward(x, topk_weights, topk_ids, a13)
        ctx.experts, ctx.variant, ctx.dtypes = experts, variant, (w_gate.dtype, w_up.dtype, w_down.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, topk_weights, topk_ids, a13 = ctx.saved_tensors
        g = ctx.variant.backward_fp8(dout.to(torch.bfloat16).contiguous(), x, topk_ids, topk_weights, ctx.experts,
                                     a13=a13)
        weights = [g[k].to(dt) for k, dt in zip(("d_w_gate", "d_w_up", "d_w_down"), ctx.dtypes)]
        return (g["dx"] if ctx.needs_input_grad[0] else None, g["d_topk_weights"] if ctx.needs_input_grad[1] else None,
                *[w if ctx.needs_input_grad[2 + i] else None for i, w in enumerate(weights)], None, None, None, None)
