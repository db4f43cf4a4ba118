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
import sys
import time

import torch
import torch.distributed as dist

import mokgen
from mokgen.ir import MoESpec
from mokgen.reference import moe_reference, rel_error
from mokgen.runtime import InputError, KernelTimeout
from mokgen.runtime.peers import _WORKSPACES, RendezvousTimeout
from mokgen.verify import make_weights
from mokgen.verify_ranks import in_turns as _in_turns
from mokgen.verify_ranks import init_ranks, rank_gradient_errors, shared_seed

TOL = 1e-2


def routing(T, E, K, kind, rank, world, gen):
    """(topk_ids int32 [T, K], topk_weights fp32 [T, K]) over E global experts."""
    dev = "cuda"
    if kind == "uniform":
        scores = torch.rand(T, E, device=dev, generator=gen)
    elif kind == "dropped":
        scores = torch.rand(T, E, device=dev, generator=gen)
    else:  # skewed: every token picks among rank 0's experts, expert 1 first (hot)
        El = E // world
        scores = torch.rand(T, E, device=dev, generator=gen)
        scores[:, El:] -= 2.0 if El >= K else 0.0
        scores[:, 1] += 2.0
    ids = torch.topk(scores, K, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, K, device=dev, generator=gen), -1)
    if kind == "dropped":  # empty slots (id -1): about a third, and every slot of token 0
        ids = torch.where(torch.rand(ids.shape, device=dev, generator=gen) < 1 / 3, -1, ids).to(torch.int32)
        ids[:1] = -1
    return ids, w


def poison() -> None:
    """NaN into every row buffer of this rank's peer workspace (then a barrier: no peer
    stores before this rank has poisoned)."""
    for ws in _WORKSPACES.values():
        ws.poison()
    torch.cuda.synchronize()
    dist.barrier()


SHARE_GPU = os.environ.get("MOKGEN_TEST_RANKS_SHARE_GPU") == "1"


def in_turns(fn):
    """fn() on every rank, one at a time where the ranks share one GPU (mokgen.verify_ranks)."""
    return _in_turns(fn, SHARE_GPU)


def start_golden(E, H, I, S=0):
    """Under torchrun: (rank, world, the global experts' bf16 w_gate, w_up, w_down from one
    fresh seed every rank shares, the shared expert's ws_* (a dict, empty without one), a
    generator of this rank's own inputs, the seed), the NCCL group made and the device set.
    MOKGEN_TEST_RANKS_SHARE_GPU=1: every rank on GPU 0, the group over gloo (NCCL takes one rank
    per GPU) and the peer buffers mapped by CUDA IPC (torch symmetric memory takes one rank per
    GPU): a world size larger than the GPUs there are, for correctness only (the GPU
    time-slices the ranks' processes)."""
    rank, world = init_ranks(SHARE_GPU)
    seed = shared_seed()  # one seed, fresh every run: every rank can rebuild every weight
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    wg, wu, wd, (sg, su, sd) = make_weights(MoESpec(experts=E, topk=1, hidden=H, intermediate=I, shared_intermediate=S),
                                            g)
    shared = dict(ws_gate=sg, ws_up=su, ws_down=sd) if S else {}
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed + 1 + rank)
    return rank, world, (wg, wu, wd), shared, gen, seed


