"""mokgen beside the design's own baseline script, under that script's harness, in one process.

    python benchmarks/anchor_compare.py [--anchor PATH] [--cases NAME,...] [--rounds R] [--json PATH]

DESIGN.md section 4's torch figures (221 TFLOP/s at E64 K8 H2048 I1024, T=16384, and the
others) come from `shared/bench/anchor_bench.py`, and DESIGN.md asks for that script to run
beside mokgen whenever a ratio is reported. This does exactly that: it imports the script
unchanged and hands its `bench_case` two implementations, the script's own `moe_grouped`
(torch._grouped_mm, torchtitan style) and `mokgen.moe`, so both get the same inputs (the
script's `make`), the same timing (triton's do_bench: L2 flushed before every call, median),
the same forward + backward through autograd and the same float64 check. With --rounds R each
case runs R times, the two implementations' order swapped every round, and each keeps its best
figures: at power-capped sizes the one that runs second follows the other's heat.

One difference from `mokgen bench`'s `torch_grouped_mm`, so that the two sets of ratios are not
confused: the design's `moe_grouped` concatenates [w_gate; w_up] on every call (its autograd
needs the weights as leaves), which `mokgen bench` hoists out of the timed region. `mokgen
bench`'s ratios are therefore against a stronger baseline; both are reported in docs/perf.md.

mokgen is called as a user calls it: `mokgen.moe(x, ids, w, w_gate, w_up, w_down,
check_ids=False)` (check_ids=True reads the ids back to the host once per call), eagerly, with
the host's launch time included as it is for torch. Each case needs its variant built
(`mokgen build`); the anchor script is found at ../shared/bench/anchor_bench.py or
.anchors/anchor_bench.py (a copy that travels to a GPU machine), or where --anchor says.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = (ROOT.parent / "shared" / "bench" / "anchor_bench.py", ROOT / ".anchors" / "anchor_bench.py")

# name: (T, H, I, E, K). The first five are the targets' shapes ([fast-forward], [training]); the
# small T ones the single launch's ([megakernel]).
CASES = {
    "e64_t64": (64, 2048, 1024, 64, 8),
    "e64_t256": (256, 2048, 1024, 64, 8),
    "e64_t1024": (1024, 2048, 1024, 64, 8),
    "e64_t4096": (4096, 2048, 1024, 64, 8),
    "e64_t16384": (16384, 2048, 1024, 64, 8),
    "e128_t16384": (16384, 2048, 768, 128, 8),
    "e256_t8192": (8192, 7168, 2048, 256, 8),
}


def anchor_path(path: str | None) -> Path:
    """Where the anchor script is (--anchor, else the first of CANDIDATES); a clear exit if nowhere."""
    paths = [Path(path)] if path else [p for p in CANDIDATES if p.exists()]
    if not paths or not paths[0].is_file():
        sys.exit(f"the anchor script is not at {path or ' or '.join(map(str, CANDIDATES))}: pass --anchor")
    return paths[0]


def load_anchor(path: Path):
    """The anchor script as a module (it imports torch and triton)."""
    spec = importlib.util.spec_from_file_location("anchor_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def best_of_rounds(runs: list[dict]) -> list[dict]:
    """One row per implementation, in the order they first ran: its best forward and its best
    forward + backward over the rounds (each with its TFLOP/s), the rounds' rows kept under
    "rounds"."""
    best = {}
    for r in runs:
        b = best.setdefault(r["impl"], dict(r, rounds=[]))
        b["rounds"].append(r)
        for ms, tf in (("fwd_ms", "fwd_tflops"), ("fb_ms", "fb_tflops")):
            if r[ms] < b[ms] or (math.isnan(b[ms]) and not math.isnan(r[ms])):  # (NaN: a failed backward)
                b[ms], b[tf] = r[ms], r[tf]
    return sorted(best.values(), key=lambda b: b["impl"] != "grouped")


def err_text(err: float) -> str:
    """The relative error, or "no ref" where the baseline's script computes no float64
    reference (it does up to T*H = 4096*2048 only)."""
    return "no ref" if math.isnan(err) else f"{err:.1e}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--anchor", help="path of anchor_bench.py")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run each case this many times, the two implementations' order swapped every round, and "
                         "keep each one's best forward and best forward + backward (at the power cap the one run "
                         "second follows the other's heat, up to 10%% slower)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    where = anchor_path(args.anchor)

    import torch

    if not torch.cuda.is_available():
        sys.exit("anchor_compare needs a CUDA GPU")
    import mokgen
    from mokgen.bench import gpu_state, round_order
    from mokgen.runtime import find_variant

    anchor = load_anchor(where)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; anchor harness {where}", flush=True)
    peak, copy_gbs = anchor.peak()
    print(f"dense bf16 8192^3: {peak:.0f} TFLOP/s; device copy {copy_gbs:.0f} GB/s", flush=True)

    def ours(x, idx, w, wg, wu, wd):
        return mokgen.moe(x, idx, w, wg, wu, wd, check_ids=False)

    rows = []
    for name in names:
        T, H, I, E, K = CASES[name]
        try:
            find_variant(E, K, H, I, 0)  # a clear message, before the anchor's inputs are made
        except Exception as e:  # noqa: BLE001 - reported, and the other cases still run
            print(f"# {name}: skipped, {type(e).__name__}: {e}", flush=True)
            continue
        impls = {"grouped": anchor.moe_grouped, "mokgen": ours}
        runs = []  # every round's rows, in the order they ran
        for rnd in range(args.rounds):
            order = round_order(list(impls), rnd)  # (two implementations: swapped every round)
            for r in anchor.bench_case(name, T, H, I, E, K, {n: impls[n] for n in order}):
                runs.append(dict(r, round=rnd, first=order[0], **gpu_state()))
        new = best_of_rounds(runs)
        base = {r["impl"]: r for r in new}.get("grouped")
        for r in new:
            r["fwd_x_grouped"] = base["fwd_ms"] / r["fwd_ms"] if base else float("nan")
            r["fb_x_grouped"] = base["fb_ms"] / r["fb_ms"] if base else float("nan")
            r["fwd_pct_peak"] = 100 * r["fwd_tflops"] / peak
            print(f"  {name} {r['impl']:8s} fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.1f} TF/s "
                  f"({r['fwd_x_grouped']:.2f}x)  fwd+bwd {r['fb_ms']:8.3f} ms {r['fb_tflops']:6.1f} TF/s "
                  f"({r['fb_x_grouped']:.2f}x)  rel_err {err_text(r['rel_err'])}", flush=True)
        rows += new
        torch.cuda.empty_cache()

    head = f"{'case':12s} {'impl':8s} {'fwd ms':>8s} {'TF/s':>6s} {'x grouped':>9s} {'fwd+bwd ms':>10s} {'TF/s':>6s} " \
           f"{'x grouped':>9s} {'rel_err':>8s}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['shape']:12s} {r['impl']:8s} {r['fwd_ms']:8.3f} {r['fwd_tflops']:6.1f} {r['fwd_x_grouped']:8.2f}x "
              f"{r['fb_ms']:10.3f} {r['fb_tflops']:6.1f} {r['fb_x_grouped']:8.2f}x {err_text(r['rel_err']):>8s}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                   anchor=str(where), dense_peak_tflops=peak, copy_gbs=copy_gbs,
                                                   rows=rows), indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
