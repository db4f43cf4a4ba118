"""Golden tests of the generated forward on the GPU, against the float64 reference.

Fresh random inputs every run; uniform and skewed routing (empty experts, one hot
expert); odd token counts; every workspace buffer and the output poisoned with NaN
before each launch.
"""
import math

import pytest

from mokgen.ir import MoESpec

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

# (experts, topk, hidden, intermediate, shared intermediate)
SHAPES = [
    (64, 8, 2048, 1024, 0),  # OLMoE-1B-7B
    (128, 8, 2048, 768, 0),  # Qwen3-30B-A3B
    (8, 2, 4096, 14336, 0),  # Mixtral-8x7B
    (40, 6, 1536, 640, 0),  # small and odd
    (16, 4, 1024, 512, 768),  # with a shared expert
]
TOKENS = [1, 7, 1000, 4096, 16384]
TOL = 1e-2


def spec_of(shape):
    E, K, H, I, S = shape
    return MoESpec(experts=E, topk=K, hidden=H, intermediate=I, shared_intermediate=S)


def make_inputs(shape, T, routing, gen):
    from mokgen.verify import make_inputs as mk

    return mk(spec_of(shape), T, routing, gen)


@pytest.fixture(scope="module")
def gen():
    import random

    g = torch.Generator(device="cuda")
    g.manual_seed(random.SystemRandom().randrange(2**31))  # fresh inputs every run
    return g


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "e{}k{}h{}i{}s{}".format(*s))
def test_forward_golden(shape, T, routing, gen):
    import mokgen
    from mokgen.verify import check_forward

    r = check_forward(mokgen.load(spec_of(shape)), T, routing, gen)
    assert not r.unwritten, "unwritten or NaN output rows"
    assert r.rel_error <= TOL, f"relative error {r.rel_error:.3e} > {TOL}"


def test_public_api_matches_variant(gen):
    import mokgen
    from mokgen.reference import moe_reference, rel_error

    shape = SHAPES[0]
    x, ids, w, wg, wu, wd, _ = make_inputs(shape, 513, "uniform", gen)
    out = mokgen.moe(x, ids.long(), w, wg, wu, wd)
    assert rel_error(out, moe_reference(x, ids, w, wg, wu, wd)) <= TOL


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_deterministic_bits(routing, gen):
    """20 runs, identical bits; skewed routing has one hot expert and empty ones. The tile
    scheduler hands tiles to whichever CTA is free, so this also shows the order does not
    leak into the result."""
    import mokgen

    shape = SHAPES[0]
    x, ids, w, wg, wu, wd, _ = make_inputs(shape, 4096, routing, gen)
    v = mokgen.load(spec_of(shape))
    first = v.forward(x, ids, w, wg, wu, wd)
    for _ in range(19):
        assert torch.equal(v.forward(x, ids, w, wg, wu, wd), first)


def test_cuda_graph_capture_and_replay(gen):
    import mokgen

    for err in capture_and_replay(mokgen.moe, SHAPES[0], ("skewed",), gen):
        assert err <= TOL


def test_graphs_captured_after_a_dropped_one_keep_their_dispatch_counters(gen):
    """The single launch's dispatch counters (state buffers) of a capture stream are made outside
    the capture: a graph captured after an earlier one on the same stream was dropped, and its
    memory handed out again, replays with the eager bits (made inside the first capture, they
    lived in its memory pool and went with it). A first call inside a capture is refused."""
    import mokgen
    from mokgen.runtime import InputError, Variant

    v = Variant(mokgen.load(spec_of(SHAPES[0])).path)  # (a fresh instance: no state yet)
    x, ids, w, wg, wu, wd, _ = make_inputs(SHAPES[0], 64, "skewed", gen)
    s = torch.cuda.Stream()
    with pytest.raises(InputError, match="call it once outside the capture first"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=s):
            v.forward(x, ids, w, wg, wu, wd)
    want = v.forward(x, ids, w, wg, wu, wd)
    s = torch.cuda.Stream()
    for attempt in range(3):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = v.forward(x, ids, w, wg, wu, wd)
        for _ in range(3):
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), attempt
        del g, out
        torch.cuda.empty_cache()
        junk = torch.full((1 << 24,), 7, dtype=torch.int32, device="cuda")  # (the freed memory, written over)
        del junk
    v.check_errors()


def capture_and_replay(forward, shape, routings, gen):
    """Capture forward(x, ids, w, wg, wu, wd) once in a CUDA graph at T=1000, then replay it
    with fresh inputs of each routing copied into the captured tensors; yields each replay's
    relative error against the float64 reference."""
    from mokgen.reference import moe_reference, rel_error

    x, ids, w, wg, wu, wd, _ = make_inputs(shape, 1000, "uniform", gen)
    forward(x, ids, w, wg, wu, wd)  # load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = forward(x, ids, w, wg, wu, wd)
    for routing in routings:
        x2, ids2, w2, *_ = make_inputs(shape, 1000, routing, gen)
        x.copy_(x2)
        ids.copy_(ids2)
        w.copy_(w2)
        g.replay()
        torch.cuda.synchronize()
        yield rel_error(out, moe_reference(x, ids, w, wg, wu, wd))


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "e{}k{}".format(*s))
def test_route_golden(shape, renormalize, gen):
    import dataclasses

    import mokgen
    from mokgen.reference import route_reference

    E, K = shape[:2]
    T = 1000
    logits = torch.randn(T, E, device="cuda", generator=gen)
    v = mokgen.load(dataclasses.replace(spec_of(shape), renormalize=renormalize))
    ids, w = v.route(logits)
    ref_ids, ref_w = route_reference(logits, K, renormalize)
    assert torch.equal(ids.long(), ref_ids.long())
    assert ((w.double() - ref_w).abs().max().item()) < 1e-5


def test_route_nonfinite_logits_are_reported(gen):
    """A token without a finite logit gets id E (out of range, unlike the empty slot -1): the
    dispatch reports it after the call, routed inside the single launch or not."""
    import mokgen
    from mokgen.runtime import InputError

    E, K = SHAPES[0][:2]
    x, _, _, wg, wu, wd, _ = make_inputs(SHAPES[0], 16, "uniform", gen)
    logits = torch.randn(16, E, device="cuda", generator=gen)
    logits[5] = float("nan")
    ids, _ = mokgen.route(logits, K)
    assert (ids[5] == E).all() and (ids[:5] < E).all()
    mokgen.moe_routed(x, logits, K, wg, wu, wd)
    with pytest.raises(InputError, match="outside"):
        mokgen.check_errors()


