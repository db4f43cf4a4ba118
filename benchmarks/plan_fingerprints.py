"""Fingerprints of many Plans, to prove that a change to the planning code changes no Plan.

    python benchmarks/plan_fingerprints.py write OUT.json [--seeds 1,2,3,1206] [--per-seed 40]
    python benchmarks/plan_fingerprints.py compare BEFORE.json AFTER.json

`write` makes the Plan of every spec in the set below and stores the SHA-256 of its JSON in
the Plan's own key order (so a reordered parameter counts as a change: templates see the
order), or the error a refused spec raises:
  - every variant built under generated/ (MOKGEN_HOME), with the overrides its manifest records
    (experiment, debug and profiling builds among them);
  - each preset, and each with every tuning candidate of `mokgen tune`;
  - random legal specs (benchmarks/random_specs.py's draw) and, of each, its FP8 twin and its
    twins over 2 and 4 GPUs linked by NVLink where the spec allows them.
No GPU and no compiler are needed (about 3 minutes for the default set on two cores). Run it
before a refactor, again after, then `compare`: it lists every case whose Plan (or error)
differs or that only one side has, and exits 1 if there is any.

`write --sources` fingerprints each Plan's rendered source tree too (every kernel module and
the launch shim; not manifest.json, which records the templates' own hashes): the guard of a
refactor of the templates, which must render every variant byte for byte as before.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from mokgen.codegen import default_out
from mokgen.codegen.render import render
from mokgen.ir import PRESETS, MoESpec
from mokgen.schedule.plan import make_plan
from mokgen.tune import candidates

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_specs import draw_specs  # noqa: E402


def fingerprint(spec: MoESpec, overrides: dict | None, sources: bool = False) -> str:
    """The Plan's SHA-256 (its JSON in the Plan's key order), or the error that refuses it;
    sources: then, after a space, the SHA-256 of its rendered source tree but manifest.json."""
    try:
        plan = make_plan(spec, overrides=overrides or None)
    except Exception as e:  # (a refused spec must stay refused with the same words)
        return f"error {type(e).__name__}: {e}"
    digest = hashlib.sha256(json.dumps(plan.to_dict(), default=str).encode()).hexdigest()
    if not sources:
        return digest
    tree = hashlib.sha256()
    for path, text in sorted(render(plan).items()):
        if path != "manifest.json":
            tree.update(f"{path}\0{len(text)}\0".encode() + text.encode())
    return f"{digest} {tree.hexdigest()}"


def cases(seeds: list[int], per_seed: int) -> list[tuple[str, MoESpec, dict | None]]:
    out = []
    home = default_out()
    for manifest in sorted(home.glob("**/manifest.json")):
        m = json.loads(manifest.read_text())
        out.append((f"built:{manifest.parent.relative_to(home)}", MoESpec.from_dict(m["spec"]),
                    m["plan"].get("overrides")))
    for name, spec in sorted(PRESETS.items()):
        out.append((f"preset:{name}", spec, None))
        out += [(f"preset:{name}:candidate{i}", spec, c) for i, c in enumerate(candidates(spec))]
    for seed in seeds:
        for i, spec in enumerate(draw_specs(per_seed, seed)):
            out.append((f"random{seed}:{i}", spec, None))
            for tag, change in [("fp8", dict(dtype="fp8"))] + [
                    (f"w{w}", dict(world_size=w, topology="nvlink")) for w in (2, 4)]:
                try:
                    twin = MoESpec.from_dict(dict(spec.to_dict(), **change))
                except ValueError:  # (an illegal twin, say E not divisible by the GPUs)
                    continue
                out.append((f"random{seed}:{i}:{tag}", twin, None))
    return out


def what_differs(a: str, b: str) -> str:
    """Which part of two fingerprints differs: the Plan (or its refusal) or only its sources."""
    (plan_a, _, src_a), (plan_b, _, src_b) = (x.partition(" ") for x in (a, b))
    if a.startswith("error") or b.startswith("error") or plan_a != plan_b:
        return "the Plan"
    return "the rendered sources" if src_a and src_b else "sources fingerprinted on one side only"


def compare(before: dict, after: dict) -> list[str]:
    """One line per case that differs or that only one side has."""
    lines = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a != b:
            lines.append(f"{key}: " + ("only after" if a is None else "only before" if b is None else
                                       f"{what_differs(a, b)}: {a[:70]} -> {b[:70]}"))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="fingerprint every case into OUT.json")
    w.add_argument("out")
    w.add_argument("--seeds", default="1,2,3,1206", help="random_specs.py seeds (comma-separated)")
    w.add_argument("--per-seed", type=int, default=40, help="random specs per seed")
    w.add_argument("--sources", action="store_true",
                   help="fingerprint each Plan's rendered source tree too (the guard of a template refactor)")
    c = sub.add_parser("compare", help="list the cases whose Plans differ; exit 1 if any")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args()
    if args.cmd == "compare":
        before, after = (json.loads(Path(p).read_text()) for p in (args.before, args.after))
        lines = compare(before, after)
        sources = all(" " in v for v in before.values() if not v.startswith("error"))
        print("\n".join(lines) if lines else
              f"{len(before)} Plans, all the same" + (", and their rendered sources" if sources else ""))
        return 1 if lines else 0
    import mokgen

    # (an editable install elsewhere, or another checkout first on the path, would be what runs)
    what = "planning code and templates" if args.sources else "planning code"
    print(f"fingerprinting the {what} of {Path(mokgen.__file__).parent}", flush=True)
    todo = cases([int(s) for s in args.seeds.split(",") if s], args.per_seed)
    prints = {}
    for i, (key, spec, overrides) in enumerate(todo):
        prints[key] = fingerprint(spec, overrides, args.sources)
        if (i + 1) % 50 == 0 or i + 1 == len(todo):
            print(f"[{i + 1}/{len(todo)}] Plans fingerprinted", flush=True)
    Path(args.out).write_text(json.dumps(prints, indent=1, sort_keys=True))
    refused = sum(v.startswith("error") for v in prints.values())
    print(f"{len(prints)} cases ({refused} refused) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
