"""An experimental build (a Plan override, built by build_gpu_variants.py under
generated/experiments/NAME) against the default build and torch grouped_mm, side by side in
one process. CUDA-graph replay times (no launch overhead), 10 warm-ups and the median of 50,
with the SM clock and power after each. The three are timed in interleaved rounds (the order
rotating each round) and the best round's median kept per implementation, so that a
power-capped clock late in the run does not favour whichever ran first; the line also gives
the median over rounds of the two builds' ratio within a round.

    python benchmarks/compare_experiment.py NAME [--variant V] [--tokens T,T,...]
                                            [--rounds R] [--eager] [--json PATH]

NAME is fused, cluster2, per_expert, multi, apart, wave, nosmall (the Plan without the single
launch's bands by T: its plain 128-row tiles at every T), nopairs (without weight pairs), late (the
single launch's combine after every down tile and a status_mirror launch behind it), nodiscard (the
bands' combine without its L2 discards; discard_rows and discard_pad: one part of them each;
h_by_combine: h's lines dropped by the combine in every band, none by an M tile's last down tile),
claim_late (each CTA claims its next tile once its current tile's loads are issued), or
any other directory under generated/experiments; several names, comma-separated, are timed side by
side in the same rounds, each against the default build.
V defaults to the OLMoE layer. --eager also times the builds called directly (launch overhead
included).
"""
import argparse
import json

import torch

import mokgen
from mokgen.bench import _capture, baseline_weights, experiment_build, time_rounds, torch_grouped_mm
from mokgen.verify import make_inputs

ap = argparse.ArgumentParser()
ap.add_argument("name")
ap.add_argument("--variant", default="e64_k8_h2048_i1024_bf16_sm90a")
ap.add_argument("--tokens", default="64,256,1024,4096,16384")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--eager", action="store_true", help="also time both builds called directly")
ap.add_argument("--json")
args = ap.parse_args()

plain = mokgen.load(args.variant)
spec = plain.spec
names = args.name.split(",")
exps = {}
for name in names:
    exps[name] = experiment_build(name, args.variant)
rows = []
for T in [int(t) for t in args.tokens.split(",")]:
    x, ids, w, wg, wu, wd, shared = make_inputs(spec, T, "uniform", torch.Generator("cuda").manual_seed(T))
    w13, ws = baseline_weights(wg, wu, *shared)
    impls = {"default": _capture(lambda: plain.forward(x, ids, w, wg, wu, wd, *shared)).replay}
    for name, exp in exps.items():
        impls[name] = _capture(lambda exp=exp: exp.forward(x, ids, w, wg, wu, wd, *shared)).replay
    impls["torch_grouped_mm"] = lambda: torch_grouped_mm(x, ids, w, w13, wd, spec.intermediate, ws)
    if args.eager:
        impls["default eager"] = lambda: plain.forward(x, ids, w, wg, wu, wd, *shared)
        for name, exp in exps.items():
            impls[f"{name} eager"] = lambda exp=exp: exp.forward(x, ids, w, wg, wu, wd, *shared)
    best = time_rounds(impls, args.rounds, rows, T=T)
    ref = plain.forward(x, ids, w, wg, wu, wd, *shared)
    line = f"T={T:6d}  default {best['default']:.3f} ms  torch grouped_mm {best['torch_grouped_mm']:.3f} ms " \
           f"(default {best['torch_grouped_mm'] / best['default']:.2f}x)"
    for name, exp in exps.items():
        same = torch.equal(ref, exp.forward(x, ids, w, wg, wu, wd, *shared))
        line += f"\n          {name} {best[name]:.3f} ms ({best['default'] / best[name]:.3f}x default, " \
                f"{best['torch_grouped_mm'] / best[name]:.2f}x torch, same bits: {same})"
        if args.eager:
            line += f", eager {best[name + ' eager']:.3f} ms against {best['default eager']:.3f}"
        # The ratio within each round (the two builds timed moments apart), median over rounds:
        # steadier than the best rounds' ratio where the clock drifts with power.
        per_round = {}
        for r in rows:
            if r.get("T") == T and r["impl"] in ("default", name):
                per_round.setdefault(r["round"], {})[r["impl"]] = r["ms"]
        ratios = sorted(v["default"] / v[name] for v in per_round.values() if len(v) == 2)
        if ratios:
            line += f"; per-round ratio median {ratios[len(ratios) // 2]:.3f}x ({', '.join(f'{x:.3f}' for x in ratios)})"
    print(line, flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump(dict(variant=args.variant, experiments=names, device=torch.cuda.get_device_name(),
                       rows=rows), f, indent=1)
