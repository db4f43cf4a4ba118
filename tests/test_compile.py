"""Ahead-of-time compile for sm_90a on a machine with no GPU (needs nvidia-cutlass-dsl)."""
import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from mokgen.ir import PRESETS, MoESpec
from mokgen.schedule.single_launch import L2_EVICT_FIRST, L2_EVICT_LAST, SWAP_ROWS

pytestmark = pytest.mark.compile

SPECS = [
    PRESETS["olmoe"],
    PRESETS["qwen3-30b-a3b"],
    MoESpec(experts=40, topk=6, hidden=1536, intermediate=640),
    MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=768),
]


def nvdisasm():
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        for cand in Path(root).glob("cu*/bin/nvdisasm"):
            return str(cand)
    return shutil.which("nvdisasm")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from mokgen.codegen import build

    out = tmp_path_factory.mktemp("variants")
    return {s.variant: build(s, out, log=lambda m: None) for s in SPECS}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
def test_compiles_for_sm90a_and_exports_launchers(built, spec):
    path = built[spec.variant]
    lib = path / "build" / "libmokgen.so"
    assert lib.exists()
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    import json

    plan = json.loads((path / "manifest.json").read_text())["plan"]
    for k in plan["kernels"]:
        assert f"mokgen_{k['name']}_launch" in syms
        assert (path / "build" / f"{k['name']}.cubin").exists()
    ctypes.CDLL(str(lib))  # loads without a GPU (module load happens at first launch)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
def test_gemm_sass_uses_hgmma_without_local_memory(built, spec):
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    import json

    path = built[spec.variant]
    plan = json.loads((path / "manifest.json").read_text())["plan"]
    gemms = [k["name"] for k in plan["kernels"] if k["template"] == "grouped_gemm_persistent.py.j2"]
    assert any(g.startswith("wgrad_") for g in gemms)  # the backward's GEMMs too
    for cubin in [path / "build" / f"{g}.cubin" for g in gemms]:
        sass = subprocess.run([tool, str(cubin)], capture_output=True, text=True, check=True).stdout
        assert "HGMMA" in sass, f"{cubin.name}: no HGMMA (off the wgmma path)"
        assert "UTMALDG" in sass, f"{cubin.name}: no TMA loads"
        assert not any(op in sass for op in ("LDL", "STL")), f"{cubin.name}: local-memory traffic (spills)"


def test_swapped_tiles_put_the_token_rows_on_the_wgmma_n(built):
    """The single launch's bands by T run swapped tiles: the wgmma's N is the band's token rows
    (HGMMA.64x<rows>), the weights its M, and the epilogue stores C transposed (stmatrix .trans);
    the 16- and 32-row bands read K blocks of 128 (16 wgmma per stage, two accumulators); their
    combine discards the L2 lines it read last, the plain launch's does not."""
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed")
    import json

    spec = PRESETS["olmoe"]
    path = built[spec.variant]
    plan = json.loads((path / "manifest.json").read_text())["plan"]
    bands = [k for k in plan["kernels"] if k["params"].get("swap")]
    assert {k["params"]["tile_m"] for k in bands} == set(SWAP_ROWS)
    for k in bands:
        sass = subprocess.run([tool, str(path / "build" / f"{k['name']}.cubin")], capture_output=True, text=True,
                              check=True).stdout
        n = k["params"]["tile_m"]
        hgmma = [line for line in sass.splitlines() if "HGMMA." in line]
        assert hgmma and all(f"HGMMA.64x{n}x16.F32.BF16" in line for line in hgmma), k["name"]
        assert len(hgmma) == 2 * k["params"]["tile_k"] // 16, k["name"]
        assert "STSM.16.MT88" in sass, k["name"]
        # The weight loads carry L2's evict-first policy (CacheHintSm90 EVICT_FIRST); the h rows' loads
        # and the h and y stores (TMA, shared to global, with a cache hint) evict-last.
        ptx = (path / "build" / f"{k['name']}.ptx").read_text()
        assert k["params"]["weights_evict_first"] and f"{L2_EVICT_FIRST};" in ptx, k["name"]
        assert k["params"]["rows_evict_last"] and f"{L2_EVICT_LAST};" in ptx, k["name"]
        stores = [line for line in ptx.splitlines() if "cp.async.bulk.tensor" in line and ".global.shared::cta" in line]
        assert stores and all("L2::cache_hint" in line for line in stores), k["name"]
        # The early combine drops the y and h lines it read last (discard.global.L2, CCTL.E.RML2 in SASS).
        assert k["params"]["discard_consumed"] and "discard.global.L2" in ptx and "CCTL.E.RML2" in sass, k["name"]
    plain = (path / "build" / "gemm_fused.ptx").read_text()
    assert "discard.global.L2" not in plain  # (the plain 128-row launch keeps its lines: measured slower)


