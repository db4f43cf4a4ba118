"""Host time of one forward call, apart from the GPU's: is a small eager call host-bound?

    python benchmarks/host_overhead.py [--variant V] [--tokens T,T,...] [--calls N] [--profile]

For each T: the GPU time (CUDA-graph replay), the eager time (CUDA events around calls made
back to back, as `mokgen bench` times them), and the host time per call measured while the GPU
is held busy by a sleep kernel (so no call ever waits for the GPU: what the wall clock shows is
the host's own work). An eager call is host-bound when its host time exceeds its GPU time.
The host figure is an upper bound: launches queued behind the sleep kernel cost the host more
than launches into a running stream (E40 eager calls timed 0.097 ms back to back, level with
their graph replays, while this probe gave more host time per call than that).
--profile adds cProfile's top entries for the host calls of the first T, and the torch
profiler's table of what one eager call puts on the GPU (kernels, copies) and for how long.
Callers timed: `variant.forward` (the runtime, no checks) and `mokgen.moe(..., check_ids=False)`
(the public entry: input checks, variant lookup).
"""
import argparse
import cProfile
import io
import json
import pstats
import time

import torch

import mokgen
from mokgen.bench import _capture, time_ms
from mokgen.verify import make_inputs

ap = argparse.ArgumentParser()
ap.add_argument("--variant", default="e64_k8_h2048_i1024_bf16_sm90a")
ap.add_argument("--tokens", default="64,256,1024")
ap.add_argument("--calls", type=int, default=200)
ap.add_argument("--profile", action="store_true")
ap.add_argument("--json")
args = ap.parse_args()

v = mokgen.load(args.variant)
rows = []


def host_us(fn, calls: int, profiler=None) -> float:
    """Mean host microseconds per call, the GPU kept busy (a sleep kernel queued first) so
    that no call waits for it."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU time at H200 clocks: longer than the calls' host time
    if profiler:
        profiler.enable()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    if profiler:
        profiler.disable()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


for i, T in enumerate(int(t) for t in args.tokens.split(",")):
    x, ids, w, wg, wu, wd, shared = make_inputs(v.spec, T, "uniform", torch.Generator("cuda").manual_seed(T))
    calls = {
        "variant.forward": lambda: v.forward(x, ids, w, wg, wu, wd, *shared),
        "mokgen.moe": lambda: mokgen.moe(x, ids, w, wg, wu, wd, check_ids=False),
    }
    graph = _capture(calls["variant.forward"])
    gpu_ms = time_ms(graph.replay) if graph is not None else float("nan")
    for name, fn in calls.items():
        fn()
        eager_ms = time_ms(fn)
        prof = cProfile.Profile() if args.profile and i == 0 else None
        host = host_us(fn, args.calls, prof)
        rows.append(dict(variant=v.name, T=T, caller=name, graph_ms=gpu_ms, eager_ms=eager_ms, host_us=host))
        print(f"T={T:6d} {name:16s} graph {gpu_ms:.3f} ms  eager {eager_ms:.3f} ms  host {host:7.1f} us/call"
              + ("  (host-bound)" if host / 1e3 > gpu_ms else ""), flush=True)
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            print(s.getvalue())
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=48))
if args.json:
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
