"""The FP8 GEMMs (templates/grouped_gemm_fp8.py.j2: gate/up with SwiGLU and h in e4m3, and
down) against the bf16 ones on the same row layout, and the FP8 forward (mokgen.moe_fp8)
against the bf16 one (mokgen.moe), one run: CUDA events, warm-up, median;
TFLOP/s over the routed rows. (The FP8 gate/up reads the rows of x already in dispatch's
order and in e4m3; the bf16 one gathers them from x.)

    python benchmarks/fp8_gemm.py [--tokens 4096,16384] [--shape 64,8,2048,1024]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import mokgen
from mokgen.bench import time_ms as timed
from mokgen.fp8 import interleave_gate_up, quantize_blocks, quantize_rows
from mokgen.ir import MoESpec
from mokgen.verify import make_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_fp8_gpu import row_layout  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--shape", default="64,8,2048,1024")
    a = ap.parse_args()
    E, K, H, I = (int(s) for s in a.shape.split(","))
    v8 = mokgen.load(MoESpec(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8"))
    vb = mokgen.load(MoESpec(experts=E, topk=K, hidden=H, intermediate=I))
    down = vb.launchers["gemm_down"]
    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    for T in (int(t) for t in a.tokens.split(",")):
        g = torch.Generator(device="cuda").manual_seed(T)
        x, ids, _, wg, wu, wd, _ = make_inputs(vb.spec, T, "uniform", g)
        rows, tile_expert, row_expert = row_layout(ids.cpu(), E)
        h = torch.randn(rows, I, device="cuda", generator=g)
        h[row_expert.cuda() < 0] = 0.0
        h_q, h_s = quantize_rows(h)
        w_q, w_s = quantize_blocks(wd)
        y8 = torch.empty(rows, H, dtype=torch.bfloat16, device="cuda")
        env = dict(h_q=h_q, h_scales=h_s, w_down_q=w_q, w_down_scales=w_s,
                   tile_expert=tile_expert.cuda(), y=y8)
        fp8_ms = timed(lambda: v8.run("gemm_down_fp8", env, dev))
        hb = h.bfloat16()
        row_token = torch.where(row_expert >= 0, 0, -1).to(torch.int32).cuda()  # (valid rows; the A rows are h's)
        counters = torch.zeros(down.args[4]["shape"][0], dtype=torch.int32, device="cuda")
        yb = torch.empty(rows, H, dtype=torch.bfloat16, device="cuda")
        te = tile_expert.cuda()

        def bf16():
            counters.zero_()  # (dispatch zeroes the tile scheduler's counter in a real call)
            down([hb, row_token, wd, te, counters, yb], stream)

        bf16_ms = timed(bf16)
        fl = 2.0 * T * K * H * I
        print(f"E{E} K{K} H{H} I{I} T={T}: down GEMM fp8 {fp8_ms:.3f} ms ({fl / fp8_ms / 1e9:.0f} TFLOP/s)  "
              f"bf16 {bf16_ms:.3f} ms ({fl / bf16_ms / 1e9:.0f} TFLOP/s)  fp8 / bf16 speed {bf16_ms / fp8_ms:.2f}x",
              flush=True)
        # gate/up
        xr = torch.randn(rows, H, device="cuda", generator=g)
        xr[row_expert.cuda() < 0] = 0.0
        xq, xs = quantize_rows(xr)
        w13q, w13s = quantize_blocks(interleave_gate_up(wg, wu))
        hq = torch.empty(rows, I, dtype=torch.float8_e4m3fn, device="cuda")
        hs = torch.empty(rows, I // 128, device="cuda")
        genv = dict(x_rows_q=xq, x_rows_scales=xs, w13_q=w13q, w13_scales=w13s, tile_expert=te, h_q=hq, h_scales=hs)
        fp8_gu = timed(lambda: v8.run("gemm_gateup_fp8", genv, dev))
        gateup = vb.launchers["gemm_gateup"]
        tokens = torch.where(row_expert >= 0, torch.arange(rows) % max(T, 1), -1).to(torch.int32).cuda()
        hb16 = torch.empty(rows, I, dtype=torch.bfloat16, device="cuda")

        def bf16_gu():
            counters.zero_()
            gateup([x, tokens, wg, wu, te, counters, hb16], stream)

        bf16_gu_ms = timed(bf16_gu)
        fl2 = 2 * fl
        print(f"E{E} K{K} H{H} I{I} T={T}: gate/up GEMM fp8 {fp8_gu:.3f} ms ({fl2 / fp8_gu / 1e9:.0f} TFLOP/s)  "
              f"bf16 {bf16_gu_ms:.3f} ms ({fl2 / bf16_gu_ms / 1e9:.0f} TFLOP/s)  fp8 / bf16 speed "
              f"{bf16_gu_ms / fp8_gu:.2f}x", flush=True)
        # the layer: mokgen.moe_fp8 against mokgen.moe (bf16), the same routing
        from mokgen.fp8 import quantize_experts

        w = torch.softmax(torch.randn(T, K, device="cuda", generator=g), -1)
        experts = quantize_experts(wg, wu, wd)
        with torch.no_grad():
            layer8 = timed(lambda: mokgen.moe_fp8(x, ids, w, experts, check_ids=False))
            layer16 = timed(lambda: mokgen.moe(x, ids, w, wg, wu, wd, check_ids=False))
        fl3 = 3 * fl
        print(f"E{E} K{K} H{H} I{I} T={T}: forward fp8 {layer8:.3f} ms ({fl3 / layer8 / 1e9:.0f} TFLOP/s)  "
              f"bf16 {layer16:.3f} ms ({fl3 / layer16 / 1e9:.0f} TFLOP/s)  fp8 / bf16 speed {layer16 / layer8:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
