"""What bounds a small training step's host time: the step back to back with parts of the
runtime taken away, one at a time.

    python benchmarks/host_floor.py [--variant V] [--tokens T] [--steps N]

A step is mokgen.moe under autograd, then torch.autograd.grad of x, topk_weights and the
three weights, made back to back (no sync inside; wall clock per step, median of 5 runs of N
steps). Rows:
  real                    the step as users run it
  no C call               every launch binds its pointers (BoundEntry, or the Launcher's
                          arrays where a launcher is wrapped) but calls no kernel
  no launch               no kernel binding or call at all (allocations and fills stay)
  entry points stubbed    Variant.forward_train and Variant.backward return fixed tensors:
                          torch's autograd and mokgen.moe's checks alone
  bare Function           a torch.autograd.Function with the same inputs and saved tensors
and the cost of one small generated launch and of one torch fill, back to back.
Rows after "real" compute nothing meaningful (the kernels do not run): timing only.
"""
import argparse
import statistics
import time

import torch

import mokgen
from mokgen.runtime import variant as variant_module
from mokgen.runtime.library import BoundEntry, Launcher
from mokgen.verify import make_inputs

ap = argparse.ArgumentParser()
ap.add_argument("--variant", default="e40_k6_h1536_i640_bf16_sm90a")
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--steps", type=int, default=200)
args = ap.parse_args()

v = mokgen.load(args.variant)
T = args.tokens
x, ids, w, wg, wu, wd, _ = make_inputs(v.spec, T, "uniform", torch.Generator("cuda").manual_seed(T))
leaves = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
dout = torch.randn_like(x)
saved_out = v.forward_train(x, ids, w, wg, wu, wd)
saved_grads = v.backward(dout, x, ids, w, wg, wu, wd, saved=saved_out[1:])
torch.cuda.synchronize()


def step():
    out = mokgen.moe(leaves[0], ids, *leaves[1:], check_ids=False)
    return torch.autograd.grad(out, leaves, dout)


def us_per_call(fn, n: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def no_c_call(self, env, stream):  # BoundEntry.__call__ without the kernels' entry points
    self._data_t(*[env[n].data_ptr() for n in self.tensors])
    self._dyn_t(*[env[n].shape[d] for n, d in self.extents])


def launcher_no_c_call(self, tensors, stream):  # Launcher.__call__ likewise (the status launch)
    self._data_t(*[t.data_ptr() for t in tensors])
    self._dyn_t(*[tensors[i].shape[d] for i, d in self._dyn])


class Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, variant, save, x, ids, w, wg, wu, wd, sg, su, sd):
        ctx.save_for_backward(x, ids, w, wg, wu, wd, sg, su, sd, *saved_out[1:])
        return saved_out[0]

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors
        dx, dw, dg, du, dd = saved_grads[:5]
        return None, None, dx, None, dw, dg, du, dd, None, None, None


def bare():
    out = Bare.apply(v, True, leaves[0], ids, *leaves[1:], None, None, None)
    return torch.autograd.grad(out, leaves, dout)


print(f"{v.name} T={T}, us per step back to back (GPU time of the step from a graph: see host_overhead.py)")
print(f"  real                  {us_per_call(step, args.steps):8.1f}", flush=True)
saved_calls = BoundEntry.__call__, Launcher.__call__
try:
    BoundEntry.__call__, Launcher.__call__ = no_c_call, launcher_no_c_call
    print(f"  no C call             {us_per_call(step, args.steps):8.1f}", flush=True)
    BoundEntry.__call__ = Launcher.__call__ = lambda self, bound, stream: None
    print(f"  no launch             {us_per_call(step, args.steps):8.1f}", flush=True)
finally:
    BoundEntry.__call__, Launcher.__call__ = saved_calls
entry_points = {n: getattr(variant_module.Variant, n) for n in ("forward_train", "backward")}
try:
    variant_module.Variant.forward_train = lambda self, *a, **k: saved_out
    variant_module.Variant.backward = lambda self, *a, **k: saved_grads
    print(f"  entry points stubbed  {us_per_call(step, args.steps):8.1f}", flush=True)
finally:
    for n, f in entry_points.items():
        setattr(variant_module.Variant, n, f)
print(f"  bare Function         {us_per_call(bare, args.steps):8.1f}", flush=True)
status = v.launchers["status_mirror"]
assert type(status) is Launcher
counters = v.kernels["status_mirror"]["args"][0]["shape"][0]
bound = dict(tile_counters=torch.zeros(counters, dtype=torch.int32, device="cuda"),
             status_host=torch.zeros(1, dtype=torch.int32, pin_memory=True))
status_args = [bound[a["tensor"]] for a in v.kernels["status_mirror"]["args"]]
stream = torch.cuda.current_stream().cuda_stream
print(f"  one small generated launch {us_per_call(lambda: status(status_args, stream), 2000):5.1f}")
z = torch.empty(1024, device="cuda")
print(f"  one torch fill             {us_per_call(z.zero_, 2000):5.1f}")
