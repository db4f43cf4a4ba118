"""Host time of one forward call, apart from the GPU's: is a small eager call host-bound?

    python benchmarks/host_overhead.py [--variant V] [--tokens T,T,...] [--calls N] [--rounds R] [--train] [--parts] [--profile]
                                       [--callers NAME,NAME]

For each T: the GPU time (CUDA-graph replay), the eager time (CUDA events around calls made
back to back, as `mokgen bench` times them), the wall-clock time per call of calls made back to
back (the larger of host and GPU time), and the host time per call measured while the GPU
is held busy by a sleep kernel (so no call ever waits for the GPU: what the wall clock shows is
the host's own work). An eager call is host-bound when its host time exceeds its GPU time.
The host figure is an upper bound: launches queued behind the sleep kernel cost the host more
than launches into a running stream (E40 eager calls timed 0.097 ms back to back, level with
their graph replays, while this probe gave more host time per call than that).
--profile adds cProfile's top entries for the host calls of the first T, and the torch
profiler's table of what one eager call puts on the GPU (kernels, copies) and for how long.
--parts adds, for each caller at the first T, the inclusive host time per call of the
runtime's pieces (entry points, workspaces, launches, the error bookkeeping), timed by
perf_counter wrappers: far less distortion than cProfile's, which slows every Python call.
Callers timed: `variant.forward` (the runtime, no checks) and `mokgen.moe(..., check_ids=False)`
(the public entry: input checks, variant lookup).

--train times a training step instead (forward under autograd, then torch.autograd.grad of
x, topk_weights and the three weights): through `mokgen.moe` (the eager binding,
runtime/eager.py), through the variant's torch custom op (`ops.forward_train`, what
torch.compile traces), whose dispatch the eager binding avoids, and through
torch.cuda.make_graphed_callables over `mokgen.moe` (the forward and the backward each one
CUDA graph replay), and through torch.compile(mokgen.moe, mode="reduce-overhead") (the custom
ops in torch's CUDA graphs).
"""
import argparse
import collections
import cProfile
import functools
import io
import json
import pstats
import statistics
import sys
import time

import torch

import mokgen
from mokgen.bench import _capture, time_ms
from mokgen.runtime import Variant
from mokgen.runtime.library import Launcher
from mokgen.verify import make_inputs

ap = argparse.ArgumentParser()
ap.add_argument("--variant", default="e64_k8_h2048_i1024_bf16_sm90a")
ap.add_argument("--tokens", default="64,256,1024")
ap.add_argument("--calls", type=int, default=200)
ap.add_argument("--profile", action="store_true")
ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every caller (the median is shown)")
ap.add_argument("--train", action="store_true", help="time a training step (forward + backward)")
ap.add_argument("--parts", action="store_true", help="host time of the runtime's pieces (first T)")
ap.add_argument("--callers", help="time only the callers whose names contain one of these (comma-separated), "
                                  "e.g. 'mokgen.moe' (no torch.compile, no graph capture of the step)")
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


# The runtime's pieces --parts times: (owner, attribute).
PARTS = [(Variant, n) for n in ("forward", "forward_train", "backward", "run", "_workspace", "_check_status",
                                "_record_status")] + [(Launcher, "__call__")]


def parts_us(fn, calls: int) -> dict:
    """{piece: (us per call of fn, times per call)}: each piece's inclusive host time, the GPU
    kept busy as in host_us; the pieces are wrapped for this measurement only."""
    spent, count = collections.Counter(), collections.Counter()

    def timed(f, label):
        @functools.wraps(f)
        def g(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0
                count[label] += 1
        return g

    saved = [(owner, name, owner.__dict__[name]) for owner, name in PARTS]
    try:
        for owner, name, f in saved:
            setattr(owner, name, timed(f, f"{owner.__name__}.{name}"))
        total = host_us(fn, calls)
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)
    return {"call": (total, 1.0), **{k: (spent[k] / calls * 1e6, count[k] / calls) for k in spent}}


