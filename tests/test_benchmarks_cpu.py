"""The benchmark scripts' own checks, which run before any GPU work (no GPU needed)."""
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench_module(name: str):
    """A script under benchmarks/, imported as a module (the folder is not a package)."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "anchor_compare.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_anchor_compare_refuses_unknown_cases_and_a_missing_script(tmp_path):
    r = run("--cases", "e64_t16384,e9_t1")
    assert r.returncode == 2 and "unknown case(s) e9_t1" in r.stderr and "e64_t16384" in r.stderr
    r = run("--anchor", str(tmp_path / "nope.py"))
    assert r.returncode == 1 and "the anchor script is not at" in r.stderr and "--anchor" in r.stderr


def test_anchor_compare_covers_the_targets_shapes():
    CASES = bench_module("anchor_compare").CASES
    # (T, H, I, E, K): the forward targets' layers and token counts, and the small-T ones
    want = {(16384, 2048, 1024, 64, 8), (4096, 2048, 1024, 64, 8), (16384, 2048, 768, 128, 8),
            (8192, 7168, 2048, 256, 8)} | {(t, 2048, 1024, 64, 8) for t in (64, 256, 1024)}
    assert want <= set(CASES.values())


def test_anchor_rounds_keep_each_implementations_best_of_either_order():
    """--rounds: each implementation's best forward and best forward + backward over the rounds
    (run in swapped orders), the grouped baseline's row first; a failed backward (NaN) never wins."""
    best_of_rounds = bench_module("anchor_compare").best_of_rounds
    row = lambda impl, rnd, fwd, fb: dict(impl=impl, round=rnd, fwd_ms=fwd, fwd_tflops=1 / fwd, fb_ms=fb,  # noqa: E731
                                          fb_tflops=1 / fb)
    runs = [row("grouped", 0, 2.0, 6.0), row("mokgen", 0, 1.1, float("nan")),
            row("mokgen", 1, 1.0, 3.2), row("grouped", 1, 2.2, 5.8)]
    best = best_of_rounds(runs)
    assert [b["impl"] for b in best] == ["grouped", "mokgen"]
    assert (best[0]["fwd_ms"], best[0]["fb_ms"], best[0]["fb_tflops"]) == (2.0, 5.8, 1 / 5.8)
    assert (best[1]["fwd_ms"], best[1]["fwd_tflops"], best[1]["fb_ms"]) == (1.0, 1.0, 3.2)
    assert [r["round"] for r in best[1]["rounds"]] == [0, 1]


def test_anchor_compare_says_where_the_baseline_computes_no_reference():
    """The design's script checks against float64 only up to T*H = 4096*2048; above it the
    error column says so instead of printing nan."""
    err_text = bench_module("anchor_compare").err_text
    assert err_text(float("nan")) == "no ref" and err_text(2.87e-3) == "2.9e-03"


