"""Forward entry points run eagerly with every buffer they touch placed against unmapped memory:
an access past a buffer's end (--side tail) or before its start (--side head) faults at once
instead of landing in the caching allocator's neighbouring blocks, where compute-sanitizer's
memcheck (which sees cudaMalloc's segments, and no bulk-tensor copy) cannot tell it from a
legal access.

    python benchmarks/guard_pages.py [--variant V] [--tokens 16,64] [--entries E,E]
                                     [--side tail|head|both] [--align B] [--poison]

Each buffer of the call (the inputs, the output, the per-call workspace and the dispatch
counters) gets a mapping of its own from the driver's virtual memory calls, with an unmapped
granule after it (tail) or before it (head). --entries: the entry points forced at every T
(default: T's own entry, the plain launch and the per-GEMM path). Every case runs after the
last in a process of its own (a fault ends a CUDA context), under CUDA_LAUNCH_BLOCKING so a
fault names its kernel. Exit status 0 when every case ran and gave the default entry's bits.
"""
import argparse
import ctypes
import os
import subprocess
import sys


class GuardedMemory:
    """Device buffers each mapped alone in a reserved range with an unmapped granule beside it
    (cuMemAddressReserve / cuMemCreate / cuMemMap). Never freed: a probe's process is short."""

    def __init__(self, device: int, side: str, align: int):
        import torch

        assert side in ("tail", "head")
        self.side, self.align, self.device = side, align, device
        torch.empty(1, device=f"cuda:{device}")  # (the driver calls below use torch's current context)
        self.cu = ctypes.CDLL("libcuda.so.1")
        # CUmemAllocationProp: type, requestedHandleTypes, location {type, id}, win32 metadata, allocFlags
        self.prop = (ctypes.c_int * 8)(1, 0, 1, device, 0, 0, 0, 0)  # pinned device memory
        gran = ctypes.c_size_t()
        self._check(self.cu.cuMemGetAllocationGranularity(ctypes.byref(gran), self.prop, 0), "granularity")
        self.granule = gran.value
        # CUmemAccessDesc: location {type device, id}, flags read-write
        self.access = (ctypes.c_int * 3)(1, device, 3)

    def _check(self, err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"guarded memory: {what} failed (CUresult {err})")

    def tensor(self, nbytes: int):
        """A uint8 tensor of nbytes whose end (tail) or start (head) touches unmapped memory."""
        import torch

        padded = -(-nbytes // self.align) * self.align
        mapped = -(-padded // self.granule) * self.granule
        # Inside a CUDA graph capture (graph_replays.py --guard) these calls would end it, as
        # unsafe, unless this thread's capture mode is relaxed for them (as torch's allocator does).
        mode = ctypes.c_int(2)  # CU_STREAM_CAPTURE_MODE_RELAXED
        self._check(self.cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)), "capture mode")
        try:
            ptr = self._map(padded, mapped)
        finally:
            self.cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))

        class Interface:  # (torch takes a device pointer through the CUDA array interface)
            __cuda_array_interface__ = dict(shape=(nbytes,), typestr="|u1", data=(ptr, False), version=3,
                                            strides=None)
        return torch.as_tensor(Interface(), device=f"cuda:{self.device}")

    def _map(self, padded: int, mapped: int) -> int:
        base = ctypes.c_uint64()
        self._check(self.cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(mapped + 2 * self.granule),
                                                ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)),
                    "reserve")
        start = base.value + self.granule  # an unmapped granule on each side
        handle = ctypes.c_uint64()
        self._check(self.cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(mapped), self.prop, ctypes.c_uint64(0)),
                    "create")
        self._check(self.cu.cuMemMap(ctypes.c_uint64(start), ctypes.c_size_t(mapped), ctypes.c_size_t(0), handle,
                                     ctypes.c_uint64(0)), "map")
        self._check(self.cu.cuMemSetAccess(ctypes.c_uint64(start), ctypes.c_size_t(mapped), self.access,
                                           ctypes.c_size_t(1)), "set access")
        return start + mapped - padded if self.side == "tail" else start

    def guard_state(self, variant) -> None:
        """Every set of dispatch counters the variant makes from now on in guarded memory."""
        make = variant._new_state_set
        variant._new_state_set = lambda device: {n: self.like(t) for n, t in make(device).items()}

    def guard_workspace(self, variant, ws: dict) -> dict:
        """ws's per-call buffers replaced, in place, by guarded copies (never freed: a CUDA graph
        may hold them); its state buffers are guard_state's."""
        ws.update({n: self.like(t) for n, t in ws.items() if n not in variant._state_shapes})
        return ws

    def like(self, t):
        """A guarded copy of t (same dtype, shape and bits)."""
        if t is None or t.numel() == 0:
            return t
        g = self.tensor(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        g.copy_(t)
        return g


def entries_for(variant, T: int, forced: list[str]) -> list[str]:
    return list(dict.fromkeys([variant.forward_entry(T)] + forced))


def run_cases(args, cases: list, first: int) -> int:
    """Cases from index `first`, in this process; prints one line each. Returns the exit status."""
    import torch

    import mokgen
    import mokgen.runtime.variant as runtime_variant
    from mokgen.verify import make_tokens, make_weights

    runtime_variant.KEEP_WORKSPACE_BYTES = 0  # (every call its own workspace, so every one guarded)
    v = mokgen.load(args.variant)
    mem = GuardedMemory(torch.cuda.current_device(), args.side, args.align)
    mem.guard_state(v)
    make_workspace = v._workspace
    guarded = [False]

    def workspace(*a, **kw):
        ws = make_workspace(*a, **kw)
        if not guarded[0]:
            return ws
        mem.guard_workspace(v, ws)
        for name, g in ws.items():
            if args.poison and name not in v._state_shapes and not bool((g == 0).all()):
                g.fill_(float("nan") if g.dtype.is_floating_point else 0x3FFFFFFF)
        return ws
    v._workspace = workspace

    gen = torch.Generator("cuda").manual_seed(0)
    wg, wu, wd, shared = make_weights(v.spec, gen)  # (one set for every case)
    gw = [mem.like(t) for t in (wg, wu, wd, *shared)]
    status = 0
    for i in range(first, len(cases)):
        T, entry = cases[i]
        x, ids, w = make_tokens(v.spec, T, args.routing, torch.Generator("cuda").manual_seed(T))
        guarded[0] = False
        want = v.forward(x, ids, w, wg, wu, wd, *shared)
        v.check_errors()
        guarded[0] = True
        gx, gids, gwt = mem.like(x), mem.like(ids), mem.like(w)
        out = mem.like(torch.empty_like(x))
        print(f"[{i + 1}/{len(cases)}] T={T} {entry} ({args.side})", end=" ", flush=True)
        v._run_forward(entry, gx, dict(topk_ids=gids, topk_weights=gwt), *gw, out)
        v.check_errors()
        same = torch.equal(out, want)
        status |= not same
        print("ran; " + ("the same bits" if same else "OTHER BITS"), flush=True)
    return status


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="e8_k2_h4096_i14336_bf16_sm90a")
    ap.add_argument("--tokens", default="16,64")
    ap.add_argument("--entries", default="forward_fused,forward")
    ap.add_argument("--side", choices=("tail", "head", "both"), default="both")
    ap.add_argument("--align", type=int, default=16, help="a buffer's start alignment in bytes (tail: its slack)")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--poison", action="store_true", help="per-call buffers that are not zeroed filled with NaN / "
                    "0x3FFFFFFF")
    ap.add_argument("--first", type=int, default=None, help=argparse.SUPPRESS)  # (a child process's start)
    args = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
        assert all(t > 0 for t in tokens) and args.align > 0 and args.align % 16 == 0
    except (ValueError, AssertionError):
        ap.error("--tokens: positive integers, comma-separated; --align: a positive multiple of 16")
    forced = [e for e in args.entries.split(",") if e]
    if args.first is not None:  # a child: this side's cases from --first on
        import mokgen

        v = mokgen.load(args.variant)
        unknown = set(forced) - set(v.plan["steps"])
        if unknown:
            ap.error(f"{args.variant} has no entry point {', '.join(sorted(unknown))}")
        cases = [(T, e) for T in tokens for e in entries_for(v, T, forced)]
        return run_cases(args, cases, args.first)
    status = 0
    for side in (("tail", "head") if args.side == "both" else (args.side,)):
        first = 0
        while True:
            cmd = [sys.executable, __file__, "--first", str(first), "--side", side, "--variant", args.variant,
                   "--tokens", args.tokens, "--entries", args.entries, "--align", str(args.align),
                   "--routing", args.routing] + (["--poison"] if args.poison else [])
            p = subprocess.run(cmd, env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}, capture_output=True, text=True)
            sys.stdout.write(p.stdout)
            done = p.stdout.count(" ran; ")
            if p.returncode in (0, 1) and "Traceback" not in p.stderr:
                status |= p.returncode
                break
            status = 2
            print("FAULT: " + (p.stderr.strip().splitlines() or ["(no message)"])[-1], flush=True)
            if not p.stdout.strip():  # (it failed before its first case)
                break
            first += done + 1  # the case after the one that faulted
    return status


if __name__ == "__main__":
    sys.exit(main())
