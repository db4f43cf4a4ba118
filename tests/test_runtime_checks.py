import types

import pytest
import torch

from mokgen.runtime.checks import InputError, check_moe_inputs, check_tensor


def test_check_tensor_messages():
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    check_tensor("x", t, torch.bfloat16, (None, 8), None)
    with pytest.raises(InputError, match="x must be torch.float32, got torch.bfloat16"):
        check_tensor("x", t, torch.float32, (None, 8), None)
    with pytest.raises(InputError, match=r"must have shape \['\*', 16\]"):
        check_tensor("x", t, torch.bfloat16, (None, 16), None)
    with pytest.raises(InputError, match="contiguous"):
        check_tensor("x", t.t(), torch.bfloat16, (8, 4), None)
    with pytest.raises(InputError, match="3-d"):
        check_tensor("w", t, torch.bfloat16, (1, 4, 8), None)


def test_cpu_inputs_are_refused():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="must be on a CUDA device"):
        check_moe_inputs(x, None, None, None, None, None, None, None, None)


def test_a_timed_out_wait_is_reported_by_kernel_and_site():
    from mokgen.runtime.variant import timeout_message

    msg = timeout_message("e64_k8_h2048_i1024_bf16_sm90a", {0: "gemm_gateup", 1: "gemm_down"}, 16 * 2 + 2, 500)
    assert "gemm_down" in msg and "free pipeline stage" in msg and "500 ms" in msg and "still usable" in msg
    assert "GEMM slot 6" in timeout_message("v", {}, 16 * 7 + 9, 1)


def test_error_codes_become_the_right_exception():
    from mokgen.runtime import KernelTimeout
    from mokgen.runtime.variant import status_error
    from mokgen.schedule.status import BAD_IDS_CODE

    e = status_error("v", 64, {0: "gemm_fused"}, BAD_IDS_CODE, 500)
    assert isinstance(e, InputError) and "outside [0, 64)" in str(e)
    e = status_error("v", 64, {0: "gemm_fused"}, 16 + 4, 500)
    assert isinstance(e, KernelTimeout) and "gemm_fused" in str(e) and "h_ready" in str(e)
    # expert parallel: which message from which rank never came
    from mokgen.schedule.expert_parallel import EP_ERROR, FLAG_KINDS

    e = status_error("v", 64, {}, EP_ERROR + FLAG_KINDS.index("rows") * 4096 + 1, 10_000)
    assert isinstance(e, KernelTimeout) and "rank 1's rows never arrived" in str(e)
    assert "release_peer_workspaces" in str(e)


def test_expert_parallel_call_checks_before_any_work():
    """A bad max_tokens is refused with a clear message before any GPU work."""
    from mokgen.runtime import _moe_expert_parallel

    class Group:  # stands in for a process group of 2 ranks
        pass

    import torch.distributed as dist

    x = torch.zeros(4, 64, requires_grad=True)
    orig = dist.get_world_size
    dist.get_world_size = lambda group=None: 2
    try:
        with pytest.raises(InputError, match="max_tokens"):
            _moe_expert_parallel(x, None, None, None, None, None, None, None, None, (4, 2, 64, 64, 0), True, Group(),
                                 0)
    finally:
        dist.get_world_size = orig


def test_a_receive_overflow_is_reported_as_the_callers_error():
    from mokgen.runtime.variant import status_error
    from mokgen.schedule.expert_parallel import EP_ERROR, OVERFLOW_KIND

    e = status_error("v", 64, {}, EP_ERROR + OVERFLOW_KIND * 4096 + 1, 10_000)
    assert isinstance(e, InputError) and "rank 1 would have received more" in str(e) and "recv_rows" in str(e)


