"""The single launch at small T: every forward path of one layer side by side, in one process.

    python benchmarks/small_t.py [--variant V] [--tokens T,T,...] [--rounds R] [--json PATH]

Paths (the first two need benchmarks/build_gpu_variants.py's experiment builds):
  multi            one launch per stage: dispatch (2), gate/up, down, combine
  apart            dispatch (2), then the fused launch (gate/up, down, combine)
  one_launch       the default: dispatch inside the fused launch (precomputed routing), in the
                   tiles the Plan's launch_bands give this T
  route+one        the route kernel, then the one launch (from router logits)
  routed           mokgen.moe_routed's launch: route, dispatch, GEMMs and combine in one
  torch_grouped_mm the torch baseline (routing precomputed)
Each is timed called directly ("eager": host launch overhead included) and replayed from a
CUDA graph, 10 warm-ups and the median of 50 CUDA-event timed calls, in interleaved rounds
(the best round kept), so a power-capped clock late in the run favours none of them. Each time
is printed with its TFLOP/s (mokgen.bench.forward_flops: the routed pairs' GEMMs) and its ratio
to torch and to the multi-kernel path; --json writes every timing with its TFLOP/s.
"""
import argparse
import json

import torch

import mokgen
from mokgen.bench import _capture, baseline_weights, experiment_build, forward_flops, time_rounds, torch_grouped_mm
from mokgen.verify import make_inputs

ap = argparse.ArgumentParser()
ap.add_argument("--variant", default="e64_k8_h2048_i1024_bf16_sm90a")
ap.add_argument("--tokens", default="64,256,1024,2048")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--json")
args = ap.parse_args()

plain = mokgen.load(args.variant)
spec = plain.spec
builds = {}
for name in ("multi", "apart"):
    builds[name] = experiment_build(name, args.variant)
rows = []
for T in [int(t) for t in args.tokens.split(",")]:
    if T > plain.plan.get("fused_max_tokens", 0):
        print(f"T={T}: above the fused launch's {plain.plan.get('fused_max_tokens', 0)} tokens, skipped")
        continue
    gen = torch.Generator("cuda").manual_seed(T)
    x, ids, w, wg, wu, wd, shared = make_inputs(spec, T, "uniform", gen)
    logits = torch.randn(T, spec.experts, device="cuda", generator=gen)
    ids, w = plain.route(logits)  # every path computes the same layer
    w13, ws = baseline_weights(wg, wu, *shared)

    def route_then_one():
        i, ww = plain.route(logits)
        return plain.forward(x, i, ww, wg, wu, wd, *shared)

    calls = {
        "multi": lambda: builds["multi"].forward(x, ids, w, wg, wu, wd, *shared),
        "apart": lambda: builds["apart"].forward(x, ids, w, wg, wu, wd, *shared),
        "one_launch": lambda: plain.forward(x, ids, w, wg, wu, wd, *shared),
        "route+one": route_then_one,
        "routed": lambda: plain.forward_routed(x, logits, wg, wu, wd, *shared)[0],
    }
    want = calls["multi"]()
    for name, fn in calls.items():  # the same bits on every path
        assert torch.equal(fn(), want), f"{name} differs from the multi-kernel path at T={T}"
    impls = {f"{n} eager": fn for n, fn in calls.items()}
    impls.update({f"{n} graph": _capture(fn).replay for n, fn in calls.items()})
    impls["torch_grouped_mm"] = lambda: torch_grouped_mm(x, ids, w, w13, wd, spec.intermediate, ws)
    first = len(rows)
    best = time_rounds(impls, args.rounds, rows, T=T)
    plain.check_errors()
    flops = forward_flops(spec, T)
    for r in rows[first:]:
        r["tflops"] = flops / r["ms"] / 1e9
    torch_ms = best["torch_grouped_mm"]
    print(f"T={T}  torch grouped_mm {torch_ms:.3f} ms ({flops / torch_ms / 1e9:.1f} TFLOP/s)", flush=True)
    for mode in ("eager", "graph"):
        multi = best[f"multi {mode}"]
        print(f"  {mode:5s} " + "  ".join(
            f"{n} {best[f'{n} {mode}']:.3f} ms ({flops / best[f'{n} {mode}'] / 1e9:.1f} TFLOP/s, "
            f"{torch_ms / best[f'{n} {mode}']:.2f}x torch, {multi / best[f'{n} {mode}']:.3f}x multi)" for n in calls),
            flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump(dict(variant=args.variant, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
