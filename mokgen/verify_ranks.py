"""`mokgen verify` of an expert-parallel variant: one process per rank under torchrun, each
rank's output and gradients against the float64 reference of the whole layer (every expert).

    python -m torch.distributed.run --standalone --nproc-per-node=W -m mokgen.verify_ranks VARIANT_DIR \
        [--tokens 1,513] [--routing uniform,skewed] [--forward-only] [--share-gpu]

Every rank draws the same global weights (one seed, broadcast) and its own tokens, routing and
output gradient (its own seed), so any rank can rebuild any rank's inputs: the backward's
reference is the global layer over every rank's tokens. Workspaces and gradients start as NaN,
so a row nobody wrote fails. With --share-gpu (what `mokgen verify` passes where there are fewer
GPUs than ranks) every rank runs on GPU 0 over a gloo group, the peers' buffers mapped by CUDA
IPC (MOKGEN_PEER_MEMORY=ipc); the GPU time-slices the ranks, so this proves results, not speed,
and the float64 references are computed one rank at a time so that they fit.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

import torch

from .ir import MoESpec
from .verify import (GRADIENTS, ROUTINGS, SHARED_GRADIENTS, TOLERANCE, free_gpu_bytes, gradient_error, make_tokens,
                     make_weights, reference_backward_bytes)


def init_ranks(share_gpu: bool = False) -> tuple:
    """Under torchrun: (rank, world), the default process group made and this rank's GPU set.
    A rank per GPU over NCCL (a rank without a GPU of its own exits with the reason); with
    share_gpu every rank on GPU 0 over gloo (NCCL takes one rank per GPU) and the peer buffers
    mapped by CUDA IPC (torch symmetric memory takes one rank per GPU)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if share_gpu:
        os.environ.setdefault("MOKGEN_PEER_MEMORY", "ipc")
        torch.cuda.set_device(0)
        dist.init_process_group("gloo")
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
        if local >= torch.cuda.device_count():
            sys.exit(f"rank {rank}: local rank {local} has no GPU of its own ({torch.cuda.device_count()} here): "
                     "one process per GPU (`mokgen verify` checks a layer with its ranks sharing a GPU)")
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return rank, world


def in_turns(fn, share_gpu: bool):
    """fn() on every rank; with the ranks sharing a GPU one rank at a time, its memory freed
    before the next: every rank's float64 reference of the whole layer at once need not fit."""
    import torch.distributed as dist

    if not share_gpu:
        return fn()
    result = None
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            result = fn()
            torch.cuda.empty_cache()
        dist.barrier()
    return result


def shared_seed() -> int:
    """One fresh seed, the same on every rank."""
    import torch.distributed as dist

    seed = torch.tensor([random.SystemRandom().randrange(2**31)], device="cuda")
    dist.broadcast(seed, 0)
    return int(seed.item())


def whole_layer(spec: MoESpec) -> MoESpec:
    """The one-GPU layer with every expert: what the reference computes."""
    return MoESpec(**{**spec.to_dict(), "world_size": 1, "topology": "single", "nodes": 1})


