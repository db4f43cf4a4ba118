"""`mokgen bench`: the generated op against PyTorch baselines, in one run, on one GPU.

Timing: CUDA events around each call, warm-up first, the median of many calls.
FLOPs counted as DESIGN.md does: 6*T*K*H*I for the routed forward (+ 6*T*H*Is for a
shared expert). Reports ms, TFLOP/s, the ratio to torch grouped_mm, the fraction of
the dense bf16 GEMM peak measured in the same run, and the relative error of each
implementation against the float64 reference.

Baselines (both written as a PyTorch user would; a shared expert is added as dense
bf16 matmuls over all tokens):
  torch_grouped_mm  sort by expert, torch._grouped_mm for gate/up (weights
                    concatenated once, outside the timed region) and down, SwiGLU,
                    weighted index_add combine
  torch_loop        a Python loop over experts (Hugging Face style)
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from .files import write_text_atomic
from .module import experts_torch, torch_grouped_mm, torch_shared_expert
from .reference import moe_reference, rel_error
from .verify import make_inputs


def baseline_weights(wg, wu, sg=None, su=None, sd=None):
    """The baselines' weights, concatenated once outside the timed region: w13 = [w_gate;
    w_up] per expert, and (ws13, ws_down) for a shared expert (None without one)."""
    return torch.cat([wg, wu], dim=1), ((torch.cat([sg, su], dim=0), sd) if sg is not None else None)


def torch_loop(x, ids, w, wg, wu, wd, shared=None):
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in range(wg.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel():
            xe = x[tok]
            y = (F.silu(xe @ wg[e].t()) * (xe @ wu[e].t())) @ wd[e].t()
            out.index_add_(0, tok, y.float() * w[tok, slot, None])
    if shared is not None:
        torch_shared_expert(x, *shared, out)
    return out.to(x.dtype)


# The forward's baselines by name (`mokgen bench --baselines`; the module docstring says what each
# is). Forward + backward always runs torch grouped_mm with autograd.
BASELINES = ("torch_grouped_mm", "torch_loop")
# Rounds of `mokgen bench` (energy_rounds): each implementation timed in each, the order rotating.
BENCH_ROUNDS = 2
# The forward's float64 reference runs expert by expert; beside x and out in float64 (8 bytes an
# element each) it holds one expert's weights and rows. Up to T x H = 16384 x 4096 (1 GB for x and
# out) it fits beside any variant's bench inputs; a larger call is timed without it.
REFERENCE_MAX_ELEMENTS = 16384 * 4096


def experiment_build(name: str, variant: str):
    """The experiment build generated/experiments/NAME/VARIANT (benchmarks/build_gpu_variants.py
    makes them), loaded; exits with what to run where it is not built."""
    import sys

    from .codegen import default_out
    from .runtime import Variant

    path = default_out() / "experiments" / name / variant
    if not (path / "build" / "libmokgen.so").exists():
        sys.exit(f"{path} is not built: run benchmarks/build_gpu_variants.py")
    return Variant(path)


def forward_flops(spec, tokens: int) -> float:
    """The forward's GEMM FLOPs at `tokens` tokens: gate, up and down (2 x 3 x H x I a routed
    pair) for each of the T x K pairs, and the shared expert's for each token. Padding rows and
    the dispatch and combine are not counted; the backward is twice the forward."""
    return 6.0 * tokens * spec.hidden * (spec.topk * spec.intermediate + spec.shared_intermediate)


def time_ms(fn, warmup: int = 10, iters: int = 50) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def energy_mj() -> int | None:
    """The GPU's energy counter (NVML, mJ since the driver loaded), or None without NVML."""
    try:
        import pynvml

        return pynvml.nvmlDeviceGetTotalEnergyConsumption(torch.cuda._get_pynvml_handler(None))
    except Exception:  # no NVML, or a GPU without the counter: the timings still stand
        return None


def time_with_energy(fn, warmup: int = 10, iters: int = 50) -> tuple[float, float | None, float | None]:
    """(median ms per call, mean J per call, mean W while those calls ran). Energy over a
    separate run of back-to-back calls, long enough (>= 0.3 s) for the counter's resolution.
    The power is that run's energy over its own time: NVML's board power reading averages over
    about a second and reads low after a short timing, where this one shows whether the calls
    ran at the power cap (H200: 700 W), where a figure depends on how long the GPU has been busy."""
    ms = time_ms(fn, warmup, iters)
    reps = max(iters, int(300 / max(ms, 1e-3)))
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0 = energy_mj()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    e1 = energy_mj()
    if e0 is None or e1 is None:
        return ms, None, None
    joules = (e1 - e0) / 1000
    return ms, joules / reps, joules / (start.elapsed_time(end) / 1000)


