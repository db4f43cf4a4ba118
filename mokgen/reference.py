"""The float64 reference of the layer (DESIGN.md section 1), forward and backward.

Plain PyTorch, written for clarity, not speed; it knows nothing of the kernels.
Every golden test compares the generated ops against this.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route_reference(logits: torch.Tensor, topk: int, renormalize: bool = False):
    """softmax(logits) in float64, the top-k (ties to the lower expert id), optional renormalisation."""
    probs = torch.softmax(logits.double(), dim=-1)
    E = probs.shape[-1]
    # Sort by (-p, id): a stable sort on -p keeps ascending ids among equal values.
    order = torch.sort(-probs, dim=-1, stable=True).indices[:, :topk]
    weights = torch.gather(probs, 1, order)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    assert order.max().item() < E if order.numel() else True
    return order.to(torch.int32), weights


def expert_ffn(x, w_gate, w_up, w_down):
    """SwiGLU MLP of one expert: (silu(x W_g^T) * (x W_u^T)) W_d^T."""
    return (F.silu(x @ w_gate.t()) * (x @ w_up.t())) @ w_down.t()


def moe_reference(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None):
    """out[t] = sum_k w[t,k] * y[t,k] + shared(x)[t], all in float64 (returns float64).

    Differentiable: run it on float64 leaves that require grad for the reference backward.
    """
    x64 = x.double()
    w64 = topk_weights.double()
    out = torch.zeros_like(x64)
    ids = topk_ids.long()
    for e in range(w_gate.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        y = expert_ffn(x64[tok], w_gate[e].double(), w_up[e].double(), w_down[e].double())
        out = out.index_add(0, tok, y * w64[tok, slot, None])
    if ws_gate is not None:
        out = out + expert_ffn(x64, ws_gate.double(), ws_up.double(), ws_down.double())
    return out


def dot_error_scales(dout, x, topk_ids, w_gate, w_up, w_down):
    """||dout[t] * y[t,k]|| (elementwise product, float64) for every (token, slot) pair. A
    pair's d_topk_weights = <dout[t], y[t,k]> is a sum of those products; rounding each term
    gives an error that scales with this norm, not with the sum, which cancellation can bring
    near zero. For random vectors the two are of the same size."""
    ids = topk_ids.long()
    scales = torch.zeros(ids.shape, dtype=torch.float64, device=x.device)
    for e in range(w_gate.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel():
            y = expert_ffn(x[tok].double(), w_gate[e].double(), w_up[e].double(), w_down[e].double())
            scales[tok, slot] = (dout[tok].double() * y).norm(dim=1)
    return scales


def moe_reference_backward(dout, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
                           ws_down=None):
    """Gradients of moe_reference in float64: dict of dx, d_topk_weights, d_w_gate, d_w_up, d_w_down
    (+ d_ws_gate, d_ws_up, d_ws_down). d_topk_weights[t,k] = <dout[t], y[t,k]>."""
    names = ["x", "topk_weights", "w_gate", "w_up", "w_down"]
    leaves = {n: t.detach().double().requires_grad_(True) for n, t in
              zip(names, (x, topk_weights, w_gate, w_up, w_down))}
    shared = {}
    if ws_gate is not None:
        shared = {n: t.detach().double().requires_grad_(True) for n, t in
                  zip(["ws_gate", "ws_up", "ws_down"], (ws_gate, ws_up, ws_down))}
    out = moe_reference(leaves["x"], topk_ids, leaves["topk_weights"], leaves["w_gate"], leaves["w_up"],
                        leaves["w_down"], shared.get("ws_gate"), shared.get("ws_up"), shared.get("ws_down"))
    if out.requires_grad:  # (a call whose every slot is empty and no shared expert: out is 0, no graph)
        out.backward(dout.double())
    return {f"d_{n}" if n != "x" else "dx": t.grad if t.grad is not None else torch.zeros_like(t)
            for n, t in {**leaves, **shared}.items()}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf (never passes)."""
    out64 = out.double()
    if torch.isnan(out64).any() or torch.isinf(out64).any():
        return float("inf")
    denom = ref.double().norm().item()
    num = (out64 - ref.double()).norm().item()
    return num / denom if denom else num