def test_calls_from_router_logits_take_the_one_launch_where_the_fused_launch_serves_them():
    from mokgen.ir import PRESETS, MoESpec
    from mokgen.runtime.variant import forward_entry, routes_in_launch
    from mokgen.schedule import make_plan

    from mokgen.runtime.variant import routed_entry

    plan = make_plan(PRESETS["olmoe"]).to_dict()
    bound, small = plan["fused_max_tokens"], plan["launch_bands"][0][0]
    assert 0 < small < bound and plan["launch_bands"][-1][0] == bound
    assert [routes_in_launch(plan, t) for t in (0, 1, small, small + 1, bound, bound + 1)] == \
        [False, True, True, True, True, False]
    assert [forward_entry(plan, t) for t in (1, small, small + 1, bound, bound + 1)] == \
        ["forward_n16"] * 2 + ["forward_n32", "forward_fused", "forward"]
    # each band's launch has its routing twin too
    assert [routed_entry(plan, t) for t in (small, small + 1, bound)] == \
        ["forward_routed_n16", "forward_routed_n32", "forward_routed"]
    no_small = make_plan(PRESETS["olmoe"], overrides={"fused_small": False}).to_dict()
    assert no_small["launch_bands"] == [] and forward_entry(no_small, 1) == "forward_fused"
    # (a Plan built before the bands: one small calls' launch)
    old = dict(plan, launch_bands=[], small_max_tokens=384, steps=dict(plan["steps"], forward_small=["x"]))
    assert [forward_entry(old, t) for t in (384, 385)] == ["forward_small", "forward_fused"]
    fused_only = make_plan(PRESETS["olmoe"], overrides={"fuse_gemms": True}).to_dict()
    assert routes_in_launch(fused_only, 100000)  # its one forward path is the fused launch
    for no_launch in ({"fuse_gemms": False}, {"dispatch_in_launch": False}):
        assert not routes_in_launch(make_plan(PRESETS["olmoe"], overrides=no_launch).to_dict(), 1)
    ep = make_plan(MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, world_size=2,
                           topology="nvlink")).to_dict()
    assert not routes_in_launch(ep, 1)  # expert parallel: route, then the layer


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_too_many_tokens_for_32_bit_offsets_are_refused_with_the_batch_that_fits(dtype):
    from mokgen.ir import MoESpec
    from mokgen.runtime.variant import buffer_shapes_at, call_buffer_fns, check_offsets
    from mokgen.schedule import make_plan

    plan = make_plan(MoESpec(experts=256, topk=8, hidden=7168, intermediate=2048, dtype=dtype)).to_dict()
    fns = call_buffer_fns(plan)

    def shapes(t):
        return buffer_shapes_at(fns, t)

    check_offsets("v", shapes, 8192)  # the benchmark's T; the weight gradients (> 2^31 at E256) do not count
    with pytest.raises(InputError, match="too many tokens") as e:
        check_offsets("v", shapes, 100_000)
    fits = int(str(e.value).rsplit("at most ", 1)[1].split()[0])
    check_offsets("v", shapes, fits)
    with pytest.raises(InputError):
        check_offsets("v", shapes, fits + 1)


def test_release_workspaces_drops_every_kept_workspace(monkeypatch):
    """mokgen.release_workspaces() empties what each loaded variant keeps for its next small call."""
    import mokgen
    from mokgen import runtime

    def loaded(kept):  # a loaded variant's kept workspaces (runtime.Variant.release_workspaces clears them)
        v = types.SimpleNamespace(_kept=kept)
        v.release_workspaces = v._kept.clear
        return v

    kept = [loaded({("given", "cuda:0", 0): (64, {}, [], "forward_n32")}), loaded({})]
    monkeypatch.setattr(runtime, "_LOADED", {"a": kept[0], "b": kept[1]})
    mokgen.release_workspaces()
    assert all(v._kept == {} for v in kept)
    assert "release_workspaces" in mokgen.__all__


