"""mokgen runtime: built variants as torch ops (needs torch; no jinja2, no compiler
when the compiled artifacts exist)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..ir import MoESpec
from .checks import InputError, check_ids_in_range, check_moe_inputs
from .eager import needs_grad
from .fp8_layer import moe_fp8, moe_fp8_train, quantize_experts_fp8
from .library import LaunchError
from .peers import RendezvousTimeout
from .variant import KernelTimeout, Variant, VariantNotBuilt

_LOADED: dict[str, Variant] = {}


def variants_root() -> Path:
    env = os.environ.get("MOKGEN_HOME")
    return Path(env) if env else _SOURCE_ROOT / "generated"


_SOURCE_ROOT = Path(__file__).resolve().parents[2]


def _can_compile() -> bool:
    import importlib.util

    return importlib.util.find_spec("cutlass") is not None or importlib.util.find_spec("nvidia_cutlass_dsl") is not None


def load(spec_or_path, *, build: bool = True) -> Variant:
    """A Variant from a MoESpec (built on first use where CuTe-DSL is installed) or a variant directory."""
    if isinstance(spec_or_path, MoESpec):
        path = variants_root() / spec_or_path.variant
        if build and _can_compile() and str(path.resolve()) not in _LOADED:
            from ..codegen import build as build_variant

            # A no-op when the variant on disk was built from exactly what this mokgen renders
            # now; a variant of another template, mokgen or CuTe-DSL version is rebuilt.
            build_variant(spec_or_path, variants_root(), log=lambda m: None)
    else:
        path = Path(spec_or_path)
        if not path.is_dir():
            candidate = variants_root() / str(spec_or_path)
            if candidate.is_dir():
                path = candidate
    key = str(path.resolve())
    if key not in _LOADED:
        if not (path / "manifest.json").exists():
            raise VariantNotBuilt(
                f"variant not found at {path}; build it with `mokgen build` (needs nvidia-cutlass-dsl)")
        _LOADED[key] = Variant(path)
        _warn_if_stale(_LOADED[key])
    return _LOADED[key]


def _warn_if_stale(v: Variant) -> None:
    """Where nothing can rebuild it (no CuTe-DSL here), say so when a variant was built by
    another mokgen: it still runs, but it is not what this version would generate."""
    from .. import __version__

    built_by = v.manifest.get("plan", {}).get("mokgen_version")
    if built_by and built_by != __version__:
        import warnings

        warnings.warn(f"{v.name} was built by mokgen {built_by}, this is {__version__}: rebuild it with "
                      f"`mokgen build --from-manifest {v.path / 'manifest.json'}` where CuTe-DSL is installed",
                      stacklevel=3)


def _find_built(want: dict) -> Variant | None:
    """A loaded or built variant whose spec has these field values, among the builds at the
    top of variants_root(): an experiment's, a debug or a profiling build of the same layer
    (under experiments/, debug/, profile/ or elsewhere), even when loaded, never serves calls
    that name no build."""
    root = variants_root()
    for v in _LOADED.values():
        if v.path.resolve().parent == root.resolve() and all(v.spec.to_dict()[f] == val for f, val in want.items()):
            return v
    if root.is_dir():
        import json

        for m in sorted(root.glob("*/manifest.json")):
            spec = json.loads(m.read_text())["spec"]
            if all(spec[f] == val for f, val in want.items()) and (m.parent / "build" / "libmokgen.so").exists():
                return load(m.parent)
    return None


def find_variant(E, K, H, I, S, world_size: int = 1, renormalize: bool | None = None) -> Variant:
    """The variant serving these shapes (E: all experts of the group): an existing build whose
    spec matches, else a new build. renormalize: None where the layer does not route (any
    build serves), else the routing's renormalisation."""
    key = (os.environ.get("MOKGEN_HOME"), E, K, H, I, S, world_size, renormalize)
    if key not in _BY_SHAPE:  # (found once per process: the lookup reads manifests)
        topology = "nvlink" if world_size > 1 else "single"
        want = dict(experts=E, topk=K, hidden=H, intermediate=I, shared_intermediate=S, world_size=world_size,
                    dtype="bf16")
        if renormalize is not None:
            want["renormalize"] = renormalize
        _BY_SHAPE[key] = _find_built(want) or load(MoESpec(experts=E, topk=K, hidden=H, intermediate=I,
                                                           shared_intermediate=S, world_size=world_size,
                                                           topology=topology, renormalize=bool(renormalize)))
    return _BY_SHAPE[key]


