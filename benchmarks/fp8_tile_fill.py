"""What a partly filled M tile costs: the FP8 GEMMs alone (and the bf16 ones on the same row
layout: benchmarks/fp8_gemm.py's `gemms`) with every expert given exactly c rows, so every
expert has the same M tiles: c // 128 full ones and, if c % 128, one holding c % 128 rows.

    python benchmarks/fp8_tile_fill.py [--rows 256,272,320,384] [--shape 256,8,7168,2048] [--json PATH]

c = 0 is the benchmark's uniform random routing at T = 8192. Tokens T = c E / K (each token's K
ids are consecutive experts mod E). Comparing c = 256 (2 full tiles per expert), 272 (2 full
and one of 16 rows) and 384 (3 full) prices the tail tile against a full one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mokgen  # noqa: E402
from fp8_gemm import gemms  # noqa: E402
from mokgen.bench import gpu_state  # noqa: E402
from mokgen.ir import MoESpec  # noqa: E402
from mokgen.verify import make_inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="128,192,256,272,320,384", help="rows per expert, c (0: random routing)")
    ap.add_argument("--shape", default="256,8,7168,2048", help="E,K,H,I")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    E, K, H, I = (int(s) for s in a.shape.split(","))
    v8 = mokgen.load(MoESpec(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8"))
    vb = mokgen.load(MoESpec(experts=E, topk=K, hidden=H, intermediate=I))
    g = torch.Generator(device="cuda").manual_seed(0)
    _, _, _, wg, wu, wd, _ = make_inputs(vb.spec, 1, "uniform", g)
    out = []
    for c in (int(s) for s in a.rows.split(",")):
        if c == 0:
            T = 8192
            x, ids = make_inputs(vb.spec, T, "uniform", g)[:2]
        else:
            if c * E % K:
                raise SystemExit(f"--rows {c}: c E = {c * E} is not a multiple of K = {K}")
            T = c * E // K
            x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
            ids = (torch.arange(T * K, device="cuda") % E).view(T, K).to(torch.int32)
        for r in gemms(v8, vb, T, x, ids, wg, wu, wd, g):
            r.update(rows_per_expert=c, full_tiles=c // 128, tail_rows=c % 128)
            print(f"c={c:4d} ({c // 128} full tiles + {c % 128:3d} rows)  {r['impl']:18s} {r['ms']:.3f} ms",
                  flush=True)
            out.append(r)
        torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(dict(shape=[E, K, H, I], gpu=gpu_state(), rows=out), indent=1))


if __name__ == "__main__":
    main()