def test_only_the_builds_at_the_top_of_the_variants_root_serve_calls(monkeypatch, tmp_path):
    """find_variant's lookup among loaded variants: an experiment's, a debug or a profiling build
    of the same layer (loaded from below the root, or from anywhere else) never serves a call
    that names no build; the build at the top of the root does."""
    import types

    import mokgen.runtime as runtime
    from mokgen.ir import MoESpec

    spec = MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024)
    monkeypatch.setenv("MOKGEN_HOME", str(tmp_path))
    loaded = {}
    monkeypatch.setattr(runtime, "_LOADED", loaded)
    want = dict(experts=64, topk=8, hidden=2048, intermediate=1024, world_size=1, dtype="bf16")
    for where in ("experiments/wave", "debug/broken_dependency", "profile", "../elsewhere"):
        path = tmp_path / where / spec.variant
        loaded[str(path)] = types.SimpleNamespace(path=path, spec=spec)
    assert runtime._find_built(want) is None
    top = types.SimpleNamespace(path=tmp_path / spec.variant, spec=spec)
    loaded[str(top.path)] = top
    assert runtime._find_built(want) is top


def _bare_variant(monkeypatch, steps: dict, kernels: dict, side=()):
    """A Variant without a library: its launchers record (kernel, bound tensors, stream)."""
    from mokgen.runtime import variant as V

    v = object.__new__(V.Variant)
    v.plan = {"steps": steps}
    v.spec = types.SimpleNamespace(variant="v")
    v.kernels = {n: {"args": [{"tensor": t} for t in args]} for n, args in kernels.items()}
    v._side_kernels = frozenset(side)
    launched = []
    v.launchers = {n: (lambda ts, stream, _n=n: launched.append((_n, ts, stream))) for n in kernels}
    monkeypatch.setattr(V, "cuda_stream", lambda device: 7)
    return v, launched


def test_run_binds_each_kernels_tensors_by_name_in_the_plans_order(monkeypatch):
    """Variant.run: every kernel of the entry, in order, on the caller's stream, with the
    call's tensors bound by the Plan's names; skipped kernels are left out; a launcher swapped
    after the first call is the one called (benchmarks wrap them); a missing tensor is named."""
    v, launched = _bare_variant(monkeypatch, {"fwd": ["a", "b", "c"]},
                                {"a": ["x", "w"], "b": ["w"], "c": ["out", "x"]})
    env = {"x": 1, "w": 2, "out": 3}
    v.run("fwd", env, "cuda:0")
    assert launched == [("a", [1, 2], 7), ("b", [2], 7), ("c", [3, 1], 7)]
    launched.clear()
    v.run("fwd", env, "cuda:0", skip={"b"})
    assert [n for n, *_ in launched] == ["a", "c"]
    v.launchers["b"] = lambda ts, stream: launched.append(("wrapped", ts, stream))
    launched.clear()
    v.run("fwd", env, "cuda:0")
    assert [n for n, *_ in launched] == ["a", "wrapped", "c"]
    with pytest.raises(KeyError, match=r"'c': \['out'\]"):
        v.run("fwd", {"x": 1, "w": 2}, "cuda:0")


def test_an_error_code_in_the_status_word_raises_once_without_waiting(monkeypatch):
    """The status mirror writes a set error code to the host word; a non-waiting check reads
    it without an event or a sync, raises the code's error once and clears the word."""
    import ctypes

    from mokgen.runtime import variant as V
    from mokgen.schedule.status import BAD_IDS_CODE

    v = object.__new__(V.Variant)
    v.name, v.spec, v.plan = "v", types.SimpleNamespace(experts=64), {"overrides": {}}
    v._gemm_by_slot, v._state, v._status_event = {}, {}, None
    v._status_host = torch.zeros(1, dtype=torch.int32)
    v._status_word = ctypes.c_int32.from_address(v._status_host.data_ptr())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    v._check_status(wait=False)  # 0: no error (or the call not finished)
    v._status_host[0] = BAD_IDS_CODE
    with pytest.raises(InputError, match="outside"):
        v._check_status(wait=False)
    assert int(v._status_host[0]) == 0
    v._check_status(wait=False)