_BY_SHAPE: dict[tuple, Variant] = {}


def moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, ws_gate=None, ws_up=None, ws_down=None,
        check_ids: bool = True, recompute: bool = False, group=None, max_tokens: int | None = None,
        recv_rows: int | None = None, nodes: int | None = None):
    """out[t] = bf16(sum_k topk_weights[t,k] * expert_{topk_ids[t,k]}(x[t]) + shared(x)[t]).

    An id of -1 is an empty slot (a dropped pair, as capacity-limited routers make): it
    contributes nothing, and its d_topk_weights entry is 0.

    Checks every input before any launch. check_ids also checks the values (ids in [0, E) or
    -1, x finite), which reads one small tensor back to the host (a synchronisation); it is
    skipped during CUDA graph capture. Unchecked out-of-range ids contribute nothing and are
    reported by the device: mokgen.check_errors() or the next call raises InputError.

    Under torch.compile (mode="reduce-overhead" too) it runs as the variant's custom ops; an
    eager call of the same sizes before the first compiled one (or mokgen.MoE, which finds its
    build when it is made) spares a graph break at the lookup of the build.

    Differentiable in x, topk_weights and the weights. Under autograd it saves the inputs and
    the SwiGLU inputs x @ w_gate^T, x @ w_up^T (2 x ~T*K x I bf16, + 2 x T x Is with a shared
    expert); recompute=True saves the inputs only and the backward recomputes the rest (one
    more gate/up GEMM per expert kind).

    Expert parallel: group is the process group whose ranks share the experts (one GPU each,
    linked by NVLink). Each rank passes its own tokens and its E/W local experts' weights
    (rank r owns global experts r*E/W .. (r+1)*E/W - 1); topk_ids are global. Every rank must
    make the same calls in the same order (a rank that does not take part is reported as a
    KernelTimeout on the others, never a hang; at the call that makes the workspace, a host
    collective, as RendezvousTimeout after MOKGEN_RENDEZVOUS_TIMEOUT_S seconds, default 300).
    The group's peer workspace is made by the first call, for max_tokens tokens per rank
    (default: the largest T of that first call over the group) and recv_rows (token, expert) rows received per rank and call (default:
    group size x max_tokens x topk, which no routing exceeds; a smaller bound saves memory, and
    a call whose routing would exceed it is dropped on every rank and reported as InputError).
    Differentiable too: autograd saves the inputs and the SwiGLU inputs in the receive layout
    (2 x rows x I bf16, rows bounded by recv_rows), or with recompute=True the inputs only; the
    backward exchanges again and is collective as well (every rank runs the backward of every
    layer it ran, so the layer's output must reach every rank's loss).

    Across nodes: nodes=N (> 1) says the group's ranks are in N nodes of G = W/N GPUs,
    node-major (rank = node * G + local index). Tokens go to other nodes through NCCL
    (torch.distributed) over the rail of GPUs with the same local index, each token once per
    destination node, and the node-local generated layer runs the pairs
    (mokgen/schedule/multinode.py): the single-GPU layer (G = 1) or the NVLink
    expert-parallel megakernel over the node's GPUs, whose workspace grows with the calls (every
    GPU of a node at once). Forward only (under torch.no_grad()); no shared expert. Ids out of
    range on any rank (and, with check_ids, x with NaN or Inf) are found on the device and read
    with the call's sizes: every rank raises InputError at the same point.
    """
    if isinstance(topk_ids, torch.Tensor) and topk_ids.dtype == torch.int64:
        topk_ids = topk_ids.to(torch.int32)
    E, K, H, I, S = check_moe_inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    if nodes is not None and nodes != 1:
        if group is None:
            raise InputError(f"nodes={nodes!r} needs group= (the process group of every node's ranks)")
        from .multinode import moe_multinode

        return moe_multinode(x, topk_ids, topk_weights, w_gate, w_up, w_down, (E, K, H, I, S), group, nodes,
                             check_ids)
    if group is not None:
        return _moe_expert_parallel(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                                    (E, K, H, I, S), check_ids, group, max_tokens, recompute, recv_rows)
    v = _variant_for(E, K, H, I, S)
    if check_ids:
        check_ids_in_range(topk_ids, E, x)
    return v.ops.layer(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, recompute=recompute)