def round_order(names: list, r: int) -> list:
    """Round r's order of the implementations: rotated by r, so each takes the first place in turn."""
    return names[r % len(names):] + names[:r % len(names)]


def energy_rounds(impls: dict, rounds: int) -> dict:
    """{name: (ms, J per call, W, GPU state)}: each implementation timed with its energy
    (time_with_energy) in `rounds` rounds whose order rotates by one each round, as time_rounds
    does, and the round with its lowest median kept (with that round's energy and GPU state):
    at power-capped sizes whatever runs second follows the first's heat (4% on a training step
    at E64 T=16384, docs/perf.md), so a single round in a fixed order favours the first."""
    best = {}
    names = list(impls)
    for r in range(rounds):
        for name in round_order(names, r):
            ms, joules, watts = time_with_energy(impls[name])
            if name not in best or ms < best[name][0]:
                best[name] = (ms, joules, watts, gpu_state())
    return best


def time_rounds(impls: dict, rounds: int, rows: list, **tags) -> dict:
    """Each implementation timed (time_ms) in `rounds` interleaved rounds, every timing
    appended to rows (with tags and the GPU state), the best round's median returned per
    name: a power-capped clock late in the run then favours none of them. The order rotates
    by one each round: whatever runs first in a round follows the previous round's last (often
    torch, at lower power) and gets a cooler GPU, which at power-capped sizes is worth up to 10%
    (measured: two builds with the same GEMMs, the first in every round 0.90x the second)."""
    best = {}
    names = list(impls)
    for r in range(rounds):
        for name in round_order(names, r):
            fn = impls[name]
            ms = time_ms(fn, 10, 50)
            rows.append(dict(tags, impl=name, round=r, ms=ms, **gpu_state()))
            best[name] = min(best.get(name, ms), ms)
    return best


def gpu_state() -> dict:
    """SM clock and board power right now (NVML). The generated GEMMs can run into the
    power cap (H200: 700 W) and lose clock: these show when a figure was power-bound."""
    try:
        return dict(sm_clock_mhz=torch.cuda.clock_rate(), power_w=round(torch.cuda.power_draw() / 1000))
    except Exception:  # no NVML: the timings still stand
        return {}


def forced_call(variant, entry: str, x, ids, w, wg, wu, wd, shared=()):
    """A call of one forward entry point of `variant` (a band, the plain launch or the per-GEMM
    path, whichever T's default is) on these inputs into an output of its own, made once:
    what the probes that force an entry time, capture and compare."""
    out = x.new_empty(x.shape)

    def call():
        variant._run_forward(entry, x, dict(topk_ids=ids, topk_weights=w), wg, wu, wd, *shared, out)
        return out
    return call


def _capture(fn):
    """A CUDA graph of fn (the generated op needs no host sync, so it captures): its replay
    time is the GPU time without launch overhead. The graph holds fn, and so every tensor
    fn holds that was made outside the capture (forced_call's output): a replay writes
    where the capture did, and a tensor freed meanwhile is memory the allocator hands on or
    gives back to the driver (torch.cuda.graph empties the cache before each capture), which
    made a replay write into another buffer or fault."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.captured_fn = fn
        return g
    except Exception as e:  # report, never hide, a capture failure
        print(f"  CUDA graph capture failed: {type(e).__name__}: {e}")
        return None


def dense_peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / time_ms(lambda: a @ b, 10, 30) / 1e9


def e4m3_peak_tflops() -> float | None:
    """A dense 8192^3 e4m3 GEMM (torch._scaled_mm, fp32 accumulation, bf16 out): the e4m3
    ceiling measured in the same run, which an FP8 layer's % of peak is taken against; None
    where this torch cannot run it."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    try:
        return 2 * n ** 3 / time_ms(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16), 10, 30) / 1e9
    except (RuntimeError, TypeError):
        return None


