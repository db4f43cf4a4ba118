"""Per-kernel GPU time of one variant's entry point (torch.profiler), and the idle gaps
between kernels on the device timeline, to see where time goes.

    python benchmarks/profile_stages.py [VARIANT] [T] [ENTRY] [--graph]

VARIANT: a built variant's name, or the path of a build directory (an experiment's, say
generated/experiments/chunked/e64_k8_h2048_i1024_bf16_sm90a).

ENTRY: forward (default), forward_train, backward (the SwiGLU inputs saved by
forward_train) or backward_recompute. --graph: time replays of a CUDA graph of the call (as
`mokgen bench` does) instead of eager calls, so the gaps are the device's own.
"""
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import mokgen
from mokgen.runtime import Variant
from mokgen.verify import make_inputs

graph = "--graph" in sys.argv
argv = [a for a in sys.argv if a != "--graph"]
name = argv[1] if len(argv) > 1 else "e64_k8_h2048_i1024_bf16_sm90a"
T = int(argv[2]) if len(argv) > 2 else 16384
entry = argv[3] if len(argv) > 3 else "forward"
v = Variant(Path(name)) if Path(name, "manifest.json").exists() else mokgen.load(name)
gen = torch.Generator("cuda").manual_seed(0)
x, ids, w, wg, wu, wd, (sg, su, sd) = make_inputs(v.spec, T, "uniform", gen)
dout = torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype)
saved = v.forward_train(x, ids, w, wg, wu, wd, sg, su, sd)[1:] if entry == "backward" else None
calls = {"forward": lambda: v.forward(x, ids, w, wg, wu, wd, sg, su, sd),
         "forward_train": lambda: v.forward_train(x, ids, w, wg, wu, wd, sg, su, sd),
         "backward": lambda: v.backward(dout, x, ids, w, wg, wu, wd, sg, su, sd, saved=saved),
         "backward_recompute": lambda: v.backward(dout, x, ids, w, wg, wu, wd, sg, su, sd)}
if entry not in calls:
    sys.exit(f"unknown entry {entry!r}; one of {', '.join(calls)}")
if entry == "forward":
    entry = v.forward_entry(T)
call = calls[entry if entry in calls else "forward"]
if graph:
    from mokgen.bench import _capture

    call = _capture(call).replay
for _ in range(5):
    call()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        call()
    torch.cuda.synchronize()

# The generated kernels only (CuTe-DSL names them kernel_...; torch's allocations and fills
# of the outputs are other kernels).
kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and e.name.startswith("kernel_")), key=lambda e: e.time_range.start)
steps = list(v.plan["steps"][entry])
if any(k["name"] == "status_mirror" for k in v.plan["kernels"]):
    steps.append("status_mirror")  # the runtime's one-thread launch behind every call (its error code)
per_stage, gaps = {}, {}
for i, e in enumerate(kernels):
    stage = steps[i % len(steps)]
    per_stage.setdefault(stage, []).append(e.time_range.end - e.time_range.start)
    if i:
        gaps.setdefault(stage, []).append(e.time_range.start - kernels[i - 1].time_range.end)
print(f"{name} T={T} {entry}{' (graph replays)' if graph else ''}: device time per call (median of 10), and the idle gap before each kernel")
total = 0.0
for stage in steps:
    d = statistics.median(per_stage.get(stage, [0]))
    g = statistics.median(gaps.get(stage, [0]))
    total += d + g
    print(f"  {stage:16s} {d:9.1f} us   gap before {g:7.1f} us")
print(f"  {'sum':16s} {total:9.1f} us")