def _variant_for(E, K, H, I, S, world_size: int = 1, renormalize: bool | None = None) -> Variant:
    """find_variant, with a spec the sizes make illegal reported as the caller's InputError."""
    try:
        return find_variant(E, K, H, I, S, world_size=world_size, renormalize=renormalize)
    except Exception as e:  # spec errors name the offending size
        if e.__class__.__name__ == "SpecError":
            gpus = f" for {world_size} GPUs" if world_size > 1 else ""
            raise InputError(f"these shapes cannot be generated{gpus}: {e}") from None
        raise


def _moe_expert_parallel(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, sizes,
                         check_ids, group, max_tokens, recompute=False, recv_rows=None):
    import torch.distributed as dist

    from .peers import workspace

    E_local, K, H, I, S = sizes
    W = dist.get_world_size(group)
    for name, value in (("max_tokens", max_tokens), ("recv_rows", recv_rows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    v = _variant_for(E_local * W, K, H, I, S, world_size=W)
    if check_ids:
        check_ids_in_range(topk_ids, E_local * W, x)
    peers = workspace(v, group, x.shape[0], max_tokens, recv_rows)
    if needs_grad(x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
        if not v.has_backward:
            raise NotImplementedError(f"{v.name}: the backward is not generated for this layer ({v.why_no_backward()})")
        saved = not recompute and "backward" in v.plan["steps"]
        peers.prepare(v, "backward" if saved else "backward_recompute")  # collective: every rank is here
        return _ExpertParallelMoE.apply(v, peers, saved, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate,
                                        ws_up, ws_down)
    return v.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, peers=peers)


class _ExpertParallelMoE(torch.autograd.Function):
    """The expert-parallel layer under autograd. It saves the inputs and (saved) the SwiGLU
    inputs in the receive layout (Variant.forward_train), or the inputs only (recompute). The
    backward is collective (every rank of the group runs it, for every layer, in the same
    order) and exchanges the pairs' rows again (Variant.backward with the peer workspace)."""

    @staticmethod
    def forward(ctx, v, peers, saved, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
        ctx.variant, ctx.peers = v, peers
        inputs = (x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
        if not saved:
            ctx.save_for_backward(*inputs)
            return v.forward(*inputs, peers=peers)
        out, *swiglu_inputs = v.forward_train(*inputs, peers=peers)
        ctx.save_for_backward(*inputs, *swiglu_inputs)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, ids, w, wg, wu, wd, sg, su, sd, *saved = ctx.saved_tensors
        dx, dw, dg, du, dd, dsg, dsu, dsd = ctx.variant.backward(dout.contiguous(), x, ids, w, wg, wu, wd, sg, su, sd,
                                                                  saved=saved or None, peers=ctx.peers)
        return None, None, None, dx, None, dw, dg, du, dd, dsg, dsu, dsd


def release_peer_workspaces() -> None:
    """Free the expert-parallel peer workspaces (every rank of a group together)."""
    from .peers import release_all

    release_all()


def release_workspaces() -> None:
    """Drop the buffers small calls keep for their next call (Variant._workspace; at most
    KEEP_WORKSPACE_BYTES per inference slot, KEEP_TRAINING_BYTES per training entry, on each
    device and stream): torch's allocator gets them
    back, and the next call allocates again. Safe at any time: a call still running on the GPU
    keeps its buffers alive in stream order, as torch's allocator does for any freed tensor."""
    for v in _LOADED.values():
        v.release_workspaces()


def moe_routed(x, router_logits, topk: int, w_gate, w_up, w_down, *, ws_gate=None, ws_up=None, ws_down=None,
               renormalize: bool = False):
    """The layer from router logits: (out, topk_ids, topk_weights), where (topk_ids,
    topk_weights) = route(router_logits, topk, renormalize=...) and out = moe(x, topk_ids,
    topk_weights, ...), bit for bit. Calls the single launch serves (T up to the Plan's
    fused_max_tokens, one GPU) run route, dispatch, the GEMMs and the combine in one launch;
    larger ones, and calls under autograd (differentiable in x, router_logits through the
    weights, and the experts' weights), run route, then moe. No host synchronisation: ids
    the router could not pick (non-finite logits) are reported by the device, as InputError
    at mokgen.check_errors() or the next call."""
    _check_logits(router_logits)
    T, E = router_logits.shape
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != T:
        raise InputError(f"x must be [T, H] with T = router_logits.shape[0] = {T}, got "
                         f"{list(getattr(x, 'shape', [])) or type(x).__name__}")
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= E:
        raise InputError(f"topk must be an integer in [1, {E}], got {topk!r}")
    ids_like = torch.empty((T, topk), dtype=torch.int32, device=router_logits.device)
    E_w, K, H, I, S = check_moe_inputs(x, ids_like, ids_like.float(), w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    if E_w != E:
        raise InputError(f"router_logits route over {E} experts, the weights hold {E_w}")
    if needs_grad(x, router_logits, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
        ids, weights = route(router_logits, topk, renormalize=renormalize)
        return moe(x, ids, weights, w_gate, w_up, w_down, ws_gate=ws_gate, ws_up=ws_up, ws_down=ws_down,
                   check_ids=False), ids, weights
    v = _variant_for(E, K, H, I, S, renormalize=renormalize)
    return v.ops.routed(x, router_logits, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)


def _check_logits(router_logits) -> None:
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        raise InputError("router_logits must be a 2-d tensor [T, E]")
    if router_logits.dtype != torch.float32:
        raise InputError(f"router_logits must be torch.float32, got {router_logits.dtype}")
    if not router_logits.is_cuda:
        raise InputError(f"router_logits must be on a CUDA device, got {router_logits.device}")
    if not router_logits.is_contiguous():
        raise InputError("router_logits must be contiguous (call .contiguous())")


def route(router_logits, topk: int, *, renormalize: bool = False, variant: Variant | None = None):
    """Router logits [T, E] fp32 -> (topk_ids int32, topk_weights fp32), the generated route kernel."""
    _check_logits(router_logits)
    E = router_logits.shape[1]
    if variant is None:
        from ..ir import SpecError

        try:  # validates E and topk with the spec's messages
            spec = MoESpec(experts=E, topk=topk, hidden=64, intermediate=64, renormalize=renormalize)
        except SpecError as e:
            raise InputError(str(e)) from None
        # Any built variant with this router serves (the route kernel depends on E, K and
        # renormalisation only); else build the smallest one.
        variant = _find_built(dict(experts=E, topk=topk, renormalize=renormalize, world_size=1, dtype="bf16")) or load(spec)
    elif variant.spec.experts != E or variant.spec.topk != topk:
        raise InputError(f"variant {variant.name} routes over {variant.spec.experts} experts, top-"
                         f"{variant.spec.topk}; got E={E}, topk={topk}")
    return variant.ops.routing(router_logits)


def check_errors() -> None:
    """Wait for the launched work of every loaded variant; raise KernelTimeout if a kernel
    gave up a bounded wait (its call's output is invalid)."""
    for v in _LOADED.values():
        v.check_errors()


__all__ = ["InputError", "KernelTimeout", "LaunchError", "RendezvousTimeout", "Variant", "VariantNotBuilt",
           "check_errors", "load", "moe", "moe_fp8", "moe_fp8_train", "moe_routed", "quantize_experts_fp8", "route",
           "find_variant", "release_peer_workspaces", "release_workspaces"]
