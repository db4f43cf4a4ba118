"""Golden tests of the expert-parallel layer on several GPUs: one process per GPU.

    torchrun --nproc-per-node=2 tests/ep_worker.py [--shape E,K,H,I,S] [--tokens 1,513,4096,8192]

Each rank holds its own tokens and E/W experts; its output is compared with the float64
reference of the global layer (all experts) on its tokens. Fresh random inputs, uniform
and skewed routing (one rank's experts receive every token, one expert most of them),
different token counts per rank (including none), poisoned workspaces, 20-run bitwise
determinism, and a rank that does not take part (the others must raise KernelTimeout,
not hang). Prints one line per case; exits non-zero on the first failure.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
import torch.distributed as dist

import mokgen
from mokgen.reference import moe_reference, rel_error
from mokgen.runtime import KernelTimeout
from mokgen.runtime.peers import _WORKSPACES

TOL = 1e-2


def routing(T, E, K, kind, rank, world, gen):
    """(topk_ids int32 [T, K], topk_weights fp32 [T, K]) over E global experts."""
    dev = "cuda"
    if kind == "uniform":
        scores = torch.rand(T, E, device=dev, generator=gen)
    else:  # skewed: every token picks among rank 0's experts, expert 1 first (hot)
        El = E // world
        scores = torch.rand(T, E, device=dev, generator=gen)
        scores[:, El:] -= 2.0 if El >= K else 0.0
        scores[:, 1] += 2.0
    ids = torch.topk(scores, K, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, K, device=dev, generator=gen), -1)
    return ids, w


def poison() -> None:
    """NaN into every row buffer of this rank's peer workspace (then a barrier: no peer
    stores before this rank has poisoned)."""
    for ws in _WORKSPACES.values():
        for name in ("ep_recv", "ep_ret", "h", "y"):
            ws.buffers[name].fill_(float("nan"))
    torch.cuda.synchronize()
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="64,8,2048,1024,0")
    ap.add_argument("--tokens", default="1,513,4096,8192")
    ap.add_argument("--no-timeout-case", action="store_true")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    E, K, H, I, S = (int(v) for v in a.shape.split(","))
    El = E // world
    tokens = [int(t) for t in a.tokens.split(",")]
    cap = max(tokens)
    seed = torch.tensor([random.SystemRandom().randrange(2**31)], device="cuda")
    dist.broadcast(seed, 0)  # one seed, fresh every run: every rank can rebuild every weight
    g = torch.Generator(device="cuda")
    g.manual_seed(int(seed.item()))
    wg = torch.randn(E, I, H, device="cuda", generator=g).mul_(H ** -0.5).bfloat16()
    wu = torch.randn(E, I, H, device="cuda", generator=g).mul_(H ** -0.5).bfloat16()
    wd = torch.randn(E, H, I, device="cuda", generator=g).mul_(I ** -0.5).bfloat16()
    shared = {}
    if S:
        shared = dict(ws_gate=torch.randn(S, H, device="cuda", generator=g).mul_(H ** -0.5).bfloat16(),
                      ws_up=torch.randn(S, H, device="cuda", generator=g).mul_(H ** -0.5).bfloat16(),
                      ws_down=torch.randn(H, S, device="cuda", generator=g).mul_(S ** -0.5).bfloat16())
    mine = slice(rank * El, (rank + 1) * El)
    local = (wg[mine].contiguous(), wu[mine].contiguous(), wd[mine].contiguous())
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(seed.item()) + 1 + rank)
    failures = 0

    def case(name, T, kind, runs=1):
        nonlocal failures
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        ids, w = routing(T, E, K, kind, rank, world, gen)
        poison()
        outs = []
        t0 = time.time()
        with torch.no_grad():
            for _ in range(runs):
                outs.append(mokgen.moe(x, ids, w, *local, group=dist.group.WORLD, max_tokens=cap, **shared))
            mokgen.check_errors()
        ref = moe_reference(x, ids, w, wg, wu, wd, *(shared[k] for k in ("ws_gate", "ws_up", "ws_down"))
                            if S else ())
        err = rel_error(outs[0], ref) if T else 0.0
        same = all(torch.equal(o, outs[0]) for o in outs[1:])
        ok = (err < TOL and not torch.isnan(outs[0]).any().item()) and same
        failures += not ok
        print(f"rank {rank} {name:28s} T={T:<5d} {kind:8s} err={err:.2e} runs={runs} same_bits={same} "
              f"{time.time() - t0:.1f}s {'ok' if ok else 'FAIL'}", flush=True)

    for T in tokens:
        for kind in ("uniform", "skewed"):
            case("golden", T, kind)
    # different token counts per rank, and a rank with none
    case("uneven", 513 if rank == 0 else 7, "uniform")
    case("one rank empty", 0 if rank == world - 1 else 300, "skewed")
    case("20 runs, same bits", min(4096, cap), "skewed", runs=20)

    # captured once in a CUDA graph, replayed with new inputs (the flags' epoch lives on the
    # device, so a replay needs nothing from the host)
    T = min(513, cap)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    ids, w = routing(T, E, K, "uniform", rank, world, gen)
    with torch.no_grad():
        mokgen.moe(x, ids, w, *local, group=dist.group.WORLD, max_tokens=cap, check_ids=False, **shared)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mokgen.moe(x, ids, w, *local, group=dist.group.WORLD, max_tokens=cap, check_ids=False, **shared)
        for kind in ("uniform", "skewed", "uniform"):
            x.copy_(torch.randn(T, H, device="cuda", generator=gen).bfloat16())
            new_ids, new_w = routing(T, E, K, kind, rank, world, gen)
            ids.copy_(new_ids)
            w.copy_(new_w)
            graph.replay()
            mokgen.check_errors()
            ref = moe_reference(x, ids, w, wg, wu, wd, *(shared[k] for k in ("ws_gate", "ws_up", "ws_down"))
                                if S else ())
            err = rel_error(out, ref)
            ok = err < TOL and not torch.isnan(out).any().item()
            failures += not ok
            print(f"rank {rank} {'CUDA graph replay':28s} T={T:<5d} {kind:8s} err={err:.2e} {'ok' if ok else 'FAIL'}",
                  flush=True)

    if not a.no_timeout_case:
        # rank world-1 does not take part: the others raise KernelTimeout within the bound
        x = torch.randn(64, H, device="cuda", generator=gen).bfloat16()
        ids, w = routing(64, E, K, "uniform", rank, world, gen)
        if rank != world - 1:
            t0 = time.time()
            try:
                with torch.no_grad():
                    mokgen.moe(x, ids, w, *local, group=dist.group.WORLD, **shared)
                mokgen.check_errors()
                print(f"rank {rank} absent peer: no error raised FAIL", flush=True)
                failures += 1
            except KernelTimeout as e:
                print(f"rank {rank} absent peer: KernelTimeout after {time.time() - t0:.1f}s ok ({str(e)[:90]}...)",
                      flush=True)
        torch.cuda.synchronize()
        dist.barrier()  # nobody frees its workspace while a peer may still store into it
        mokgen.release_peer_workspaces()
        case("after a fresh workspace", 100, "uniform")
    total = torch.tensor([failures], device="cuda")
    dist.all_reduce(total)
    if rank == 0:
        print(f"EP golden: {'PASS' if total.item() == 0 else f'{total.item()} FAILED'}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if total.item() else 0)


if __name__ == "__main__":
    main()
