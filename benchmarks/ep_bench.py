"""Expert-parallel forward on several GPUs: mokgen against torch expert parallelism, one run.

    torchrun --nproc-per-node=2 benchmarks/ep_bench.py [--tokens 4096,8192] [--backward] [--json out.json]

Per rank: T tokens, E/W local experts, uniform random routing over all E experts. Times
(CUDA events, warm-up, median; the slowest rank's figure) the mokgen layer, the torch
baseline (sort, count exchange, all_to_all, torch._grouped_mm experts, all_to_all back,
weighted index_add), and on one GPU the single-GPU mokgen layer doing the same local work
(T tokens over all E experts). Also times mokgen's send and return kernels alone and
reports the NVLink bytes they move and the rate achieved. --backward also times forward +
backward through autograd (FLOPs counted as 3x the forward's) against the torch baseline with
autograd, and the backward's kernels.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import torch.distributed as dist

import mokgen
from mokgen.module import torch_expert_parallel
from mokgen.runtime import find_variant
from mokgen.schedule import H200
from mokgen.runtime.peers import workspace
from mokgen.verify_ranks import init_ranks


def torch_ep(x, ids, w, w13, wd, E, group):
    """The torch expert-parallel layer (mokgen.module.torch_expert_parallel)."""
    return torch_expert_parallel(x, ids, w, w13, wd, E, group)


def timed(fn, warm=5, iters=20):
    """Median ms over iters, the slowest rank's."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    t = torch.tensor([sorted(ts)[len(ts) // 2]], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def finish(rank, path, rows):
    """Rank 0 writes the rows as JSON where asked; every rank leaves the process group."""
    if rank == 0 and path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


def start_ranks(E, H, I):
    """Under torchrun: (rank, world, group, generator, this rank's E/world experts' bf16
    w_gate, w_up, w_down), the NCCL group made and the device set."""
    rank, world = init_ranks()
    g = torch.Generator(device="cuda")
    g.manual_seed(1234 + rank)
    El = E // world
    weights = ((torch.randn(El, I, H, device="cuda", generator=g) / math.sqrt(H)).bfloat16(),
               (torch.randn(El, I, H, device="cuda", generator=g) / math.sqrt(H)).bfloat16(),
               (torch.randn(El, H, I, device="cuda", generator=g) / math.sqrt(I)).bfloat16())
    return rank, world, dist.group.WORLD, g, weights