def test_single_launch_routes_and_dispatches_inside(built):
    """The one-launch forward: its counters are released once per CTA and polled with
    acquire loads (no atomics in the spin), and its routing twin routes with warp shuffles."""
    path = built[PRESETS["olmoe"].variant] / "build"
    for name in ("gemm_fused", "gemm_fused_routed"):
        ptx = (path / f"{name}.ptx").read_text()
        assert "ld.acquire.gpu" in ptx and "atom.global.release.add" in ptx, name
    routed = (path / "gemm_fused_routed.ptx").read_text()
    assert routed.count("shfl.sync.bfly") > (path / "gemm_fused.ptx").read_text().count("shfl.sync.bfly")
    assert "ex2.approx" in routed


def test_single_launch_combine_keeps_all_k_row_loads_in_flight(built):
    """The single launches' combine phase issues a piece's K row loads back to back, before
    the first product (templates/combine_piece.py.j2): with a load inside the branch that skips
    an id, ptxas had waited on each row (five loads, products, three more; docs/perf.md)."""
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed")
    spec = PRESETS["olmoe"]
    path = built[spec.variant] / "build"
    for name in ("gemm_fused", "gemm_fused_n32", "gemm_fused_n160"):
        sass = subprocess.run([tool, str(path / f"{name}.cubin")], capture_output=True, text=True,
                              check=True).stdout
        # Each piece ends with its 16-byte store to out: count the 16-byte loads that follow a
        # store before the next product (the next piece's row loads).
        counting, runs = False, [0]
        for line in sass.splitlines():
            if "STG.E.128" in line:
                counting = True
                runs.append(0)
            elif "FFMA" in line:
                counting = False
            elif counting and "LDG.E.128" in line:
                runs[-1] += 1
        assert max(runs) >= spec.topk, f"{name}: at most {max(runs)} row loads in flight before a product"


def test_profiling_build_compiles_and_keeps_the_fast_path_clean(tmp_path):
    """A profiling build (task records) compiles for every kernel kind, its GEMMs still
    run on HGMMA without spills, and it lives apart from the normal build."""
    from mokgen.codegen.build import build_profiling

    spec = SPECS[3]  # routed and shared-expert GEMMs, dispatch, combine
    path = build_profiling(spec, tmp_path, log=lambda m: None)
    assert path.parent == tmp_path / "profile"
    tool = nvdisasm()
    for cubin in sorted((path / "build").glob("*.cubin")):
        sass = subprocess.run([tool, str(cubin)], capture_output=True, text=True, check=True).stdout if tool else ""
        # route, its backward and the status mirror: entry points of their own, no tasks
        if tool and not cubin.stem.startswith(("route", "status_mirror")):
            assert "GLOBALTIMER" in sass, f"{cubin.name}: records no times"
        if tool and ("gemm" in cubin.stem or cubin.stem.startswith("shared")):
            assert "HGMMA" in sass and not any(op in sass for op in ("LDL", "STL")), cubin.name