def test_run_forks_side_kernels_onto_the_variants_second_stream_and_joins_the_caller(monkeypatch):
    """An entry with side-stream kernels (expert parallel: the sends) runs on the variant's own
    two streams: the main one waits for the caller's, each side kernel's fork waits for the main
    one, and the caller waits for both at the end (for every later use of the call's buffers)."""
    import torch

    class Stream:
        def __init__(self, name, handle):
            self.name, self.cuda_stream, self.waits = name, handle, []

        def wait_stream(self, other):
            self.waits.append(other.name)

    v, launched = _bare_variant(monkeypatch, {"fwd": ["a", "send", "b"]}, {"a": ["x"], "send": ["x"], "b": ["x"]},
                                side=["send"])
    caller, main, side = Stream("caller", 1), Stream("main", 2), Stream("side", 3)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    v._streams = lambda device: (main, side)
    v.run("fwd", {"x": 0}, "cuda:0")
    assert [(n, s) for n, _, s in launched] == [("a", 2), ("send", 3), ("b", 2)]
    assert main.waits == ["caller"] and side.waits == ["main"] and caller.waits == ["main", "side"]
    launched.clear()
    caller.waits.clear()
    v.run("fwd", {"x": 0}, "cuda:0", skip={"send"})  # (no side kernel left: the caller's stream alone)
    assert [(n, s) for n, _, s in launched] == [("a", 7), ("b", 7)] and caller.waits == []


def test_an_entrys_launches_read_their_pointers_and_extents_from_one_bound_array(monkeypatch):
    """Variant.run's usual path (every launcher a Launcher): one pointer array and one extent
    array per call, each kernel's entry point given the address of its own slice; the pointers
    are the bound tensors', the extents their symbolic dimensions'; a launch error names its
    kernel."""
    import ctypes

    import torch

    from mokgen.runtime.library import LaunchError, Launcher

    seen = []

    def launcher(name, n_args, dyn):
        la = object.__new__(Launcher)
        la.name, la._dyn = name, dyn
        la._err = lambda err: b"an error"

        def raw(data, extents, stream):
            ptrs = list((ctypes.c_void_p * n_args).from_address(data))
            seen.append((name, [p or 0 for p in ptrs], list((ctypes.c_int32 * len(dyn)).from_address(extents)),
                         stream))
            return 0 if name != "bad" else 700
        la.raw = raw
        return la

    v, _ = _bare_variant(monkeypatch, {"fwd": ["a", "b", "c"], "oops": ["a", "bad"]},
                         {"a": ["x", "w"], "b": ["w"], "c": ["out", "x"], "bad": ["w"]})
    v.launchers = {"a": launcher("a", 2, [(0, 0)]), "b": launcher("b", 1, []), "c": launcher("c", 2, [(0, 0), (1, 0)]),
                   "bad": launcher("bad", 1, [])}
    env = {"x": torch.zeros(5, 3), "w": torch.zeros(2, 2), "out": torch.zeros(7, 3)}
    p = {n: t.data_ptr() for n, t in env.items()}
    v.run("fwd", env, "cuda:0")
    assert seen == [("a", [p["x"], p["w"]], [5], 7), ("b", [p["w"]], [], 7), ("c", [p["out"], p["x"]], [7, 5], 7)]
    seen.clear()
    v.run("fwd", env, "cuda:0", skip={"a"})
    assert [s[0] for s in seen] == ["b", "c"] and seen[1][2] == [7, 5]
    with pytest.raises(LaunchError, match="kernel bad failed to launch: an error"):
        v.run("oops", env, "cuda:0")