def bench_variant(variant, tokens: list[int], baselines=BASELINES, log=print,
                  routing: str = "uniform", rounds: int = BENCH_ROUNDS, on_rows=None) -> list[dict]:
    """The forward of each implementation at each T: its output checked against the float64
    reference, its time and energy per call in `rounds` rotating rounds (energy_rounds; the
    per-expert loop, seconds a call, once). on_rows(rows so far) after each T."""
    spec = variant.spec
    rows = []
    for i, T in enumerate(tokens):
        log(f"[{i + 1}/{len(tokens)}] {variant.name} T={T}: checking, then timing in {rounds} round(s)")
        gen = torch.Generator(device="cuda").manual_seed(1234 + T)
        x, ids, w, wg, wu, wd, (sg, su, sd) = make_inputs(spec, T, routing, gen)
        flops = forward_flops(spec, T)
        ref = None
        if T * spec.hidden <= REFERENCE_MAX_ELEMENTS:
            ref = moe_reference(x, ids, w, wg, wu, wd, sg, su, sd)
        else:
            log(f"  (no float64 reference of the output at T={T}: T x H above {REFERENCE_MAX_ELEMENTS})")
        if spec.dtype == "fp8":  # (the experts quantised ahead, by the variant's kernels; rel_err is FP8's)
            experts = variant.quantize_experts_fp8(wg, wu, wd)
            impls = {"mokgen": lambda: variant.forward_fp8(x, ids, w, experts)}
        else:
            # (as mokgen.moe runs it, without its input checks: eagerly the variant's entry, not
            # the custom op, whose dispatch only torch.compile needs)
            impls = {"mokgen": lambda: variant.ops.layer(x, ids, w, wg, wu, wd, sg, su, sd)}
        w13, shared = baseline_weights(wg, wu, sg, su, sd)
        if "torch_grouped_mm" in baselines:
            impls["torch_grouped_mm"] = lambda: torch_grouped_mm(x, ids, w, w13, wd, spec.intermediate, shared)
        if "torch_loop" in baselines:
            impls["torch_loop"] = lambda: torch_loop(x, ids, w, wg, wu, wd, shared)
        graph = _capture(impls["mokgen"])
        if graph is not None:
            impls["mokgen_graph"] = graph.replay
        errs = {}
        for name, fn in impls.items():
            out = fn() if name != "mokgen_graph" else impls["mokgen"]()
            errs[name] = rel_error(out, ref) if ref is not None else None
        timed = energy_rounds({n: f for n, f in impls.items() if n != "torch_loop"}, rounds)
        if "torch_loop" in impls:
            timed["torch_loop"] = (time_ms(impls["torch_loop"], 5, 10), None, None, gpu_state())
        for name in impls:
            ms, joules, watts, st = timed[name]
            err = errs[name]
            if joules is not None:
                st.update(joules=joules, call_power_w=round(watts))
            path = variant.forward_entry(T) if name.startswith("mokgen") else None  # which forward path ran
            rows.append(dict(variant=variant.name, impl=name, T=T, ms=ms, tflops=flops / ms / 1e9, rel_err=err,
                             routing=routing, path=path, **st))
            log(f"  {variant.name} T={T} {name}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s, rel_err {_err(err)}"
                + (f", {st['sm_clock_mhz']} MHz" if "sm_clock_mhz" in st else "")
                + (f", {st['joules']:.3f} J per call, {st['call_power_w']} W while the calls ran" if "joules" in st
                   else f", {st['power_w']} W" if "power_w" in st else ""))
        torch.cuda.empty_cache()
        if on_rows:
            on_rows(with_speedups(rows))
    return with_speedups(rows)