def test_interleaved_rounds_rotate_which_implementation_goes_first(monkeypatch):
    """At power-capped sizes the first timing of a round gets the coolest GPU: every
    implementation takes that place in turn, and the best round is kept per implementation."""
    import mokgen.bench as bench

    order, fake_ms = [], iter(range(100, 0, -1))
    monkeypatch.setattr(bench, "time_ms", lambda fn, warmup, iters: (order.append(fn()), next(fake_ms))[1])
    monkeypatch.setattr(bench, "gpu_state", lambda: {})
    rows = []
    best = bench.time_rounds({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, 3, rows, T=1)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [r["round"] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2] and rows[0]["T"] == 1
    assert best == {"a": 93, "b": 92, "c": 94}


def test_a_captured_graph_keeps_what_its_callable_holds_alive(monkeypatch):
    """A replay writes where the capture did: the output a forced call made outside the
    capture must live as long as the graph, not as long as the caller's variable (a probe
    that dropped it had its replays write into freed memory, and fault once torch gave the
    memory back to the driver)."""
    import contextlib
    import gc
    import weakref

    import mokgen.bench as bench

    class Graph:  # (torch.cuda.CUDAGraph's Python class takes attributes too)
        def replay(self):
            pass

    class Stream:
        def wait_stream(self, other):
            pass

    fake = dict(Stream=Stream, current_stream=Stream, stream=lambda s: contextlib.nullcontext(), CUDAGraph=Graph,
                graph=lambda g: contextlib.nullcontext())
    for name, value in fake.items():
        monkeypatch.setattr(bench.torch.cuda, name, value, raising=False)

    class Out:
        pass

    def forced(out):
        return lambda: out
    out = Out()
    alive = weakref.ref(out)
    replay = bench._capture(forced(out)).replay
    del out
    gc.collect()
    assert alive() is not None, "the graph let go of the output its replays write"
    del replay
    gc.collect()
    assert alive() is None


def test_bench_rounds_rotate_and_keep_each_implementations_best_round_with_its_energy(monkeypatch):
    """mokgen bench times every implementation in rotating rounds (energy_rounds): each takes
    the first place in turn, and the round with its lowest median is kept with that round's
    energy, power and GPU state."""
    import mokgen.bench as bench

    order, ms = [], iter([5.0, 9.0, 4.0, 9.5])  # round 0: a, b; round 1: b, a
    monkeypatch.setattr(bench, "time_with_energy", lambda fn: (order.append(fn()), next(ms), len(order), 700.0)[1:])
    monkeypatch.setattr(bench, "gpu_state", lambda: {"at": len(order)})
    best = bench.energy_rounds({"a": lambda: "a", "b": lambda: "b"}, 2)
    assert order == ["a", "b", "b", "a"]
    assert best == {"a": (5.0, 1, 700.0, {"at": 1}), "b": (4.0, 3, 700.0, {"at": 3})}


def test_bench_keeps_what_it_measured_when_a_run_stops(monkeypatch, tmp_path):
    """mokgen bench rewrites its JSON after every T (complete: false), so a run that crashes or
    is interrupted at a later T keeps the rows of the earlier ones; an older file at the path
    is replaced at the start; a finished run writes complete: true."""
    import json
    import types

    import mokgen.bench as bench

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(bench, "dense_peak_tflops", lambda: 800.0)
    monkeypatch.setattr(bench, "plot", lambda result, path: None)

    def fake_bench(variant, tokens, baselines, log, rounds, on_rows):
        rows = []
        for T in tokens:
            if T == 4096:
                raise KeyboardInterrupt
            rows += [dict(variant=variant.name, impl=i, T=T, ms=ms, tflops=1.0, rel_err=None)
                     for i, ms in (("mokgen", 1.0), ("torch_grouped_mm", 3.0))]
            on_rows(bench.with_speedups(rows))
        return bench.with_speedups(rows)

    monkeypatch.setattr(bench, "bench_variant", fake_bench)
    v = types.SimpleNamespace(name="v", spec=types.SimpleNamespace(dtype="bf16"))
    path = tmp_path / "out" / "bench.json"
    path.parent.mkdir()
    path.write_text(json.dumps(dict(complete=True, rows=[dict(T=1, impl="old")])))
    logs = []
    with pytest.raises(KeyboardInterrupt):
        bench.run([v], [64, 1024, 4096], path, ("torch_grouped_mm",), log=logs.append)
    kept = json.loads(path.read_text())
    assert kept["complete"] is False and kept["device"] == "fake GPU"
    assert [(r["T"], r["impl"]) for r in kept["rows"]] == [(64, "mokgen"), (64, "torch_grouped_mm"),
                                                           (1024, "mokgen"), (1024, "torch_grouped_mm")]
    assert kept["rows"][0]["speedup_vs_grouped_mm"] == 3.0 and kept["rows"][0]["peak_tflops"] == 800.0
    assert any("complete: false" in line and str(path) in line for line in logs)
    assert not list(path.parent.glob(".*.tmp"))
    done = bench.run([v], [64, 256], path, ("torch_grouped_mm",), log=logs.append)
    assert json.loads(path.read_text()) == json.loads(json.dumps(done)) and done["complete"] is True
    assert [r["T"] for r in done["rows"]] == [64, 64, 256, 256]


def test_forward_flops_count_the_routed_pairs_and_the_shared_expert():
    """TFLOP/s in `mokgen bench` and benchmarks/small_t.py come from one count: 2 x 3 x H x I per
    routed pair (gate, up, down) and 2 x 3 x H x S per token for a shared expert of size S."""
    from mokgen.bench import forward_flops
    from mokgen.ir import MoESpec

    olmoe = MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024)
    assert forward_flops(olmoe, 1024) == 2 * 3 * 2048 * 1024 * 1024 * 8  # 103 GFLOP: 0.260 ms is 396 TFLOP/s
    shared = MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=768)
    assert forward_flops(shared, 7) == 6 * 7 * 1024 * (4 * 512 + 768)
    assert forward_flops(olmoe, 0) == 0