@pytest.mark.parametrize("T", [1, 1000])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "e{}k{}".format(*s))
def test_route_backward_golden(shape, renormalize, T, gen):
    """mokgen.route is differentiable in its weights: d_logits (the generated route_backward)
    against float64 autograd of softmax, the same picks and the renormalisation; same bits twice."""
    import mokgen

    E, K = shape[:2]
    logits = torch.randn(T, E, device="cuda", generator=gen).requires_grad_(True)
    d_w = torch.randn(T, K, device="cuda", generator=gen)
    grads = []
    for _ in range(2):
        logits.grad = None
        ids, w = mokgen.route(logits, K, renormalize=renormalize)
        assert not ids.requires_grad and w.requires_grad
        (w * d_w).sum().backward()
        grads.append(logits.grad.clone())
    ref_logits = logits.detach().double().requires_grad_(True)
    ref_w = torch.softmax(ref_logits, dim=-1).gather(1, ids.long())
    if renormalize:
        ref_w = ref_w / ref_w.sum(1, keepdim=True)
    (ref_w * d_w.double()).sum().backward()
    ref = ref_logits.grad
    assert (grads[0].double() - ref).abs().max().item() <= 1e-5 * max(ref.abs().max().item(), 1e-30) + 1e-7
    assert torch.equal(grads[0], grads[1])


def test_bad_inputs_rejected_before_launch(gen):
    import mokgen
    from mokgen.runtime import InputError

    x, ids, w, wg, wu, wd, _ = make_inputs(SHAPES[0], 16, "uniform", gen)
    with pytest.raises(InputError, match="topk_ids must be in"):
        bad = ids.clone()
        bad[3, 2] = 64
        mokgen.moe(x, bad, w, wg, wu, wd)
    with pytest.raises(InputError, match="x must be torch.bfloat16"):
        mokgen.moe(x.float(), ids, w, wg, wu, wd)
    with pytest.raises(InputError, match="topk_weights must have shape"):
        mokgen.moe(x, ids, w[:, :4].contiguous(), wg, wu, wd)
    with pytest.raises(InputError, match="on a CUDA device"):
        mokgen.moe(x.cpu(), ids, w, wg, wu, wd)
    with pytest.raises(InputError, match="NaN or Inf"):
        nan = x.clone()
        nan[5, 7] = float("inf")
        mokgen.moe(nan, ids, w, wg, wu, wd)


def test_unchecked_out_of_range_ids_are_reported_by_the_device(gen):
    # check_ids=False skips the host check: dispatch finds the pair no expert counted, the
    # call still finishes (that pair contributes nothing), and the error surfaces after.
    import mokgen
    from mokgen.runtime import InputError

    for T in (16, 4096):  # the fused path and the multi-kernel path
        x, ids, w, wg, wu, wd, _ = make_inputs(SHAPES[0], T, "uniform", gen)
        bad = ids.clone()
        bad[3, 2] = 64
        mokgen.moe(x, bad, w, wg, wu, wd, check_ids=False)
        with pytest.raises(InputError, match="outside \\[0, 64\\)"):
            mokgen.check_errors()
        mokgen.check_errors()  # reported once
        out = mokgen.moe(x, ids, w, wg, wu, wd, check_ids=False)
        mokgen.check_errors()
        assert torch.isfinite(out.float()).all()
    # Every id garbage (any int32): the single launch's 16-row and 160-row bands and the
    # per-GEMM path report it; none faults.
    for T in (64, 1024, 4096):
        x, ids, w, wg, wu, wd, _ = make_inputs(SHAPES[0], T, "uniform", gen)
        garbage = torch.randint(-2**31, 2**31 - 1, ids.shape, device="cuda", dtype=torch.int32, generator=gen)
        mokgen.moe(x, garbage, w, wg, wu, wd, check_ids=False)
        with pytest.raises(InputError, match="outside \\[0, 64\\)"):
            mokgen.check_errors()
    # the per-expert dispatch kernels (an experiment's build) report them too
    v = mokgen.load(built_path(spec_of(SHAPES[0]), experiment_dir("per_expert"), SAME_BITS_EXPERIMENTS["per_expert"]))
    v.forward(x, bad, w, wg, wu, wd)
    with pytest.raises(InputError, match="outside \\[0, 64\\)"):
        v.check_errors()


