"""[hardening] Builds: concurrent builds never corrupt the variants directory, a killed build
leaves nothing a later load trusts, and a variant another mokgen, template or CuTe-DSL
version built is rebuilt (or, where nothing can rebuild it, reported)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mokgen.codegen.render import render
from mokgen.ir import MoESpec
from mokgen.schedule.plan import make_plan

A = MoESpec(experts=8, topk=2, hidden=256, intermediate=128)
B = MoESpec(experts=6, topk=3, hidden=192, intermediate=320, shared_intermediate=64)


def cli_build(spec, out, *extra):
    return [sys.executable, "-m", "mokgen.cli", "build", "--experts", str(spec.experts), "--topk", str(spec.topk),
            "--hidden", str(spec.hidden), "--intermediate", str(spec.intermediate), "--shared-intermediate",
            str(spec.shared_intermediate), "--out", str(out), *extra]


def test_concurrent_builds_of_the_same_and_other_variants_never_corrupt(tmp_path):
    # Six processes at once: three render the same variant, three another; each also
    # re-renders with --force, so publishes really race.
    procs = [subprocess.Popen(cli_build(spec, tmp_path, "--no-compile", *(["--force"] if i % 2 else [])),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, spec in enumerate([A, B, A, B, A, B])]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    for spec in (A, B):
        files = render(make_plan(spec))
        for rel, text in files.items():
            assert (tmp_path / spec.variant / rel).read_text() == text, rel
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".old-*"))


@pytest.mark.compile
def test_a_killed_build_leaves_nothing_a_load_would_trust(tmp_path):
    from mokgen.codegen import build, is_built
    from mokgen.runtime import VariantNotBuilt, load

    p = subprocess.Popen(cli_build(A, tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(tmp_path.glob(f".tmp-{A.variant}-*/build")) and time.time() < deadline:
        time.sleep(0.05)  # wait until it is compiling
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert list(tmp_path.glob(".tmp-*")), "the kill came too late to test anything"
    assert not is_built(tmp_path / A.variant)
    with pytest.raises(VariantNotBuilt):
        load(tmp_path / A.variant)
    # The next build succeeds and clears what the killed one left.
    build(A, tmp_path, log=lambda m: None)
    assert is_built(tmp_path / A.variant) and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.compile
def test_a_variant_of_another_version_is_rebuilt(tmp_path, monkeypatch):
    from mokgen.codegen import build

    path = build(A, tmp_path, log=lambda m: None)
    fresh = (path / "manifest.json").read_text()
    for field in ("templates", "cute_dsl_version"):  # another template, another CuTe-DSL
        m = json.loads(fresh)
        m[field] = {"grouped_gemm_persistent.py.j2": "0" * 16} if field == "templates" else "4.0.0"
        (path / "manifest.json").write_text(json.dumps(m))
        stamp = (path / "build" / "build.json").stat().st_mtime_ns
        # What mokgen.load(spec) does where CuTe-DSL is installed: a stale variant is rebuilt.
        monkeypatch.setenv("MOKGEN_HOME", str(tmp_path))
        import mokgen.runtime as rt

        monkeypatch.setattr(rt, "Variant", lambda p: type("V", (), {"manifest": {}, "name": "v", "path": p})())
        rt._LOADED.clear()
        rt.load(A)
        assert (path / "manifest.json").read_text() == fresh
        assert (path / "build" / "build.json").stat().st_mtime_ns != stamp


def test_a_variant_built_by_another_mokgen_is_reported_where_it_cannot_be_rebuilt(tmp_path, monkeypatch):
    import mokgen.runtime as rt

    path = tmp_path / A.variant
    path.mkdir()
    files = render(make_plan(A))
    m = json.loads(files["manifest.json"])
    m["plan"]["mokgen_version"] = "0.0.1"
    (path / "manifest.json").write_text(json.dumps(m))
    fake = type("V", (), {"manifest": m, "name": A.variant, "path": path})()
    monkeypatch.setattr(rt, "Variant", lambda p: fake)
    rt._LOADED.clear()
    with pytest.warns(UserWarning, match="built by mokgen 0.0.1"):
        rt.load(path)
    rt._LOADED.clear()


@pytest.mark.compile
def test_a_plan_change_no_source_sees_rewrites_the_manifest_without_compiling(tmp_path, monkeypatch):
    """Where only the manifest's Plan differs (its notes: decisions, the task graph) and every
    rendered source, template and version is the same, the build rewrites manifest.json and
    compiles nothing; a changed source still recompiles."""
    from mokgen.codegen import build

    path = build(A, tmp_path, log=lambda m: None)
    fresh = (path / "manifest.json").read_text()
    stamp = (path / "build" / "build.json").stat().st_mtime_ns
    m = json.loads(fresh)
    m["plan"]["decisions"] = ["an older note"]
    (path / "manifest.json").write_text(json.dumps(m))
    logs = []
    assert build(A, tmp_path, log=logs.append) == path
    assert (path / "manifest.json").read_text() == fresh and "manifest's Plan rewritten" in logs[-1]
    assert (path / "build" / "build.json").stat().st_mtime_ns == stamp and not list(path.glob(".manifest-*"))
    m["files"] = dict(m["files"], **{"combine.py": "0" * 64})  # a source that differs: compiled again
    m["plan"] = json.loads(fresh)["plan"]
    (path / "manifest.json").write_text(json.dumps(m))
    build(A, tmp_path, log=lambda m: None)
    assert (path / "manifest.json").read_text() == fresh
    assert (path / "build" / "build.json").stat().st_mtime_ns != stamp


@pytest.mark.compile  # (the keys hold the CuTe-DSL version: where it is not installed there is nothing to key)
def test_kernel_keys_follow_every_input_of_a_kernels_compile(tmp_path, monkeypatch):
    """A kernel's key changes with its rendered module, its arguments, the target arch and the
    environment's CUTE_DSL_* settings, and with nothing another kernel has: so reuse_unchanged
    copies only what would compile alike."""
    from mokgen.codegen.build import kernel_keys

    plan = make_plan(A)
    files = render(plan)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    d = json.loads(files["manifest.json"])["plan"]
    keys = kernel_keys(d, tmp_path)
    assert set(keys) == {k["name"] for k in d["kernels"]} and len(set(keys.values())) == len(keys)
    assert kernel_keys(d, tmp_path) == keys  # (deterministic)
    (tmp_path / "combine.py").write_text(files["combine.py"] + "\n# another source\n")
    changed = kernel_keys(d, tmp_path)
    assert {n for n in keys if changed[n] != keys[n]} == {k["name"] for k in d["kernels"] if k["module"] == "combine"}
    (tmp_path / "combine.py").write_text(files["combine.py"])
    k = next(k for k in d["kernels"] if k["name"] == "gemm_down")
    k["args"][0]["shape"] = ["M", 1]  # (a fake tensor of another shape)
    assert {n for n, v in kernel_keys(d, tmp_path).items() if v != keys[n]} == {"gemm_down"}
    d["target"]["arch"] = "sm_100a"
    assert all(v != keys[n] for n, v in kernel_keys(d, tmp_path).items())
    d = json.loads(files["manifest.json"])["plan"]  # (as rendered again)
    assert kernel_keys(d, tmp_path) == keys
    monkeypatch.setenv("CUTE_DSL_MOKGEN_TEST", "1")  # (as a compile setting the workers inherit would)
    assert all(v != keys[n] for n, v in kernel_keys(d, tmp_path).items())


@pytest.mark.compile
def test_a_rebuild_compiles_only_the_kernels_that_changed(tmp_path):
    """A build whose Plan changes one kernel compiles that kernel and copies the others'
    artifacts from the build it replaces; --force (force=True) compiles them all again."""
    from mokgen.codegen import build

    path = build(A, tmp_path, log=lambda m: None)
    kernels = json.loads((path / "build" / "build.json").read_text())["kernels"]
    stamps = {n: (path / "build" / f"{n}.o").read_bytes() for n in kernels}
    logs = []
    build(A, tmp_path, overrides={"gemm_down.epi_stages": 4}, log=logs.append)
    built = json.loads((path / "build" / "build.json").read_text())
    assert any("compiling 1 kernels" in m and f"{len(kernels) - 1} unchanged" in m for m in logs), logs
    assert [m for m in logs if "compiled" in m and "gemm_down" in m]
    assert all((path / "build" / f"{n}.o").read_bytes() == stamps[n] for n in kernels if n != "gemm_down")
    assert set(built["kernel_keys"]) == set(kernels)
    logs.clear()
    build(A, tmp_path, overrides={"gemm_down.epi_stages": 4}, force=True, log=logs.append)
    assert not [m for m in logs if "unchanged" in m]


def test_a_relative_out_directory_reaches_the_compile_workers_as_an_absolute_path(tmp_path, monkeypatch):
    """The compile workers run in the repository root: a build into a directory given relative
    to the caller's (mokgen build --out DIR) hands them absolute paths."""
    import importlib
    from pathlib import Path

    b = importlib.import_module("mokgen.codegen.build")  # (the module: mokgen.codegen.build is also the function)
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(b.subprocess, "run", fake_run)
    b._compile(Path("rel/src"), Path("rel/src/build"), [["route"], ["combine"]], 2, lambda m: None)
    assert len(seen) == 2 and all(Path(c[3]) == tmp_path / "rel/src" and Path(c[4]) == tmp_path / "rel/src/build"
                                  for c in seen)