def bench_training(variant, tokens: list[int], log=print, routing: str = "uniform",
                   rounds: int = BENCH_ROUNDS, on_rows=None) -> list[dict]:
    """Forward + backward through autograd (the output gradient fixed, parameter gradients
    reset to None between calls), the generated op against torch grouped_mm with autograd
    (a shared expert as dense bf16 matmuls). FLOPs 3x the forward's (the backward does twice
    the forward's work). The first call's gradients are checked against float64 autograd of
    the reference. Both are timed in `rounds` rotating rounds (energy_rounds). An FP8 variant
    runs mokgen.moe_fp8_train (the experts quantised on each call, every gradient in FP8).
    on_rows(rows so far) after each T."""
    from .runtime import moe, moe_fp8_train
    from .verify import GRADIENTS, SHARED_GRADIENTS

    spec = variant.spec
    rows = []
    for i, T in enumerate(tokens):
        log(f"[{i + 1}/{len(tokens)}] {variant.name} T={T} forward + backward: checking, then timing in {rounds} "
            "round(s)")
        gen = torch.Generator(device="cuda").manual_seed(4321 + T)
        x, ids, w, wg, wu, wd, shared = make_inputs(spec, T, routing, gen)
        shared = shared if shared[0] is not None else ()
        dout = torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype)
        flops = 3 * forward_flops(spec, T)
        leaves = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd) + shared]

        def ours():
            xr, wr, g, u, d, *s = leaves
            if spec.dtype == "fp8":
                moe_fp8_train(xr, ids, wr, g, u, d, check_ids=False).backward(dout)
            else:
                moe(xr, ids, wr, g, u, d, **dict(zip(("ws_gate", "ws_up", "ws_down"), s)),
                    check_ids=False).backward(dout)

        def grouped():
            xr, wr, g, u, d, *s = leaves
            experts_torch(xr, ids, wr, g, u, d, shared=s or None).backward(dout)

        ref = reference_gradients(spec, T, dout, (x, ids, w, wg, wu, wd) + tuple(shared), log)
        impls, grad_errs = {}, {}
        for name, fn in (("mokgen", ours), ("torch_grouped_mm", grouped)):
            for t in leaves:
                t.grad = None
            fn()
            grad_errs[name] = {}
            if ref is not None:
                grad_errs[name] = {k: rel_error(t.grad, ref[k]) for k, t in zip(GRADIENTS + SHARED_GRADIENTS, leaves)}

            def call(fn=fn):
                for t in leaves:
                    t.grad = None
                fn()

            impls[name] = call
        del ref  # (its float64 gradients, gigabytes at large T, are not kept while the calls are timed)
        # Energy per call too: at large T both run into the power cap, where the time
        # follows the energy a call needs.
        timed = energy_rounds(impls, rounds)
        for name in impls:
            errs = grad_errs[name]
            ms, joules, watts, st = timed[name]
            if joules is not None:
                st.update(joules=joules, call_power_w=round(watts))
            worst = max(errs.values()) if errs else None
            rows.append(dict(variant=variant.name, impl=name, T=T, ms=ms, tflops=flops / ms / 1e9, rel_err=worst,
                             grad_errors=errs, routing=routing, path="forward+backward", **st))
            log(f"  {variant.name} T={T} {name} fwd+bwd: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s, worst "
                f"gradient rel_err {_err(worst)}" + (f", {st['sm_clock_mhz']} MHz" if "sm_clock_mhz" in st else "")
                + (f", {st['call_power_w']} W while the calls ran" if "call_power_w" in st else ""))
        torch.cuda.empty_cache()
        if on_rows:
            on_rows(with_speedups(rows))
    return with_speedups(rows)


def reference_gradients(spec, T: int, dout, inputs: tuple, log=print):
    """float64 autograd of the reference (moe_reference_backward) where it fits in what the GPU
    has free (verify.reference_backward_bytes: E64 T=16384 about 16 GB, E256 about 180 GB
    whatever T), else None, and the log says why no gradient error is given."""
    from .reference import moe_reference_backward
    from .verify import free_gpu_bytes, reference_backward_bytes

    need, free = reference_backward_bytes(spec, T), free_gpu_bytes()
    if need > free:
        log(f"  (no float64 reference of the gradients at T={T}: it needs about {need / 2**30:.1f} GiB, "
            f"{free / 2**30:.1f} GiB free)")
        return None
    return moe_reference_backward(dout, *inputs)


def _err(err, width: int = 0) -> str:
    """A relative error for the log and the table; "-" where no reference was computed (None)."""
    return f"{'-' if err is None else format(err, '.1e' if width else '.2e'):>{width}}"