def test_small_calls_keep_their_workspace_and_give_the_same_bits(gen):
    """An inference call's per-call buffers are kept for the next call of the same entry and T
    (same device and stream) when small: calls that reuse them (other routings in between) give
    a fresh workspace's bits; a new T replaces them; a large call's are never kept, nor a
    capture's."""
    import mokgen
    from mokgen.runtime.variant import KEEP_WORKSPACE_BYTES

    v = mokgen.load(spec_of(SHAPES[0]))
    v._kept.clear()
    inputs = {r: make_inputs(SHAPES[0], 200, r, gen) for r in ("uniform", "skewed", "dropped")}
    first = {r: v.forward(*a[:6]).clone() for r, a in inputs.items()}
    slot = next(iter(v._kept))
    kept = {n: t.data_ptr() for n, t in v._kept[slot][1].items()}
    for r in ("dropped", "uniform", "skewed", "uniform"):
        assert torch.equal(v.forward(*inputs[r][:6]), first[r])
    assert {n: t.data_ptr() for n, t in v._kept[slot][1].items()} == kept
    v._kept.clear()  # a fresh workspace: the same bits
    assert torch.equal(v.forward(*inputs["skewed"][:6]), first["skewed"])
    v.forward(*make_inputs(SHAPES[0], 33, "uniform", gen)[:6])
    assert [k[0] for k in v._kept.values()] == [33]
    mokgen.release_workspaces()
    assert not v._kept
    v.forward(*make_inputs(SHAPES[0], 33, "uniform", gen)[:6])
    x, ids, w, wg, wu, wd, _ = make_inputs(SHAPES[0], 16384, "uniform", gen)
    v.forward(x, ids, w, wg, wu, wd)
    big = [n for n, dt, shape, _ in v.buffer_shapes(16384) if n in v.entry_buffers(v.forward_entry(16384))]
    assert big and all(k[0] != 16384 for k in v._kept.values()) and KEEP_WORKSPACE_BYTES < sum(
        math.prod(shape) * dt.itemsize for n, dt, shape, _ in v.buffer_shapes(16384) if n in big)
    v._kept.clear()
    x, ids, w, wg, wu, wd, _ = make_inputs(SHAPES[0], 64, "uniform", gen)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        v.forward(x, ids, w, wg, wu, wd)
    assert not v._kept
    v.check_errors()


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]], ids=["e64", "mixtral"])
def test_graphs_of_every_forward_entry_replay_side_by_side(shape, gen):
    """Graphs of T's own entry, the plain launch and the per-GEMM path, captured at T = 16 and
    then 64 in one process, replay in turn with the default entry's bits, the outputs poisoned
    before each replay. The caller keeps no reference to the outputs (only weak ones): the
    graphs hold them. Mixing entries this way faulted while the probes let those outputs be
    freed (docs/perf.md, "The graph-replay fault on Mixtral, found")."""
    import weakref

    import mokgen
    from mokgen.bench import _capture, forced_call

    v = mokgen.load(spec_of(shape))
    for T in (16, 64):
        x, ids, w, wg, wu, wd, shared = make_inputs(shape, T, "uniform", gen)
        want = v.forward(x, ids, w, wg, wu, wd, *shared)
        graphs = {}
        for entry in dict.fromkeys([v.forward_entry(T), "forward_fused", "forward"]):
            call = forced_call(v, entry, x, ids, w, wg, wu, wd, shared)
            out = call()
            assert torch.equal(out, want), (T, entry)
            g = _capture(call)
            assert g is not None, (T, entry)
            graphs[entry] = (g, weakref.ref(out))
            del call, out
        for _ in range(3):
            for entry, (g, out) in graphs.items():
                assert out() is not None, f"T={T} {entry}: the graph let its output go"
                out().fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                assert torch.equal(out(), want), (T, entry)
    v.check_errors()


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4]], ids=["e64", "mixtral", "shared"])
def test_forward_entries_stay_inside_their_buffers(shape):
    """Every buffer of a call (inputs, output, workspace, counters) mapped alone with unmapped
    memory right after its end, then right before its start (benchmarks/guard_pages.py): T's
    own entry, the plain launch and the per-GEMM path at odd and band-edge T run without a
    fault and give the default entry's bits. (Inside torch's cached segments an access past a
    buffer lands in a neighbour and no checker sees it.)"""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "guard_pages.py"
    p = subprocess.run([sys.executable, str(script), "--variant", spec_of(shape).variant, "--tokens", "1,7,35,1000"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("the same bits") == p.stdout.count(" ran; ") > 0


@pytest.mark.parametrize("T", [64, 1000, 4096])
def test_device_errors_reach_the_host_from_graph_replays_and_the_next_call(T, gen):
    """A set error code reaches the pinned host word (the single launch's last CTA writes it, the
    per-GEMM path's combine as it starts): a replay of a captured call with
    bad ids raises at check_errors and again at the next call once it has finished, a clean
    replay after it raises nothing, and a clean call leaves the word at 0 (every path: the
    single launch's bands at T = 64 and 1000, the per-GEMM path)."""
    import mokgen
    from mokgen.runtime import InputError

    v = mokgen.load(spec_of(SHAPES[0]))
    assert "status" in v.plan["steps"]
    x, ids, w, wg, wu, wd, _ = make_inputs(SHAPES[0], T, "uniform", gen)
    v.forward(x, ids, w, wg, wu, wd)
    v.check_errors()
    assert int(v._status_host[0]) == 0
    good = ids.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        v.forward(x, ids, w, wg, wu, wd)
    ids[T // 2, 1] = 64
    g.replay()
    with pytest.raises(InputError, match="outside \\[0, 64\\)"):
        v.check_errors()
    ids.copy_(good)
    g.replay()
    v.check_errors()
    ids[0, 0] = 100
    g.replay()
    torch.cuda.synchronize()
    with pytest.raises(InputError, match="outside \\[0, 64\\)"):
        v.forward(x, good, w, wg, wu, wd)  # (checked before it launches: raises, launches nothing)
    out = v.forward(x, good, w, wg, wu, wd)
    v.check_errors()
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("T", [7, 1000, 4096, 16384])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "e{}k{}h{}i{}s{}".format(*s))
def test_empty_slots_golden(shape, T, gen):
    """Slots with id -1 (dropped pairs; token 0 has only such) contribute nothing and raise no
    error, on the fused path (small T) and the per-GEMM path."""
    import mokgen
    from mokgen.verify import check_forward

    v = mokgen.load(spec_of(shape))
    r = check_forward(v, T, "dropped", gen)
    v.check_errors()
    assert not r.unwritten and r.rel_error <= TOL, f"relative error {r.rel_error:.3e}"


def test_empty_slots_per_expert_dispatch_and_backward(gen):
    """The per-expert dispatch kernels count the empty slots too (no error); the backward gives them a
    d_topk_weights of exactly 0 and every gradient matches float64 autograd."""
    import mokgen
    from mokgen.verify import check_backward, check_forward

    v = mokgen.load(built_path(spec_of(SHAPES[0]), experiment_dir("per_expert"), SAME_BITS_EXPERIMENTS["per_expert"]))
    r = check_forward(v, 4096, "dropped", gen)
    v.check_errors()
    assert not r.unwritten and r.rel_error <= TOL
    for shape in (SHAPES[0], SHAPES[4]):
        v = mokgen.load(spec_of(shape))
        r = check_backward(v, 1000, "dropped", gen)
        v.check_errors()
        assert not r.unwritten and not r.failures, r.failures
    x, ids, w, wg, wu, wd, _ = make_inputs(SHAPES[0], 513, "dropped", gen)
    w.requires_grad_(True)
    mokgen.moe(x, ids, w, wg, wu, wd).float().sum().backward()
    assert (w.grad[ids < 0] == 0).all() and (w.grad[ids >= 0] != 0).any()


def test_torch_compile_fake(gen):
    import mokgen

    shape = SHAPES[0]
    x, ids, w, wg, wu, wd, _ = make_inputs(shape, 64, "uniform", gen)
    v = mokgen.load(spec_of(shape))

    @torch.compile(fullgraph=True)
    def f(x, ids, w):
        return v.ops.forward(x, ids, w, wg, wu, wd) * 2

    assert torch.equal(f(x, ids, w), v.forward(x, ids, w, wg, wu, wd) * 2)


# Debug builds whose waits give up after half a second and that never finish:
#   deadlock:           the gate/up pipeline deadlocks (the gather releases its stages too
#                       late, past the bound the Plan normally enforces), and so does the
#                       backward's bwd_dgrad_down (test_a_deadlocked_backward_fails_fast);
#   broken_dependency:  the single launch's down tiles wait for one gate/up tile more than
#                       an M tile has, so their h_ready counter never gets there;
#   broken_dispatch:    the single launch's CTAs wait for one chunk of pairs more to be counted
#                       than there are (one expert more where they count by experts).
# (overrides, tokens, the kernel and the wait the error must name)
BROKEN_BUILDS = {
    "deadlock": ({"debug_unchecked": True, "gemm_gateup.gather_lag": 3, "bwd_dgrad_down.gather_lag": 3,
                  "wait_timeout_ms": 500}, 4096, "gemm_gateup", "pipeline stage"),
    "broken_dependency": ({"fuse_gemms": True, "debug_break_dependency": True, "wait_timeout_ms": 500}, 64,
                          "gemm_fused", "h_ready"),
    "broken_dispatch": ({"fuse_gemms": True, "debug_break_dispatch": True, "wait_timeout_ms": 500}, 64,
                        "gemm_fused", "dispatch inside the launch"),
    "broken_combine": ({"fuse_gemms": True, "combine_early": True, "debug_break_combine": True, "wait_timeout_ms": 500},
                       64, "gemm_fused", "combine task"),
}


def built_path(spec, directory, overrides):
    """The directory of a non-default build (Plan overrides) of spec: built here where
    CuTe-DSL is installed, else it must have come built (benchmarks/build_gpu_variants.py)."""
    path = directory / spec.variant
    if not (path / "build" / "libmokgen.so").exists():
        from conftest import HAS_CUTLASS

        if not HAS_CUTLASS:
            pytest.skip(f"{path} not built: run benchmarks/build_gpu_variants.py where CuTe-DSL is installed")
        from mokgen.codegen import build

        build(spec, directory, overrides=overrides, log=lambda m: None)
    return path


def deadlock_dir(name="deadlock"):
    from mokgen.codegen import default_out

    return default_out() / "debug" / name


@pytest.mark.parametrize("broken", sorted(BROKEN_BUILDS))
def test_a_deadlocked_kernel_fails_fast_instead_of_hanging(broken):
    from stall_check import assert_fails_fast

    overrides, tokens, kernel, site = BROKEN_BUILDS[broken]
    path = built_path(spec_of(SHAPES[0]), deadlock_dir(broken), overrides)
    assert_fails_fast(
        "from mokgen.verify import make_inputs\n"
        f"v = mokgen.load({str(path)!r})\n"
        f"x, ids, w, wg, wu, wd, _ = make_inputs(v.spec, {tokens}, 'uniform')\n",
        "v.forward(x, ids, w, wg, wu, wd)", "good.forward(x, ids, w, wg, wu, wd)", (kernel, site))


def test_a_deadlocked_backward_fails_fast():
    """The backward's error code reaches the host through its last kernel (wgrad_up's last CTA
    copies it; no status_mirror launch follows): a deadlock in bwd_dgrad_down ends in
    KernelTimeout naming it, and the context still serves a normal call."""
    from stall_check import assert_fails_fast

    overrides, tokens, *_ = BROKEN_BUILDS["deadlock"]
    path = built_path(spec_of(SHAPES[0]), deadlock_dir("deadlock"), overrides)
    assert_fails_fast(
        "from mokgen.verify import make_inputs\n"
        f"v = mokgen.load({str(path)!r})\n"
        "assert v.plan['steps']['backward'][-1] == 'wgrad_up' and 'backward' in v._mirrored\n"
        f"x, ids, w, wg, wu, wd, _ = make_inputs(v.spec, {tokens}, 'uniform')\n"
        "out, *saved = v.forward_train(x, ids, w, wg, wu, wd)\n"
        "v.check_errors()\n",  # (the training forward is sound: only the backward stalls)
        "v.backward(torch.ones_like(out), x, ids, w, wg, wu, wd, saved=saved)",
        "good.forward(x, ids, w, wg, wu, wd)", ("bwd_dgrad_down", "pipeline stage"))


@pytest.mark.parametrize("T", [64, 1000, 4096])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[4]], ids=lambda s: "e{}k{}h{}i{}s{}".format(*s))
def test_profiling_build_is_golden_and_records_every_task(shape, T, gen, tmp_path):
    """The profiling build runs the path the Plan takes at T (the single launch in its band's
    tiles, the per-GEMM kernels), gives the normal build's answer, and records every
    task once: every tile, and a single launch's dispatch and combine phases per CTA."""
    import math

    from mokgen.codegen.build import profile_dir
    from mokgen.profile import collect, draw, summarize
    from mokgen.runtime import Variant
    from mokgen.verify import check_forward

    path = profile_dir() / spec_of(shape).variant
    if not (path / "build" / "libmokgen.so").exists():
        from conftest import HAS_CUTLASS

        if not HAS_CUTLASS:
            pytest.skip("profiling build missing: run benchmarks/build_gpu_variants.py where CuTe-DSL is installed")
        from mokgen.codegen.build import build_profiling

        build_profiling(spec_of(shape), log=lambda m: None)
    v = Variant(path)
    r = check_forward(v, T, "skewed", gen)
    assert not r.unwritten and r.rel_error <= TOL
    records = collect(v, T, "skewed", seed=0)
    sms = v.plan["target"]["sms"]
    for name, rows in records.items():
        assert rows, name
        assert all(0 <= sm < sms and 0 <= s <= e for sm, s, e in rows), name
    # Every used GEMM tile is recorded exactly once (the same inputs as collect's).
    from mokgen.verify import make_inputs as mk

    ids = mk(v.spec, T, "skewed", torch.Generator("cuda").manual_seed(0))[1]
    counts = torch.bincount(ids.flatten().long(), minlength=v.spec.local_experts).tolist()
    entry = v.forward_entry(T)
    kernels = {k["name"]: k for k in v.plan["kernels"]}
    if entry == "forward":
        # one dispatch task per CTA: per chunk of pairs (the O(T*K) kernels) or per expert
        d = kernels["dispatch_count"]
        d_tasks = math.ceil(T * v.spec.topk / d["params"]["chunk"]) if d["template"] == "dispatch_chunked.py.j2" \
            else v.spec.local_experts
        assert len(records["combine"]) == T and len(records["dispatch_count"]) == d_tasks
        assert len(records["dispatch_scatter"]) == d_tasks
        used_m_tiles = sum(math.ceil(c / v.plan["row_tile"]) for c in counts)
        for k in v.plan["steps"]["forward"]:
            if kernels[k]["template"] == "grouped_gemm_persistent.py.j2":
                m_tiles = math.ceil(T / v.plan["row_tile"]) if k.startswith("shared") else used_m_tiles
                p = kernels[k]["params"]
                assert len(records[k]) == m_tiles * math.ceil(p["n_size"] / p["tile_n"])
    else:  # one launch: every CTA's dispatch phase, its tiles by kind, the combine of the CTAs with rows
        (name,) = v.plan["steps"][entry]
        p = kernels[name]["params"]
        used = sum(math.ceil(c / p["tile_m"]) for c in counts)
        shared_m = math.ceil(T / p["tile_m"]) if p.get("s_size") else 0
        assert len(records[f"{name} gate/up tiles"]) == used * p["n_size"] // p["tile_n"]
        assert len(records[f"{name} down tiles"]) == used * p["n2_tiles"]
        if shared_m:
            assert len(records[f"{name} shared gate/up tiles"]) == shared_m * p["s_size"] // p["tile_n"]
            assert len(records[f"{name} shared down tiles"]) == shared_m * p["n2_tiles"]
        grid = len(records[f"{name} dispatch"])
        assert 0 < grid <= sms and len({sm for sm, _, _ in records[f"{name} dispatch"]}) == grid
        warps = p["mma_warpgroups"] * 4
        parts = max(d for d in p["combine_parts"] if T * d <= grid * warps or d == 1)  # the launch's choice
        # (the early combine: every CTA's phase, from its last tile to its last task; else the
        # CTAs whose warps have a task)
        combining = grid if p.get("combine_early") else min(grid, math.ceil(T * parts / warps))
        assert len(records[f"{name} combine"]) == combining
        assert min(r[1] for r in records[f"{name} dispatch"]) == 0.0  # the span starts with the launch
    s = summarize(records, sms)
    assert 0 <= s["idle_fraction"] < 1 and s["span_us"] > 0
    assert draw(records, s, sms, tmp_path / "p.png", "test") is None or (tmp_path / "p.png").stat().st_size > 0


