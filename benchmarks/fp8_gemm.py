"""The FP8 GEMMs (templates/grouped_gemm_fp8.py.j2: gate/up with SwiGLU and h in e4m3, and
down) against the bf16 ones on the same row layout, and the FP8 forward (mokgen.moe_fp8)
against the bf16 one (mokgen.moe), one run: CUDA events, warm-up, median;
TFLOP/s over the routed rows. (The FP8 gate/up reads the rows of x already in dispatch's
order and in e4m3; the bf16 one gathers them from x.)

    python benchmarks/fp8_gemm.py [--tokens 4096,16384] [--shape 64,8,2048,1024] [--layer-only]
                                  [--backward] [--train] [--json fp8.json] [--fp8-dir DIR]

--fp8-dir times the FP8 variant built in DIR (an experiment's overrides) instead of the default.
--backward also times the FP8 backward's data gradients (Variant.backward_data_fp8: dx and
d_topk_weights, recomputing the forward's products) against torch's bf16 autograd of the same
gradients (the weights frozen, the forward's activations saved).
--train times forward + backward through autograd: mokgen.moe_fp8_train (the experts quantised
on each call, and quantised once as over one optimizer step's micro-batches; every gradient in
FP8), mokgen.moe (bf16) and torch grouped_mm, 18 T K H I FLOPs; and, alone, the experts'
quantisation and the FP8 backward's kernels.

The layer's line also times torch grouped_mm (bf16, mokgen/bench.py's baseline) in the same run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import mokgen
from mokgen.bench import baseline_weights, dense_peak_tflops, e4m3_peak_tflops, gpu_state, time_ms as timed
from mokgen.module import torch_grouped_mm
from mokgen.fp8 import interleave_gate_up, quantize_blocks, quantize_rows
from mokgen.ir import MoESpec
from mokgen.verify import make_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_fp8_gpu import row_layout, tile_counters, token_rows  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--shape", default="64,8,2048,1024")
    ap.add_argument("--layer-only", action="store_true", help="time only the layers, not the GEMMs alone")
    ap.add_argument("--backward", action="store_true", help="also time the FP8 backward's data gradients")
    ap.add_argument("--train", action="store_true", help="also time forward + backward through autograd")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--fp8-dir", type=Path, help="the FP8 variant's directory (default: the built variant)")
    a = ap.parse_args()
    rows = []
    peaks = dict(bf16=dense_peak_tflops(), e4m3=e4m3_peak_tflops())
    print(f"measured dense GEMM peaks (8192^3): bf16 {peaks['bf16']:.0f} TFLOP/s, e4m3 "
          + (f"{peaks['e4m3']:.0f} TFLOP/s" if peaks["e4m3"] else "n/a (torch._scaled_mm unavailable)"), flush=True)
    E, K, H, I = (int(s) for s in a.shape.split(","))
    v8 = mokgen.load(a.fp8_dir or MoESpec(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8"))
    vb = mokgen.load(MoESpec(experts=E, topk=K, hidden=H, intermediate=I))
    for T in (int(t) for t in a.tokens.split(",")):
        g = torch.Generator(device="cuda").manual_seed(T)
        x, ids, _, wg, wu, wd, _ = make_inputs(vb.spec, T, "uniform", g)
        fl = 2.0 * T * K * H * I
        if not a.layer_only:
            rows += gemms(v8, vb, T, x, ids, wg, wu, wd, g)
        rows += layers(v8, T, x, ids, wg, wu, wd, g, 3 * fl)
        if a.backward:
            rows += backward_data(v8, T, x, ids, wg, wu, wd, g, fl)
        if a.train:
            rows += training(T, x, ids, wg, wu, wd, g, 9 * fl)
        torch.cuda.empty_cache()
    print(f"{'impl':32s} {'T':>6s} {'ms':>8s} {'TFLOP/s':>8s} {'% of dense peak':>16s}")
    for r in rows:  # % of the measured dense peak of the dtype the implementation computes in
        peak = peaks["e4m3" if "fp8" in r["impl"] else "bf16"]
        if peak and "tflops" in r:
            r["pct_of_dense_peak"] = 100.0 * r["tflops"] / peak
        print(f"{r['impl']:32s} {r['T']:6d} {r['ms']:8.3f} {r.get('tflops', float('nan')):8.0f} "
              f"{r.get('pct_of_dense_peak', float('nan')):15.0f}%")
    if a.json:
        a.json.write_text(json.dumps(dict(shape=[E, K, H, I], gpu=gpu_state(), dense_peak_tflops=peaks, rows=rows),
                                     indent=1))


def gemms(v8, vb, T, x, ids, wg, wu, wd, g):
    """The FP8 GEMMs alone against the bf16 ones on the same row layout."""
    E, K, H, I = vb.spec.experts, vb.spec.topk, vb.spec.hidden, vb.spec.intermediate
    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    down = vb.launchers["gemm_down"]
    rows, tile_expert, row_expert = row_layout(ids.cpu(), E)
    h = torch.randn(rows, I, device="cuda", generator=g)
    h[row_expert.cuda() < 0] = 0.0
    h_q, h_s = quantize_rows(h)
    w_q, w_s = quantize_blocks(wd)
    y8 = torch.empty(rows, H, dtype=torch.bfloat16, device="cuda")
    row_token = token_rows(row_expert)  # (which rows hold tokens; the A rows are h's)
    env = dict(h_q=h_q, h_scales=h_s, w_down_q=w_q, w_down_scales=w_s,
               tile_expert=tile_expert.cuda(), row_token=row_token, y=y8)
    env["tile_counters"] = tile_counters(v8)

    def fp8_down():
        env["tile_counters"].zero_()  # (dispatch zeroes the unit counters in a real call)
        v8.run("gemm_down_fp8", env, dev)

    fp8_ms = timed(fp8_down)
    hb = h.bfloat16()
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
    genv = dict(x_rows_q=xq, x_rows_scales=xs, w13_q=w13q, w13_scales=w13s, tile_expert=te, row_token=row_token,
                h_q=hq, h_scales=hs)
    genv["tile_counters"] = env["tile_counters"]

    def fp8_gateup():
        genv["tile_counters"].zero_()
        v8.run("gemm_gateup_fp8", genv, dev)

    fp8_gu = timed(fp8_gateup)
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
    return [dict(T=T, impl=n, ms=ms, tflops=f / ms / 1e9) for n, ms, f in
            (("gemm_down_fp8", fp8_ms, fl), ("gemm_down_bf16", bf16_ms, fl), ("gemm_gateup_fp8", fp8_gu, fl2),
             ("gemm_gateup_bf16", bf16_gu_ms, fl2))]


def layers(v8, T, x, ids, wg, wu, wd, g, flops):
    """The layer: the FP8 variant's forward (mokgen.moe_fp8 without its input checks) against
    mokgen.moe (bf16) and torch grouped_mm, the same routing."""
    from mokgen.fp8 import quantize_experts

    E, K = wg.shape[0], ids.shape[1]
    H, I = x.shape[1], wg.shape[1]
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=g), -1)
    experts = quantize_experts(wg, wu, wd)
    w13, _ = baseline_weights(wg, wu)
    with torch.no_grad():
        ms = dict(mokgen_fp8=timed(lambda: v8.forward_fp8(x, ids, w, experts)),
                  mokgen_bf16=timed(lambda: mokgen.moe(x, ids, w, wg, wu, wd, check_ids=False)),
                  torch_grouped_mm=timed(lambda: torch_grouped_mm(x, ids, w, w13, wd, I, None), 3, 10))
    st = gpu_state()
    print(f"E{E} K{K} H{H} I{I} T={T}: forward fp8 {ms['mokgen_fp8']:.3f} ms "
          f"({flops / ms['mokgen_fp8'] / 1e9:.0f} TFLOP/s)  bf16 {ms['mokgen_bf16']:.3f} ms "
          f"({flops / ms['mokgen_bf16'] / 1e9:.0f})  torch grouped_mm {ms['torch_grouped_mm']:.3f} ms  "
          f"fp8 / bf16 speed {ms['mokgen_bf16'] / ms['mokgen_fp8']:.2f}x, fp8 / torch "
          f"{ms['torch_grouped_mm'] / ms['mokgen_fp8']:.2f}x  ({st.get('sm_clock_mhz')} MHz, {st.get('power_w')} W)",
          flush=True)
    return [dict(T=T, impl=f"forward_{n}", ms=v, tflops=flops / v / 1e9) for n, v in ms.items()]


def backward_data(v8, T, x, ids, wg, wu, wd, g, fl):
    """dx and d_topk_weights: the FP8 backward (10 T K H I FLOPs with its recompute of the
    gate/up products) against torch's autograd of the bf16 layer for the same two gradients
    (6 T K H I: it saved the forward's activations)."""
    from mokgen.fp8 import quantize_experts

    E, K = wg.shape[0], ids.shape[1]
    H, I = x.shape[1], wg.shape[1]
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=g), -1)
    dout = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    experts = quantize_experts(wg, wu, wd)
    w13, _ = baseline_weights(wg, wu)
    fp8 = timed(lambda: v8.backward_data_fp8(dout, x, ids, w, experts))
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = torch_grouped_mm(xr, ids, wr, w13, wd, I, None)
    torch_ms = timed(lambda: torch.autograd.grad(out, (xr, wr), dout, retain_graph=True), 3, 10)
    print(f"E{E} K{K} H{H} I{I} T={T}: backward dx, d_topk_weights fp8 {fp8:.3f} ms ({10 * fl / 2 / fp8 / 1e9:.0f} "
          f"TFLOP/s)  torch grouped_mm autograd {torch_ms:.3f} ms  fp8 / torch {torch_ms / fp8:.2f}x", flush=True)
    return [dict(T=T, impl="backward_data_fp8", ms=fp8, tflops=5 * fl / fp8 / 1e9),
            dict(T=T, impl="backward_data_torch_grouped_mm", ms=torch_ms, tflops=3 * fl / torch_ms / 1e9)]