def test_bench_table_gives_the_power_while_the_calls_ran():
    """The W column is the energy counter's mean over the timed calls where there is one (NVML's
    board reading averages over about a second and reads low after a short timing), else the
    board reading."""
    from mokgen.bench import format_table

    row = dict(variant="v", T=1024, impl="mokgen", ms=0.266, tflops=388.0, speedup_vs_grouped_mm=3.7, rel_err=3e-3,
               sm_clock_mhz=1500, power_w=577, joules=0.191, call_power_w=718)
    board = {k: v for k, v in row.items() if k not in ("joules", "call_power_w")}
    calls_line, board_line = format_table([row, board], peak=780.0).splitlines()[2:]
    assert calls_line.split()[-2:] == ["718", "0.191"]
    assert board_line.split()[-2:] == ["577", "-"]
    assert calls_line.split()[7] == "3.0e-03"
    # past the size of the float64 reference no error is computed: "-", not nan (None in the JSON)
    unchecked = format_table([dict(row, rel_err=None)], peak=780.0).splitlines()[2]
    assert unchecked.split()[7] == "-" and "nan" not in unchecked


def test_stage_builds_copies_what_the_runtime_loads(tmp_path):
    """stage_builds.py copies each matching variant's manifest, library and hierarchy in generated/'s
    layout (and nothing else), refuses a copy over --max-mb before writing, and names unbuilt ones."""
    import os

    home, dest = tmp_path / "generated", tmp_path / "staged"
    for rel, files in {"e64_a_sm90a": ("manifest.json", "build/libmokgen.so", "build/gemm.cubin", "gemm.py"),
                       "e64_a_w2nvlink_n2_sm90a": ("hierarchy.json",),
                       "experiments/ep_x/e64_a_w2nvlink_sm90a": ("manifest.json", "build/libmokgen.so"),
                       "experiments/other/e64_a_sm90a": ("manifest.json", "build/libmokgen.so")}.items():
        for f in files:
            (home / rel / f).parent.mkdir(parents=True, exist_ok=True)
            (home / rel / f).write_bytes(b"x" * 1000)
    env = dict(os.environ, MOKGEN_HOME=str(home))

    def stage(*args):
        return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stage_builds.py"), str(dest), *args],
                              capture_output=True, text=True, timeout=120, env=env)

    r = stage("--set", "twogpu")
    assert r.returncode == 0, r.stderr
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == ["e64_a_sm90a/build/libmokgen.so", "e64_a_sm90a/manifest.json",
                   "e64_a_w2nvlink_n2_sm90a/hierarchy.json",
                   "experiments/ep_x/e64_a_w2nvlink_sm90a/build/libmokgen.so",
                   "experiments/ep_x/e64_a_w2nvlink_sm90a/manifest.json"]
    r = stage("experiments/other/*")  # DEST emptied first: only this one now
    assert r.returncode == 0 and sorted(p.name for p in dest.rglob("*") if p.is_file()) == ["libmokgen.so",
                                                                                        "manifest.json"]
    r = stage("--max-mb", "0.001")
    assert r.returncode == 1 and "over --max-mb" in r.stderr and (dest / "experiments").exists()
    r = stage("nothing_*")
    assert r.returncode == 1 and "no built variant" in r.stderr
    dest = tmp_path / "home.tar.xz"  # an archive: the same files, compressed; the limit is the archive's
    r = stage("--set", "twogpu", "--max-mb", "0.05")
    assert r.returncode == 0 and "packed into" in r.stdout, r.stderr
    with tarfile.open(dest) as tar:
        assert sorted(m.name for m in tar.getmembers() if m.isfile()) == got
    assert not list(tmp_path.glob("*.part"))
    r = stage("--set", "twogpu", "--max-mb", "0.00001")
    assert r.returncode == 1 and "over --max-mb" in r.stderr and not list(tmp_path.glob("*.part"))
    (home / "e64_a_sm90a" / "build" / "libmokgen.so").unlink()
    r = stage("e64_a_sm90a")
    assert r.returncode == 1 and "not compiled: e64_a_sm90a" in r.stderr