# The fused GEMM (gate/up and down in one launch, tiles linked by device-side counters).
FUSED_OVERRIDES = {"fuse_gemms": True}


def fused_dir():
    from mokgen.codegen import default_out

    return default_out() / "experiments" / "fused"


def fused_variant(shape):
    from mokgen.runtime import Variant

    return Variant(built_path(spec_of(shape), fused_dir(), FUSED_OVERRIDES))


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("T", [1, 7, 1000, 4096])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[4]], ids=lambda s: "e{}k{}h{}i{}s{}".format(*s))
def test_fused_gemms_golden(shape, T, routing, gen):
    from mokgen.verify import check_forward

    r = check_forward(fused_variant(shape), T, routing, gen)
    assert not r.unwritten, "unwritten or NaN output rows"
    assert r.rel_error <= TOL, f"relative error {r.rel_error:.3e} > {TOL}"


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[4]], ids=["routed", "with_shared_expert"])
def test_fused_gemms_match_the_multi_kernel_path_bit_for_bit(shape, gen):
    # With a shared expert, its tiles run inside the fused launch: still the same bits.
    import mokgen

    fused, plain = fused_variant(shape), mokgen.load(spec_of(shape))
    x, ids, w, wg, wu, wd, shared = make_inputs(shape, 4096, "skewed", gen)
    want = plain.forward(x, ids, w, wg, wu, wd, *shared)
    for _ in range(20):
        assert torch.equal(fused.forward(x, ids, w, wg, wu, wd, *shared), want)


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("T", [7, 1000])
@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "deepseek-v3"])
def test_fused_launch_of_real_shared_expert_layers(preset, T, routing, gen):
    # Layers with a shared expert, run whole in the fused launch: golden, and the same bits
    # as the multi-kernel path.
    import mokgen
    from mokgen.ir import PRESETS
    from mokgen.runtime import Variant
    from mokgen.verify import check_forward, make_inputs as inputs_of

    spec = PRESETS[preset]
    fused, plain = Variant(built_path(spec, fused_dir(), FUSED_OVERRIDES)), mokgen.load(spec)
    r = check_forward(fused, T, routing, gen)
    assert not r.unwritten and r.rel_error <= TOL, r
    x, ids, w, wg, wu, wd, shared = inputs_of(spec, T, routing, gen)
    assert torch.equal(fused.forward(x, ids, w, wg, wu, wd, *shared), plain.forward(x, ids, w, wg, wu, wd, *shared))