def training(T, x, ids, wg, wu, wd, g, flops):
    """Forward + backward through autograd (gradients reset between calls): the FP8 layer over
    bf16 master weights (quantised on each call, as a training step without gradient
    accumulation must; and quantised once, as over the micro-batches of one optimizer step),
    the bf16 layer, and torch grouped_mm (mokgen.module.experts_torch)."""
    from mokgen.module import experts_torch

    E, K = wg.shape[0], ids.shape[1]
    H, I = x.shape[1], wg.shape[1]
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=g), -1)
    dout = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    leaves = [t.clone().requires_grad_() for t in (x, w, wg, wu, wd)]
    once = mokgen.quantize_experts_fp8(wg, wu, wd, K)  # (once per optimizer step, over several micro-batches)
    impls = dict(train_mokgen_fp8=lambda: mokgen.moe_fp8_train(leaves[0], ids, *leaves[1:], check_ids=False),
                 train_mokgen_fp8_quantised_once=lambda: mokgen.moe_fp8_train(leaves[0], ids, *leaves[1:],
                                                                              experts=once, check_ids=False),
                 train_mokgen_bf16=lambda: mokgen.moe(leaves[0], ids, *leaves[1:], check_ids=False),
                 train_torch_grouped_mm=lambda: experts_torch(leaves[0], ids, *leaves[1:]))
    # Where the FP8 step's time goes: the experts' quantisation (every call of moe_fp8_train:
    # the variant's kernels) and the backward's kernels alone (Variant.backward_fp8: every gradient).
    v8 = mokgen.load(MoESpec(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8"))
    experts = v8.quantize_experts_fp8(wg, wu, wd)
    _, a13 = v8.forward_fp8(x, ids, w, experts, save=True)  # (the products the training forward saves)
    rows = [dict(T=T, impl="quantize_experts_fp8", ms=timed(lambda: v8.quantize_experts_fp8(wg, wu, wd))),
            dict(T=T, impl="backward_fp8", ms=timed(lambda: v8.backward_fp8(dout, x, ids, w, experts, a13=a13)))]
    rows[1]["tflops"] = 6 * flops / 9 / rows[1]["ms"] / 1e9
    experts = a13 = None
    for name, fn in impls.items():
        def call():
            for t in leaves:
                t.grad = None
            fn().backward(dout)

        ms = timed(call, 3, 10) if "torch" in name else timed(call)
        rows.append(dict(T=T, impl=name, ms=ms, tflops=flops / ms / 1e9))
    ms = {r["impl"]: r["ms"] for r in rows}
    print(f"E{E} K{K} H{H} I{I} T={T}: forward + backward fp8 {ms['train_mokgen_fp8']:.3f} ms  bf16 "
          f"{ms['train_mokgen_bf16']:.3f} ms  torch grouped_mm {ms['train_torch_grouped_mm']:.3f} ms  fp8 / bf16 "
          f"{ms['train_mokgen_bf16'] / ms['train_mokgen_fp8']:.2f}x, fp8 / torch "
          f"{ms['train_torch_grouped_mm'] / ms['train_mokgen_fp8']:.2f}x  (of the fp8 step: quantising the experts "
          f"{ms['quantize_experts_fp8']:.3f} ms, the backward's kernels {ms['backward_fp8']:.3f} ms); quantised once "
          f"per optimizer step: fp8 {ms['train_mokgen_fp8_quantised_once']:.3f} ms, fp8 / bf16 "
          f"{ms['train_mokgen_bf16'] / ms['train_mokgen_fp8_quantised_once']:.2f}x", flush=True)
    return rows


if __name__ == "__main__":
    main()
