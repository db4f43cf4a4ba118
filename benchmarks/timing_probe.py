"""Why does one forward time differently in `mokgen bench` and in the tuner? Times the same
forward (E64 K8 H2048 I1024, T=16384) in one process after each thing the bench does
before it, with the SM clock and power read through NVML next to each figure.

    python benchmarks/timing_probe.py [VARIANT] [T]
"""
import sys
import time

import torch

import mokgen
from mokgen.bench import dense_peak_tflops, time_ms, torch_grouped_mm
from mokgen.reference import moe_reference
from mokgen.verify import make_inputs

name = sys.argv[1] if len(sys.argv) > 1 else "e64_k8_h2048_i1024_bf16_sm90a"
T = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
v = mokgen.load(name)


def state():
    try:
        return f"clock {torch.cuda.clock_rate()} MHz, power {torch.cuda.power_draw() / 1000:.0f} W"
    except Exception as e:  # NVML missing: the figures still count
        return f"(no NVML: {type(e).__name__})"


x, ids, w, wg, wu, wd, _ = make_inputs(v.spec, T, "uniform", torch.Generator("cuda").manual_seed(T))
fwd = lambda: v.forward(x, ids, w, wg, wu, wd)  # noqa: E731
op = lambda: v.ops.forward(x, ids, w, wg, wu, wd)  # noqa: E731
w13 = torch.cat([wg, wu], dim=1)
base = lambda: torch_grouped_mm(x, ids, w, w13, wd, v.spec.intermediate)  # noqa: E731


def probe(what):
    a = time_ms(fwd, 5, 20)
    b = time_ms(fwd, 10, 50)
    c = time_ms(op, 10, 50)
    print(f"{what:34s} forward 5+20 {a:.3f} ms, 10+50 {b:.3f} ms, custom op {c:.3f} ms   {state()}", flush=True)


probe("fresh process")
probe("again")
time.sleep(3)
probe("after 3 s idle")
dense_peak_tflops()
probe("after the dense-GEMM peak")
moe_reference(x, ids, w, wg, wu, wd)
probe("after the float64 reference")
print(f"{'torch grouped_mm':34s} {time_ms(base, 10, 50):.3f} ms   {state()}", flush=True)
probe("after the baseline")
for i in range(3):
    t0 = time.time()
    while time.time() - t0 < 2:
        fwd()
    torch.cuda.synchronize()
    probe(f"after {2 * (i + 1)} s of back-to-back forwards")
print(f"{'torch grouped_mm':34s} {time_ms(base, 10, 50):.3f} ms   {state()}", flush=True)
