"""A built variant's torch ops: the torch.library custom ops `mokgen::<variant>_forward` (its
autograd formula the `_backward` op), `_forward_train`, `_backward`, `_route`,
`_forward_routed` and `_route_backward`, with fake implementations for torch.compile, and
VariantOps, through which mokgen.moe, mokgen.MoE and torch.compile reach them.
"""
import contextvars
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from ..schedule.backward import SAVED_FOR_BACKWARD
from .eager import Layer, Route, needs_grad

if TYPE_CHECKING:
    from .variant import Variant

# Set while a custom op runs (what torch.compile's graphs call): the call takes every buffer
# for itself, the launches' state buffers too, and keeps nothing for the next call. With
# mode="reduce-overhead", torch runs a graph's first calls eagerly with allocations drawn
# from the CUDA-graph pool it later resets and hands out again, so a buffer that outlived such
# a call would be memory torch considers free (it refuses the graph: "tensor(s) in the
# cudagraph pool not tracked as outputs"), and torch.cuda.is_current_stream_capturing()
# cannot tell those calls from eager ones.
PER_CALL_MEMORY = contextvars.ContextVar("mokgen_per_call_memory", default=False)


class per_call_memory:
    """`with per_call_memory():` the variant calls inside allocate every buffer per call."""

    __slots__ = ("token",)

    def __enter__(self):
        self.token = PER_CALL_MEMORY.set(True)
        return self

    def __exit__(self, *exc):
        PER_CALL_MEMORY.reset(self.token)
        return False


_OPS: dict[str, object] = {}


