"""The training step (autograd's forward, forward_train, then the backward it saves for) of the
default build beside experiment builds and beside itself with kernels skipped, timed in energy
rounds (mokgen.bench.energy_rounds: the order rotating, the best round kept, J and W per call),
as docs/perf.md's training entries measure it.

    python benchmarks/compare_training.py [--builds NAME,NAME] [--skip KERNEL,KERNEL[;KERNEL...]]
                                          [--variant V] [--tokens T,T] [--rounds R]

--builds: experiment builds (generated/experiments/NAME, benchmarks/build_gpu_variants.py); each
is checked against the default build first (relative difference of every gradient, the same bits
over three steps). --skip: sets of kernels replaced by no-ops, separated by ';' (the results are
then wrong, the time is real): how much a kernel could be worth at most.
"""
import argparse
import sys

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--builds", default="", help="experiment builds, comma-separated")
ap.add_argument("--skip", default="", help="kernel sets to skip, ';' between sets, ',' within one")
ap.add_argument("--variant", default="e64_k8_h2048_i1024_bf16_sm90a")
ap.add_argument("--tokens", default="16384")
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()
builds = [b for b in args.builds.split(",") if b]
skips = [tuple(k for k in s.split(",") if k) for s in args.skip.split(";") if s.strip(",")]
if not builds and not skips:
    ap.error("nothing to compare: give --builds or --skip")
try:
    tokens = [int(t) for t in args.tokens.split(",")]
except ValueError:
    ap.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")

import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen.bench import energy_rounds, experiment_build  # noqa: E402
from mokgen.verify import make_inputs  # noqa: E402

plain = mokgen.load(args.variant)
unknown = {k for s in skips for k in s} - set(plain.launchers)
if unknown:
    sys.exit(f"{args.variant} has no kernels {sorted(unknown)}")
exps = {b: experiment_build(b, args.variant) for b in builds}
real = dict(plain.launchers)
S = plain.spec
flops = 3 * 6.0 * S.topk * S.hidden * S.intermediate
for T in tokens:
    gen = torch.Generator("cuda").manual_seed(T + 7)
    x, ids, w, wg, wu, wd, shared = make_inputs(S, T, "uniform", gen)
    dout = torch.randn(T, S.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step(v, skipped=()):
        for k in skipped:
            v.launchers[k] = lambda args, stream: None
        try:
            out, *saved = v.forward_train(x, ids, w, wg, wu, wd, *shared)
            return v.backward(dout, x, ids, w, wg, wu, wd, *shared, saved=saved)
        finally:
            v.launchers.update(real if v is plain else {})

    base = step(plain)
    for name, v in exps.items():
        got = step(v)
        diffs = ", ".join(f"{g.float().sub(r.float()).norm() / r.float().norm().clamp_min(1e-30):.1e}"
                          for g, r in zip(got, base) if g is not None)
        same = all(torch.equal(a, b) for _ in range(3) for a, b in zip(step(v), got) if a is not None)
        v.check_errors()
        print(f"T={T} {name}: gradients against the default build {diffs}; the same bits over 3 steps: {same}")
    impls = {"default": lambda: step(plain), **{n: (lambda v=v: step(v)) for n, v in exps.items()},
             **{"skip " + ",".join(s): (lambda s=s: step(plain, s)) for s in skips}}
    res = energy_rounds(impls, args.rounds)
    for name, (ms, joules, watts, st) in res.items():
        print(f"T={T} {name:32s} {ms:8.3f} ms {flops * T / ms / 1e9:7.1f} TFLOP/s "
              f"{res['default'][0] / ms:.4f}x default" + (f"  {watts:.0f} W" if watts else "")
              + (f"  {st['sm_clock_mhz']} MHz" if "sm_clock_mhz" in st else ""))