def test_cluster_build_multicasts_the_weight_tiles(tmp_path):
    from mokgen.codegen import build

    path = build(SPECS[0], tmp_path, overrides={"cluster_m": 2}, log=lambda m: None)
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed")
    for name in ("gemm_gateup", "gemm_down"):
        sass = subprocess.run([tool, str(path / "build" / f"{name}.cubin")], capture_output=True, text=True,
                              check=True).stdout
        assert "UTMALDG.3D.MULTICAST" in sass and "HGMMA" in sass, name
        assert not any(op in sass for op in ("LDL", "STL")), name


def test_rebuild_is_a_no_op_and_failed_build_leaves_nothing(built, tmp_path, monkeypatch):
    import importlib

    build_mod = importlib.import_module("mokgen.codegen.build")
    BuildError, build = build_mod.BuildError, build_mod.build

    spec = SPECS[0]
    path = built[spec.variant]
    stamp = (path / "build" / "build.json").read_text()
    assert build(spec, path.parent, log=lambda m: None) == path
    assert (path / "build" / "build.json").read_text() == stamp

    def boom(*a, **k):
        raise BuildError("injected compile failure")

    monkeypatch.setattr(build_mod, "_compile", boom)
    other = MoESpec(experts=4, topk=2, hidden=256, intermediate=128)
    with pytest.raises(BuildError, match="injected"):
        build(other, tmp_path, log=lambda m: None)
    assert not (tmp_path / other.variant).exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_random_legal_specs_compile(tmp_path):
    """A few random legal specs (odd multiples of 64, K = E, a shared expert) compile for
    sm_90a with HGMMA and no spills; benchmarks/random_specs.py runs 50 of them on a GPU."""
    import sys
    from pathlib import Path

    from mokgen.codegen import build

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from random_specs import draw_specs

    tool = nvdisasm()
    for spec in draw_specs(8, seed=11)[4:]:  # past the fixed edge cases, which the GPU run covers
        path = build(spec, tmp_path, log=lambda m: None)
        for cubin in sorted((path / "build").glob("*gemm*.cubin")) + sorted((path / "build").glob("shared_*.cubin")):
            sass = subprocess.run([tool, str(cubin)], capture_output=True, text=True, check=True).stdout if tool else ""
            if tool:
                assert "HGMMA" in sass and not any(op in sass for op in ("LDL", "STL")), (spec.variant, cubin.name)


EP_SPEC = MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=512, world_size=2,
                  topology="nvlink")
EXCHANGE = ("ep_publish", "ep_layout", "ep_send", "ep_wait_returns")  # (the overlapped Plan: gemm_down returns)
EXCHANGE_BWD = ("ep_layout_bwd", "ep_send_bwd", "ep_send_bwd_grad", "ep_send_bwd_x", "ep_return_bwd")  # the backward's


def check_exchange_ptx(build_dir: Path) -> None:
    """Peer stores are ordered by a system-scope fence and announced by a release store at
    system scope; waits are acquire loads at system scope, bounded by the global timer."""
    ptx = {k: (build_dir / f"{k}.ptx").read_text() for k in EXCHANGE}
    for k in ("ep_publish", "ep_send"):
        assert "fence.acq_rel.sys" in ptx[k] and "st.release.sys.global" in ptx[k], k
    assert "st.global.v4" in ptx["ep_send"], "ep_send: rows are not stored 16 B at a time"
    down = build_dir / "gemm_down.ptx"  # it returns its rows itself, then raises the returns flags
    if down.exists():
        text = down.read_text()
        assert "fence.acq_rel.sys" in text and "st.release.sys.global" in text and "st.global.v4" in text
    if (build_dir / "ep_send_bwd.ptx").exists():
        bwd = {k: (build_dir / f"{k}.ptx").read_text() for k in EXCHANGE_BWD}
        for k in ("ep_send_bwd", "ep_return_bwd"):
            assert "fence.acq_rel.sys" in bwd[k] and "st.release.sys.global" in bwd[k] and "st.global.v4" in bwd[k], k
        assert "st.global.v4" in bwd["ep_layout_bwd"]  # it zeroes the padding rows, 16 B at a time
    for k in ("ep_layout", "ep_wait_returns"):
        assert "ld.acquire.sys.global" in ptx[k] and "%globaltimer" in ptx[k], k
    gateup = build_dir / "gemm_gateup.ptx"  # its producer waits for each expert's rows
    if gateup.exists():
        assert "ld.acquire.sys.global" in gateup.read_text()