def register_ops(v: "Variant"):
    """torch.library custom ops `mokgen::<variant>_forward` (differentiable: its autograd
    formula is the `_backward` op), `_backward` and `_route`, with fake (meta)
    implementations for torch.compile, registered once per process and variant name; returns
    this variant's VariantOps over them."""
    if v.name in _OPS:
        return VariantOps(v, _OPS[v.name])

    class Ops:
        variant = v

    @torch.library.custom_op(f"mokgen::{v.name}_forward", mutates_args=())
    def forward(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                ws_gate: Optional[Tensor] = None, ws_up: Optional[Tensor] = None,
                ws_down: Optional[Tensor] = None) -> Tensor:
        with per_call_memory():
            return Ops.variant.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)

    @forward.register_fake
    def _(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None):
        return torch.empty_like(x)

    @torch.library.custom_op(f"mokgen::{v.name}_backward", mutates_args=())
    def backward(dout: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor,
                 w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor],
                 saved: list[Tensor]) -> list[Tensor]:
        """The gradients (5, or 8 with a shared expert): see Variant.backward. saved: what
        forward_train saved, or [] (dispatch again and recompute)."""
        with per_call_memory():
            grads = Ops.variant.backward(dout, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up,
                                         ws_down, saved or None)
        return [g for g in grads if g is not None]

    @backward.register_fake
    def _(dout, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, saved):
        shared = [torch.empty_like(w) for w in (ws_gate, ws_up, ws_down) if w is not None]
        return [torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w_gate), torch.empty_like(w_up),
                torch.empty_like(w_down)] + shared

    def input_grads(grads, shared: bool):
        """The autograd formula's return value for the inputs (x, topk_ids, topk_weights,
        w_gate, w_up, w_down, ws_gate, ws_up, ws_down)."""
        dx, dw, dg, du, dd, *ds = grads
        return (dx, None, dw, dg, du, dd) + (tuple(ds) if shared else (None, None, None))

    # The inference forward's autograd formula (mokgen.moe(..., recompute=True)): only the
    # inputs are saved; the backward dispatches again and recomputes the SwiGLU inputs.
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def autograd_backward(ctx, grad):
        x, ids, w, wg, wu, wd, sg, su, sd = ctx.saved_tensors
        return input_grads(backward(grad.contiguous(), x, ids, w, wg, wu, wd, sg, su, sd, []), sg is not None)

    forward.register_autograd(autograd_backward, setup_context=setup_context)

    # The training forward (mokgen.moe's default under autograd): it also returns what the
    # backward needs besides the inputs (SAVED_FOR_BACKWARD: the SwiGLU inputs, 2 x rows x I
    # bf16 with rows ~ T*K, + 2 x T x Is for a shared expert; dispatch's small int tables).
    @torch.library.custom_op(f"mokgen::{v.name}_forward_train", mutates_args=())
    def forward_train(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor,
                      w_down: Tensor, ws_gate: Optional[Tensor] = None, ws_up: Optional[Tensor] = None,
                      ws_down: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                 Tensor, Tensor, Tensor]:
        with per_call_memory():
            return Ops.variant.forward_train(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)

    @forward_train.register_fake
    def _(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None):
        shapes = Ops.variant.saved_shapes(x.shape[0])
        dtypes = dict(pos=torch.int32, row_token=torch.int32, tile_expert=torch.int32, counts=torch.int32)
        return (torch.empty_like(x),) + tuple(x.new_empty(shapes[n], dtype=dtypes.get(n, x.dtype))
                                              for n in SAVED_FOR_BACKWARD)

    def setup_context_train(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output[1:])
        ctx.mark_non_differentiable(*output[1:])

    def autograd_backward_train(ctx, grad, *_saved_grads):
        x, ids, w, wg, wu, wd, sg, su, sd, *saved = ctx.saved_tensors
        return input_grads(backward(grad.contiguous(), x, ids, w, wg, wu, wd, sg, su, sd, saved), sg is not None)

    forward_train.register_autograd(autograd_backward_train, setup_context=setup_context_train)

    @torch.library.custom_op(f"mokgen::{v.name}_forward_routed", mutates_args=())
    def forward_routed(x: Tensor, logits: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                       ws_gate: Optional[Tensor] = None, ws_up: Optional[Tensor] = None,
                       ws_down: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        with per_call_memory():
            return Ops.variant.forward_routed(x, logits, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)

    @forward_routed.register_fake
    def _(x, logits, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None):
        K = Ops.variant.spec.topk
        return (torch.empty_like(x), x.new_empty(x.shape[0], K, dtype=torch.int32),
                x.new_empty(x.shape[0], K, dtype=torch.float32))

    @torch.library.custom_op(f"mokgen::{v.name}_route", mutates_args=())
    def route(logits: Tensor) -> tuple[Tensor, Tensor]:
        return Ops.variant.route(logits)

    @route.register_fake
    def _(logits):
        K = Ops.variant.spec.topk
        return (logits.new_empty(logits.shape[0], K, dtype=torch.int32),
                logits.new_empty(logits.shape[0], K, dtype=torch.float32))

    @torch.library.custom_op(f"mokgen::{v.name}_route_backward", mutates_args=())
    def route_backward(logits: Tensor, topk_ids: Tensor, d_topk_weights: Tensor) -> Tensor:
        return Ops.variant.route_backward(logits, topk_ids, d_topk_weights)

    @route_backward.register_fake
    def _(logits, topk_ids, d_topk_weights):
        return torch.empty_like(logits)

    # mokgen.route is differentiable in its weights (the ids are not): the router's weight
    # gets its gradient through d_logits.
    def setup_context_route(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output[0])
        ctx.mark_non_differentiable(output[0])

    def autograd_backward_route(ctx, _d_ids, d_weights):
        logits, ids = ctx.saved_tensors
        return route_backward(logits, ids, d_weights.float())

    route.register_autograd(autograd_backward_route, setup_context=setup_context_route)

    Ops.forward = forward
    Ops.forward_train = forward_train
    Ops.backward = backward
    Ops.route = route
    Ops.forward_routed = forward_routed
    Ops.route_backward = route_backward
    _OPS[v.name] = Ops
    return VariantOps(v, Ops)


class VariantOps:
    """A variant's torch ops (Variant.ops). The custom ops are registered once per variant
    name (torch.library's names are process-wide), so every Variant object of one name (an
    experiment's or a debug build of the same layer, say) shares them; their implementations
    run the variant that last took them (`shared.variant`). Reaching a custom op through this
    object takes it for this variant first, and the eager entries (layer, routing, routed) run
    this variant directly: a call through one build's ops never runs another's kernels. (A
    graph compiled by torch.compile runs the custom ops of whichever variant of that name last
    took them before it was traced or when it runs.)"""

    _CUSTOM = ("forward", "forward_train", "backward", "route", "forward_routed", "route_backward")

    def __init__(self, variant, shared):
        self.variant = variant
        self._shared = shared

    def __deepcopy__(self, memo):  # (a copied module shares the loaded variant, as it shared the ops before)
        return self

    def __copy__(self):
        return self

    def __getattr__(self, name):
        if name in VariantOps._CUSTOM:
            if not torch.compiler.is_compiling():  # (torch.compile traces no assignment to a class)
                self._shared.variant = self.variant
            return getattr(self._shared, name)
        raise AttributeError(name)

    def layer(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None,
              recompute: bool = False):
        """The layer as mokgen.moe and mokgen.MoE run it (inputs checked by the caller):
        under autograd the training forward, which saves the SwiGLU inputs (or with recompute,
        or where the Plan saves nothing, the inference forward, whose backward recomputes
        them); else the inference forward. torch.compile traces the custom ops; an eager call
        runs the variant's entries directly (runtime/eager.py: the same kernels and bits
        without the ops' dispatch)."""
        v = self.variant
        args = (x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
        training = needs_grad(x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
        save = training and not recompute and v.has_backward
        if torch.compiler.is_compiling():
            return self.forward_train(*args)[0] if save else self.forward(*args)
        if training:
            return Layer.apply(v, save, *args)
        return v.forward(*args)

    def routing(self, logits):
        """(topk_ids, topk_weights) of the generated route, differentiable in the logits
        through the weights: the custom op under torch.compile, else as layer() does."""
        if torch.compiler.is_compiling():
            return self.route(logits)
        if needs_grad(logits):
            return Route.apply(self.variant, logits)
        return self.variant.route(logits)

    def routed(self, x, logits, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None):
        """(out, topk_ids, topk_weights) from the router logits, without autograd (mokgen.moe_routed
        and mokgen.MoE's inference): the custom op under torch.compile, else the variant's entry."""
        args = (x, logits, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
        return self.forward_routed(*args) if torch.compiler.is_compiling() else self.variant.forward_routed(*args)