def test_fused_launch_captures_and_replays_with_new_inputs(gen):
    # A new routing each replay: the h_ready counters are reset by dispatch inside the graph.
    for err in capture_and_replay(fused_variant(SHAPES[0]).forward, SHAPES[0], ("skewed", "uniform"), gen):
        assert err <= TOL


# Plan overrides that must not change a bit: the same tiles in the same K order.
#   cluster2: 2-CTA clusters multicast the routed GEMMs' weight tiles;
#   per_expert: the per-expert dispatch kernels (one CTA per expert) place every row where the
#             default O(T*K) chunked ones do;
#   multi:    one launch per GEMM at every T (the default runs the fused launch up to
#             fused_max_tokens tokens);
#   apart:    the fused launch after the two dispatch kernels (the default dispatches inside it).
SAME_BITS_EXPERIMENTS = {"cluster2": {"cluster_m": 2}, "per_expert": {"dispatch_chunked": False},
                         "multi": {"fuse_gemms": False}, "apart": {"dispatch_in_launch": False},
                         "claim_late": {"claim_late": True}}


def experiment_dir(name):
    from mokgen.codegen import default_out

    return default_out() / "experiments" / name


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("T", [1, 7, 1000, 4096, 16384])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[4]], ids=lambda s: "e{}k{}h{}i{}s{}".format(*s))
@pytest.mark.parametrize("experiment", sorted(SAME_BITS_EXPERIMENTS))
def test_experiment_gives_the_same_bits(experiment, shape, T, routing, gen, monkeypatch):
    import mokgen
    from mokgen.runtime import Variant

    path = built_path(spec_of(shape), experiment_dir(experiment), SAME_BITS_EXPERIMENTS[experiment])
    exp, plain = Variant(path), mokgen.load(spec_of(shape))
    for v in (exp, plain):  # (undone after the test: the loaded variant is shared with later tests)
        monkeypatch.setattr(v, "poison", True)
    x, ids, w, wg, wu, wd, (sg, su, sd) = make_inputs(shape, T, routing, gen)
    want = plain.forward(x, ids, w, wg, wu, wd, sg, su, sd)
    got = exp.forward(x, ids, w, wg, wu, wd, sg, su, sd)
    assert not torch.isnan(got).any()
    assert torch.equal(got, want)


def band_tokens(plan):
    """Each band of the single launch's tiles by T (launch_bands): its first and last T and an
    odd one between."""
    out, low = [], 1
    for top, _ in plan["launch_bands"]:
        out += sorted({low, (low + top) // 2 | 1, top})
        low = top + 1
    return out


@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[3]], ids=lambda s: "e{}k{}h{}i{}s{}".format(*s))
def test_every_band_of_the_single_launch_is_golden_and_gives_the_multi_kernel_bits(shape, routing, gen):
    """The single launch in each of its tile sizes (swapped tiles of 16 to 160 token rows, the
    plain 128-row tiles), at the first, a middle and the last T of its band: against the float64
    reference, with poisoned workspace and output, and bit for bit the multi-kernel path's."""
    import mokgen
    from mokgen.reference import moe_reference, rel_error
    from mokgen.runtime import Variant
    from mokgen.verify import run_poisoned

    plain = mokgen.load(spec_of(shape))
    multi = Variant(built_path(spec_of(shape), experiment_dir("multi"), SAME_BITS_EXPERIMENTS["multi"]))
    assert any(e.startswith("forward_n") for _, e in plain.plan["launch_bands"])
    for T in band_tokens(plain.plan):
        inputs = make_inputs(shape, T, routing, gen)
        got = run_poisoned(plain, inputs)
        x, ids, w, wg, wu, wd, _ = inputs
        assert not torch.isnan(got).any(), (T, plain.forward_entry(T))
        err = rel_error(got, moe_reference(x, ids, w, wg, wu, wd))
        assert err <= TOL, (T, plain.forward_entry(T), err)
        assert torch.equal(got, run_poisoned(multi, inputs)), (T, plain.forward_entry(T))


