"""Golden tests of the FP8 layer over 2 GPUs (mokgen.moe_fp8(..., group=)): one process per
GPU, each GPU holding half the experts in FP8, tokens crossing through NCCL.

    torchrun --nproc-per-node=2 tests/fp8_ep_worker.py [--tokens 1,513,4096]

Each rank's output is compared with the float64 emulation of the global FP8 layer (every
expert quantised as the ranks quantise theirs: 128 x 128 blocks never span experts) on its
tokens within REQUANTIZED_TOLERANCE, and with the bf16 layer's float64 reference within
FP8_TOLERANCE: fresh random inputs, uniform, skewed and dropped routing, different token
counts per rank (including none), 20 runs with the same bits, bad ids on one rank (every rank
raises). Prints one line per case; exits non-zero on a failure.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import mokgen
from mokgen.fp8 import FP8_TOLERANCE, REQUANTIZED_TOLERANCE, moe_fp8_emulated, quantize_experts
from mokgen.reference import moe_reference, rel_error
from mokgen.runtime import InputError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ep_worker import finish_golden, routing, start_levels_golden  # noqa: E402


def main():
    (E, K, H, I), tokens, rank, world, (wg, wu, wd), gen, mine = start_levels_golden()
    every = quantize_experts(wg, wu, wd)
    local = quantize_experts(wg[mine].contiguous(), wu[mine].contiguous(), wd[mine].contiguous())
    failures = 0

    def case(name, T, kind, runs=1):
        nonlocal failures
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        ids, w = routing(T, E, K, kind, rank, world, gen)
        with torch.no_grad():
            outs = [mokgen.moe_fp8(x, ids, w, local, group=dist.group.WORLD) for _ in range(runs)]
            torch.cuda.synchronize()
            mokgen.check_errors()
        err = rel_error(outs[0], moe_fp8_emulated(x, ids, w, every).to(torch.bfloat16).double()) if T else 0.0
        vs_ref = rel_error(outs[0], moe_reference(x, ids, w, wg, wu, wd)) if T else 0.0
        same = all(torch.equal(o, outs[0]) for o in outs[1:])
        ok = err <= REQUANTIZED_TOLERANCE and vs_ref <= FP8_TOLERANCE and same \
            and not torch.isnan(outs[0].float()).any().item()
        failures += not ok
        print(f"rank {rank} {name:24s} T={T:<5d} {kind:8s} vs emulation {err:.2e} vs float64 bf16 layer "
              f"{vs_ref:.2e} runs={runs} same_bits={same} {'ok' if ok else 'FAIL'}", flush=True)

    for T in tokens:
        for kind in ("uniform", "skewed", "dropped"):
            case("golden, FP8 over 2 GPUs", T, kind)
    case("uneven", 513 if rank == 0 else 7, "uniform")
    case("one rank empty", 0 if rank == world - 1 else 300, "skewed")
    case("20 runs, same bits", 1024, "skewed", runs=20)
    # an id out of range on one rank only: every rank raises, and the next call works
    x = torch.randn(8, H, device="cuda", generator=gen).bfloat16()
    ids, w = routing(8, E, K, "uniform", rank, world, gen)
    bad_ids = ids.clone()
    if rank == 0:
        bad_ids[3, 1] = E + 5
    try:
        with torch.no_grad():
            mokgen.moe_fp8(x, bad_ids, w, local, group=dist.group.WORLD)
        print(f"rank {rank} bad ids on rank 0: accepted FAIL", flush=True)
        failures += 1
    except InputError as e:
        ok = "rank(s) [0]" in str(e)
        failures += not ok
        print(f"rank {rank} bad ids on rank 0: InputError {'ok' if ok else 'FAIL'} ({str(e)[:80]})", flush=True)
    case("after bad ids on one rank", 64, "uniform")

    finish_golden(failures, rank, "FP8 EP golden")


if __name__ == "__main__":
    main()