def test_expert_parallel_variant_compiles(tmp_path):
    """The 2-GPU layer: the exchange kernels with system-scope flags, and GEMMs that load the
    received rows by TMA on HGMMA without spills."""
    from mokgen.codegen import build

    path = build(EP_SPEC, tmp_path, log=lambda m: None)
    syms = subprocess.run(["nm", "-D", "--defined-only", str(path / "build" / "libmokgen.so")], capture_output=True,
                          text=True).stdout
    backward = ("gemm_gateup_train", "shared_gateup_train", "bwd_recompute", "bwd_dgrad_down", "bwd_swiglu",
                "bwd_dgrad_gateup", "wgrad_down", "wgrad_gate", "wgrad_up", "bwd_combine", "bwd_shared_swiglu",
                "wgrad_shared_up")
    for k in EXCHANGE + EXCHANGE_BWD + ("gemm_gateup", "gemm_down", "shared_gateup", "combine") + backward:
        assert f"mokgen_{k}_launch" in syms, k
    check_exchange_ptx(path / "build")
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed")
    for name in ("gemm_gateup", "gemm_down", "bwd_recompute", "bwd_dgrad_down", "wgrad_down", "wgrad_gate"):
        sass = subprocess.run([tool, str(path / "build" / f"{name}.cubin")], capture_output=True, text=True,
                              check=True).stdout
        assert "HGMMA" in sass and "UTMALDG" in sass and not any(op in sass for op in ("LDL", "STL")), name


def test_gate_up_launch_that_sends_its_rows_compiles(tmp_path):
    """Plan override gemm_sends: the gate/up GEMMs with the send inside their launch, on
    HGMMA without spills, their send storing to peers and counting at system scope."""
    import sys

    from mokgen.codegen.render import render, write_tree
    from mokgen.schedule import make_plan

    plan = make_plan(EP_SPEC, overrides={"gemm_sends": True})
    write_tree(render(plan), tmp_path / "v")
    names = ("gemm_gateup", "gemm_gateup_train", "ep_send_bwd_grad")
    subprocess.run([sys.executable, "-m", "mokgen.codegen.compile_worker", str(tmp_path / "v"), str(tmp_path / "b"),
                    *names], check=True, capture_output=True)
    for name in names[:2]:
        ptx = (tmp_path / "b" / f"{name}.ptx").read_text()
        assert "fence.acq_rel.sys" in ptx and "st.release.sys" in ptx, name
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed")
    for name in names[:2]:
        sass = subprocess.run([tool, str(tmp_path / "b" / f"{name}.cubin")], capture_output=True, text=True,
                              check=True).stdout
        assert "HGMMA" in sass and "UTMALDG" in sass and not any(op in sass for op in ("LDL", "STL")), name