def rank_gradient_errors(got: dict, every: list, rank: int, weights, mine: slice, shared) -> dict:
    """This rank's gradients (`got`, by name) against float64 autograd of the whole layer over
    every rank's tokens (`every`: each rank's x, topk_ids, topk_weights, dout, in rank order):
    dx and d_topk_weights of its own tokens, the weight gradients of its experts (`mine` of the
    global `weights`), and its shared expert's (`shared`: ws_gate, ws_up, ws_down, or Nones),
    each rank's own copy, over its own tokens. Returns gradient_error by name."""
    from .reference import dot_error_scales, expert_ffn, moe_reference_backward

    X, IDS, W, DOUT = (torch.cat([e[i] for e in every]) for i in range(4))
    ref = moe_reference_backward(DOUT, X, IDS, W, *weights)
    x, ids, _, dout = every[rank]
    first, T = sum(e[0].shape[0] for e in every[:rank]), x.shape[0]
    want = {"dx": ref["dx"][first:first + T], "d_topk_weights": ref["d_topk_weights"][first:first + T],
            "d_w_gate": ref["d_w_gate"][mine], "d_w_up": ref["d_w_up"][mine], "d_w_down": ref["d_w_down"][mine]}
    if shared[0] is not None:
        own = [t.detach().double().requires_grad_(True) for t in (x, *shared)]
        expert_ffn(*own).backward(dout.double())
        want["dx"] = want["dx"] + own[0].grad
        want.update(zip(SHARED_GRADIENTS, (t.grad for t in own[1:])))
    scale = dot_error_scales(dout, x, ids, *weights)
    return {k: gradient_error(k, got[k], want[k], scale) if got[k].numel() else 0.0 for k in want}


class RankCheck:
    """The checks of one rank: `forward` and `backward` cases, each printed as one line."""

    def __init__(self, variant, rank: int, world: int, seed: int, cap: int, share_gpu: bool):
        self.v, self.rank, self.world, self.seed, self.cap, self.share_gpu = variant, rank, world, seed, cap, share_gpu
        self.whole = whole_layer(variant.spec)
        self.failures = self.unchecked = self.cases = 0
        g = torch.Generator(device="cuda")
        g.manual_seed(seed)
        *self.weights, self.shared = make_weights(self.whole, g)  # (every rank the same)
        El = variant.spec.local_experts
        self.mine = slice(rank * El, (rank + 1) * El)
        self.local = [t[self.mine].contiguous() for t in self.weights]

    def inputs_of(self, r: int, tokens: int, routing: str) -> tuple:
        """Rank r's x, topk_ids (global expert ids), topk_weights and output gradient in the
        current case."""
        g = torch.Generator(device="cuda")
        g.manual_seed((self.seed + 1 + self.cases * 4099 + r) % 2**63)
        x, ids, w = make_tokens(self.whole, tokens, routing, g)
        return x, ids, w, torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)

    def call(self, x, ids, w, experts, shared):
        """mokgen.moe over the group: this rank's experts, the shared expert (Nones without one)."""
        import torch.distributed as dist

        import mokgen

        return mokgen.moe(x, ids, w, *experts, ws_gate=shared[0], ws_up=shared[1], ws_down=shared[2],
                          group=dist.group.WORLD, max_tokens=self.cap)

    def poison(self) -> None:
        """Every peer workspace's rows NaN, then a barrier: no peer stores into them before every
        rank has poisoned its own."""
        import torch.distributed as dist

        from .runtime.peers import _WORKSPACES

        for ws in _WORKSPACES.values():
            ws.poison()
        torch.cuda.synchronize()
        dist.barrier()

    def report(self, tokens: int, routing: str, what: str, errors: dict, nan: list) -> None:
        worst = max(errors, key=errors.get) if errors else "-"
        bad = bool(nan) or any(e > TOLERANCE for e in errors.values())
        self.failures += bad
        print(f"{self.v.name} rank {self.rank} T={tokens:<6d} {routing:8s} {what} worst rel_err="
              f"{errors.get(worst, 0.0):.3e} ({worst}){' unwritten: ' + ','.join(nan) if nan else ''} "
              f"{'FAIL' if bad else 'ok'}", flush=True)

    def forward(self, tokens: int, routing: str) -> None:
        from .reference import moe_reference, rel_error

        import mokgen

        self.cases += 1
        x, ids, w, _ = self.inputs_of(self.rank, tokens, routing)
        self.poison()
        self.v.poison = True  # (workspace and output start as NaN)
        try:
            with torch.no_grad():
                out = self.call(x, ids, w, self.local, self.shared)
            mokgen.check_errors()
        finally:
            self.v.poison = False
        ref = moe_reference(x, ids, w, *self.weights, *self.shared) if tokens else out.double()
        self.report(tokens, routing, "forward ", {"out": rel_error(out, ref) if tokens else 0.0},
                    ["out"] if torch.isnan(out).any().item() else [])

    def backward(self, tokens: int, routing: str) -> None:
        """Every rank T tokens: dx, d_topk_weights and this rank's experts' weight gradients
        against float64 autograd of the whole layer over every rank's tokens; the shared
        expert's (each rank's own copy) over this rank's tokens."""
        import mokgen

        self.cases += 1
        every = [self.inputs_of(r, tokens, routing) for r in range(self.world)]
        x, ids, w, dout = every[self.rank]
        has_shared = self.shared[0] is not None
        leaves = [t.detach().clone().requires_grad_(True)
                  for t in (x, w, *self.local, *(self.shared if has_shared else ()))]
        self.poison()
        self.v.poison = True  # (per-call buffers and the gradients too)
        try:
            out = self.call(leaves[0], ids, leaves[1], leaves[2:5], leaves[5:] or (None, None, None))
            out.backward(dout)
            mokgen.check_errors()
        finally:
            self.v.poison = False
        got = dict(zip(GRADIENTS + (SHARED_GRADIENTS if has_shared else ()), (t.grad for t in leaves)))

        def judge():
            if reference_backward_bytes(self.whole, tokens * self.world) > free_gpu_bytes():
                return None
            return rank_gradient_errors(got, every, self.rank, self.weights, self.mine, self.shared)

        errors = in_turns(judge, self.share_gpu)
        if errors is None:
            self.unchecked += 1
            print(f"{self.v.name} rank {self.rank} T={tokens:<6d} {routing:8s} backward NOT CHECKED: its float64 "
                  "reference does not fit in this GPU's free memory", flush=True)
            return
        self.report(tokens, routing, "backward", errors, [k for k, g in got.items() if torch.isnan(g).any().item()])