# The fused launch claiming its tiles in wavefront order (down tiles from early on, 33 M tiles
# of gate/up tiles behind): the order changes when a tile runs, never its bits.
WAVE_OVERRIDES = {"gemm_fused.wave_lag": 33}


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("T", [1, 7, 1000, 2048])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3]], ids=lambda s: "e{}k{}h{}i{}s{}".format(*s))
def test_wavefront_tile_order_gives_the_same_bits(shape, T, routing, gen, monkeypatch):
    import mokgen
    from mokgen.runtime import Variant

    exp = Variant(built_path(spec_of(shape), experiment_dir("wave"), WAVE_OVERRIDES))
    plain = mokgen.load(spec_of(shape))
    for v in (exp, plain):  # (undone after the test: the loaded variant is shared with later tests)
        monkeypatch.setattr(v, "poison", True)
    x, ids, w, wg, wu, wd, _ = make_inputs(shape, T, routing, gen)
    got = exp.forward(x, ids, w, wg, wu, wd)
    assert not torch.isnan(got).any()
    assert torch.equal(got, plain.forward(x, ids, w, wg, wu, wd))


# ---- backward ----------------------------------------------------------------------
BACKWARD_TOKENS = [1, 7, 1000, 4096]


@pytest.mark.parametrize("saved", [True, False], ids=["saved", "recompute"])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("T", BACKWARD_TOKENS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "e{}k{}h{}i{}s{}".format(*s))
def test_backward_golden(shape, T, routing, saved, gen):
    """Every gradient against float64 autograd of the reference, with the SwiGLU inputs saved
    by the training forward or recomputed; workspace and gradients poisoned, so an unwritten
    element fails."""
    import mokgen
    from mokgen.verify import check_backward

    r = check_backward(mokgen.load(spec_of(shape)), T, routing, gen, saved)
    assert not r.unwritten, f"unwritten or NaN gradients: {r.unwritten}"
    assert not r.failures, f"relative errors above {TOL} and above torch bf16's {r.torch_errors}: {r.failures}"


def _band_edges():
    from mokgen.schedule.plan import make_plan

    bands = make_plan(spec_of(SHAPES[0])).to_dict().get("launch_bands", [])
    return sorted({1} | {top for top, _ in bands} | {top + 1 for top, _ in bands})


@pytest.mark.parametrize("T", _band_edges())
def test_training_step_unpoisoned_at_every_band_edge(T, gen):
    """The training forward and backward as a user runs them (no poisoned workspace) at the first
    and last T of every band of the single launch, where the row buffers change size: the
    gradients are the poisoned run's bits. The allocator's memory is first filled with a positive
    garbage pattern, so a kernel that reads an index nobody wrote (the tile table once had 128
    entries for 18560 rows at T = 1024) faults or differs instead of reading -1."""
    import mokgen
    from mokgen.verify import GRADIENTS, run_backward_poisoned

    v = mokgen.load(spec_of(SHAPES[0]))
    x, ids, w, wg, wu, wd, _ = make_inputs(SHAPES[0], T, "uniform", gen)
    dout = torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype)
    want = run_backward_poisoned(v, (x, ids, w, wg, wu, wd, (None, None, None)), dout)
    junk = torch.full((1 << 28,), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
    del junk  # (its blocks go back to the caching allocator with the pattern in them)
    _, *saved = v.forward_train(x, ids, w, wg, wu, wd)
    got = v.backward(dout, x, ids, w, wg, wu, wd, saved=saved)[:5]
    torch.cuda.synchronize()
    assert all(torch.equal(g, want[k]) for g, k in zip(got, GRADIENTS))


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_backward_deterministic_bits(routing, gen):
    """20 backward runs, identical bits in every gradient (hot and empty experts included)."""
    import mokgen

    shape = SHAPES[0]
    x, ids, w, wg, wu, wd, _ = make_inputs(shape, 4096, routing, gen)
    dout = torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype)
    v = mokgen.load(spec_of(shape))
    out, *saved = v.forward_train(x, ids, w, wg, wu, wd)
    assert torch.equal(out, v.forward(x, ids, w, wg, wu, wd))  # the training forward's output: same bits
    first = v.backward(dout, x, ids, w, wg, wu, wd, saved=saved)[:5]
    for _ in range(19):
        _, *saved = v.forward_train(x, ids, w, wg, wu, wd)
        again = v.backward(dout, x, ids, w, wg, wu, wd, saved=saved)[:5]
        assert all(torch.equal(a, b) for a, b in zip(again, first))
    # Recomputing the SwiGLU inputs gives the saved ones' bits (same tiles, same K order).
    assert all(torch.equal(a, b) for a, b in zip(v.backward(dout, x, ids, w, wg, wu, wd)[:5], first))


def autograd_grads(fn, x, ids, w, wg, wu, wd, dout):
    leaves = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    fn(leaves[0], ids, *leaves[1:]).backward(dout)
    return dict(zip(("dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"), (t.grad for t in leaves)))


def test_autograd_and_torch_compile(gen):
    """mokgen.moe is differentiable through torch.autograd, eagerly and under torch.compile
    (the fake implementations), and both give the reference's gradients."""
    import mokgen
    from mokgen.reference import moe_reference_backward, rel_error

    x, ids, w, wg, wu, wd, _ = make_inputs(SHAPES[0], 513, "skewed", gen)
    dout = torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype)
    ref = moe_reference_backward(dout, x, ids, w, wg, wu, wd)
    eager = autograd_grads(mokgen.moe, x, ids, w, wg, wu, wd, dout)
    recomputed = autograd_grads(lambda *a: mokgen.moe(*a, recompute=True), x, ids, w, wg, wu, wd, dout)
    ops = mokgen.load(spec_of(SHAPES[0])).ops  # the custom ops: one graph, no break
    compiled = autograd_grads(torch.compile(lambda *a: ops.forward_train(*a)[0], fullgraph=True), x, ids, w, wg, wu,
                              wd, dout)
    through_op = autograd_grads(lambda *a: ops.forward_train(*a)[0], x, ids, w, wg, wu, wd, dout)  # eager, the op
    # The public function too (its host-side checks and lookup may break the graph).
    compiled_api = autograd_grads(torch.compile(mokgen.moe), x, ids, w, wg, wu, wd, dout)
    for name, r in ref.items():
        assert rel_error(eager[name], r) <= TOL, name
        assert torch.equal(recomputed[name], eager[name]), name
        assert torch.equal(compiled[name], eager[name]), name
        assert torch.equal(compiled_api[name], eager[name]), name
        assert torch.equal(through_op[name], eager[name]), name