def kernel_times(variant, call, names, iters=10):
    """Median ms of the named kernels inside calls (events around each launch)."""
    names = [n for n in names if n in variant.launchers]  # (the overlapped Plan has no ep_wait_rows)
    found = {n: [] for n in names}
    saved = dict(variant.launchers)
    pending = []
    for n in names:
        def wrap(tensors, stream, _n=n, _f=saved[n]):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            main = torch.cuda.current_stream()
            # the stream the kernel runs on: the current one, or the Plan's side stream
            on = main if stream == main.cuda_stream else torch.cuda.ExternalStream(stream)
            a.record(on)
            _f(tensors, stream)
            b.record(on)
            pending.append((_n, a, b))
        variant.launchers[n] = wrap
    try:
        for _ in range(iters):
            call()
            torch.cuda.synchronize()
            for n, a, b in pending:
                found[n].append(a.elapsed_time(b))
            pending.clear()
    finally:
        variant.launchers.update(saved)
    return {n: sorted(v)[len(v) // 2] for n, v in found.items() if v}  # (built for another entry: not called)


def host_profile(call, rank, calls=50):
    """Host time per eager call (no sync inside), and the functions it goes to (cProfile)."""
    import cProfile
    import pstats
    import time

    torch.cuda.synchronize()
    dist.barrier()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    host_us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        print(f"   host: {host_us:.0f} us per eager call (profiled)", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


BACKWARD_KERNELS = ["dispatch_count", "dispatch_scatter", "ep_publish", "ep_layout_bwd", "ep_send_bwd_grad",
                    "ep_send_bwd_x", "gemm_gateup_train", "bwd_dgrad_down", "bwd_swiglu", "bwd_dgrad_gateup",
                    "ep_return_bwd", "wgrad_down", "ep_wait_rows", "wgrad_gate", "wgrad_up", "ep_wait_returns",
                    "bwd_combine"]


def bench_backward(T, E, K, H, I, tokens, wg, wu, wd, v, group, rank, g, variants=()):
    """Forward + backward through autograd: mokgen's layer against torch EP with autograd, and
    the single-GPU mokgen layer on the same local work; parameter gradients reset each call."""
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w, ids = torch.topk(torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1), K, -1)
    ids, w = ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float().requires_grad_(True)
    dout = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    params = [t.clone().requires_grad_(True) for t in (wg, wu, wd)]
    w13 = torch.cat([wg, wu], 1).requires_grad_(True)
    wd_t = wd.clone().requires_grad_(True)

    def step(fn, leaves):
        for t in leaves:
            t.grad = None
        fn().backward(dout)

    mk = lambda: mokgen.moe(x, ids, w, *params, group=group, max_tokens=max(tokens), check_ids=False)
    ms = timed(lambda: step(mk, [x, w, *params]))
    ms_recompute = timed(lambda: step(lambda: mokgen.moe(x, ids, w, *params, group=group, max_tokens=max(tokens),
                                                         check_ids=False, recompute=True), [x, w, *params]))
    ms_torch = timed(lambda: step(lambda: torch_ep(x, ids, w, w13, wd_t, E, group), [x, w, w13, wd_t]))
    kt = kernel_times(v, lambda: step(mk, [x, w, *params]), BACKWARD_KERNELS)
    ones = [(torch.randn(E, I, H, device="cuda", generator=g) / math.sqrt(H)).bfloat16().requires_grad_(True)
            for _ in range(2)] + [(torch.randn(E, H, I, device="cuda", generator=g) / math.sqrt(I)).bfloat16()
                                  .requires_grad_(True)]
    ms_single = timed(lambda: step(lambda: mokgen.moe(x, ids, w, *ones, check_ids=False), [x, w, *ones]))
    for path in variants:  # other builds of the layer: forward + backward through the variant itself
        other = mokgen.load(path)
        peers = workspace(other, group, T, max(tokens))
        peers.prepare(other, "backward")
        xd, wdt = x.detach(), w.detach()

        def both():  # the saved path, as autograd runs it
            _, *saved = other.forward_train(xd, ids, wdt, *wp, peers=peers)
            return other.backward(dout, xd, ids, wdt, *wp, saved=saved, peers=peers)

        wp = [p.detach() for p in params]
        t_other = timed(both)
        got, want = both(), v.backward(dout, xd, ids, wdt, *wp, peers=workspace(v, group, T, max(tokens)))  # recompute
        same = all(torch.equal(a_, b_) for a_, b_ in zip(got, want) if a_ is not None)
        kt_o = kernel_times(other, both, ["ep_send_bwd_grad", "ep_send_bwd_x", "bwd_dgrad_down", "bwd_dgrad_gateup",
                                          "ep_return_bwd", "wgrad_down", "ep_wait_rows", "ep_wait_returns"])
        if rank == 0:
            print(f"   {path}: forward+backward {t_other:.3f} ms ({ms_torch / t_other:.2f}x torch EP); gradients the "
                  f"same bits as the default build: {same}; decisions: {other.plan['overrides']}; kernels (ms): "
                  + ", ".join(f"{k} {t:.3f}" for k, t in kt_o.items()), flush=True)
    fl = 3 * 6.0 * T * K * H * I
    row = dict(shape=f"E{E} K{K} H{H} I{I}", world=dist.get_world_size(group), tokens_per_rank=T,
               mode="forward+backward", mokgen_ms=ms, mokgen_recompute_ms=ms_recompute, torch_ep_ms=ms_torch,
               ratio=ms_torch / ms,
               mokgen_tflops_per_gpu=fl / ms / 1e9, torch_tflops_per_gpu=fl / ms_torch / 1e9, single_gpu_ms=ms_single,
               per_gpu_vs_single=ms_single / ms, kernels_ms=kt)
    if rank == 0:
        print(f"T={T}/rank forward+backward  mokgen {ms:.3f} ms ({row['mokgen_tflops_per_gpu']:.0f} TF/s/GPU)  torch EP "
              f"{ms_torch:.3f} ms ({row['torch_tflops_per_gpu']:.0f})  ratio {row['ratio']:.2f}x  | recompute=True "
              f"{ms_recompute:.3f} ms ({ms_torch / ms_recompute:.2f}x)  | "
              f"{100 * row['mokgen_tflops_per_gpu'] / H200.dense_bf16_tflops:.0f}% of the dense bf16 GEMM peak  | "
              f"single GPU same work {ms_single:.3f} ms -> EP at {100 * row['per_gpu_vs_single']:.0f}%", flush=True)
        print("   backward kernels (ms): " + ", ".join(f"{k} {t:.3f}" for k, t in kt.items()), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="64,8,2048,1024")
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--json", default=None)
    ap.add_argument("--host-profile", action="store_true", help="also print where the host spends an eager call")
    ap.add_argument("--backward", action="store_true", help="also time forward + backward through autograd")
    ap.add_argument("--forward", default="yes", choices=["yes", "no"], help="time the forward alone (default yes)")
    ap.add_argument("--variants", default="", help="comma-separated variant directories (builds of the same layer "
                                                    "with other Plan decisions) to time beside it")
    a = ap.parse_args()
    E, K, H, I = (int(v) for v in a.shape.split(","))
    rank, world, group, g, (wg, wu, wd) = start_ranks(E, H, I)
    El = E // world
    tokens = [int(t) for t in a.tokens.split(",")]
    w13 = torch.cat([wg, wu], 1)
    v = find_variant(E, K, H, I, 0, world_size=world)
    single = find_variant(E, K, H, I, 0)
    rows = []
    for T in tokens if a.backward else ():
        rows.append(bench_backward(T, E, K, H, I, tokens, wg, wu, wd, v, group, rank, g,
                                   [p for p in a.variants.split(",") if p]))
    for T in tokens if a.forward == "yes" else ():
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        w, ids = torch.topk(torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1), K, -1)
        ids, w = ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()
        with torch.no_grad():
            run = lambda: mokgen.moe(x, ids, w, wg, wu, wd, group=group, max_tokens=max(tokens), check_ids=False)
            ms = timed(run)
            # the same call replayed from a CUDA graph: the GPU's time without the host's launch
            # overhead (the flags carry a device-side epoch, so replays need nothing from the host)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            ms_graph = timed(graph.replay)
            if a.host_profile:
                host_profile(run, rank)
            ms_torch = timed(lambda: torch_ep(x, ids, w, w13, wd, E, group))
            if a.variants:  # the default build called like the others (no input checks): the same footing
                mine = workspace(v, group, T, max(tokens))
                t_direct = timed(lambda: v.forward(x, ids, w, wg, wu, wd, peers=mine))
                if rank == 0:
                    print(f"   default build, called directly: {t_direct:.3f} ms (from a CUDA graph "
                          f"{ms_graph:.3f} ms)", flush=True)
            for path in filter(None, a.variants.split(",")):
                other = mokgen.load(path)
                peers = workspace(other, group, T, max(tokens))
                t_other = timed(lambda: other.forward(x, ids, w, wg, wu, wd, peers=peers))
                diff = (other.forward(x, ids, w, wg, wu, wd, peers=peers).float() - run().float()).abs().max().item()
                other_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(other_graph):
                    other.forward(x, ids, w, wg, wu, wd, peers=peers)
                t_other_graph = timed(other_graph.replay)
                kt_o = kernel_times(other, lambda: other.forward(x, ids, w, wg, wu, wd, peers=peers),
                                    ["ep_send", "gemm_gateup", "gemm_down", "ep_return", "gemm_fused"])
                if rank == 0:
                    print(f"   {path}: {t_other:.3f} ms, from a CUDA graph {t_other_graph:.3f} ms "
                          f"({ms_torch / t_other:.2f}x / {ms_torch / t_other_graph:.2f}x torch EP), max |diff| vs the "
                          f"default build {diff:.1e}; decisions: {other.plan['overrides']}; kernels (ms): "
                          + ", ".join(f"{k} {t:.3f}" for k, t in kt_o.items()), flush=True)
            err = (run().float() - torch_ep(x, ids, w, w13, wd, E, group).float()).norm().item() / \
                torch_ep(x, ids, w, w13, wd, E, group).float().norm().item()
            kt = kernel_times(v, run, ["dispatch_count", "dispatch_scatter", "ep_publish", "ep_layout", "ep_send",
                                       "ep_return", "ep_wait_rows", "ep_wait_returns", "gemm_gateup",
                                       "gemm_down", "gemm_fused", "combine"])
            # the same local work on one GPU (every rank does it alone, at once)
            wg1 = torch.randn(E, I, H, device="cuda", generator=g).bfloat16()
            wu1, wd1 = torch.randn_like(wg1), torch.randn(E, H, I, device="cuda", generator=g).bfloat16()
            ms_single = timed(lambda: single.forward(x, ids, w, wg1, wu1, wd1))
        peer_rows = int((ids.long() // El != rank).sum().item())
        peer_bytes = torch.tensor([peer_rows * H * 2], device="cuda", dtype=torch.float64)
        dist.all_reduce(peer_bytes, op=dist.ReduceOp.MAX)
        fl = 6.0 * T * K * H * I
        row = dict(shape=f"E{E} K{K} H{H} I{I}", world=world, tokens_per_rank=T, mokgen_ms=ms, torch_ep_ms=ms_torch,
                   ratio=ms_torch / ms, mokgen_graph_ms=ms_graph, ratio_graph=ms_torch / ms_graph,
                   mokgen_tflops_per_gpu=fl / ms / 1e9, torch_tflops_per_gpu=fl / ms_torch / 1e9,
                   single_gpu_ms=ms_single, per_gpu_vs_single=ms_single / ms, rel_diff_vs_torch=err,
                   kernels_ms=kt, nvlink_bytes_each_way=peer_bytes.item(),
                   # the send runs inside the gate/up GEMM's launch where the Plan has no ep_send, the
                   # return inside the down GEMM's unless it has ep_return; small calls run both inside
                   # the single launch (gemm_fused): rates over the launch that moved the rows
                   send_gbs=peer_bytes.item() / kt.get("ep_send", kt.get("gemm_gateup", kt.get("gemm_fused"))) / 1e6,
                   return_gbs=peer_bytes.item() / kt.get("ep_return", kt.get("gemm_down", kt.get("gemm_fused"))) / 1e6)
        rows.append(row)
        if rank == 0:
            print(f"T={T}/rank  mokgen {ms:.3f} ms ({row['mokgen_tflops_per_gpu']:.0f} TF/s/GPU)  torch EP "
                  f"{ms_torch:.3f} ms ({row['torch_tflops_per_gpu']:.0f})  ratio {row['ratio']:.2f}x  | "
                  f"{100 * row['mokgen_tflops_per_gpu'] / H200.dense_bf16_tflops:.0f}% of the dense bf16 GEMM peak per "
                  f"GPU ({H200.dense_bf16_tflops:.0f} TF/s, measured)  | mokgen from a "
                  f"CUDA graph {ms_graph:.3f} ms ({fl / ms_graph / 1e9:.0f} TF/s/GPU, {ms_torch / ms_graph:.2f}x)  | single GPU "
                  f"same work {ms_single:.3f} ms -> EP at {100 * row['per_gpu_vs_single']:.0f}%  | diff vs torch "
                  f"{err:.1e}", flush=True)
            print("   kernels (ms): " + ", ".join(f"{k} {t:.3f}" for k, t in kt.items()) +
                  f"  | NVLink {peer_bytes.item() / 1e6:.0f} MB each way: send {row['send_gbs']:.0f} GB/s, return "
                  f"{row['return_gbs']:.0f} GB/s" + ("" if "ep_return" in kt else " (over the down GEMM's launch, which "
                                                                                   "returns its rows itself)"), flush=True)
    finish(rank, a.json, rows)


if __name__ == "__main__":
    main()
