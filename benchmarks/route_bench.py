"""The route stage on its own: the generated route kernel and its backward against the same
softmax / top-k / autograd in torch ops, in one process (CUDA events, 10 warm-ups, median of 50),
each replayed from a CUDA graph (GPU time) and called directly (host launch time included).

    python benchmarks/route_bench.py [--experts E] [--topk K] [--hidden H] [--intermediate I]
                                     [--tokens T,T,...] [--renormalize]

(H and I only name the build whose route kernels run; the route depends on E, K and the
renormalisation.)
"""
import argparse

import torch

import mokgen
from mokgen.bench import _capture, time_ms
from mokgen.module import route_torch

ap = argparse.ArgumentParser()
ap.add_argument("--experts", type=int, default=64)
ap.add_argument("--topk", type=int, default=8)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--intermediate", type=int, default=1024)
ap.add_argument("--tokens", default="64,1024,4096,16384")
ap.add_argument("--renormalize", action="store_true")
args = ap.parse_args()
E, K, rn = args.experts, args.topk, args.renormalize
v = mokgen.load(mokgen.MoESpec(experts=E, topk=K, hidden=args.hidden, intermediate=args.intermediate, renormalize=rn))
for T in [int(t) for t in args.tokens.split(",")]:
    gen = torch.Generator("cuda").manual_seed(T)
    logits = torch.randn(T, E, device="cuda", generator=gen)
    ids, w = v.route(logits)
    dw = torch.randn(T, K, device="cuda", generator=gen)
    want_ids, _ = route_torch(logits, K, rn)
    assert torch.equal(ids.long().sort(-1).values, want_ids.long().sort(-1).values), "route picks differ from torch"
    calls = {"route": lambda: v.route(logits), "route_backward": lambda: v.route_backward(logits, ids, dw),
             "torch softmax + topk": lambda: route_torch(logits, K, rn)}
    line = f"E={E} K={K} T={T:6d}"
    for name, fn in calls.items():
        graph = _capture(fn)
        line += f"  {name} {time_ms(graph.replay) * 1e3:6.1f} us (eager {time_ms(fn) * 1e3:6.1f})"
    print(line, flush=True)
