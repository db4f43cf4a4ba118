"""Golden tests of the layer over several nodes: one process per GPU, each GPU a node.

    torchrun --nproc-per-node=2 tests/multinode_worker.py [--tokens 1,513,4096]

Two GPUs configured as 2 nodes x 1 GPU: tokens cross between them through NCCL
(torch.distributed), never through the NVLink exchange of the expert-parallel megakernel.
Each rank's output is compared with the float64 reference of the global layer (all experts)
on its tokens: fresh random inputs, uniform and skewed routing (every token to rank 0's
experts, one hot expert), different token counts per rank (including none), 20 runs with the
same bits, the same work as 1 node x 2 GPUs (mokgen.moe with the group alone), bad input
refused before the rows move (bad ids on one rank: every rank raises). Then the levels with
1 node x 2 GPUs: the node-local megakernel over both GPUs, the path a node of several GPUs
takes (two GPUs cannot form two nodes of two). Prints one line per case; exits non-zero on a
failure.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import mokgen
from mokgen.reference import moe_reference, rel_error
from mokgen.runtime import InputError
from mokgen.runtime.multinode import moe_multinode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ep_worker import finish_golden, routing, start_levels_golden  # noqa: E402

TOL = 1e-2


def main():
    (E, K, H, I), tokens, rank, world, (wg, wu, wd), gen, mine = start_levels_golden()
    El = E // world
    local = (wg[mine].contiguous(), wu[mine].contiguous(), wd[mine].contiguous())
    failures = 0
    cap = max(tokens)

    def levels(x, ids, w, nodes):
        if nodes == world:
            return mokgen.moe(x, ids, w, *local, group=dist.group.WORLD, nodes=world)
        # 1 node x 2 GPUs through the levels: no row crosses a network, the node-local layer is
        # the NVLink megakernel over both GPUs (top-K, the other nodes' slots empty), with the node-local
        # workspace growing as the calls grow: the node-local path of nodes of several GPUs
        return moe_multinode(x, ids, w, *local, (El, K, H, I, 0), dist.group.WORLD, nodes, True)

    def case(name, T, kind, runs=1, nodes=world):
        nonlocal failures
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        ids, w = routing(T, E, K, kind, rank, world, gen)
        t0 = time.time()
        with torch.no_grad():
            outs = [levels(x, ids, w, nodes) for _ in range(runs)]
            torch.cuda.synchronize()
            # the same work on 1 node x 2 GPUs (the NVLink megakernel)
            one_node = mokgen.moe(x, ids, w, *local, group=dist.group.WORLD, max_tokens=cap)
            mokgen.check_errors()
        ref = moe_reference(x, ids, w, wg, wu, wd)
        err = rel_error(outs[0], ref) if T else 0.0
        vs_one_node = rel_error(outs[0], one_node.double()) if T else 0.0
        same = all(torch.equal(o, outs[0]) for o in outs[1:])
        ok = err < TOL and vs_one_node < TOL and not torch.isnan(outs[0]).any().item() and same
        failures += not ok
        print(f"rank {rank} {name:26s} T={T:<5d} {kind:8s} err={err:.2e} vs 1 node x {world} GPUs {vs_one_node:.2e} "
              f"runs={runs} same_bits={same} {time.time() - t0:.1f}s {'ok' if ok else 'FAIL'}", flush=True)

    for T in tokens:
        for kind in ("uniform", "skewed"):
            case("golden, 2 nodes x 1 GPU", T, kind)
    case("uneven", 513 if rank == 0 else 7, "uniform")
    case("one rank empty", 0 if rank == world - 1 else 300, "skewed")
    case("20 runs, same bits", min(2048, cap), "skewed", runs=20)
    case("empty slots", 513, "dropped")
    for T in tokens:
        for kind in ("uniform", "skewed"):
            case(f"levels, 1 node x {world} GPUs", T, kind, nodes=1)
    case("levels, 1 node, one rank empty", 0 if rank == world - 1 else 300, "skewed", nodes=1)
    case("levels, 1 node, same bits", min(2048, cap), "skewed", runs=20, nodes=1)
    case("levels, 1 node, empty slots", 513, "dropped", nodes=1)

    # bad arguments: refused before any exchange, the same way on every rank
    x = torch.randn(8, H, device="cuda", generator=gen).bfloat16()
    ids, w = routing(8, E, K, "uniform", rank, world, gen)
    for what, kw, err in (("nodes not dividing the group", dict(nodes=3), InputError),
                          ("nodes without a group", dict(nodes=2, group=None), InputError)):
        try:
            with torch.no_grad():
                mokgen.moe(x, ids, w, *local, **{"group": dist.group.WORLD, **kw})
            print(f"rank {rank} {what}: accepted FAIL", flush=True)
            failures += 1
        except err as e:
            print(f"rank {rank} {what}: {type(e).__name__} ok ({str(e)[:80]})", flush=True)
    # an id out of range on one rank only: every rank raises (none is left waiting in the engine),
    # checked ids or not, and the next call works
    bad_ids = ids.clone()
    if rank == 0:
        bad_ids[3, 1] = E + 5
    for checked in (True, False):
        try:
            with torch.no_grad():
                mokgen.moe(x, bad_ids, w, *local, group=dist.group.WORLD, nodes=world, check_ids=checked)
            print(f"rank {rank} bad ids on rank 0 (check_ids={checked}): accepted FAIL", flush=True)
            failures += 1
        except InputError as e:
            ok = "rank(s) [0]" in str(e)
            failures += not ok
            print(f"rank {rank} bad ids on rank 0 (check_ids={checked}): InputError {'ok' if ok else 'FAIL'} "
                  f"({str(e)[:80]})", flush=True)
    case("after bad ids on one rank", 64, "uniform")
    try:
        mokgen.moe(x, ids, w.requires_grad_(True), *local, group=dist.group.WORLD, nodes=world)
        print(f"rank {rank} under autograd: accepted FAIL", flush=True)
        failures += 1
    except NotImplementedError as e:
        print(f"rank {rank} under autograd: NotImplementedError ok ({str(e)[:80]})", flush=True)

    finish_golden(failures, rank, "MULTINODE golden")


if __name__ == "__main__":
    main()
