"""Per-kernel GPU time of one variant's forward (torch.profiler), to see where time goes.

    python benchmarks/profile_stages.py [VARIANT] [T]
"""
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
print(f"{name} T={T}: per-kernel CUDA time, 10 forwards")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