def test_on_device_switches_the_current_device_and_restores_it(monkeypatch):
    """on_device(t.device) makes t's device current inside (the kernels launch on the current
    device's context) and restores the caller's after, also when the body raises; a device
    without an index stays on the current one."""
    import torch

    from mokgen.runtime.library import on_device

    current = [1]

    def exchange(index):  # (as torch's: a negative index changes nothing and returns -1)
        if index < 0:
            return -1
        prev, current[0] = current[0], index
        return prev

    maybe_exchange = exchange

    monkeypatch.setattr(torch.cuda, "_exchange_device", exchange)
    monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", maybe_exchange)
    with on_device(torch.device("cuda", 3)):
        assert current == [3]
    assert current == [1]
    with pytest.raises(RuntimeError), on_device(torch.device("cuda", 0)):
        assert current == [0]
        raise RuntimeError("a failed launch")
    assert current == [1]
    with on_device(torch.device("cuda")):
        assert current == [1]
    assert current == [1]


def test_a_single_launch_passes_its_own_arrays_by_address():
    """Launcher.__call__ (the status launch, wrapped benchmarks): the same entry point as
    BoundEntry's, given the addresses of an array of its tensors' pointers and of their
    symbolic extents."""
    import ctypes

    import torch

    from mokgen.runtime.library import Launcher

    seen = []
    la = object.__new__(Launcher)
    la.name, la._dyn = "k", [(1, 0)]
    la._data_t, la._dyn_t = ctypes.c_void_p * 2, ctypes.c_int32 * 1
    la.raw = lambda data, extents, stream: seen.append(
        ([p or 0 for p in (ctypes.c_void_p * 2).from_address(data)], ctypes.c_int32.from_address(extents).value,
         stream)) or 0
    a, b = torch.zeros(3), torch.zeros(9, 2)
    la([a, b], 5)
    assert seen == [([a.data_ptr(), b.data_ptr()], 9, 5)]


def _workspace_variant(monkeypatch):
    """A Variant without a library whose entry "fwd" uses a per-call buffer and a state buffer,
    on the CPU (where its buffers' bookkeeping runs just the same)."""
    from mokgen.runtime import variant as V

    v = object.__new__(V.Variant)
    v.name = "v"
    v.plan = {"steps": {"fwd": ["k"]},
              "buffers": [dict(name="rows", dtype="i32", shape=["2*T"], init="none"),
                          dict(name="sync", dtype="i32", shape=[4], init="zeros", memory="state")]}
    v.kernels = {"k": {"args": [{"tensor": "rows"}, {"tensor": "sync"}]}}
    v._buffer_fns = V.call_buffer_fns(v.plan)
    v._state_shapes = {"sync": (torch.int32, (4,))}
    v._state, v._kept, v._state_reserve = {}, {}, {}
    v.poison = v.profiling = v.expert_parallel = False
    monkeypatch.setattr(V, "cuda_stream", lambda device: 7)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return v


def test_a_capture_streams_state_buffers_come_from_the_reserve_made_outside_captures(monkeypatch):
    """A stream whose first call is inside a CUDA graph capture takes a state set made, zeroed,
    beside the first stream's (made inside the capture, it would live in the graph's pool and go
    with it); a device's first call inside a capture is refused with a clear error."""
    from mokgen.runtime import InputError
    from mokgen.runtime import variant as V

    v = _workspace_variant(monkeypatch)
    cpu = torch.device("cpu")
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    with pytest.raises(InputError, match="call it once outside the capture first"):
        v._workspace(5, cpu, "fwd")
    capturing[0] = False
    eager = v._workspace(5, cpu, "fwd")["sync"]  # stream 7: its own set, and the reserve beside it
    assert len(v._state_reserve[cpu]) == V.STATE_RESERVE
    spare = v._state_reserve[cpu][-1]["sync"]
    capturing[0] = True
    monkeypatch.setattr(V, "cuda_stream", lambda device: 8)  # torch's capture stream, first seen in a capture
    got = v._workspace(5, cpu, "fwd")["sync"]
    assert got is spare and got is not eager and torch.equal(got, torch.zeros(4, dtype=torch.int32))
    assert len(v._state_reserve[cpu]) == V.STATE_RESERVE - 1
    assert v._workspace(5, cpu, "fwd")["sync"] is got  # (kept for that stream's later captures)


