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

from .reference import moe_reference, rel_error

TOLERANCE = 1e-2  # DESIGN.md: bf16 relative error bound against float64
ROUTINGS = ("uniform", "skewed")


def make_inputs(spec, tokens: int, routing: str = "uniform", gen: torch.Generator | None = None,
                device: str = "cuda"):
    """x, topk_ids (int32), topk_weights (fp32), w_gate, w_up, w_down, (ws_gate, ws_up, ws_down)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if gen is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(random.SystemRandom().randrange(2**31))
    E, K, H, I, S = spec.local_experts, spec.topk, spec.hidden, spec.intermediate, spec.shared_intermediate

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(torch.bfloat16)

    x = randn(tokens, H)
    logits = torch.randn(tokens, E, device=device, generator=gen)
    if routing == "skewed":
        logits[:, E // 2:] = -1e4  # the upper half of the experts gets no token
        logits[:, min(3, E - 1)] = 1e4  # one hot expert gets every token
    w, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float().contiguous()
    wg, wu = randn(E, I, H, scale=1 / math.sqrt(H)), randn(E, I, H, scale=1 / math.sqrt(H))
    wd = randn(E, H, I, scale=1 / math.sqrt(I))
    shared = (None, None, None)
    if S:
        shared = (randn(S, H, scale=1 / math.sqrt(H)), randn(S, H, scale=1 / math.sqrt(H)),
                  randn(H, S, scale=1 / math.sqrt(S)))
    return x, ids.to(torch.int32).contiguous(), w, wg, wu, wd, shared


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

    @property
    def ok(self) -> bool:
        return not self.unwritten and self.rel_error <= TOLERANCE


def check_forward(variant, tokens: int, routing: str, gen=None) -> CheckResult:
    inputs = make_inputs(variant.spec, tokens, routing, gen)
    out = run_poisoned(variant, inputs)
    x, ids, w, wg, wu, wd, (sg, su, sd) = inputs
    ref = moe_reference(x, ids, w, wg, wu, wd, sg, su, sd)
    return CheckResult(tokens, routing, rel_error(out, ref), bool(torch.isnan(out).any()))
