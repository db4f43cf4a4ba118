"""Forward entry points captured in CUDA graphs at several T in one process, then replayed: a
check that graphs of every entry replay side by side. It found the Mixtral graph-replay fault
(docs/perf.md, "The graph-replay fault on Mixtral, found": the probes freed the output a graph
still wrote; bench._capture now keeps it), and its knobs are those that narrowed it.

    python benchmarks/graph_replays.py [--variant V] [--tokens 16,64] [--entries E,E[;E,E]]
                                       [--replays N] [--sync] [--eager] [--no-kept] [--hold]
                                       [--poison] [--dump] [--guard tail|head]

At each T (in order, in one process): the default entry's eager call, then each entry in
--entries (the default one first) called eagerly (its bits checked against the default's) and
captured (bench._capture: a warm-up on a fresh stream, then torch's capture stream); then the
graphs replayed in blocks of 30, entry after entry, --replays in all. --entries takes one list
for every T or one per T separated by ';'. The knobs isolate what a fault needs:
  --sync     synchronise and check the error code after every replay (names the replay)
  --eager    call the entries eagerly instead of from graphs
  --no-kept  no workspace kept between calls (the runtime's KEEP_WORKSPACE_BYTES = 0)
  --hold     every workspace the runtime makes kept alive (no memory freed or reused)
  --poison   every int buffer of every call filled with 0x3FFFFFFF and every float with NaN
             first (a read before the call writes would index far out or show as non-finite)
  --dump     the dispatch counters (state sets) read back after every capture and replay block
  --guard    every per-call buffer and dispatch counter, eager or captured, mapped alone against
             unmapped memory after its end (tail) or before its start (head): guard_pages.py's
             memory, so that an access out of a buffer faults in a graph's replay too
Exit status 0 when every replay ran and every entry gave the default's bits.
"""
import argparse
import sys

BLOCK = 30  # replays of one graph before the next entry's


def entries_per_t(spec: str, n: int) -> list[list[str]]:
    """--entries: one comma-separated list for every T, or one per T separated by ';'."""
    lists = [[e for e in part.split(",") if e] for part in spec.split(";")]
    if len(lists) not in (1, n):
        raise ValueError(f"{len(lists)} entry lists for {n} token counts")
    return lists * n if len(lists) == 1 else lists


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="e8_k2_h4096_i14336_bf16_sm90a")
    ap.add_argument("--tokens", default="16,64")
    ap.add_argument("--entries", default="forward_fused,forward")
    ap.add_argument("--replays", type=int, default=240)
    ap.add_argument("--guard", choices=("tail", "head"), default=None)
    for flag in ("sync", "eager", "no-kept", "hold", "poison", "dump"):
        ap.add_argument(f"--{flag}", action="store_true")
    args = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
        assert all(t > 0 for t in tokens) and args.replays > 0
        per_t = entries_per_t(args.entries, len(tokens))
    except (ValueError, AssertionError) as e:
        ap.error(f"--tokens: positive integers, comma-separated; --replays: positive; --entries: {e}")

    import torch

    import mokgen
    import mokgen.runtime.variant as runtime_variant
    from mokgen.bench import _capture, forced_call
    from mokgen.verify import make_inputs

    if args.no_kept:
        runtime_variant.KEEP_WORKSPACE_BYTES = 0
    v = mokgen.load(args.variant)
    unknown = {e for es in per_t for e in es} - set(v.plan["steps"])
    if unknown:
        ap.error(f"{args.variant} has no entry point {', '.join(sorted(unknown))}")
    held = []
    make_workspace = v._workspace
    mem = None
    if args.guard:
        from guard_pages import GuardedMemory  # (this script's folder)

        mem = GuardedMemory(torch.cuda.current_device(), args.guard, 16)
        mem.guard_state(v)

    def workspace(*a, **kw):  # (an instance attribute: the runtime's own calls find it)
        ws = make_workspace(*a, **kw)
        if mem is not None:
            mem.guard_workspace(v, ws)
        if args.hold:
            held.append(dict(ws))
        if args.poison:
            for name, t in ws.items():
                if name in v._state_shapes:
                    continue
                if t.dtype == torch.int32:
                    t.fill_(0x3FFFFFFF)
                elif t.dtype.is_floating_point:
                    t.fill_(float("nan"))
        return ws
    v._workspace = workspace

    def dump(where: str) -> None:
        if args.dump:
            torch.cuda.synchronize()
            raised = [t.tolist() for t in v._state.values() if t.any()]
            raised += [s[n].tolist() for sets in v._state_reserve.values() for s in sets for n in s if s[n].any()]
            print(f"  [{where}] {len(v._state)} state buffers; raised: {raised or 'none'}", flush=True)

    ok = True
    for T, entries in zip(tokens, per_t):
        x, ids, w, wg, wu, wd, shared = make_inputs(v.spec, T, "uniform", torch.Generator("cuda").manual_seed(T))
        default = v.forward_entry(T)
        want = v.forward(x, ids, w, wg, wu, wd, *shared)
        v.check_errors()
        dump(f"T={T} after the default's eager call")
        calls = {}
        for entry in dict.fromkeys([default] + entries):
            call = forced_call(v, entry, x, ids, w, wg, wu, wd, shared)
            got = call()
            same = torch.equal(got, want)
            finite = bool(torch.isfinite(got).all())
            ok &= same
            v.check_errors()
            calls[entry] = call if args.eager else _capture(call).replay
            v.check_errors()
            print(f"T={T} {entry}: {'the same bits' if same else 'OTHER BITS'}{'' if finite else ', NOT FINITE'}"
                  f"{'' if args.eager else '; captured'}", flush=True)
            dump(f"T={T} after {entry}")
        names = list(calls)
        for i in range(args.replays):
            name = names[(i // BLOCK) % len(names)]
            calls[name]()
            if args.sync or i % BLOCK == BLOCK - 1:
                try:
                    v.check_errors()
                except Exception as e:
                    print(f"T={T}: replay {i} ({name}) failed: {type(e).__name__}: {e}", flush=True)
                    raise
                if i % BLOCK == BLOCK - 1:
                    dump(f"T={T} after replays of {name}")
        v.check_errors()
        print(f"T={T}: {args.replays} replays ran", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