def test_calls_inside_the_custom_ops_keep_nothing_and_own_their_state_buffers(monkeypatch):
    """Inside per_call_memory (the custom ops, which torch.compile's graphs call: with
    mode="reduce-overhead" a graph's first calls allocate from a CUDA-graph pool that torch
    resets) a call's buffers and its launches' state buffers are its own: nothing it allocates
    outlives it in the variant, and what the eager calls keep is left as it was."""
    from mokgen.runtime import ops as O

    v = _workspace_variant(monkeypatch)
    cpu = torch.device("cpu")
    first = v._workspace(5, cpu, "fwd", keep=True)
    assert first["rows"].shape == (10,) and v._kept and v._state
    again = v._workspace(5, cpu, "fwd", keep=True)
    assert again["rows"] is first["rows"] and again["sync"] is first["sync"]
    kept, state = dict(v._kept), dict(v._state)
    with O.per_call_memory():
        own = v._workspace(5, cpu, "fwd", keep=True)
        other_t = v._workspace(3, cpu, "fwd", keep=True)
    assert own["rows"] is not first["rows"] and own["sync"] is not first["sync"]
    assert torch.equal(own["sync"], torch.zeros(4, dtype=torch.int32))
    assert other_t["rows"].shape == (6,)
    assert v._kept == kept and v._state == state
    with pytest.raises(RuntimeError):  # (the mode ends with its block, also on an error)
        with O.per_call_memory():
            raise RuntimeError
    assert v._workspace(5, cpu, "fwd", keep=True)["rows"] is first["rows"]


def test_every_custom_op_runs_its_variant_call_with_per_call_memory(monkeypatch):
    """The custom ops' implementations (what compiled graphs call) run the variant's entry
    points inside per_call_memory; the eager binding's calls do not."""
    from mokgen.runtime import ops as O
    from mokgen.runtime import variant as V

    seen = {}

    def entry(name, result):
        def call(*args, **kwargs):
            seen[name] = O.PER_CALL_MEMORY.get()
            return result()
        return call

    x = torch.zeros(3, 4)
    v = object.__new__(V.Variant)
    v.name = "per_call_memory_probe"
    v.forward = entry("forward", lambda: x.clone())
    v.forward_train = entry("forward_train", lambda: tuple(x.clone() for _ in range(9)))
    v.backward = entry("backward", lambda: tuple(x.clone() for _ in range(5)) + (None,) * 3)
    v.forward_routed = entry("forward_routed", lambda: (x.clone(), x.clone(), x.clone()))
    ops = O.register_ops(v)
    ids, w = torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)
    ops.forward(x, ids, w, x, x, x)
    ops.forward_train(x, ids, w, x, x, x)
    ops.backward(x, x, ids, w, x, x, x, None, None, None, [])
    ops.forward_routed(x, x, x, x, x)
    assert seen == dict(forward=True, forward_train=True, backward=True, forward_routed=True)
    seen.clear()
    v.forward(x)
    assert seen == dict(forward=False) and O.PER_CALL_MEMORY.get() is False


