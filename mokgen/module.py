"""`mokgen.MoE`: a drop-in MoE block (router + routed SwiGLU experts [+ shared expert])
whose expert part runs through the generated kernels, forward and backward.

The router is an fp32 linear layer; softmax, top-k and the optional renormalisation run in
PyTorch, or with fused_routing=True in the generated route kernel and its generated backward
(d_logits from d_topk_weights); either way the router's weight gets its gradient through
d_topk_weights, which the generated backward returns. `reference=True` builds the same block
on plain PyTorch ops (torch grouped_mm), for comparisons and for machines without a GPU build.
`dtype="fp8"` runs the routed experts in FP8 (docs/fp8.md) over the same bf16 parameters.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


# Optimizer steps taken in this process (any torch.optim optimizer): the FP8 blocks' kept
# experts are from before the last one, or not. (A fused AdamW step does not bump its
# parameters' version counters, measured on an H200 with torch 2.11, so those alone miss it.)
_OPTIMIZER_STEPS = [0]
_STEP_HOOK = []


def _count_optimizer_steps() -> None:
    """Count every optimizer step from now on (one global post-step hook, registered once)."""
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def stepped(optimizer, args, kwargs):
            _OPTIMIZER_STEPS[0] += 1

        _STEP_HOOK.append(register_optimizer_step_post_hook(stepped))


def route_torch(logits: torch.Tensor, topk: int, renormalize: bool):
    """(topk_ids int32, topk_weights fp32) from fp32 router logits, differentiable in the weights."""
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(torch.int32), weights


def torch_shared_expert(x, ws13, ws_down, out):
    """Adds the shared expert (every token) to the fp32 accumulator, as dense bf16 matmuls."""
    S = ws_down.shape[1]
    hs13 = x @ ws13.t()
    out += ((F.silu(hs13[:, :S]) * hs13[:, S:]) @ ws_down.t()).float()


def torch_grouped_mm(x, ids, w, w13, wd, I, shared=None):
    """The layer (DESIGN.md section 1) as a PyTorch user writes it, differentiable: tokens
    sorted by expert, torch._grouped_mm for gate/up (w13 = [w_gate; w_up] per expert) and
    down, SwiGLU, a weighted index_add combine. shared: (ws13 = [ws_gate; ws_up], ws_down)
    when the layer has a shared expert. The benchmarks' baseline. Empty slots (-1) give the
    exact forward, but their rows lie past the last group, which torch._grouped_mm leaves
    unwritten, and its autograd reads them: differentiate it only over routings without empty
    slots (mokgen.verify.torch_backward makes them weight-0 pairs of expert 0)."""
    T, _ = x.shape
    E, K = wd.shape[0], ids.shape[1]
    flat = ids.reshape(-1).long()
    flat = torch.where(flat < 0, E, flat)  # empty slots (-1) sort last, past every expert's group
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E + 1)[:E], 0).to(torch.int32)
    tok = order // K
    h13 = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
    h = F.silu(h13[:, :I]) * h13[:, I:]
    y = torch._grouped_mm(h, wd.transpose(1, 2), offs=offs)
    out = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
    # (rows past the last group's offset are left unwritten by _grouped_mm: selected away)
    kept = (flat[order] < E)[:, None]
    out.index_add_(0, tok, torch.where(kept, y.float(), 0.0) * w.reshape(-1)[order, None])
    if shared is not None:
        torch_shared_expert(x, *shared, out)
    return out.to(x.dtype)


def torch_expert_parallel(x, ids, w, w13, wd, E, group, shared=None):
    """The layer with expert parallelism as a PyTorch user writes it: each rank holds E/W
    experts (w13 = [w_gate; w_up] and wd of its local experts); a count exchange and one host
    sync for the split sizes, NCCL all_to_alls through torch.distributed.nn (differentiable:
    the backward is the reverse all_to_all), torch._grouped_mm experts, a weighted index_add
    combine. shared: (ws13, ws_down) or None. The expert-parallel benchmarks' baseline."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_to_all_single as a2a

    W = dist.get_world_size(group)
    El, K, I = E // W, ids.shape[1], wd.shape[2]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.bincount(flat, minlength=E)
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts, group=group)
    send = counts.view(W, El).sum(1).tolist()
    recv = counts_in.view(W, El).sum(1).tolist()
    xr = a2a(x.new_empty(sum(recv), x.shape[1]), x[tok], recv, send, group=group)
    local = torch.repeat_interleave(torch.arange(El, device=x.device).repeat(W), counts_in)
    by_expert = torch.argsort(local, stable=True)  # arrivals are by source, then expert
    offs = torch.cumsum(counts_in.view(W, El).sum(0), 0).to(torch.int32)
    h13 = torch._grouped_mm(xr[by_expert], w13.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(F.silu(h13[:, :I]) * h13[:, I:], wd.transpose(1, 2), offs=offs)
    ys = torch.empty_like(y).index_copy(0, by_expert, y)
    back = a2a(x.new_empty(sum(send), x.shape[1]), ys, send, recv, group=group)
    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    out = out.index_add(0, tok, back.float() * w.reshape(-1)[order, None])
    if shared is not None:
        torch_shared_expert(x, *shared, out)
    return out.to(x.dtype)


def experts_torch(x, ids, weights, w_gate, w_up, w_down, shared=None):
    """torch_grouped_mm on separate weights (shared: (ws_gate, ws_up, ws_down) or None); the
    concatenations are part of the autograd graph."""
    shared13 = (torch.cat([shared[0], shared[1]], dim=0), shared[2]) if shared is not None else None
    return torch_grouped_mm(x, ids, weights, torch.cat([w_gate, w_up], dim=1), w_down, w_gate.shape[1], shared13)


class MoE(nn.Module):
    """Router + `experts` SwiGLU experts (top-`topk` per token) + an optional shared expert.

    Input [..., hidden] bf16, output the same shape. Parameters: router.weight [E, H] fp32,
    w_gate, w_up [E, I, H], w_down [E, H, I] bf16 (+ ws_gate, ws_up [S, H], ws_down [H, S]).
    Under autograd it saves the SwiGLU inputs (2 x ~T*K x I bf16, + 2 x T x S) unless recompute=True.
    fused_routing=True routes with the generated route kernel (and its backward) instead of torch ops;
    in inference (no autograd, one GPU) routing then runs inside the layer's single launch.

    dtype="fp8": the routed experts run the generated FP8 layer (mokgen.moe_fp8_train: e4m3
    with block scales, every gradient in FP8, bf16 out) over the bf16 parameters, which stay the
    master weights the optimizer updates. Their FP8 copy (as many bytes as the bf16 weights) is
    kept between calls and quantised again once any torch.optim optimizer has stepped (a global
    post-step hook counts the steps) or w_gate, w_up or w_down has changed otherwise (their
    storage, or their version counters, which in-place updates such as load_state_dict and
    nn.init bump): so micro-batches that accumulate gradients between two optimizer steps
    quantise once. An update that neither steps a torch.optim optimizer nor bumps the counters
    (writing through `.data` outside an optimizer) must be followed by requantize(). A shared
    expert runs in bf16 (torch matmuls) beside the FP8 experts; hidden and intermediate sizes
    multiples of 128.

    Expert parallel (group: a process group of W ranks, one GPU each): the module holds its
    rank's E/W experts (rank r: global experts r*E/W ...), the router and the shared expert
    are replicated (their gradients are each rank's own: average them across the group as for
    any replicated parameter). Every rank calls forward and backward of every block together.
    bf16: the NVLink expert-parallel megakernel (the GPUs linked by NVLink); max_tokens and
    recv_rows size its peer workspace (mokgen.moe says how). fp8: the FP8 layer across nodes,
    one GPU per node, tokens crossing through NCCL (mokgen.moe_fp8_train(group=)).
    """

    def __init__(self, hidden: int, intermediate: int, experts: int, topk: int, shared_intermediate: int = 0,
                 renormalize: bool = False, device=None, reference: bool = False, recompute: bool = False,
                 group=None, max_tokens: int | None = None, recv_rows: int | None = None,
                 fused_routing: bool = False, dtype: str = "bf16"):
        super().__init__()
        from .ir import MoESpec

        world = 1
        if group is not None:
            import torch.distributed as dist

            world = dist.get_world_size(group)
        # Validates the sizes with the spec's messages before any allocation.
        self.spec = MoESpec(experts=experts, topk=topk, hidden=hidden, intermediate=intermediate,
                            shared_intermediate=shared_intermediate, renormalize=renormalize, world_size=world,
                            topology="nvlink" if world > 1 else "single", dtype=dtype)
        self.reference = reference
        self.fused_routing = fused_routing  # softmax / top-k in the generated route kernels
        self.recompute = recompute  # save only the inputs; the backward recomputes the SwiGLU inputs
        ep = world > 1
        self.group, self.max_tokens, self.recv_rows = (group, max_tokens, recv_rows) if ep else (None, None, None)
        local = self.spec.local_experts
        bf16 = dict(device=device, dtype=torch.bfloat16)
        self.router = nn.Linear(hidden, experts, bias=False, device=device, dtype=torch.float32)
        self.w_gate = nn.Parameter(torch.empty(local, intermediate, hidden, **bf16))
        self.w_up = nn.Parameter(torch.empty(local, intermediate, hidden, **bf16))
        self.w_down = nn.Parameter(torch.empty(local, hidden, intermediate, **bf16))
        if shared_intermediate:
            self.ws_gate = nn.Parameter(torch.empty(shared_intermediate, hidden, **bf16))
            self.ws_up = nn.Parameter(torch.empty(shared_intermediate, hidden, **bf16))
            self.ws_down = nn.Parameter(torch.empty(hidden, shared_intermediate, **bf16))
        else:
            self.ws_gate = self.ws_up = self.ws_down = None
        self.reset_parameters()
        # The generated ops, found (or built) once: a module on a GPU resolves them now, so
        # that torch.compile traces a plain custom-op call; elsewhere at the first forward.
        self._ops = None
        self._routed_ops = None  # (fused_routing, inference: the build with this routing's renormalisation)
        self._fp8 = None  # dtype fp8: (what they were quantised from: _fp8_key(), the FP8 experts)
        if dtype == "fp8":
            _count_optimizer_steps()
        if not reference and self.w_gate.is_cuda and self.group is None and dtype == "bf16":
            self._resolve()

    def _resolve(self):
        from .runtime import find_variant

        s = self.spec  # renormalisation happens in the router (torch): any build of these sizes serves
        self._ops = find_variant(s.experts, s.topk, s.hidden, s.intermediate, s.shared_intermediate).ops

    def _forward_expert_parallel(self, x2, ids, weights, shared):
        if self.reference:
            shared13 = (torch.cat([shared[0], shared[1]], 0), shared[2]) if shared is not None else None
            return torch_expert_parallel(x2, ids, weights, torch.cat([self.w_gate, self.w_up], 1), self.w_down,
                                         self.spec.experts, self.group, shared13)
        from .runtime import moe

        ws_gate, ws_up, ws_down = shared or (None, None, None)
        return moe(x2.contiguous(), ids, weights.contiguous(), self.w_gate, self.w_up, self.w_down, ws_gate=ws_gate,
                   ws_up=ws_up, ws_down=ws_down, check_ids=False, group=self.group, max_tokens=self.max_tokens,
                   recv_rows=self.recv_rows, recompute=self.recompute)

    def __getstate__(self):
        """Pickling (torch.save of the module, copy.deepcopy) keeps the parameters and settings;
        the generated ops (a loaded library of this process) and the FP8 copy of the experts
        are left out and found, or quantised, again at the first forward."""
        state = self.__dict__.copy()
        state.update(_ops=None, _routed_ops=None, _fp8=None)
        return state

    @torch.no_grad()
    def reset_parameters(self):
        H, I, S = self.spec.hidden, self.spec.intermediate, self.spec.shared_intermediate
        nn.init.normal_(self.router.weight, std=1 / math.sqrt(H))
        for p, fan_in in ((self.w_gate, H), (self.w_up, H), (self.w_down, I), (self.ws_gate, H), (self.ws_up, H),
                          (self.ws_down, S)):
            if p is not None:
                p.normal_(std=1 / math.sqrt(fan_in))

    def _fp8_key(self) -> tuple:
        """What the FP8 experts were quantised from: each weight's storage, version and place,
        and the optimizer steps taken before."""
        return (_OPTIMIZER_STEPS[0],) + tuple((p.data_ptr(), p._version, p.device, tuple(p.shape))
                                              for p in (self.w_gate, self.w_up, self.w_down))

    def fp8_experts(self):
        """(dtype fp8) The routed experts in FP8 (mokgen.fp8.FP8Experts), quantised from the
        current w_gate, w_up, w_down by the generated kernels: the kept copy while those are
        unchanged, else quantised again now."""
        if self.spec.dtype != "fp8":
            raise ValueError(f"fp8_experts() is for dtype='fp8' blocks; this one is {self.spec.dtype}")
        key = self._fp8_key()
        if self._fp8 is None or self._fp8[0] != key:
            from .runtime import quantize_experts_fp8

            self._fp8 = None  # (the old copy freed before the new one is made)
            with torch.no_grad():
                experts = quantize_experts_fp8(self.w_gate, self.w_up, self.w_down, self.spec.topk)
            self._fp8 = (key, experts)
        return self._fp8[1]

    def requantize(self) -> None:
        """(dtype fp8) Forget the FP8 copy of the experts: the next call quantises them again.
        Needed only after an update outside any torch.optim optimizer that the weights' version
        counters do not see (through `.data`); optimizer steps and in-place updates are seen."""
        self._fp8 = None

    def _forward_fp8(self, x2, ids, weights, shared):
        from .reference import expert_ffn
        from .runtime import moe_fp8_train

        out = moe_fp8_train(x2.contiguous(), ids, weights.contiguous(), self.w_gate, self.w_up, self.w_down,
                            experts=self.fp8_experts(), check_ids=False, recompute=self.recompute, group=self.group)
        # (the shared expert in bf16 beside the FP8 experts: the SwiGLU MLP as dense torch matmuls)
        return out if shared is None else out + expert_ffn(x2, *shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] bf16 (under torch.autocast, any float dtype: cast to bf16, as autocast
        casts a matmul's inputs); returns bf16 of x's shape. The router runs in fp32 either way."""
        x = self._bf16_input(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        with torch.autocast(x.device.type, enabled=False):  # (fp32 routing, whatever the caller's autocast)
            logits = self.router(x2.float())
        fp8 = self.spec.dtype == "fp8" and not self.reference
        if self.fused_routing and not self.reference and self.group is None and not torch.is_grad_enabled() \
                and not fp8:
            # Inference with generated routing: route, dispatch, the experts and the combine in
            # one launch where the fused launch serves the call (the same bits as route + moe).
            if self._routed_ops is None:
                from .runtime import find_variant

                s = self.spec
                self._routed_ops = find_variant(s.experts, s.topk, s.hidden, s.intermediate, s.shared_intermediate,
                                                renormalize=s.renormalize).ops
            shared = (self.ws_gate, self.ws_up, self.ws_down) if self.ws_gate is not None else (None, None, None)
            out = self._routed_ops.routed(x2.contiguous(), logits.contiguous(), self.w_gate, self.w_up, self.w_down,
                                          *shared)[0]
            return out.reshape(shape)
        if self.fused_routing and not self.reference:
            from .runtime import route

            ids, weights = route(logits.contiguous(), self.spec.topk, renormalize=self.spec.renormalize)
        else:
            ids, weights = route_torch(logits, self.spec.topk, self.spec.renormalize)
        shared = (self.ws_gate, self.ws_up, self.ws_down) if self.ws_gate is not None else None
        if fp8:
            out = self._forward_fp8(x2, ids, weights, shared)
        elif self.group is not None:
            out = self._forward_expert_parallel(x2, ids, weights, shared)
        elif self.reference:
            out = experts_torch(x2, ids, weights, self.w_gate, self.w_up, self.w_down, shared)
        else:
            if self._ops is None:
                self._resolve()
            # The ids come from topk over E experts: always in range, no check needed; the
            # shapes and dtypes are the module's own.
            args = (x2.contiguous(), ids, weights.contiguous(), self.w_gate, self.w_up, self.w_down,
                    *(shared or (None, None, None)))
            out = self._ops.layer(*args, recompute=self.recompute)
        return out.reshape(shape)

    @staticmethod
    def _bf16_input(x):
        if not isinstance(x, torch.Tensor) or x.dtype == torch.bfloat16 or not x.is_floating_point():
            return x  # (the layer's checks name anything else)
        if torch.is_autocast_enabled(x.device.type):
            return x.to(torch.bfloat16)
        from .runtime.checks import InputError

        raise InputError(f"mokgen.MoE takes bf16 input (its experts are bf16), got {x.dtype}: cast it "
                         "(x.bfloat16()) or run the block under torch.autocast")

    def extra_repr(self) -> str:
        s = self.spec
        ep = f"expert parallel over {s.world_size} ranks ({s.local_experts} experts here), " if self.group else ""
        return (f"hidden={s.hidden}, intermediate={s.intermediate}, experts={s.experts}, topk={s.topk}, "
                f"shared_intermediate={s.shared_intermediate}, renormalize={s.renormalize}, "
                f"{'dtype=fp8, ' if s.dtype == 'fp8' else ''}{ep}"
                f"{'torch reference' if self.reference else 'generated kernels'}"
                f"{', generated routing' if self.fused_routing and not self.reference else ''}")
