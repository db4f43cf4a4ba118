"""mokgen: a compiler for Mixture-of-Experts megakernels.

    spec (MoESpec) -> stage graph (ir) -> Plan (schedule) -> CuTe-DSL source (codegen)
    -> ahead-of-time compiled kernels -> torch ops (runtime)

Public API: MoESpec, load, moe (differentiable), route, moe_routed (route + moe, one launch
where it can), moe_fp8 (FP8 experts; differentiable in x and the routing weights), moe_fp8_train
(the FP8 layer over bf16 weights, differentiable in all), quantize_experts_fp8 (bf16 weights to
FP8 on the GPU), check_errors, release_workspaces, MoE (an nn.Module).
"""
__version__ = "0.1.0"

from .ir import MoESpec, SpecError  # noqa: E402


def load(spec_or_path, **kw):
    """Load (building if needed) a variant; returns a runtime.Variant."""
    from .runtime import load as _load

    return _load(spec_or_path, **kw)


def moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, ws_gate=None, ws_up=None, ws_down=None, **kw):
    """The MoE layer of DESIGN.md section 1, through the generated kernels."""
    from .runtime import moe as _moe

    return _moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=ws_gate, ws_up=ws_up,
                ws_down=ws_down, **kw)


def moe_fp8(x, topk_ids, topk_weights, experts, *, check_ids=True, group=None):
    """The layer with FP8 experts (mokgen.fp8.quantize_experts): e4m3 with block scales, bf16 out;
    differentiable in x and topk_weights, the experts frozen; group= spreads the experts over
    GPUs, one per node (see mokgen.runtime.moe_fp8)."""
    from .runtime import moe_fp8 as _moe_fp8

    return _moe_fp8(x, topk_ids, topk_weights, experts, check_ids=check_ids, group=group)


def moe_fp8_train(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, experts=None, check_ids=True,
                  recompute=False, group=None):
    """The FP8 layer over bf16 master weights (quantised on each call, or once per optimizer step:
    experts=quantize_experts_fp8(...)), differentiable in every input; group= spreads the experts
    over GPUs, one per node (see mokgen.runtime.moe_fp8_train)."""
    from .runtime import moe_fp8_train as _moe_fp8_train

    return _moe_fp8_train(x, topk_ids, topk_weights, w_gate, w_up, w_down, experts=experts, check_ids=check_ids,
                          recompute=recompute, group=group)


def quantize_experts_fp8(w_gate, w_up, w_down, topk):
    """The experts' FP8 weights quantised on their GPU by the generated kernels (see
    mokgen.runtime.quantize_experts_fp8)."""
    from .runtime import quantize_experts_fp8 as _quantize

    return _quantize(w_gate, w_up, w_down, topk)


def moe_routed(x, router_logits, topk, w_gate, w_up, w_down, *, ws_gate=None, ws_up=None, ws_down=None,
               renormalize=False):
    """(out, topk_ids, topk_weights): route, then the layer; one launch where the fused launch
    serves the call (see mokgen.runtime.moe_routed)."""
    from .runtime import moe_routed as _moe_routed

    return _moe_routed(x, router_logits, topk, w_gate, w_up, w_down, ws_gate=ws_gate, ws_up=ws_up,
                       ws_down=ws_down, renormalize=renormalize)


def check_errors():
    """Raise KernelTimeout if a generated kernel gave up a bounded wait in an earlier call
    (waits for the launched work first). Later calls also raise it, without waiting."""
    from .runtime import check_errors as _check

    _check()


def release_peer_workspaces():
    """Free the expert-parallel peer workspaces (call it on every rank of the group together)."""
    from .runtime import release_peer_workspaces as _release

    _release()


def release_workspaces():
    """Drop the buffers small inference calls keep for their next call of the same size (up to
    64 MB per entry, device and stream); call torch.cuda.empty_cache() after it to return them
    to the device."""
    from .runtime import release_workspaces as _release

    _release()


def route(router_logits, topk: int, *, renormalize: bool = False, experts_spec=None):
    """Router logits [T, E] (fp32) -> (topk_ids int32 [T, K], topk_weights fp32 [T, K])."""
    from .runtime import route as _route

    return _route(router_logits, topk, renormalize=renormalize)


def __getattr__(name):
    if name == "MoE":  # imports torch: only when asked for
        from .module import MoE

        return MoE
    raise AttributeError(f"module 'mokgen' has no attribute {name!r}")


__all__ = ["MoE", "MoESpec", "SpecError", "check_errors", "load", "moe", "moe_fp8", "moe_fp8_train", "moe_routed",
           "quantize_experts_fp8", "release_peer_workspaces", "release_workspaces", "route", "__version__"]
