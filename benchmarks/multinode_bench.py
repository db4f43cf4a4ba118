"""The layer over 2 nodes x 1 GPU against 1 node x 2 GPUs on the same work, one run.

    torchrun --nproc-per-node=2 benchmarks/multinode_bench.py [--tokens 1024,4096,8192] [--json out.json] [--fp8]

Two GPUs of one host as 2 nodes (tokens cross through NCCL, as between nodes) and as one node
(the NVLink expert-parallel megakernel), E64 K8 H2048 I1024, uniform routing, T tokens per
rank; also the torch expert-parallel baseline. Times (CUDA events, warm-up, median, the
slowest rank's) each layer, and the engine's all_to_all of the same row bytes alone: the rate
the performance model (docs/multinode.md) is checked with. --fp8 also times the FP8 layer
over the same 2 GPUs (mokgen.moe_fp8(..., group=): the same levels, each GPU's experts in FP8),
and its forward + backward through autograd (mokgen.moe_fp8_train(..., group=), the experts
quantised once, as once per optimizer step) against the bf16 expert-parallel megakernel's and
torch EP's forward + backward in the same run.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import mokgen
from mokgen.ir import MoESpec
from mokgen.module import torch_expert_parallel
from mokgen.runtime.multinode import moe_multinode
from mokgen.schedule import H200
from mokgen.schedule.multinode import link_model, remote_nodes_per_token

from ep_bench import finish, start_ranks, timed  # (this directory; timed: the slowest rank's median of CUDA events)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,4096,8192")
    ap.add_argument("--json", default=None)
    ap.add_argument("--host-profile", action="store_true", help="also print where an eager call spends its time")
    ap.add_argument("--fp8", action="store_true", help="also time the FP8 layer over the same GPUs")
    a = ap.parse_args()
    E, K, H, I = 64, 8, 2048, 1024
    rank, world, group, g, (wg, wu, wd) = start_ranks(E, H, I)
    tokens = [int(t) for t in a.tokens.split(",")]
    w13 = torch.cat([wg, wu], 1)
    if a.fp8:
        from mokgen.fp8 import quantize_experts

        experts = quantize_experts(wg, wu, wd)
    spec = MoESpec(experts=E, topk=K, hidden=H, intermediate=I, world_size=world, topology="nvlink", nodes=world)
    rows = []
    for T in tokens:
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        w, ids = torch.topk(torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1), K, -1)
        ids, w = ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()
        with torch.no_grad():
            nodes = timed(lambda: mokgen.moe(x, ids, w, wg, wu, wd, group=group, nodes=world, check_ids=False),
                          warm=3, iters=15)
            if a.host_profile:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                for _ in range(5):
                    mokgen.moe(x, ids, w, wg, wu, wd, group=group, nodes=world, check_ids=False)
                torch.cuda.synchronize()
                prof.disable()
                if rank == 0:
                    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                    for _ in range(3):
                        mokgen.moe(x, ids, w, wg, wu, wd, group=group, nodes=world, check_ids=False)
                    torch.cuda.synchronize()
                if rank == 0:
                    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
                    print(tp.key_averages().table(sort_by="cpu_time_total", row_limit=12), flush=True)
            one = timed(lambda: mokgen.moe(x, ids, w, wg, wu, wd, group=group, max_tokens=max(tokens),
                                           check_ids=False))
            # the levels over 1 node x 2 GPUs: the node-local megakernel path a node of several GPUs runs
            levels_one = timed(lambda: moe_multinode(x, ids, w, wg, wu, wd, (E // world, K, H, I, 0), group, 1,
                                                     False))
            torch_ms = timed(lambda: torch_expert_parallel(x, ids, w, w13, wd, E, group))
            fp8 = timed(lambda: mokgen.moe_fp8(x, ids, w, experts, group=group, check_ids=False)) if a.fp8 else None
            diff = (mokgen.moe(x, ids, w, wg, wu, wd, group=group, nodes=world, check_ids=False).float()
                    - mokgen.moe(x, ids, w, wg, wu, wd, group=group, max_tokens=max(tokens),
                                 check_ids=False).float()).abs().max().item()
        # the engine alone: the token rows (deduplicated per node) and their slots out, one
        # summed row per (token, node) back, as the layer moves them
        sent = int(((ids.long() // (E // world)) != rank).any(1).sum().item())
        counts = torch.tensor([0 if r == rank else sent for r in range(world)], device="cuda")
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)
        sc, rc = counts.tolist(), recv.tolist()
        out_rows = torch.empty(sent, H + 2 * K * 2, dtype=torch.bfloat16, device="cuda")
        in_rows = torch.empty(sum(rc), H + 2 * K * 2, dtype=torch.bfloat16, device="cuda")
        back_out, back_in = torch.empty(sum(rc), H, dtype=torch.bfloat16, device="cuda"), \
            torch.empty(sent, H, dtype=torch.bfloat16, device="cuda")

        def exchange():
            dist.all_to_all_single(in_rows, out_rows, rc, sc, group=group)
            dist.all_to_all_single(back_in, back_out, sc, rc, group=group)

        xchg = timed(exchange)
        bytes_each_way = sent * (H * 2 + 8 * K + H * 2)
        gbs = bytes_each_way / (xchg * 1e-3) / 1e9
        model = link_model(spec, H200, T, net_gbs=gbs)
        fl = 6.0 * T * K * H * I
        row = dict(tokens_per_rank=T, two_nodes_ms=nodes, one_node_ms=one, torch_ep_ms=torch_ms,
                   two_nodes_vs_one_node=one / nodes, two_nodes_vs_torch=torch_ms / nodes, max_abs_diff=diff,
                   engine_exchange_ms=xchg, engine_gbs=gbs, bytes_each_way=bytes_each_way,
                   remote_nodes_per_token=sent / max(T, 1), model_remote_nodes=remote_nodes_per_token(spec),
                   model_ms=model["predicted_ms"], model_gemm_ms=model["gemm_ms"],
                   two_nodes_tflops=fl / nodes / 1e9, levels_one_node_ms=levels_one, fp8_two_nodes_ms=fp8)
        rows.append(row)
        if rank == 0:
            print(f"T={T}/rank  2 nodes x 1 GPU {nodes:.3f} ms ({row['two_nodes_tflops']:.0f} TF/s/GPU, "
                  f"{torch_ms / nodes:.2f}x torch EP)  | 1 node x 2 GPUs {one:.3f} ms ({one / nodes:.2f}x of it)  | "
                  f"torch EP {torch_ms:.3f} ms  | max |diff| 2 nodes vs 1 node {diff:.1e}", flush=True)
            print(f"   engine: {bytes_each_way / 1e6:.0f} MB each way ({sent / max(T, 1):.3f} rows per token, model "
                  f"{row['model_remote_nodes']:.3f}) in {xchg:.3f} ms, {gbs:.0f} GB/s  | model at that rate "
                  f"{model['predicted_ms']:.3f} ms (GEMMs {model['gemm_ms']:.3f} ms at "
                  f"{H200.grouped_gemm_tflops:.0f} TF/s)", flush=True)
            print(f"   the levels over 1 node x 2 GPUs (the node-local megakernel, other nodes' slots empty): {levels_one:.3f} ms "
                  f"({one / levels_one:.2f}x of the megakernel on the tokens)", flush=True)
            if fp8 is not None:
                print(f"   FP8 over 2 nodes x 1 GPU {fp8:.3f} ms ({fl / fp8 / 1e9:.0f} TF/s/GPU, {nodes / fp8:.2f}x the "
                      f"bf16 levels, {torch_ms / fp8:.2f}x torch EP)", flush=True)
    if a.fp8:
        for T in tokens:
            rows.append(bench_fp8_train(T, E, K, H, I, max(tokens), (wg, wu, wd), experts, group, rank, g))
    finish(rank, a.json, rows)


def bench_fp8_train(T, E, K, H, I, max_tokens, weights, experts, group, rank, g) -> dict:
    """Forward + backward through autograd over the group's GPUs, parameter gradients reset each
    call: the FP8 layer across nodes (one GPU each), the bf16 expert-parallel megakernel, torch
    EP. FLOPs counted as 3x the forward's."""
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w, ids = torch.topk(torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1), K, -1)
    ids, w = ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float().requires_grad_(True)
    dout = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    params = [t.clone().requires_grad_(True) for t in weights]
    w13 = torch.cat(weights[:2], 1).requires_grad_(True)
    wd_t = weights[2].clone().requires_grad_(True)

    def step(fn, leaves):
        for t in leaves:
            t.grad = None
        fn().backward(dout)

    fp8 = timed(lambda: step(lambda: mokgen.moe_fp8_train(x, ids, w, *params, experts=experts, group=group,
                                                          check_ids=False), [x, w, *params]))
    bf16 = timed(lambda: step(lambda: mokgen.moe(x, ids, w, *params, group=group, max_tokens=max_tokens,
                                                 check_ids=False), [x, w, *params]))
    torch_ms = timed(lambda: step(lambda: torch_expert_parallel(x, ids, w, w13, wd_t, E, group), [x, w, w13, wd_t]))
    fl = 3 * 6.0 * T * K * H * I
    row = dict(tokens_per_rank=T, mode="forward+backward", fp8_two_nodes_ms=fp8, bf16_megakernel_ms=bf16,
               torch_ep_ms=torch_ms, fp8_vs_bf16=bf16 / fp8, fp8_vs_torch=torch_ms / fp8,
               fp8_tflops_per_gpu=fl / fp8 / 1e9)
    if rank == 0:
        print(f"T={T}/rank forward+backward  FP8 over 2 nodes x 1 GPU {fp8:.3f} ms ({fl / fp8 / 1e9:.0f} TF/s/GPU) | "
              f"bf16 EP megakernel {bf16:.3f} ms ({bf16 / fp8:.2f}x of it) | torch EP {torch_ms:.3f} ms "
              f"({torch_ms / fp8:.2f}x of it)", flush=True)
    return row


if __name__ == "__main__":
    main()