def start_levels_golden():
    """The start of a golden worker of the layer across nodes (one GPU per node): --shape E,K,H,I
    and --tokens T,.. parsed, start_golden's weights, and this rank's share of the experts.
    Returns (shape, token counts, rank, world, (wg, wu, wd) global, generator, this rank's
    expert slice)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="64,8,2048,1024")
    ap.add_argument("--tokens", default="1,513,4096")
    a = ap.parse_args()
    E, K, H, I = (int(v) for v in a.shape.split(","))
    rank, world, weights, _, gen, _ = start_golden(E, H, I)
    El = E // world
    return (E, K, H, I), [int(t) for t in a.tokens.split(",")], rank, world, weights, gen, \
        slice(rank * El, (rank + 1) * El)


def finish_golden(failures: int, rank: int, label: str):
    """Sum the ranks' failures, print `label: PASS` (rank 0) or the count, leave the group and
    exit non-zero on any failure."""
    total = torch.tensor([failures], device="cuda")
    dist.all_reduce(total)
    if rank == 0:
        print(f"{label}: " + ("PASS" if total.item() == 0 else f"FAIL ({total.item()} cases)"), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if total.item() else 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="64,8,2048,1024,0")
    ap.add_argument("--tokens", default="1,513,4096,8192")
    ap.add_argument("--no-timeout-case", action="store_true")
    ap.add_argument("--grad-tokens", default="1,513,4096", help="token counts per rank of the backward cases")
    a = ap.parse_args()
    # The host rendezvous' bound (300 s by default) short enough for the absent-rank case,
    # long enough for every rank's first call.
    os.environ.setdefault("MOKGEN_RENDEZVOUS_TIMEOUT_S", "15")
    E, K, H, I, S = (int(v) for v in a.shape.split(","))
    rank, world, (wg, wu, wd), shared, gen, seed = start_golden(E, H, I, S)
    El = E // world
    tokens = [int(t) for t in a.tokens.split(",")]
    cap = max(tokens + [int(t) for t in a.grad_tokens.split(",") if t])
    mine = slice(rank * El, (rank + 1) * El)
    local = (wg[mine].contiguous(), wu[mine].contiguous(), wd[mine].contiguous())
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
    case("empty slots", min(4096, cap), "dropped")
    case("empty slots, few tokens", 100, "dropped")
    # Small calls run the single launch (send, GEMMs and return in one kernel), larger ones the
    # per-GEMM path; ranks may take different ones in one call, and both give the same bits.
    from mokgen.runtime import find_variant

    v = find_variant(E, K, H, I, S, world_size=world)
    small = min(1024, cap, v.plan.get("fused_max_tokens", 0))
    if small:
        case("20 runs, same bits, 1 launch", small, "skewed", runs=20)
        case("mixed paths", small if rank == 0 else cap, "skewed")
        x = torch.randn(small, H, device="cuda", generator=gen).bfloat16()
        ids, w = routing(small, E, K, "skewed", rank, world, gen)
        with torch.no_grad():
            one = mokgen.moe(x, ids, w, *local, group=dist.group.WORLD, max_tokens=cap, **shared)
            bound = v.plan["fused_max_tokens"]
            v.plan["fused_max_tokens"] = 0  # this call: the per-GEMM path
            try:
                multi = mokgen.moe(x, ids, w, *local, group=dist.group.WORLD, max_tokens=cap, **shared)
            finally:
                v.plan["fused_max_tokens"] = bound
            mokgen.check_errors()
        same = torch.equal(one, multi)
        failures += not same
        print(f"rank {rank} {'1 launch = per-GEMM path':28s} T={small:<5d} skewed   same_bits={same} "
              f"{'ok' if same else 'FAIL'}", flush=True)

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

    # ---- backward: every gradient against float64 autograd of the global layer ----------
    find_variant(E, K, H, I, S, world_size=world).poison = True  # per-call buffers and gradients start NaN
    grad_cases = iter(range(1, 1 << 30))
    shared_names = ("ws_gate", "ws_up", "ws_down")

    def inputs_of(case_seed, r, T, kind):
        """Rank r's x, ids, w, dout of a case: every rank can make every rank's."""
        g_r = torch.Generator(device="cuda")
        g_r.manual_seed(case_seed * 4099 + r)
        x = torch.randn(T, H, device="cuda", generator=g_r).bfloat16()
        ids, w = routing(T, E, K, kind, r, world, g_r)
        return x, ids, w, torch.randn(T, H, device="cuda", generator=g_r).bfloat16()

    def mokgen_grads(x, ids, w, dout, recompute):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, *local, *(shared[n] for n in shared_names if S))]
        out = mokgen.moe(leaves[0], ids, leaves[1], *leaves[2:5], group=dist.group.WORLD, max_tokens=cap,
                         recompute=recompute, **dict(zip(shared_names, leaves[5:])))
        out.backward(dout)
        mokgen.check_errors()
        names = ["dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"] + (["d_ws_gate", "d_ws_up", "d_ws_down"]
                                                                              if S else [])
        return dict(zip(names, (t.grad for t in leaves)))

    def grad_case(name, Ts, kind, runs=1, recompute=False):
        nonlocal failures
        case_seed = seed % 100000 + next(grad_cases)
        every = [inputs_of(case_seed, r, Ts[r], kind) for r in range(world)]
        x, ids, w, dout = every[rank]
        poison()
        t0 = time.time()
        got = [mokgen_grads(x, ids, w, dout, recompute) for _ in range(runs)]

        def judge():
            return rank_gradient_errors(got[0], every, rank, (wg, wu, wd), mine,
                                        tuple(shared[n] for n in shared_names) if S else (None, None, None))

        errs = in_turns(judge)
        nan = [k for k in got[0] if torch.isnan(got[0][k]).any().item()]
        same = all(torch.equal(g[k], got[0][k]) for g in got[1:] for k in got[0])
        ok = not nan and same and all(e < TOL for e in errs.values())
        failures += not ok
        worst = max(errs, key=errs.get)
        name += " (recompute)" if recompute else ""
        print(f"rank {rank} {name:28s} T={Ts[rank]:<5d} {kind:8s} worst {worst} {errs[worst]:.2e} nan={nan or '-'} "
              f"runs={runs} same_bits={same} {time.time() - t0:.1f}s {'ok' if ok else 'FAIL'}", flush=True)

    for T in (int(t) for t in a.grad_tokens.split(",") if t):
        for kind in ("uniform", "skewed"):
            for recompute in (False, True):
                grad_case("backward golden", [T] * world, kind, recompute=recompute)
    grad_case("backward uneven", [513 if r == 0 else 7 for r in range(world)], "uniform")
    grad_case("backward one rank empty", [0 if r == world - 1 else 300 for r in range(world)], "skewed")
    grad_case("backward one rank empty", [0 if r == world - 1 else 300 for r in range(world)], "skewed", recompute=True)
    grad_case("backward 20 runs, same bits", [min(1024, cap)] * world, "skewed", runs=20)
    grad_case("backward empty slots", [513] * world, "dropped")
    find_variant(E, K, H, I, S, world_size=world).poison = False

    # The absent-peer cases come first: they need a workspace every rank has already made,
    # because making one is a host collective (an all-reduce and the symmetric-memory
    # rendezvous) that a rank which never calls would hang in.
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
        # The first call on a group makes the workspace (a host collective): rank world-1 does
        # not come, the others raise RendezvousTimeout after the bound, and nothing hangs.
        if rank != world - 1:
            t0 = time.time()
            try:
                with torch.no_grad():
                    mokgen.moe(x, ids, w, *local, group=dist.group.WORLD, **shared)
                print(f"rank {rank} absent peer at the first call: no error raised FAIL", flush=True)
                failures += 1
            except RendezvousTimeout as e:
                print(f"rank {rank} absent peer at the first call: RendezvousTimeout after {time.time() - t0:.1f}s ok "
                      f"({str(e)[:90]}...)", flush=True)
        dist.barrier()
        case("after a fresh workspace", 100, "uniform")
        # the same in the backward: every rank runs the forward, rank world-1 skips the backward
        x = torch.randn(64, H, device="cuda", generator=gen).bfloat16().requires_grad_(True)
        ids, w = routing(64, E, K, "uniform", rank, world, gen)
        out = mokgen.moe(x, ids, w, *local, group=dist.group.WORLD, max_tokens=cap, **shared)
        mokgen.check_errors()
        if rank != world - 1:
            t0 = time.time()
            try:
                out.backward(torch.ones_like(out))
                mokgen.check_errors()
                print(f"rank {rank} absent peer in the backward: no error raised FAIL", flush=True)
                failures += 1
            except KernelTimeout as e:
                print(f"rank {rank} absent peer in the backward: KernelTimeout after {time.time() - t0:.1f}s ok "
                      f"({str(e)[:90]}...)", flush=True)
        torch.cuda.synchronize()
        dist.barrier()
        mokgen.release_peer_workspaces()
        grad_case("backward after a fresh workspace", [100] * world, "uniform")
    # A workspace that receives at most R rows per rank and call: a routing that fits is golden;
    # one that would send more to one rank is dropped on every rank and reported, and the next
    # call that fits is golden again (the workspace stays in step). Whether a call fits is
    # worked out here from every rank's ids with the layout's own rule (each local expert's
    # rows padded to the row tile, against RC rows plus a tile per local expert).
    torch.cuda.synchronize()
    dist.barrier()
    mokgen.release_peer_workspaces()
    T, tile = 1024, find_variant(E, K, H, I, S, world_size=world).plan["row_tile"]
    R = T * K  # uniform routing needs about T*K rows per rank; skewed sends every rank's T*K to rank 0

    def overflows(ids):
        every = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(every, ids)
        counts = torch.bincount(torch.cat(every).reshape(-1).long(), minlength=E)
        padded = ((counts + tile - 1) // tile * tile).view(world, El).sum(1)
        return bool((padded > (-(-R // tile) + El) * tile).any().item())

    refused_once = False
    for kind in ("uniform", "skewed", "uniform"):
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        ids, w = routing(T, E, K, kind, rank, world, gen)
        want_error = overflows(ids)
        with torch.no_grad():
            out = mokgen.moe(x, ids, w, *local, group=dist.group.WORLD, max_tokens=T, recv_rows=R, **shared)
        try:
            mokgen.check_errors()
            raised = None
        except InputError as e:
            raised = e
        ok = (raised is not None) == want_error
        if not want_error and ok:
            ref = moe_reference(x, ids, w, wg, wu, wd, *(shared[k] for k in ("ws_gate", "ws_up", "ws_down"))
                                if S else ())
            ok = rel_error(out, ref) < TOL
        refused_once |= raised is not None
        failures += not ok
        print(f"rank {rank} {'receive bound ' + str(R) + ' rows':28s} T={T:<5d} {kind:8s} "
              f"{'refused: ' + str(raised)[:70] + '...' if raised else 'golden'} (overflow expected: {want_error}) "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    if not refused_once:
        print(f"rank {rank} receive bound: no call overflowed, the refusal was not exercised FAIL", flush=True)
        failures += 1
    torch.cuda.synchronize()
    dist.barrier()
    mokgen.release_peer_workspaces()

    total = torch.tensor([failures], device="cuda")
    dist.all_reduce(total)
    if rank == 0:
        print(f"EP golden: {'PASS' if total.item() == 0 else f'{total.item()} FAILED'}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if total.item() else 0)


if __name__ == "__main__":
    main()
