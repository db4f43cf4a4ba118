"""Where an FP8 layer's time goes, kernel by kernel: the forward (mokgen.moe_fp8), every
gradient (Variant.backward_fp8) and the experts' quantisation (Variant.quantize_experts_fp8),
each run warm, then once under torch.profiler; prints each kernel's CUDA time.

    python benchmarks/profile_fp8.py [--shape 256,8,7168,2048] [--tokens 8192]
"""
from __future__ import annotations

import argparse

import torch

import mokgen
from mokgen.ir import MoESpec
from mokgen.verify import make_inputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="256,8,7168,2048")
    ap.add_argument("--tokens", type=int, default=8192)
    a = ap.parse_args()
    E, K, H, I = (int(s) for s in a.shape.split(","))
    v = mokgen.load(MoESpec(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8"))
    g = torch.Generator(device="cuda").manual_seed(a.tokens)
    x, ids, w, wg, wu, wd, _ = make_inputs(MoESpec(experts=E, topk=K, hidden=H, intermediate=I), a.tokens, "uniform",
                                           g)
    experts = v.quantize_experts_fp8(wg, wu, wd)
    dout = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    calls = dict(forward=lambda: v.forward_fp8(x, ids, w, experts),
                 backward_fp8=lambda: v.backward_fp8(dout, x, ids, w, experts),
                 quantize_experts=lambda: v.quantize_experts_fp8(wg, wu, wd))
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.device_time for e in events) / 1e3
        print(f"E{E} K{K} H{H} I{I} T={a.tokens} {name}: {total:.3f} ms of GPU time in {len(events)} kernels and copies")
        by = {}
        for e in events:
            by.setdefault(e.name, []).append(e.device_time / 1e3)
        for k, ts in sorted(by.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {sum(ts):9.3f} ms  x{len(ts):<3d} {k[:100]}")


if __name__ == "__main__":
    main()
