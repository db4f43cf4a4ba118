"""Several builds of one FP8 variant side by side in one process: the experts' quantisation
(Variant.quantize_experts_fp8), the forward (forward_fp8) and every gradient (backward_fp8),
each build timed in interleaved rounds (CUDA events, 10 warm-ups, median of 50; the best
round kept per build, so a power-capped clock late in the run favours none), on the same
inputs; and whether every build gives the same bits as the first.

    python benchmarks/compare_fp8_builds.py NAME=DIR [NAME=DIR ...] [--shape 256,8,7168,2048]
                                            [--tokens 8192] [--rounds 3] [--calls quantize,forward,backward]
                                            [--json PATH]

DIR is a variants root (a MOKGEN_HOME: DIR/<variant> is loaded) or a variant's own directory.
The first build is the reference: its quantised experts feed every build's forward and
backward, and each build's outputs are compared with its outputs bit for bit.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mokgen.bench import time_rounds
from mokgen.ir import MoESpec
from mokgen.runtime import Variant
from mokgen.verify import make_inputs


def load(spec: MoESpec, where: str) -> Variant:
    root = Path(where)
    path = root if (root / "manifest.json").exists() else root / spec.variant
    if not (path / "build" / "libmokgen.so").exists():
        raise SystemExit(f"{path}: not built (no build/libmokgen.so)")
    return Variant(path)


def same(a, b) -> bool:
    """Bit for bit, through the tensors of nested results (dicts, tuples, FP8 weights)."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="+", help="NAME=DIR, the first the reference")
    ap.add_argument("--shape", default="256,8,7168,2048", help="E,K,H,I")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", default="quantize,forward,backward")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    E, K, H, I = (int(s) for s in a.shape.split(","))
    spec = MoESpec(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8")
    builds = dict(b.split("=", 1) for b in a.builds)
    variants = {name: load(spec, where) for name, where in builds.items()}
    ref = next(iter(variants.values()))
    g = torch.Generator(device="cuda").manual_seed(a.tokens)
    x, ids, w, wg, wu, wd, _ = make_inputs(MoESpec(experts=E, topk=K, hidden=H, intermediate=I), a.tokens, "uniform",
                                           g)
    dout = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    experts = ref.quantize_experts_fp8(wg, wu, wd)
    calls = dict(quantize=lambda v: v.quantize_experts_fp8(wg, wu, wd),
                 forward=lambda v: v.forward_fp8(x, ids, w, experts),
                 backward=lambda v: v.backward_fp8(dout, x, ids, w, experts))
    rows, table = [], []
    for call in a.calls.split(","):
        fn = calls[call]
        expect = fn(ref)
        torch.cuda.synchronize()
        bits = {name: same(expect, fn(v)) for name, v in variants.items()}
        del expect
        for v in variants.values():
            v.check_errors()
        best = time_rounds({name: (lambda v=v: fn(v)) for name, v in variants.items()}, a.rounds, rows, call=call,
                           tokens=a.tokens)
        first = best[next(iter(best))]
        for name, ms in best.items():
            table.append(dict(call=call, build=name, ms=ms, vs_first=first / ms, same_bits=bits[name]))
            print(f"E{E} K{K} H{H} I{I} T={a.tokens}  {call:9s} {name:12s} {ms:8.3f} ms  "
                  f"{first / ms:5.3f}x the first  same bits: {bits[name]}", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(dict(spec=spec.to_dict(), builds=builds, best=table, rounds=rows), indent=1))


if __name__ == "__main__":
    main()