def test_what_a_training_forward_hands_on_is_carved_from_one_allocation(monkeypatch):
    """The buffers an eager call hands on (fresh: the training forward's saved tensors) are
    views of one allocation, each starting at a multiple of CARVE_ALIGN bytes, apart and of
    their own dtype and shape; inside a custom op (outputs may not alias) each is its own
    allocation; in poison mode each is filled."""
    from mokgen.runtime import ops as O
    from mokgen.runtime import variant as V

    v = _workspace_variant(monkeypatch)
    v.plan["buffers"] += [dict(name="ga", dtype="bf16", shape=["T", 3], init="none"),
                          dict(name="pos", dtype="i32", shape=["T", 2], init="none")]
    v.kernels["k"]["args"] += [{"tensor": "ga"}, {"tensor": "pos"}]
    v._buffer_fns = V.call_buffer_fns(v.plan)
    cpu = torch.device("cpu")
    ws = v._workspace(5, cpu, "fwd", keep=True, fresh=("ga", "pos"))
    ga, pos = ws["ga"], ws["pos"]
    assert (ga.dtype, ga.shape, pos.dtype, pos.shape) == (torch.bfloat16, (5, 3), torch.int32, (5, 2))
    assert ga.untyped_storage().data_ptr() == pos.untyped_storage().data_ptr()
    base = ga.untyped_storage().data_ptr()  # (CUDA's allocator aligns it to 512 bytes; the CPU's less)
    assert (ga.data_ptr() - base, pos.data_ptr() - base) == (0, V.CARVE_ALIGN)
    assert all(n not in kept for _, kept, *_ in v._kept.values() for n in ("ga", "pos"))
    again = v._workspace(5, cpu, "fwd", keep=True, fresh=("ga", "pos"))
    assert again["rows"] is ws["rows"] and again["ga"].data_ptr() != ga.data_ptr()
    with O.per_call_memory():
        own = v._workspace(5, cpu, "fwd", keep=True, fresh=("ga", "pos"))
    assert own["ga"].untyped_storage().data_ptr() != own["pos"].untyped_storage().data_ptr()
    v.poison = True
    poisoned = v._workspace(5, cpu, "fwd", fresh=("ga", "pos"))
    assert poisoned["ga"].isnan().all() and (poisoned["pos"] == -1).all()


def test_a_mirrored_entry_reports_its_own_error_code_and_nothing_launches_behind_it(monkeypatch):
    """An entry whose last kernel copies the error code itself (the single launch's last CTA, the
    per-GEMM path's combine, the backward's last GEMM) gets the pinned host word bound and no
    status_mirror launch behind it; an entry whose last kernel cannot, or a call that skips that
    kernel (a rank without tokens), keeps status_mirror behind its kernels."""
    from mokgen.ir import PRESETS
    from mokgen.runtime import variant as V
    from mokgen.schedule.plan import make_plan

    plan = make_plan(PRESETS["olmoe"]).to_dict()
    mirrored = V.mirrored_entries(plan)
    assert {"forward_n64", "forward_routed_n64", "forward", "forward_train", "backward"} <= mirrored
    assert "status" not in mirrored and "route" not in mirrored

    v, launched = _bare_variant(monkeypatch, {"one": ["launch"], "multi": ["a", "b"], "status": ["status_mirror"]},
                                {"launch": ["x", "status_host"], "a": ["x"], "b": ["out"],
                                 "status_mirror": ["tile_counters", "status_host"]})
    import ctypes

    v._mirrored, v._status_slot, v._status_event = frozenset({"one"}), 3, None
    host = v._status_host = torch.zeros(1, dtype=torch.int32)  # (pinned on a GPU machine)
    v._status_word = ctypes.c_int32.from_address(host.data_ptr())
    v.name, v.spec.experts, v.plan["overrides"], v._gemm_by_slot, v._state = "v", 64, {}, {}, {}
    v._token_grids = frozenset()
    counters = torch.zeros(4, dtype=torch.int32)
    monkeypatch.setattr(v, "_workspace", lambda tokens, device, entry, peers, keep: {"tile_counters": counters},
                        raising=False)
    x = torch.zeros(4, 8)
    v._run_forward("one", x, {}, None, None, None, None, None, None, "out")
    assert [(n, [id(t) for t in ts], stream) for n, ts, stream in launched] == [("launch", [id(x), id(host)], 7)]
    launched.clear()
    v._run_forward("multi", x, {}, None, None, None, None, None, None, "out")
    assert [n for n, *_ in launched] == ["a", "b", "status_mirror"]
    assert [id(t) for t in launched[-1][1]] == [id(counters), id(host)]
    launched.clear()  # (a call that skips the mirroring kernel)
    v._run_and_report("one", {"tile_counters": counters, "x": x}, "cpu", skip=frozenset({"launch"}))
    assert [n for n, *_ in launched] == ["status_mirror"]
