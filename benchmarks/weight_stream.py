"""How fast HBM gives up weights read the way a GEMM tile walks them, against a linear read.

    python benchmarks/weight_stream.py [--rows R] [--k K] [--json PATH]

A small call of the MoE layer is bound by streaming the expert weights (docs/perf.md), each
SM walking a tile of 128 weight rows along K, a 128 x tile_k box per pipeline stage. This
reads an [R, K] bf16 matrix (the gate and up weights of E64 H2048 I1024 by default: 537 MB)
in that order for several box widths (Triton, plain loads, software pipelined), and linearly,
each program a contiguous range, and prints TB/s: if the narrow boxes read slower than the
linear walk, the DRAM pages each 128-byte piece opens are the limit, not the bytes in flight.
"""
import argparse
import json

import torch
import triton
import triton.language as tl

ap = argparse.ArgumentParser()
ap.add_argument("--rows", type=int, default=64 * 2 * 1024 * 2)  # E64: w_gate and w_up rows
ap.add_argument("--k", type=int, default=2048)
ap.add_argument("--json")
args = ap.parse_args()


@triton.jit
def tile_walk(w, out, K: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr):
    """Program p sums rows [ROWS p, ROWS p + ROWS) box by box along K."""
    p = tl.program_id(0)
    r = p * ROWS + tl.arange(0, ROWS)
    acc = tl.zeros((ROWS,), tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=4):
        acc += tl.sum(tl.load(w + r[:, None] * K + k0 + tl.arange(0, BK)[None, :]).to(tl.float32), axis=1)
    tl.store(out + p, tl.sum(acc))


@triton.jit
def linear_walk(w, out, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums the contiguous elements [CHUNK p, CHUNK p + CHUNK)."""
    p = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in tl.range(0, CHUNK, BLOCK, num_stages=4):
        acc += tl.load(w + p.to(tl.int64) * CHUNK + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out + p, tl.sum(acc))


w = torch.randn(args.rows, args.k, device="cuda", dtype=torch.bfloat16)
nbytes = w.numel() * 2
res = {}
cases = {f"tile 128 x {bk} ({2 * bk} B a row)": (lambda bk=bk: tile_walk[(args.rows // 128,)](
    w, out, args.k, 128, bk, num_warps=8)) for bk in (64, 128, 256)}
cases["linear (8192 B pieces)"] = lambda: linear_walk[(args.rows // 128,)](w, out, 128 * args.k, 4096, num_warps=8)
out = torch.empty(args.rows // 128, device="cuda", dtype=torch.float32)
for name, fn in cases.items():
    ms = triton.testing.do_bench(fn, warmup=20, rep=200)
    res[name] = nbytes / ms / 1e9
    print(f"{name:28s} {ms * 1e3:8.1f} us  {res[name]:.2f} TB/s", flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), bytes=nbytes, tbps=res), f, indent=1)