def wall_ms(fn, calls: int) -> float:
    """Milliseconds per call of calls made back to back, from the wall clock: the larger of
    the host's and the GPU's time per call."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


for i, T in enumerate(int(t) for t in args.tokens.split(",")):
    x, ids, w, wg, wu, wd, shared = make_inputs(v.spec, T, "uniform", torch.Generator("cuda").manual_seed(T))
    calls = {
        "variant.forward": lambda: v.forward(x, ids, w, wg, wu, wd, *shared),
        "mokgen.moe": lambda: mokgen.moe(x, ids, w, wg, wu, wd, check_ids=False),
    }
    if args.train:
        leaves = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
        dout = torch.randn_like(x)

        def step(layer):
            out = layer(leaves[0], ids, *leaves[1:])
            return torch.autograd.grad(out, leaves, dout)

        def moe(*a):
            return mokgen.moe(*a, check_ids=False)

        def graphed_step():
            if "graphed" not in made:  # (made at the first call: only a caller that is timed pays for it)
                made["graphed"] = torch.cuda.make_graphed_callables(moe, (leaves[0], ids, *leaves[1:]))
            return step(made["graphed"])

        def compiled_step():
            if "compiled" not in made:
                made["compiled"] = torch.compile(moe, mode="reduce-overhead")
            torch.compiler.cudagraph_mark_step_begin()  # (the last step's outputs are not read again)
            return step(made["compiled"])

        made = {}
        calls = {
            "step, mokgen.moe": lambda: step(moe),
            "step, custom op": lambda: step(lambda *a: v.ops.forward_train(*a)[0]),
            "step, CUDA graphs": graphed_step,
            "step, compiled": compiled_step,
        }
    if args.callers:
        calls = {n: fn for n, fn in calls.items() if any(c in n for c in args.callers.split(","))} or \
            sys.exit(f"--callers {args.callers} names none of {', '.join(calls)}")
    if args.train:
        first = next(iter(calls.values()))()
        same = [torch.equal(a, b) for fn in list(calls.values())[1:] for a, b in zip(first, fn())]
        print(f"T={T}: the steps' gradients equal bit for bit: {all(same)}", flush=True)
    graph = _capture(next(iter(calls.values())))
    gpu_ms = time_ms(graph.replay) if graph is not None else float("nan")
    # The callers in interleaved rounds, the median kept (one round's figures drift with the
    # clock and the host's other work). The host probe's calls stay few: a step makes ~30
    # launches, and more than the GPU's launch queue holds would make the host wait for the
    # sleep kernel.
    host_calls = min(args.calls, 24) if args.train else args.calls
    got = {name: [] for name in calls}
    for r in range(args.rounds):
        for name, fn in calls.items():
            fn()
            got[name].append((time_ms(fn), wall_ms(fn, args.calls), host_us(fn, host_calls)))
    for name, fn in calls.items():
        eager_ms, wall, host = (statistics.median(f[j] for f in got[name]) for j in range(3))
        rows.append(dict(variant=v.name, T=T, caller=name, graph_ms=gpu_ms, eager_ms=eager_ms, wall_ms=wall,
                         host_us=host))
        print(f"T={T:6d} {name:16s} graph {gpu_ms:.3f} ms  eager {eager_ms:.3f} ms  back to back {wall:.3f} ms"
              f"  host {host:7.1f} us/call" + ("  (host-bound)" if host / 1e3 > gpu_ms else ""), flush=True)
        if args.parts and i == 0:
            fn()
            parts = parts_us(fn, host_calls)
            rows[-1]["parts_us"] = {k: round(us, 1) for k, (us, _) in parts.items()}
            print("    host us per call (inclusive; times per call): " + ", ".join(
                f"{k} {us:.1f} ({n:g})" for k, (us, n) in parts.items()), flush=True)
        if args.profile and i == 0:
            prof = cProfile.Profile()
            host_us(fn, host_calls, prof)
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
