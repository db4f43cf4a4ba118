"""Per-kernel GPU time of one variant's forward (torch.profiler), and the idle gaps
between kernels on the device timeline, to see where time goes.

    python benchmarks/profile_stages.py [VARIANT] [T]
"""
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mokgen
from mokgen.verify import make_inputs

name = sys.argv[1] if len(sys.argv) > 1 else "e64_k8_h2048_i1024_bf16_sm90a"
T = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
v = mokgen.load(name)
x, ids, w, wg, wu, wd, (sg, su, sd) = make_inputs(v.spec, T, "uniform", torch.Generator("cuda").manual_seed(0))
for _ in range(5):
    v.forward(x, ids, w, wg, wu, wd, sg, su, sd)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        v.forward(x, ids, w, wg, wu, wd, sg, su, sd)
    torch.cuda.synchronize()

kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
stages = [k["name"] for k in v.plan["kernels"] if k["name"] in v.plan["steps"]["forward"]]
per_stage, gaps = {}, {}
for i, e in enumerate(kernels):
    stage = v.plan["steps"]["forward"][i % len(v.plan["steps"]["forward"])]
    per_stage.setdefault(stage, []).append(e.time_range.end - e.time_range.start)
    if i:
        gaps.setdefault(stage, []).append(e.time_range.start - kernels[i - 1].time_range.end)
print(f"{name} T={T}: device time per forward (median of 10), and the idle gap before each kernel")
total = 0.0
for stage in v.plan["steps"]["forward"]:
    d = statistics.median(per_stage.get(stage, [0]))
    g = statistics.median(gaps.get(stage, [0]))
    total += d + g
    print(f"  {stage:16s} {d:9.1f} us   gap before {g:7.1f} us")
print(f"  {'sum':16s} {total:9.1f} us")