@pytest.mark.parametrize("E,T", [(40, 61), (64, 64)])
def test_training_steps_keep_their_workspace_and_give_the_same_bits(E, T, gen):
    """Small training calls keep their scratch buffers for the next call (the training
    forward's and the backward's own slots) but never what the forward saves: two forwards
    alive at once, their backwards run after both, give each step's bits from a fresh
    workspace, in any order of routings; the kept buffers are the same ones call after call.
    (E64's row buffers, padded per expert, take 136 MB in the backward even at T = 64: within
    KEEP_TRAINING_BYTES.)"""
    import mokgen
    from mokgen.runtime import find_variant

    shape = next(s for s in SHAPES if s[0] == E)
    v = find_variant(*shape)  # (the build mokgen.moe calls: any of these sizes, with or without renormalisation)
    steps = {r: make_inputs(shape, T, r, gen)[:6] for r in ("uniform", "skewed", "dropped")}
    dout = torch.randn(T, shape[2], device="cuda", generator=gen).to(torch.bfloat16)

    def fresh(r):
        v._kept.clear()
        return autograd_grads(mokgen.moe, *steps[r], dout)

    want = {r: fresh(r) for r in steps}
    v._kept.clear()
    autograd_grads(mokgen.moe, *steps["uniform"], dout)
    kinds = {slot[0] for slot in v._kept}
    assert {"forward_train", "backward"} <= kinds, kinds
    kept = {slot: {n: t.data_ptr() for n, t in k[1].items()} for slot, k in v._kept.items()}
    assert not any(n in v.saved_names for ptrs in kept.values() for n in ptrs)
    for r in ("dropped", "skewed", "uniform", "skewed"):
        got = autograd_grads(mokgen.moe, *steps[r], dout)
        assert all(torch.equal(got[k], want[r][k]) for k in got), r
    leaves = {r: [t.clone().requires_grad_(True) for t in (a[0], a[2], *a[3:])] for r, a in steps.items()}
    outs = {r: mokgen.moe(leaves[r][0], steps[r][1], *leaves[r][1:]) for r in ("skewed", "dropped")}
    for r in ("dropped", "skewed"):  # (the second forward ran before the first backward)
        outs[r].backward(dout)
        got = dict(zip(("dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"), (t.grad for t in leaves[r])))
        assert all(torch.equal(got[k], want[r][k]) for k in got), r
    assert {slot: {n: t.data_ptr() for n, t in k[1].items()} for slot, k in v._kept.items()} == kept
    v.check_errors()


def test_shared_expert_gradients_through_autograd(gen):
    """A layer with a shared expert: every gradient (the shared expert's too) through
    mokgen.moe's autograd, saved and recomputed SwiGLU inputs giving the same bits."""
    import mokgen
    from mokgen.reference import moe_reference_backward, rel_error

    x, ids, w, wg, wu, wd, shared = make_inputs(SHAPES[4], 777, "skewed", gen)
    dout = torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype)
    ref = moe_reference_backward(dout, x, ids, w, wg, wu, wd, *shared)
    runs = []
    for recompute in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd) + shared]
        mokgen.moe(leaves[0], ids, *leaves[1:5], ws_gate=leaves[5], ws_up=leaves[6], ws_down=leaves[7],
                   recompute=recompute).backward(dout)
        runs.append([t.grad for t in leaves])
    names = ["dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down", "d_ws_gate", "d_ws_up", "d_ws_down"]
    for name, saved, recomputed in zip(names, *runs):
        assert rel_error(saved, ref[name]) <= TOL, name
        assert torch.equal(saved, recomputed), name


@pytest.mark.parametrize("routing", ["uniform", "hot"])
@pytest.mark.parametrize("T", [1, 7, 1000, 2048, 4096])
@pytest.mark.parametrize("shape,renormalize", [(SHAPES[0], False), (SHAPES[3], True), (SHAPES[4], False)],
                         ids=["e64", "e40_rn", "e16_shared"])
def test_moe_routed_is_route_then_moe_bit_for_bit(shape, renormalize, T, routing, gen):
    """mokgen.moe_routed (route, dispatch, GEMMs and combine in one launch up to the fused
    launch's T, route then moe above it) against mokgen.route then mokgen.moe: the same ids,
    weights and output bits, three calls in a row."""
    import mokgen

    E, K, H, *_ = shape
    x, _, _, wg, wu, wd, (sg, su, sd) = make_inputs(shape, T, "uniform", gen)
    logits = torch.randn(T, E, device="cuda", generator=gen)
    if routing == "hot":  # most tokens pick expert 3 first; some experts get no token at all
        logits[:, 3] += 4.0
        logits[:, : E // 4] -= 6.0
    ids, w = mokgen.route(logits, K, renormalize=renormalize)
    want = mokgen.moe(x, ids, w, wg, wu, wd, ws_gate=sg, ws_up=su, ws_down=sd)
    for _ in range(3):
        with torch.no_grad():
            out, ids_r, w_r = mokgen.moe_routed(x, logits, K, wg, wu, wd, ws_gate=sg, ws_up=su, ws_down=sd,
                                                renormalize=renormalize)
        assert torch.equal(ids_r, ids) and torch.equal(w_r, w)
        assert torch.equal(out, want)
    mokgen.check_errors()


def test_moe_routed_rejects_bad_inputs_before_launch(gen):
    import mokgen
    from mokgen.runtime import InputError

    E, K, H, I, _ = SHAPES[0]
    x, _, _, wg, wu, wd, _ = make_inputs(SHAPES[0], 16, "uniform", gen)
    logits = torch.randn(16, E, device="cuda", generator=gen)
    for bad, match in (((x[:8], logits, K), "T = router_logits"), ((x, logits.double(), K), "float32"),
                       ((x, logits[:, :8].contiguous(), K), "route over 8 experts"), ((x, logits, 0), "topk"),
                       ((x, logits.t(), K), "contiguous")):
        with pytest.raises(InputError, match=match):
            mokgen.moe_routed(bad[0], bad[1], bad[2], wg, wu, wd)


@pytest.mark.parametrize("fused_routing", [False, True], ids=["torch_routing", "fused_routing"])
def test_moe_module_matches_torch_reference_module(fused_routing, gen):
    """mokgen.MoE against the same block on torch ops (same parameters): output and every
    parameter's gradient, the router's included (through the generated route and its
    backward with fused_routing)."""
    import mokgen
    from mokgen.reference import rel_error

    E, K, H, I, _ = SHAPES[3]
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device="cuda").item()))
    ours = mokgen.MoE(H, I, E, K, renormalize=True, device="cuda", fused_routing=fused_routing)
    ref = mokgen.MoE(H, I, E, K, renormalize=True, device="cuda", reference=True)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(3, 333, H, device="cuda", generator=gen).to(torch.bfloat16)
    outs = []
    for m in (ours, ref):
        y = m(x)
        (y.float() ** 2).mean().backward()
        outs.append(y)
    assert rel_error(outs[0], outs[1]) <= TOL
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert rel_error(p.grad, q.grad) <= 2 * TOL, name
    with torch.no_grad():  # inference (fused_routing: routing inside the single launch)
        assert rel_error(ours(x[:1]), ref(x[:1])) <= TOL


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_and_autocast_give_the_blocks_bits(reentrant, gen):
    """A mokgen.MoE block under torch.utils.checkpoint (its forward run again in the backward,
    so the training forward's saved tensors are made twice; with use_reentrant=True the first
    forward runs without autograd, through the inference path) gives the plain block's output
    and gradients bit for bit. fp32 input under bf16 autocast (cast to bf16, the router kept in
    fp32) gives them too, its input gradient in fp32; checkpointed under autocast, within the
    tolerance (its input gradient differed in the last bit in places)."""
    import mokgen
    from torch.utils.checkpoint import checkpoint

    from mokgen.reference import rel_error

    E, K, H, I, S = SHAPES[4]
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device="cuda").item()))
    block = mokgen.MoE(H, I, E, K, shared_intermediate=S, renormalize=True, device="cuda")
    x = torch.randn(2, 77, H, device="cuda", generator=gen)
    dy = torch.randn(2, 77, H, device="cuda", generator=gen).to(torch.bfloat16)

    def run(fn, inp, cast=False):
        for p in block.parameters():
            p.grad = None
        inp = inp.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cast):
            y = fn(inp)
        y.backward(dy)
        return [y.detach()] + [inp.grad] + [p.grad.clone() for p in block.parameters()]

    def checkpointed(inp):
        return checkpoint(block, inp, use_reentrant=reentrant)

    want = run(block, x.bfloat16())
    assert all(torch.equal(a, b) for a, b in zip(run(checkpointed, x.bfloat16()), want))
    cast = run(block, x, cast=True)
    assert cast[0].dtype == torch.bfloat16 and cast[1].dtype == torch.float32
    assert torch.equal(cast[1], want[1].float())
    assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(cast, want)) if i != 1)
    cast = run(checkpointed, x, cast=True)
    assert cast[1].dtype == torch.float32
    assert all(rel_error(a.float(), b.float()) <= TOL for a, b in zip(cast, want))
    mokgen.check_errors()