def test_expert_parallel_single_launch_compiles(tmp_path):
    """The expert-parallel single launch (dispatch, publish, layout, send, gate/up, down and
    return in one kernel), the one that also combines, and the one after the dispatch, publish
    and layout kernels: HGMMA and TMA without spills; peer stores fenced and announced at
    system scope; the counts and the rows' ready flags acquired at system scope, the launch's
    own counters at GPU scope."""
    import sys

    from mokgen.codegen.render import render, write_tree
    from mokgen.schedule import make_plan

    spec = MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, world_size=2, topology="nvlink")
    # the default, the one that also combines (ep_fused_combine), the one laid out before it
    for d, overrides in (("", {}), ("c", {"ep_fused_combine": True}), ("a", {"dispatch_in_launch": False})):
        plan = make_plan(spec, overrides=overrides)
        assert "forward_fused" in plan.steps
        write_tree(render(plan), tmp_path / f"v{d}")
        subprocess.run([sys.executable, "-m", "mokgen.codegen.compile_worker", str(tmp_path / f"v{d}"),
                        str(tmp_path / f"b{d}"), "gemm_fused", *(["ep_layout", "ep_publish"] if d == "a" else [])],
                       check=True, capture_output=True)
    tool = nvdisasm()
    releases = {}
    for d in ("", "c", "a"):
        ptx = (tmp_path / f"b{d}" / "gemm_fused.ptx").read_text()
        assert "fence.acq_rel.sys" in ptx and "st.release.sys" in ptx and "ld.acquire.sys.global" in ptx
        assert "st.global.v4" in ptx and "ld.acquire.gpu" in ptx  # rows go out 16 B at a time
        releases[d] = ptx.count("atom.global.release.add")
        if tool is not None:
            sass = subprocess.run([tool, str(tmp_path / f"b{d}" / "gemm_fused.cubin")], capture_output=True,
                                  text=True, check=True).stdout
            assert "HGMMA" in sass and "UTMALDG" in sass and not any(op in sass for op in ("LDL", "STL")), d
    assert releases[""] > releases["a"] and releases["c"] > releases["a"]  # the phases' launch-wide counters
    if tool is None:
        pytest.skip("nvdisasm not installed")


def test_late_claims_compile_in_both_producers(tmp_path):
    """Override claim_late: the single launch's producer claims each next tile right before it
    publishes it (after the current tile's loads), in the gathering producer (one GPU: the
    128-row launch and a band) and the TMA one (expert parallel); HGMMA, no spills. The per-GEMM
    kernels still claim a tile ahead."""
    import sys

    from mokgen.codegen.render import render, write_tree
    from mokgen.schedule import make_plan

    ep = MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, world_size=2, topology="nvlink")
    cases = (("one", PRESETS["olmoe"], ["gemm_fused", "gemm_fused_n64"]), ("ep", ep, ["gemm_fused"]))
    tool = nvdisasm()
    for d, spec, kernels in cases:
        files = render(make_plan(spec, overrides={"claim_late": True}))
        for name in kernels + (["gemm_gateup"] if d == "one" else []):
            lines = files[f"{name}.py"].splitlines()
            at = [i for i, line in enumerate(lines) if "claimed = sched_claim(counter)" in line]
            late = [i for i in at if "sched_publish(" in lines[i + 1]]
            assert len(at) == 1 and late == (at if name.startswith("gemm_fused") else []), (d, name)
        write_tree(files, tmp_path / f"v{d}")
        subprocess.run([sys.executable, "-m", "mokgen.codegen.compile_worker", str(tmp_path / f"v{d}"),
                        str(tmp_path / f"b{d}"), *kernels], check=True, capture_output=True)
        if tool is not None:
            for name in kernels:
                sass = subprocess.run([tool, str(tmp_path / f"b{d}" / f"{name}.cubin")], capture_output=True,
                                      text=True, check=True).stdout
                assert "HGMMA" in sass and not any(op in sass for op in ("LDL", "STL")), (d, name)
    if tool is None:
        pytest.skip("nvdisasm not installed")