def test_plan_fingerprints_tell_a_changed_plan_and_a_changed_refusal():
    """benchmarks/plan_fingerprints.py (the guard of a refactor of the planning code): the same
    spec gives the same fingerprint, another override another one, a refused spec its error,
    and compare lists every difference and every case only one side has."""
    pf = bench_module("plan_fingerprints")
    compare, fingerprint = pf.compare, pf.fingerprint
    from mokgen.ir import MoESpec

    spec = MoESpec(experts=8, topk=2, hidden=256, intermediate=128)
    a = fingerprint(spec, None)
    assert a == fingerprint(spec, None) and len(a) == 64
    assert fingerprint(spec, {"fuse_gemms": False}) != a
    assert fingerprint(spec, {"no_such_override": 1}).startswith("error PlanError")
    before = {"x": a, "y": "error PlanError: no", "gone": a}
    after = {"x": a, "y": "error PlanError: other words", "new": a}
    assert compare(before, before) == []
    assert [line.split(":")[0] for line in compare(before, after)] == ["gone", "new", "y"]


def test_plan_fingerprints_with_sources_tell_a_changed_render(monkeypatch):
    """plan_fingerprints.py write --sources (the guard of a template refactor): the rendered
    tree's hash follows the Plan's, and compare says when only the sources differ."""
    plan_fingerprints = bench_module("plan_fingerprints")
    from mokgen.ir import MoESpec

    spec = MoESpec(experts=8, topk=2, hidden=256, intermediate=128)
    a = plan_fingerprints.fingerprint(spec, None, sources=True)
    plan_hash, src_hash = a.split(" ")
    assert plan_hash == plan_fingerprints.fingerprint(spec, None)
    assert len(src_hash) == 64 and a == plan_fingerprints.fingerprint(spec, None, sources=True)
    real_render = plan_fingerprints.render
    monkeypatch.setattr(plan_fingerprints, "render", lambda plan: {
        **real_render(plan), "launch.c": real_render(plan)["launch.c"] + "// changed\n"})
    b = plan_fingerprints.fingerprint(spec, None, sources=True)
    assert b.split(" ")[0] == plan_hash and b != a
    assert plan_fingerprints.compare({"x": a}, {"x": b})[0].startswith("x: the rendered sources:")
    assert plan_fingerprints.compare({"x": a}, {"x": plan_hash})[0].startswith(
        "x: sources fingerprinted on one side only")