def format_table(rows: list[dict], peak: float) -> str:
    """The bench table. W: the mean power while back-to-back calls ran (time_with_energy), or
    NVML's board power reading where the energy counter is missing."""
    head = (f"{'variant':34s} {'T':>6s} {'impl':17s} {'ms':>9s} {'TFLOP/s':>8s} {'x grouped':>9s} {'% peak':>7s} "
            f"{'rel_err':>8s} {'MHz':>5s} {'W':>4s} {'J/call':>7s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['speedup_vs_grouped_mm']:.2f}x" if r.get("speedup_vs_grouped_mm") else "-"
        lines.append(f"{r['variant']:34s} {r['T']:6d} {r['impl']:17s} {r['ms']:9.3f} {r['tflops']:8.1f} "
                     f"{ratio:>9s} {100 * r['tflops'] / r.get('peak_tflops', peak):6.1f}% {_err(r['rel_err'], 8)} "
                     f"{r.get('sm_clock_mhz', '-'):>5} {r.get('call_power_w', r.get('power_w', '-')):>4} "
                     f"{format(r['joules'], '.3f') if 'joules' in r else '-':>7}")
    return "\n".join(lines)


def save_result(json_path: Path, result: dict) -> None:
    """The result as JSON at json_path, written whole or not at all."""
    write_text_atomic(json_path, json.dumps(result, indent=1))


def run(variants, tokens, json_path: Path | None, baselines, log=print, backward: bool = False,
        rounds: int = BENCH_ROUNDS) -> dict:
    """backward: time forward + backward (bench_training) instead of the forward. rounds: how
    many rotating rounds each implementation is timed in (energy_rounds), the best kept.
    The JSON is rewritten after every T with "complete": false, so a run that crashes or is
    interrupted keeps what it measured; the finished run writes "complete": true and the plot."""
    if not torch.cuda.is_available():
        raise RuntimeError("mokgen bench needs a CUDA GPU")
    peak = dense_peak_tflops()
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__}: dense bf16 8192^3 = {peak:.0f} TFLOP/s")
    # An FP8 layer's % of peak is against the dense e4m3 GEMM's (about twice bf16's)
    peak_e4m3 = e4m3_peak_tflops() if any(v.spec.dtype == "fp8" for v in variants) else None
    if peak_e4m3:
        log(f"dense e4m3 8192^3 = {peak_e4m3:.0f} TFLOP/s (the FP8 rows' % peak)")
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dense_peak_tflops=peak,
                  dense_peak_tflops_e4m3=peak_e4m3, complete=False, rows=[])

    def with_peaks(v, rows: list) -> list:
        for r in rows:
            r["peak_tflops"] = peak_e4m3 if v.spec.dtype == "fp8" and r["impl"].startswith("mokgen") and peak_e4m3 \
                else peak
        return rows

    rows = []
    if json_path:  # (an older run's file at this path is replaced at once, never mistaken for this one's)
        save_result(json_path, result)
    try:
        for v in variants:
            def checkpoint(so_far, v=v):
                if json_path:
                    save_result(json_path, dict(result, rows=rows + with_peaks(v, so_far)))

            new = bench_training(v, tokens, log, rounds=rounds, on_rows=checkpoint) if backward \
                else bench_variant(v, tokens, baselines, log, rounds=rounds, on_rows=checkpoint)
            rows += with_peaks(v, new)
    except BaseException as e:  # (KeyboardInterrupt too) say where the rows measured so far are
        if json_path:
            log(f"bench stopped ({type(e).__name__}): what it measured before is in {json_path} (complete: false)")
        raise
    result.update(rows=rows, complete=True)
    log(format_table(rows, peak))
    if json_path:
        save_result(json_path, result)
        log(f"wrote {json_path}")
        png = plot(result, Path(json_path).with_suffix(".png"))
        if png:
            log(f"wrote {png}")
    return result


def with_speedups(rows: list) -> list:
    """Each row's speedup_vs_grouped_mm: torch grouped_mm's time at its T over its own (None
    where grouped_mm did not run at that T)."""
    base = {r["T"]: r["ms"] for r in rows if r["impl"] == "torch_grouped_mm"}
    for r in rows:
        r["speedup_vs_grouped_mm"] = base[r["T"]] / r["ms"] if r["T"] in base else None
    return rows


def plot(result: dict, path: Path):
    """TFLOP/s against T for every implementation (one panel per variant). Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    variants = sorted({r["variant"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(variants), figsize=(6 * len(variants), 4.2), squeeze=False)
    for ax, v in zip(axes[0], variants):
        rows = [r for r in result["rows"] if r["variant"] == v]
        for impl in sorted({r["impl"] for r in rows}):
            pts = sorted((r["T"], r["tflops"]) for r in rows if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.axhline(result["dense_peak_tflops"], color="gray", ls="--", lw=1, label="dense bf16 GEMM (torch)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("TFLOP/s (forward)" if rows[0].get("path") != "forward+backward" else "TFLOP/s (forward+backward)")
        ax.set_title(v, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"mokgen bench on {result['device']} (torch {result['torch']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
