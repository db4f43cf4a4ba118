"""Random legal specs, golden on the GPU ([hardening]): build N specs drawn from a seeded
generator (here, with CuTe-DSL), keep only what the runtime loads, then check each on the
GPU against the float64 reference at several T, uniform and skewed routing.

    python benchmarks/random_specs.py build N DIR [--seed S]    # no GPU needed
    python benchmarks/random_specs.py check DIR [--json PATH]   # on the GPU

The draw always includes the edge cases E=1, K=1, K=E and sizes that are not powers of
two; sizes stay small enough that 50 specs build in minutes. Results are printed as they
come, so a run cut short still reports what it checked.
"""
import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

from mokgen.ir import MoESpec

EDGE = [
    dict(experts=1, topk=1, hidden=64, intermediate=64),
    dict(experts=5, topk=5, hidden=320, intermediate=192),  # K = E, odd sizes
    dict(experts=3, topk=1, hidden=576, intermediate=448, shared_intermediate=320),
    dict(experts=64, topk=8, hidden=1088, intermediate=704),  # 17 and 11 times 64
]


def draw_specs(n: int, seed: int) -> list[MoESpec]:
    rng = random.Random(seed)
    specs, seen = [], set()
    for kw in EDGE:
        specs.append(MoESpec(**kw))
    while len(specs) < n:
        E = rng.choice([rng.randint(1, 8), rng.randint(1, 96)])
        K = rng.choice([1, E, rng.randint(1, min(E, 8))])
        kw = dict(experts=E, topk=min(K, 64), hidden=64 * rng.randint(1, 32), intermediate=64 * rng.randint(1, 32),
                  shared_intermediate=rng.choice([0, 0, 64 * rng.randint(1, 16)]), renormalize=rng.random() < 0.3)
        spec = MoESpec(**kw)
        if spec.variant not in seen:
            seen.add(spec.variant)
            specs.append(spec)
    return specs[:n]


def build(n: int, out: Path, seed: int) -> None:
    from mokgen.codegen import build as build_variant

    out.mkdir(parents=True, exist_ok=True)
    specs = draw_specs(n, seed)
    t0 = time.time()
    for i, spec in enumerate(specs):
        path = build_variant(spec, out, log=lambda m: None)
        # Only the manifest and the library travel; the sources and objects stay here.
        for p in path.iterdir():
            if p.is_dir() and p.name == "build":
                for f in p.iterdir():
                    if f.name != "libmokgen.so":
                        f.unlink()
            elif p.name != "manifest.json":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        print(f"[{i + 1}/{len(specs)}] {spec.variant} ({time.time() - t0:.0f} s)", flush=True)


def check(out: Path, json_path: str | None) -> int:
    import torch

    from mokgen.runtime import Variant
    from mokgen.verify import check_forward, make_inputs

    rows, failed = [], 0
    dirs = sorted(p for p in out.iterdir() if (p / "manifest.json").exists())
    for i, path in enumerate(dirs):
        v = Variant(path)
        empty = make_inputs(v.spec, 0, "uniform")
        ok0 = v.forward(*empty[:6], *empty[6]).shape == (0, v.spec.hidden)
        for T in (1, 7, 130):
            for routing in ("uniform", "skewed"):
                r = check_forward(v, T, routing, torch.Generator("cuda").manual_seed(1000 * i + T))
                rows.append(dict(variant=v.name, T=T, routing=routing, rel_error=r.rel_error, ok=r.ok and ok0))
                failed += not rows[-1]["ok"]
        worst = max(r["rel_error"] for r in rows if r["variant"] == v.name)
        print(f"[{i + 1}/{len(dirs)}] {v.name}: worst rel_error {worst:.2e}, T=0 {'ok' if ok0 else 'WRONG'}",
              flush=True)
    print(f"{len(dirs)} specs, {len(rows)} golden checks, {failed} failed", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["build", "check"])
    ap.add_argument("args", nargs="+")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.what == "build":
        build(int(a.args[0]), Path(a.args[1]), a.seed)
    else:
        sys.exit(check(Path(a.args[0]), a.json))
