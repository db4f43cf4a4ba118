"""Golden tests of the FP8 layer over 2 GPUs (mokgen.moe_fp8(..., group=)): one process per
GPU, each GPU holding half the experts in FP8, tokens crossing through NCCL.

    torchrun --nproc-per-node=2 tests/fp8_ep_worker.py [--tokens 1,513,4096]

Each rank's output is compared with the float64 emulation of the global FP8 layer (every
expert quantised as the ranks quantise theirs: 128 x 128 blocks never span experts) on its
tokens within REQUANTIZED_TOLERANCE (mokgen.fp8.requantized_tolerance: a wider bound for a
few fresh tokens), and with the bf16 layer's float64 reference within
FP8_TOLERANCE: fresh random inputs, uniform, skewed and dropped routing, different token
counts per rank (including none), 20 runs with the same bits, bad ids on one rank (every rank
raises).

Training over the 2 GPUs (mokgen.moe_fp8_train(..., group=) and moe_fp8(..., group=) under
autograd; mokgen/runtime/rail.py): the output has the no-grad forward's bits, and dx,
d_topk_weights and this rank's experts' weight gradients are compared with the float64
emulation of the global FP8 backward (every rank's tokens: drawn from a generator the ranks
share; in the order of the rank's node-local rows) within the same bounds, NaN-poisoned
outputs written, two runs the same bits.

Prints one line per case; exits non-zero on a failure. MOKGEN_TEST_RANKS_SHARE_GPU=1 runs both
ranks on GPU 0 over gloo (tests/ep_worker.start_golden): the same checks where one GPU is all
there is (no NCCL between two ranks of one GPU; nothing is timed).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import mokgen
from mokgen.fp8 import FP8_TOLERANCE, moe_fp8_backward_emulated, moe_fp8_emulated, quantize_experts, \
    requantized_tolerance
from mokgen.reference import moe_reference, rel_error
from mokgen.runtime import InputError
from mokgen.verify import dot_error_scales, gradient_error

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
        ok = err <= requantized_tolerance(T) and vs_ref <= FP8_TOLERANCE and same \
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

    # training: every rank's inputs from one generator the ranks share, so that each can
    # emulate the global layer
    seed = torch.randint(2**31, (1,), device="cuda", generator=gen)
    dist.broadcast(seed, 0)
    shared = torch.Generator(device="cuda")
    shared.manual_seed(int(seed.item()))

    def train_case(name, tokens, kind, weights=True, recompute=False):
        nonlocal failures
        xs = [torch.randn(T, H, device="cuda", generator=shared).bfloat16() for T in tokens]
        routes = [routing(T, E, K, kind, r, world, shared) for r, T in enumerate(tokens)]
        douts = [torch.randn(T, H, device="cuda", generator=shared).bfloat16() for T in tokens]
        (ids, w), dout = routes[rank], douts[rank]
        masters = [t[mine].contiguous() for t in (wg, wu, wd)]
        runs = []
        for _ in range(2):
            leaves = [t.clone().requires_grad_() for t in (xs[rank], w)] + \
                ([t.clone().requires_grad_() for t in masters] if weights else [])
            with poisoned():
                if weights:
                    out = mokgen.moe_fp8_train(leaves[0], ids, leaves[1], *leaves[2:], group=dist.group.WORLD,
                                               recompute=recompute)
                else:
                    out = mokgen.moe_fp8(leaves[0], ids, leaves[1], local, group=dist.group.WORLD)
                out.backward(dout)
                torch.cuda.synchronize()
            mokgen.check_errors()
            runs.append([out.detach()] + [t.grad for t in leaves])
        with torch.no_grad():
            plain = mokgen.moe_fp8(xs[rank], ids, w, local, group=dist.group.WORLD)
        got = runs[0]
        # The global layer emulated with this rank's tokens first, then the other ranks' in rank
        # order: the order of the rows of this rank's node-local call (its own tokens, then the
        # rows that arrived, by source rank, then token), and so of each of its experts' rows,
        # whose 128-row blocks the weight gradients quantise (another order quantises other
        # blocks: a different, equally valid FP8 result, 1.7e-2 from this one at T=513).
        order = [rank] + [r for r in range(world) if r != rank]
        cat = lambda ts: torch.cat([ts[r] for r in order])  # noqa: E731
        x_all, ids_all, w_all = cat(xs), cat([r[0] for r in routes]), cat([r[1] for r in routes])
        want = moe_fp8_backward_emulated(cat(douts), x_all, ids_all, w_all, every)
        scale = dot_error_scales(cat(douts), x_all, ids_all, wg, wu, wd)
        T = tokens[rank]
        errs = {}
        for k, t in zip(("dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"), got[1:]):
            ref = want[k][mine] if k.startswith("d_w") else want[k][:T]
            ref = ref if k == "d_topk_weights" else ref.to(torch.bfloat16).double()
            errs[k] = gradient_error(k, t, ref, scale) if ref.numel() and ref.norm() > 0 else \
                float(t.float().abs().max()) if t.numel() else 0.0
        nan = any(torch.isnan(t.float()).any().item() for t in got)
        same = all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
        bound = {k: requantized_tolerance(sum(tokens) if k.startswith("d_w") else T) for k in errs}
        ok = torch.equal(got[0], plain) and same and not nan and all(errs[k] <= bound[k] for k in errs)
        failures += not ok
        print(f"rank {rank} {name:34s} T={T:<5d} {kind:8s} " + " ".join(f"{k} {v:.1e}" for k, v in errs.items())
              + f" out=no-grad forward {torch.equal(got[0], plain)} same_bits={same} nan={nan} "
              f"{'ok' if ok else 'FAIL'}", flush=True)

    for T in tokens[:2]:
        for kind in ("uniform", "skewed", "dropped"):
            train_case("train, FP8 over 2 GPUs", [T] * world, kind)
    train_case("train, uneven", [300, 7] + [64] * (world - 2), "uniform")
    train_case("train, one rank empty", [0] + [200] * (world - 1), "skewed")
    train_case("train, recompute", [513] * world, "uniform", recompute=True)
    train_case("moe_fp8 under autograd (frozen)", [257] * world, "dropped", weights=False)

    # the drop-in module: MoE(dtype="fp8", group=) trains over the group (its router replicated)
    torch.manual_seed(int(seed.item()))  # (the same router on every rank)
    block = mokgen.MoE(H, I, E, K, dtype="fp8", group=dist.group.WORLD, device="cuda")
    x = torch.randn(96, H, device="cuda", generator=gen).bfloat16().requires_grad_()
    grads = []
    for _ in range(2):
        block.zero_grad()
        x.grad = None
        out = block(x)
        out.float().square().mean().backward()
        grads.append([out.detach(), x.grad] + [p.grad for p in (block.router.weight, block.w_gate, block.w_down)])
    ok = all(torch.equal(a, b) for a, b in zip(*grads)) and all(torch.isfinite(t.float()).all() for t in grads[0]) \
        and all(t.abs().sum() > 0 for t in grads[0][1:])
    failures += not ok
    print(f"rank {rank} MoE(dtype='fp8', group=) forward + backward: finite, non-zero gradients, same bits "
          f"{'ok' if ok else 'FAIL'}", flush=True)

    finish_golden(failures, rank, "FP8 EP golden")


class poisoned:
    """Variant.poison on for every built variant while in the block: outputs start as NaN, so
    an unwritten one shows."""

    def __enter__(self):
        from mokgen.runtime.variant import Variant

        self.saved, Variant.poison = Variant.poison, True

    def __exit__(self, *exc):
        from mokgen.runtime.variant import Variant

        Variant.poison = self.saved


if __name__ == "__main__":
    main()
