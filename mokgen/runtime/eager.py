"""The layer and the route under autograd in eager mode: plain autograd Functions over a
variant's entry points.

torch.compile needs the torch.library custom ops of ops.register_ops (their schemas
and fake implementations let it trace the layer); an eager call needs neither. Through the
custom op, a call pays the op's dispatch (schema binding, the autograd wrapper, the
fake-implementation checks) on the host each time, forward and backward; a small training
step is host-bound, so those microseconds are its time. These Functions call the same
entry points with the same tensors: the same kernels, the same bits.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


class Layer(torch.autograd.Function):
    """out = the layer (mokgen.moe); differentiable in x, topk_weights and every weight.

    save: the training forward (Variant.forward_train), which also returns the SwiGLU inputs
    and dispatch's tables for the backward; else the inference forward, and the backward
    dispatches again and recomputes them (recompute=True, or a variant whose Plan saves
    nothing)."""

    @staticmethod
    def forward(ctx, v, save: bool, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
        args = (x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
        if save:
            out, *saved = v.forward_train(*args)
        else:
            out, saved = v.forward(*args), []
        ctx.v, ctx.save = v, save
        ctx.save_for_backward(*args, *saved)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, ids, w, wg, wu, wd, sg, su, sd, *saved = ctx.saved_tensors
        dx, dw, dg, du, dd, dsg, dsu, dsd = ctx.v.backward(dout.contiguous(), x, ids, w, wg, wu, wd, sg, su, sd,
                                                           saved if ctx.save else None)
        return None, None, dx, None, dw, dg, du, dd, dsg, dsu, dsd


class Route(torch.autograd.Function):
    """(topk_ids, topk_weights) = the generated route (mokgen.route); differentiable in the
    logits through the weights (the ids are not)."""

    @staticmethod
    def forward(ctx, v, logits):
        ids, weights = v.route(logits)
        ctx.v = v
        ctx.save_for_backward(logits, ids)
        ctx.mark_non_differentiable(ids)
        return ids, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, _d_ids, d_weights):
        logits, ids = ctx.saved_tensors
        return None, ctx.v.route_backward(logits, ids, d_weights.float())


def needs_grad(*tensors) -> bool:
    """Whether autograd will ask for gradients of a call with these inputs."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
