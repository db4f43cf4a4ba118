"""The fused-GEMM launch (gate/up and down in one persistent kernel, linked by device
counters) against the multi-kernel path and torch grouped_mm, side by side in one process.
CUDA-graph replay times (no launch overhead), 10 warm-ups and the median of 50, with the SM
clock and power after each.

    python benchmarks/fused_vs_multikernel.py [T,T,...] [--json PATH]
"""
import json
import sys

import torch

import mokgen
from mokgen.bench import _capture, gpu_state, time_ms, torch_grouped_mm
from mokgen.runtime import Variant
from mokgen.verify import make_inputs

sys.path.insert(0, "tests")
from test_golden_gpu import SHAPES, fused_dir, spec_of  # noqa: E402

tokens = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-")
                           else "64,256,1024,4096,16384").split(",")]
json_path = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
spec = spec_of(SHAPES[0])
plain = mokgen.load(spec)
fused = Variant(fused_dir() / spec.variant)
rows = []
for T in tokens:
    x, ids, w, wg, wu, wd, _ = make_inputs(spec, T, "uniform", torch.Generator("cuda").manual_seed(T))
    w13 = torch.cat([wg, wu], dim=1)
    impls = {
        "multi_kernel": _capture(lambda: plain.forward(x, ids, w, wg, wu, wd)).replay,
        "fused_gemms": _capture(lambda: fused.forward(x, ids, w, wg, wu, wd)).replay,
        "torch_grouped_mm": lambda: torch_grouped_mm(x, ids, w, w13, wd, spec.intermediate),
    }
    res = {}
    for name, fn in impls.items():
        res[name] = time_ms(fn, 10, 50)
        rows.append(dict(T=T, impl=name, ms=res[name], **gpu_state()))
    print(f"T={T:6d}  multi-kernel {res['multi_kernel']:.3f} ms  fused {res['fused_gemms']:.3f} ms "
          f"({res['multi_kernel'] / res['fused_gemms']:.2f}x)  torch grouped_mm {res['torch_grouped_mm']:.3f} ms "
          f"(fused {res['torch_grouped_mm'] / res['fused_gemms']:.2f}x, multi-kernel "
          f"{res['torch_grouped_mm'] / res['multi_kernel']:.2f}x)", flush=True)
if json_path:
    with open(json_path, "w") as f:
        json.dump(dict(variant=spec.variant, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