@pytest.mark.parametrize("world", [4, 8, 72])
def test_exchange_compiles_for_larger_nvlink_domains(tmp_path, world):
    """N=4 and N=8 (the DeepSeek-V3 layer) and an NVL72 domain are planned and their exchange,
    forward and backward, compiled (their GEMMs are the 2-GPU layer's templates)."""
    import sys

    from mokgen.codegen.render import render, write_tree
    from mokgen.schedule import make_plan

    experts = 288 if world == 72 else 256
    plan = make_plan(MoESpec(experts=experts, topk=8, hidden=7168, intermediate=2048, shared_intermediate=2048,
                             world_size=world, topology="nvlink"))
    write_tree(render(plan), tmp_path / "v")
    subprocess.run([sys.executable, "-m", "mokgen.codegen.compile_worker", str(tmp_path / "v"), str(tmp_path / "b"),
                    *EXCHANGE, *EXCHANGE_BWD], check=True, capture_output=True)
    check_exchange_ptx(tmp_path / "b")


def test_fp8_gemms_compile_to_qgmma_without_spills(tmp_path):
    """The FP8 grouped GEMMs (templates/grouped_gemm_fp8.py.j2): e4m3 wgmma (QGMMA), the
    promotion's accumulators in registers (no local memory); gate/up converts h to e4m3, and so
    do the quantisers of the rows, the weight gradients' operands and the weights
    (templates/quantize_*_fp8.py.j2), the blockwise ones reading their blocks by rows and
    dividing by a scale through its reciprocal, the rows' one 16 values a lane; the weight
    gradients store 16 bytes per thread."""
    from mokgen.codegen import build

    path = build(MoESpec(experts=8, topk=2, hidden=1024, intermediate=512, dtype="fp8"), tmp_path, log=lambda m: None)
    assert (path / "build" / "libmokgen.so").exists()
    tool = nvdisasm()
    for name in ("gemm_gateup_fp8", "gemm_gateup_fp8_train", "gemm_down_fp8", "bwd_recompute_fp8",
                 "bwd_dgrad_down_fp8", "bwd_dgrad_gateup_fp8", "wgrad_down_fp8", "wgrad_gateup_fp8"):
        cubin = path / "build" / f"{name}.cubin"
        assert cubin.exists(), name
        if tool:
            sass = subprocess.run([tool, str(cubin)], capture_output=True, text=True, check=True).stdout
            assert "QGMMA.64x128x32.F32.E4M3.E4M3" in sass and "UTMALDG" in sass, name
            assert not any(op in sass for op in ("LDL", "STL")), f"{name}: local-memory traffic (spills)"
            if name.startswith("gemm_gateup_fp8"):
                assert "F2FP.SATFINITE.E4M3.F32" in sass, "h is not converted to e4m3"
            if name.startswith("wgrad"):  # (the epilogue's 16-byte stores through shared memory)
                assert "STG.E.128" in sass, name
    for name in ("quantize_rows_fp8", "quantize_x_t_fp8", "swiglu_backward_fp8", "quantize_w13_fp8",
                 "quantize_w_down_fp8"):
        cubin = path / "build" / f"{name}.cubin"
        assert cubin.exists(), name
        if tool:
            sass = subprocess.run([tool, str(cubin)], capture_output=True, text=True, check=True).stdout
            assert "F2FP.SATFINITE.E4M3.F32" in sass and not any(op in sass for op in ("LDL", "STL")), name
            if name == "quantize_rows_fp8":  # 16 values a lane: 32-byte loads of x, 16-byte stores of e4m3
                assert "LDG.E.128" in sass and "STG.E.128" in sass, name
            if name.startswith("quantize_w") or name == "quantize_x_t_fp8":
                # the block comes in by rows (16-byte loads) through shared memory (16-byte stores
                # and loads: templates/fp8_block_tile.py.j2), not in the column order it goes out in
                assert all(op in sass for op in ("LDG.E.128", "STS.128", "LDS.128")), name
            if name.startswith("quantize_w"):
                # no division per value (a reciprocal per block and one corrected step:
                # templates/fp8_block_tile.py.j2), and q stored by rows 16 bytes a thread
                assert sass.count("MUFU.RCP") < 128 * 128 // 256 and "STG.E.128" in sass, name