def test_ncu_call_summarises_each_kernels_bytes_and_rate(tmp_path):
    """ncu_call.py --summary reads ncu's CSV (one row per metric, its log lines before) back into
    one line per kernel: the bytes into the SMs over the kernel's time is the rate it prints."""
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')
    rows = [("0", "kernel_gemm_fused", "gpu__time_duration.sum", "ns", "250,000"),
            ("0", "kernel_gemm_fused", "l1tex__m_xbar2l1tex_read_bytes.sum", "byte", "1,500,000,000"),
            ("0", "kernel_gemm_fused", "sm__cycles_elapsed.avg.per_second", "hz", "1,500,000,000.00"),
            ("0", "kernel_gemm_fused", "lts__t_sectors_srcunit_ltcfabric.sum", "sector", "15,000,000"),
            ("0", "kernel_gemm_fused", "lts__ltcfabric2ltc_cycles_active.avg.pct_of_peak_sustained_elapsed", "%",
             "84.1"),
            ("1", "kernel_combine", "gpu__time_duration.sum", "usecond", "10")]
    csv = tmp_path / "n.csv"
    csv.write_text("==PROF== Connected to process 1\n" + head + "".join(
        f'"{i}","1","python3","h","{k}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler '
        f'metrics","{m}","{u}","{v}"\n' for i, k, m, u, v in rows))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ncu_call.py"), "--summary", str(csv)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    fused = next(ln for ln in r.stdout.splitlines() if ln.startswith("kernel_gemm_fused")).split()
    assert fused[1:3] == ["250.0", "1500"] and fused[5:7] == ["1500.0", "6.00"] and fused[8:10] == ["480.0", "84.1"]
    assert r.stdout.splitlines()[-1].split()[1] == "260.0"  # the call: both kernels' time