def test_torch_compile_with_cuda_graphs_gives_the_eager_bits(gen):
    """torch.compile(mode="reduce-overhead"): torch's CUDA graphs over the custom ops, whose
    first calls run eagerly with memory from the graph pool that torch resets (a buffer kept for
    the next call there would be memory torch hands out again, and it refuses such a graph).
    Training steps through mokgen.moe, with new inputs and routings each step and at two T (a
    graph each), and inference at a T the single launch serves (its state buffer), give the
    eager calls' output and gradients bit for bit; a mokgen.MoE block compiled likewise trains
    within the tolerance of the eager block (inductor may round the router's softmax otherwise)."""
    import mokgen
    from mokgen.reference import rel_error

    shape = SHAPES[3]
    E, K, H, I, _ = shape

    def moe(*a):
        return mokgen.moe(*a, check_ids=False)

    compiled = torch.compile(moe, mode="reduce-overhead")
    for T in (61, 200):
        for step, routing in enumerate(("uniform", "skewed", "dropped")):
            x, ids, w, wg, wu, wd, _ = make_inputs(shape, T, routing, gen)
            dout = torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype)
            want = autograd_grads(moe, x, ids, w, wg, wu, wd, dout)
            torch.compiler.cudagraph_mark_step_begin()
            got = {k: t.clone() for k, t in autograd_grads(compiled, x, ids, w, wg, wu, wd, dout).items()}
            assert all(torch.equal(got[k], want[k]) for k in want), (T, routing)
    x, ids, w, wg, wu, wd, _ = make_inputs(shape, 64, "skewed", gen)
    with torch.no_grad():
        want = moe(x, ids, w, wg, wu, wd)
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            assert torch.equal(compiled(x, ids, w, wg, wu, wd), want)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device="cuda").item()))
    eager = mokgen.MoE(H, I, E, K, renormalize=True, device="cuda")
    module = mokgen.MoE(H, I, E, K, renormalize=True, device="cuda")
    module.load_state_dict(eager.state_dict())
    block = torch.compile(module, mode="reduce-overhead")
    for step in range(3):
        x = torch.randn(97, H, device="cuda", generator=gen).to(torch.bfloat16)
        got = []
        for m, params in ((eager, list(eager.parameters())), (block, list(module.parameters()))):
            torch.compiler.cudagraph_mark_step_begin()
            for p in params:
                p.grad = None
            xi = x.clone().requires_grad_(True)
            y = m(xi)
            (y.float() ** 2).mean().backward()
            got.append([y.detach().clone(), xi.grad.clone()] + [p.grad.clone() for p in params])
        assert all(rel_error(a, b) <= TOL for a, b in zip(*got)), step
    mokgen.check_errors()


@pytest.mark.parametrize("shape, fused_routing", [(SHAPES[3], False), (SHAPES[3], True), (SHAPES[4], False)],
                         ids=["e40-torch_routing", "e40-fused_routing", "e16_shared-torch_routing"])
def test_training_steps_replay_as_cuda_graphs(shape, fused_routing, gen):
    """torch.cuda.make_graphed_callables over mokgen.MoE: the forward and the backward each
    captured as one CUDA graph (nothing in a step synchronises with the host), and every
    replay, with new inputs each step, gives the eager module's output and the gradients of x
    and of every parameter bit for bit."""
    import mokgen

    E, K, H, I, S = shape
    T = 97
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device="cuda").item()))
    eager = mokgen.MoE(H, I, E, K, shared_intermediate=S, renormalize=True, device="cuda",
                       fused_routing=fused_routing)
    module = mokgen.MoE(H, I, E, K, shared_intermediate=S, renormalize=True, device="cuda",
                        fused_routing=fused_routing)
    module.load_state_dict(eager.state_dict())
    sample = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    graphed = torch.cuda.make_graphed_callables(module, (sample,))
    for step in range(3):
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        got = []
        for m, params in ((eager, eager.parameters()), (graphed, module.parameters())):
            params = list(params)
            for p in params:
                p.grad = None
            xi = x.clone().requires_grad_(True)
            y = m(xi)
            (y.float() ** 2).mean().backward()
            got.append([y.detach().clone(), xi.grad] + [p.grad for p in params])
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(*got)), step
    mokgen.check_errors()
