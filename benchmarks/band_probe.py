"""Every forward entry point of one build forced at each T: which tile size serves which T best.

    python benchmarks/band_probe.py [--variant V] [--tokens T,T,...] [--entries E,E,...]
                                    [--rounds R] [--json PATH]

The Plan's launch_bands give each T one entry point (a band of swapped tiles, the plain 128-row
launch, or above fused_max_tokens the per-GEMM path, "forward"). This probe calls each entry
point at each T with the same uniform routing (CUDA-graph replays, 10 warm-ups and the median of
50, interleaved rounds with the order rotating, the best round kept), checks each gives the
default entry's bits, and prints each one's time and its ratio to the default. It measured the
bands' rule where experts spill (docs/perf.md, "Swapped tiles past the largest size").

A forced entry runs in the workspace sized for the band that serves T. An entry whose tiles would
need more rows than that workspace holds for this routing (a band of larger tiles forced at a T
whose band has smaller ones) is skipped and said so, before anything runs. (The illegal memory
access this probe met on Mixtral-8x7B, forcing entries at T = 16 and then 64, was its own: it
freed each graph's output; bench._capture now keeps it. docs/perf.md, "The graph-replay fault on
Mixtral, found".)
"""
import argparse
import json
import math
import sys


def tile_rows(counts, n: int) -> int:
    """Rows the layout of tiles of n rows takes for these per-expert counts: each expert's rows
    padded to whole tiles."""
    return sum(math.ceil(c / n) * n for c in counts)


def entry_rows(entry: str) -> int:
    """The token rows of an entry point's M tiles (0: not a swapped band)."""
    return int(entry[len("forward_n"):]) if entry.startswith("forward_n") else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="e64_k8_h2048_i1024_bf16_sm90a")
    ap.add_argument("--tokens", default="1024,1100,1200,1300")
    ap.add_argument("--entries", help="comma-separated entry points (default: every band, the plain launch "
                                      "and the per-GEMM path)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
        assert all(t > 0 for t in tokens) and args.rounds > 0
    except (ValueError, AssertionError):
        ap.error("--tokens: positive integers, comma-separated; --rounds: positive")

    import torch

    import mokgen
    from mokgen.bench import _capture, forced_call, time_rounds
    from mokgen.verify import make_inputs

    v = mokgen.load(args.variant)
    plan, spec = v.plan, v.spec
    if not plan.get("launch_bands"):
        ap.error(f"{args.variant} has no bands of swapped tiles (launch_bands)")
    known = [e for e in plan["steps"] if e.startswith("forward_n") or e in ("forward_fused", "forward")]
    entries = args.entries.split(",") if args.entries else sorted(known)
    unknown = [e for e in entries if e not in known]
    if unknown:
        ap.error(f"{args.variant} has no forward entry point {', '.join(unknown)}; it has {', '.join(sorted(known))}")
    rows = []
    for T in tokens:
        gen = torch.Generator("cuda").manual_seed(T)
        x, ids, w, wg, wu, wd, shared = make_inputs(spec, T, "uniform", gen)
        counts = torch.bincount(ids.flatten().long(), minlength=spec.experts).tolist()
        shapes = dict((name, shape) for name, _, shape, _ in v.buffer_shapes(T))
        held, tables = shapes["h"][0], shapes["tile_expert_w"][0]  # (the swapped bands' rows and tile table)
        default = v.forward_entry(T)
        want = v.forward(x, ids, w, wg, wu, wd, *shared)
        calls, same = {}, {}
        for entry in dict.fromkeys([default] + entries):
            n = entry_rows(entry)
            if n and (tile_rows(counts, n) > held or tile_rows(counts, n) // n > tables):
                print(f"T={T}: {entry} skipped: its tiles need {tile_rows(counts, n)} rows in {tile_rows(counts, n) // n} "
                      f"tiles, the workspace holds {held} rows and {tables} tiles")
                continue
            call = forced_call(v, entry, x, ids, w, wg, wu, wd, shared)
            same[entry] = torch.equal(call(), want)
            calls[entry] = _capture(call).replay
        v.check_errors()
        first = len(rows)
        best = time_rounds(calls, args.rounds, rows, T=T)
        v.check_errors()
        for r in rows[first:]:
            r["same_bits"] = same[r["impl"]]
        mean = T * spec.topk / spec.experts
        print(f"T={T} (default {default}; rows an expert: mean {mean:.0f}, max {max(counts)})  " + "  ".join(
            f"{e} {best[e] * 1e3:.1f} us ({best[default] / best[e]:.3f}x{'' if same[e] else ', OTHER BITS'})"
            for e in best), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(variant=args.variant, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