def test_ncu_call_refuses_a_build_for_a_path_that_is_a_build_itself():
    """--build NAME profiles an experiment build on the one_launch or train path; the multi and
    apart paths are experiment builds already, so asking for both is an error before any GPU work."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ncu_call.py"), "--path", "multi", "--build", "x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--build goes with --path one_launch or train" in r.stderr


@pytest.mark.parametrize("probe, bad_args", [("l2_homes", ["3", "1"]), ("l2_near_stream", ["12"]),
                                             ("l2_multicast", ["0"]), ("dsmem_rows", ["0"])])
def test_l2_probes_compile_and_check_their_arguments(tmp_path, probe, bad_args):
    """The L2 probes (benchmarks/l2_homes.cu, l2_near_stream.cu, l2_multicast.cu and dsmem_rows.cu,
    run on a GPU by gpu_session.sh l2homes, l2stream, l2mcast and dsmem) build for sm_90a
    (compute_90a: wgmma and setmaxnreg have no plain sm_90 form), and refuse arguments they cannot use
    (a stride that does not divide a 2 MB page; a buffer not a multiple of 8 MiB; no timed
    launch) before they touch a GPU."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    exe = tmp_path / probe
    r = subprocess.run([nvcc, "-gencode", "arch=compute_90a,code=sm_90a", "-O2", "-std=c++17", "-o", str(exe),
                        str(ROOT / "benchmarks" / f"{probe}.cu")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(exe), *bad_args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage" in r.stdout


def test_compare_training_needs_something_to_compare():
    """compare_training.py refuses a run with neither experiment builds nor kernels to skip, and
    token counts that are not integers, before it loads torch or touches a GPU."""
    script = str(ROOT / "benchmarks" / "compare_training.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "nothing to compare" in r.stderr
    r = subprocess.run([sys.executable, script, "--skip", "bwd_swiglu", "--tokens", "x"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--tokens must be comma-separated integers" in r.stderr


def test_bench_rows_get_their_speedup_over_grouped_mm_at_the_same_token_count():
    from mokgen.bench import with_speedups

    rows = with_speedups([dict(T=64, impl="mokgen", ms=0.2), dict(T=64, impl="torch_grouped_mm", ms=0.6),
                          dict(T=1024, impl="mokgen", ms=0.25)])
    assert [r["speedup_vs_grouped_mm"] for r in rows] == [pytest.approx(3.0), pytest.approx(1.0), None]


def test_bench_checks_gradients_against_float64_wherever_the_reference_fits(monkeypatch):
    """`mokgen bench --backward` gives a gradient error at every T whose float64 autograd fits in
    the GPU's free memory (E64 T=16384, [training]'s shape, takes about 16 GB), and says why where
    it does not, instead of a bare "-"."""
    import mokgen.reference
    import mokgen.verify
    from mokgen.bench import reference_gradients
    from mokgen.ir import MoESpec

    calls, lines = [], []
    monkeypatch.setattr(mokgen.reference, "moe_reference_backward", lambda *a: calls.append(a) or {"dx": 1})
    olmoe = MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024)
    need = mokgen.verify.reference_backward_bytes(olmoe, 16384)
    assert 8 * 2**30 < need < 24 * 2**30
    monkeypatch.setattr(mokgen.verify, "free_gpu_bytes", lambda: 70 * 2**30)
    assert reference_gradients(olmoe, 16384, "dout", ("x", "ids"), lines.append) == {"dx": 1}
    assert calls == [("dout", "x", "ids")] and lines == []
    monkeypatch.setattr(mokgen.verify, "free_gpu_bytes", lambda: 4 * 2**30)
    assert reference_gradients(olmoe, 16384, "dout", ("x", "ids"), lines.append) is None
    assert len(calls) == 1 and "needs about" in lines[0] and "4.0 GiB free" in lines[0]


def test_band_probe_sizes_a_forced_band_and_refuses_bad_tokens_before_any_gpu_work():
    probe = bench_module("band_probe")
    # each expert's rows padded to whole tiles: what a band forced at T must find room for
    assert probe.tile_rows([0, 1, 160, 161], 160) == 0 + 160 + 160 + 320
    assert probe.entry_rows("forward_n144") == 144 and probe.entry_rows("forward_fused") == 0
    for bad in (["--tokens", "1,x"], ["--tokens", "0"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as e:
            probe.main(bad)
        assert e.value.code == 2, bad


def test_graph_replays_reads_entries_per_t_and_refuses_bad_arguments_before_any_gpu_work():
    replays = bench_module("graph_replays")
    assert replays.entries_per_t("forward_fused,forward", 2) == [["forward_fused", "forward"]] * 2
    assert replays.entries_per_t("forward;forward_fused", 2) == [["forward"], ["forward_fused"]]
    for bad in (["--tokens", "16,x"], ["--tokens", "0"], ["--replays", "0"], ["--entries", "a;b;c"],
                ["--guard", "middle"]):
        with pytest.raises(SystemExit) as e:
            replays.main(bad)
        assert e.value.code == 2, bad



def test_guard_pages_refuses_bad_arguments_before_any_gpu_work():
    guard = bench_module("guard_pages")
    for bad in (["--tokens", "16,x"], ["--tokens", "0"], ["--align", "8"], ["--side", "middle"]):
        with pytest.raises(SystemExit) as e:
            guard.main(bad)
        assert e.value.code == 2, bad


def test_combine_tail_finds_when_each_token_can_be_summed(tmp_path, capsys):
    tail = bench_module("combine_tail")
    # 2 CTAs; 2 experts in M tiles of 2 rows; a gate/up and 2 down tiles per M tile. Expert 0 holds
    # 3 rows (two M tiles), expert 1 one row (one M tile): tokens 0 and 1 land in expert 0's first M
    # tile, token 2's expert-0 row in its second, token 1's and token 2's expert-1 rows in M tile 2.
    ids = [[0, -1], [0, 1], [1, 0]]
    params = dict(prof_cta_rows=2, n_size=128, tile_n=128, n2_tiles=2, n2_size=256, tile_m=2,
                  combine_parts=[1, 2, 4])
    us = 1000
    phases = [[0, 0, 5 * us], [1, 0, 5 * us], [0, 60 * us, 70 * us], [1, 50 * us, 70 * us]]
    gateup = [[0, 5 * us, 20 * us], [1, 5 * us, 20 * us], [0, 20 * us, 30 * us]]
    down = [[1, 20 * us, 30 * us], [0, 30 * us, 40 * us],  # M tile 0 done at 40 us
            [1, 30 * us, 45 * us], [1, 45 * us, 50 * us],  # M tile 1 at 50
            [0, 40 * us, 55 * us], [0, 55 * us, 60 * us]]  # M tile 2 at 60: the last tile
    rows = phases + gateup + down + [[0, 0, 0]] * 4  # (unused tiles' rows stay zero)
    assert tail.m_tiles_done(rows, params) == [40 * us, 50 * us, 60 * us]
    assert tail.tokens_ready(ids, [40.0, 50.0, 60.0], 2, 2) == [40.0, 60.0, 60.0]
    with pytest.raises(ValueError, match="fills 2 M tiles"):
        tail.tokens_ready([[0], [1]], [40.0, 50.0, 60.0], 2, 2)
    # 3 tokens, 2 CTAs of 1 warp: 2 parts a token would give a warp 3 tasks, so 1 part
    assert tail.combine_parts(3, params, 2, 1) == 1 and tail.combine_parts(3, params, 2, 2) == 1
    assert tail.combine_parts(3, params, 2, 4) == 2
    a = tail.analyse(dict(rows=rows, params=params, ids=ids, experts=2), warps=1)
    assert a["last_tile_us"] == 60 and a["end_us"] == 70 and a["after_us"] == 10
    assert a["ready_before"]["20"] == pytest.approx(1 / 3) and a["ready_before"]["0.5"] == pytest.approx(1 / 3)
    # the warps free at 50 and 60 us take tokens 0 (ready) and 1 (at 60), the first of them token 2
    # (at 60): the model ends at 70 with tasks of 10 us, the last one starting as the last tile ends
    assert a["task_us"] == pytest.approx(10.0) and a["model_token_order_after_us"] == pytest.approx(10.0)
    # tasks of 1 us + 1 us a KB (a token's 2 rows of 256 bf16: 1 KB): 2 us whole, 1.5 us in halves
    a = tail.analyse(dict(rows=rows, params=params, ids=ids, experts=2), warps=1, task_cost=(1.0, 1.0))
    assert a["model_parts_after_us"]["1"] == pytest.approx(2.0)  # token 2 at 60 on the warp free since 50 + 2
    assert a["model_parts_after_us"]["2"] == pytest.approx(3.0)  # tokens 1 and 2 ready at 60: 4 halves, 2 warps
    # replayed claims: the CTAs free at 5 us take the tiles in order as recorded (15, 15, 10 us; then the
    # down tiles 10, 10, 15, 5, 15, 5 us): both free at 45 us before the last two, so the last ends at 60;
    # those two in halves of 0.6 (9, 9, 3, 3 us) end at 57
    assert tail.replay_claims(rows, params) == 60 * us
    assert tail.replay_claims(rows, params, split_last=2, half=0.6) == pytest.approx(57 * us)
    saved = tmp_path / "tail.json"
    saved.write_text(__import__("json").dumps(dict(cases={"T=3 run 0": dict(rows=rows, params=params, ids=ids,
                                                                            experts=2)})))
    assert tail.main(["--from-json", str(saved)]) == 0
    assert "T=3 run 0: last tile 60.0 us, combine ends 70.0 (+10.0)" in capsys.readouterr().out
    for bad in (["--tokens", "1,x"], ["--tokens", "0"], ["--runs", "0"], ["--task-cost", "1"],
                ["--task-cost", "1,-1"], ["--split-last", "0"], ["--half", "1.5"]):
        with pytest.raises(SystemExit) as e:
            tail.main(bad)
        assert e.value.code == 2, bad
