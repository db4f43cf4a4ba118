"""A mokgen.MoE block's training step, back to back: eager, under
torch.compile(mode="reduce-overhead") (torch's CUDA graphs), and through
torch.cuda.make_graphed_callables (one graph for the forward, one for the backward).

    python benchmarks/module_step.py

Layers E40 K6 H1536 I640 at T = 64, 320 and E64 K8 H2048 I1024 at T = 64, 256; ms a step,
median of 5 runs of 100 steps (parameter and input gradients reset to None each step, as an
optimizer's zero_grad does). The builds must exist (MOKGEN_HOME).
"""
import statistics
import time

import torch

import mokgen

LAYERS = (((40, 6, 1536, 640), (64, 320)), ((64, 8, 2048, 1024), (64, 256)))  # ((E, K, H, I), tokens)


def wall(fn, n=100):
    """ms a call of n calls back to back (the wall clock), median of 5 runs after 10 warm-up calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    r = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        r.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(r)


for (E, K, H, I), Ts in LAYERS:
    for T in Ts:
        torch.manual_seed(T)
        blocks = [mokgen.MoE(H, I, E, K, device="cuda") for _ in range(3)]  # eager, compiled, graphed
        for b in blocks[1:]:
            b.load_state_dict(blocks[0].state_dict())
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        compiled = torch.compile(blocks[1], mode="reduce-overhead")
        graphed = torch.cuda.make_graphed_callables(blocks[2], (x,))

        def step(m, params):
            torch.compiler.cudagraph_mark_step_begin()  # (the last step's outputs are not read again)
            for p in params:
                p.grad = None
            x.grad = None
            m(x).backward(dy)

        row = {}
        for name, m, b in (("eager", blocks[0], blocks[0]), ("compiled", compiled, blocks[1]),
                           ("graphed", graphed, blocks[2])):
            params = list(b.parameters())
            step(m, params)
            row[name] = wall(lambda: step(m, params))
        print(f"E{E} T={T}: ms per step  " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