def main(argv=None) -> int:
    import torch.distributed as dist

    from .runtime import load

    ap = argparse.ArgumentParser(prog="python -m mokgen.verify_ranks", description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", help="the variant's directory")
    ap.add_argument("--tokens", default="1,513", help="tokens per rank, comma-separated")
    ap.add_argument("--routing", default="uniform,skewed", help=f"comma-separated, of {', '.join(ROUTINGS)}")
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--share-gpu", action="store_true", help="every rank on GPU 0 (correctness only)")
    a = ap.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",")]
    routings = [r.strip() for r in a.routing.split(",")]
    path = Path(a.variant).resolve()
    # mokgen.moe serves a call from the builds at the top of MOKGEN_HOME: this one, loaded first
    os.environ["MOKGEN_HOME"] = str(path.parent)
    rank, world = init_ranks(a.share_gpu)
    v = load(path, build=False)
    if v.spec.world_size != world:
        sys.exit(f"{v.name} is built for {v.spec.world_size} ranks, not {world}")
    check = RankCheck(v, rank, world, shared_seed(), max(tokens), a.share_gpu)
    for routing in routings:
        for T in tokens:
            try:
                check.forward(T, routing)
                if not a.forward_only and v.has_backward:
                    check.backward(T, routing)
            except torch.OutOfMemoryError:
                # (torchrun then stops the other ranks: none is left waiting in a collective)
                sys.exit(f"{v.name} rank {rank}: out of GPU memory at T={T} tokens per rank"
                         + (f" with all {world} ranks' workspaces on one GPU" if a.share_gpu else "")
                         + ": pass fewer --tokens")
    totals = torch.tensor([check.failures, check.unchecked], device="cuda")
    dist.all_reduce(totals)
    failed, unchecked = totals.tolist()
    if rank == 0:
        print(f"{'all passed' if not failed else f'{failed} failed'} on {world} ranks (tolerance {TOLERANCE})"
              + (f"; {unchecked} backward checks not run (their float64 reference does not fit)" if unchecked else ""),
              flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
