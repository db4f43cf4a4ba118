"""Build a variant: plan -> render -> compile (worker processes) -> link -> publish.

Layout of a built variant:

    generated/<variant>/            rendered source + manifest.json (reproducible)
    generated/<variant>/build/      KERNEL.o/.h/.ptx/.cubin, libmokgen.so, build.json

A build happens in a private temporary directory beside the target and is moved
into place with one rename, under a per-variant file lock: a failed or interrupted
build never leaves a half-written variant that a later load would trust.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import __version__
from ..files import write_text_atomic
from ..ir import MoESpec
from ..schedule import Plan, make_plan
from .render import render, write_tree

LIB_NAME = "libmokgen.so"  # (mokgen/runtime/variant.py names it too: the runtime imports no codegen)
REPO_ROOT = Path(__file__).resolve().parents[2]


class BuildError(RuntimeError):
    pass


def default_out() -> Path:
    """Where variants live: $MOKGEN_HOME, else the source tree's generated/."""
    env = os.environ.get("MOKGEN_HOME")
    return Path(env) if env else REPO_ROOT / "generated"


def cuda_home() -> Path:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and (Path(cand) / "include" / "cuda_runtime.h").exists():
            return Path(cand)
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = Path(nvcc).resolve().parent.parent
        if (root / "include" / "cuda_runtime.h").exists():
            return root
    raise BuildError("CUDA toolkit headers not found (cuda_runtime.h): set CUDA_HOME")


def dsl_runtime_lib() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("nvidia-cutlass-dsl is not installed: pip install 'nvidia-cutlass-dsl[cu13]==4.8.1'")
    lib = Path(list(spec.submodule_search_locations)[0]) / "cu13" / "lib" / "libcuda_dialect_runtime_static.a"
    if not lib.exists():
        raise BuildError(f"CuTe-DSL cu13 runtime library missing: {lib}")
    return lib


def is_built(variant_dir: Path) -> bool:
    return (variant_dir / "build" / LIB_NAME).exists() and (variant_dir / "build" / "build.json").exists()


def is_current(variant_dir: Path, files: dict[str, str]) -> bool:
    """The variant on disk was built from exactly these rendered files."""
    try:
        on_disk = (variant_dir / "manifest.json").read_text()
        built = json.loads((variant_dir / "build" / "build.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return on_disk == files["manifest.json"] and built.get("manifest") == json.loads(on_disk)["files"]


def only_notes_differ(variant_dir: Path, files: dict[str, str]) -> bool:
    """The variant on disk was compiled from exactly these rendered sources, by this mokgen and
    CuTe-DSL from these templates, and only its manifest's Plan differs (its notes: decisions,
    the task graph, params no source reads). The library is current, so only the manifest
    needs writing: every kernel, argument and launch the runtime reads from the Plan is in a
    source whose hash is compared."""
    try:
        old = json.loads((variant_dir / "manifest.json").read_text())
        built = json.loads((variant_dir / "build" / "build.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    new = json.loads(files["manifest.json"])
    return built.get("manifest") == old.get("files") == new["files"] and \
        {k: v for k, v in old.items() if k != "plan"} == {k: v for k, v in new.items() if k != "plan"}


ARTIFACTS = (".o", ".h", ".ptx", ".cubin")  # what the compile worker writes per kernel


def kernel_keys(plan: dict, src: Path) -> dict[str, str]:
    """name -> a hash of everything a kernel's compiled artifacts depend on: its rendered module
    (the templates' code and every number in it), its arguments (the fake tensors' dtypes and
    shapes), its entry, the target arch, the compile worker, the CuTe-DSL version and the
    CUTE_DSL_* settings of the environment (the workers inherit them)."""
    import hashlib
    import importlib.metadata as md

    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL_") and k != "CUTE_DSL_ARCH")
    common = [plan["target"]["arch"], md.version("nvidia-cutlass-dsl"),
              (Path(__file__).parent / "compile_worker.py").read_text(), settings]
    sources: dict = {}
    keys = {}
    for k in plan["kernels"]:
        if k["module"] not in sources:
            sources[k["module"]] = (src / f"{k['module']}.py").read_text()
        what = json.dumps([common, sources[k["module"]], k["name"], k["entry"], k["args"]], sort_keys=True)
        keys[k["name"]] = hashlib.sha256(what.encode()).hexdigest()
    return keys


def reuse_unchanged(old_build: Path, build_dir: Path, keys: dict[str, str]) -> set[str]:
    """Copy into build_dir the artifacts of the kernels whose key equals the one the previous
    build (old_build) recorded for them, so only changed kernels compile again: a template
    change that touches a few kernels rebuilds those, not the variant. Returns their names."""
    try:
        old = json.loads((old_build / "build.json").read_text()).get("kernel_keys", {})
    except (FileNotFoundError, json.JSONDecodeError):
        return set()
    reused = set()
    for name, key in keys.items():
        files = [old_build / f"{name}{ext}" for ext in ARTIFACTS]
        if old.get(name) == key and all(f.exists() for f in files):
            for f in files:
                shutil.copy2(f, build_dir / f.name)
            reused.add(name)
    return reused


@contextlib.contextmanager
def _lock(out: Path, variant: str):
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f".{variant}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(src: Path, build: Path, groups: list[list[str]], jobs: int, log) -> None:
    def run(names):
        t0 = time.time()
        # (absolute paths: the workers run in the repository root, not the caller's directory)
        p = subprocess.run([sys.executable, "-m", "mokgen.codegen.compile_worker", str(src.resolve()),
                            str(build.resolve()), *names], capture_output=True, text=True, cwd=str(REPO_ROOT))
        if p.returncode:
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-25:])
            raise BuildError(f"compiling {', '.join(names)} failed:\n{tail}")
        return names, time.time() - t0

    done = 0
    total = sum(len(g) for g in groups)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for names, dt in pool.map(run, groups):
            done += len(names)
            log(f"  [{done}/{total}] compiled {', '.join(names)} ({dt:.1f}s)")


def _link(build: Path, kernels: list[str]) -> Path:
    cuda = cuda_home()
    libdir = next((cuda / d for d in ("lib64", "lib") if (cuda / d / "libcudart.so").exists()), cuda / "lib64")
    out = build / LIB_NAME
    cmd = ["gcc", "-shared", "-fPIC", "-O2", f"-I{cuda / 'include'}", f"-I{build}", str(build / "launch.c"),
           *[str(build / f"{k}.o") for k in kernels], str(dsl_runtime_lib()), f"-L{libdir}", "-lcudart",
           "-lpthread", "-o", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise BuildError(f"linking {out.name} failed:\n{p.stderr.strip()[-2000:]}")
    return out


def profile_dir(out: Path | None = None) -> Path:
    """Where profiling builds live: beside the normal builds, never in their place."""
    return (Path(out) if out else default_out()) / "profile"


def build_profiling(spec: MoESpec, out: Path | None = None, **kw) -> Path:
    """The profiling build of `spec` (every task records its SM and times): the normal
    build's Plan (tuning winner included) plus the "profile" override, under profile_dir."""
    out = Path(out) if out else default_out()
    tuned = resolve_plan(spec, out).overrides
    return build(spec, profile_dir(out), overrides={**tuned, "profile": True}, **kw)


def resolve_plan(spec: MoESpec, out: Path, overrides: dict | None = None) -> Plan:
    """The Plan a build uses: explicit overrides if given, else the winner of the
    variant's tuning record in `out` if there is one, else the cost model's."""
    if overrides is None:
        from ..tune import winner

        tuned = winner(out, spec)
        if tuned:
            return make_plan(spec, overrides=tuned[0], override_source=tuned[1])
    return make_plan(spec, overrides=overrides)


def build_multinode(spec: MoESpec, out: Path, *, jobs=None, force=False, compile=True, log=None,
                    overrides=None) -> Path:
    """A layer over several nodes: build its node-local layer (the kernels every node runs) and
    write the levels beside it, <out>/<variant>/hierarchy.json (mokgen show prints it; the
    runtime plans the same levels from the spec). Returns the multinode directory."""
    from ..schedule.multinode import hierarchy, node_local_spec

    local = build(node_local_spec(spec), out, jobs=jobs, force=force, compile=compile, log=log, overrides=overrides)
    final = out / spec.variant
    final.mkdir(parents=True, exist_ok=True)
    text = json.dumps(dict(spec=spec.to_dict(), hierarchy=hierarchy(spec), node_local=str(local.name)), indent=1,
                      sort_keys=True)
    write_text_atomic(final / "hierarchy.json", text)
    log(f"{spec.variant}: {spec.nodes} nodes x {spec.gpus_per_node} GPU(s); node-local layer {local.name}")
    return final


def build(spec: MoESpec, out: Path | None = None, *, jobs: int | None = None, force: bool = False,
          compile: bool = True, log=None, overrides: dict | None = None) -> Path:
    """Build (or reuse) the variant for `spec`; returns its directory. `overrides`
    replaces Plan decisions (experiments, tuning; None: the tuning record's winner, if
    any) and is recorded in the manifest."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = Path(out) if out else default_out()
    if spec.nodes > 1:
        return build_multinode(spec, out, jobs=jobs, force=force, compile=compile, log=log, overrides=overrides)
    plan: Plan = resolve_plan(spec, out, overrides)
    files = render(plan)
    final = out / plan.variant
    with _lock(out, plan.variant):
        if not force and is_current(final, files):
            log(f"{plan.variant}: up to date ({final})")
            return final
        if not force and compile and only_notes_differ(final, files):
            write_text_atomic(final / "manifest.json", files["manifest.json"])  # (a crash leaves the old one)
            log(f"{plan.variant}: up to date, its manifest's Plan rewritten ({final})")
            return final
        if not compile and not force and (final / "manifest.json").exists() and \
                (final / "manifest.json").read_text() == files["manifest.json"]:
            log(f"{plan.variant}: source up to date ({final})")
            return final
        _remove_leftovers(out, plan.variant)
        tmp = out / f".tmp-{plan.variant}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            t0 = time.time()
            write_tree(files, tmp)
            log(f"{plan.variant}: rendered {len(files)} files")
            if compile:
                build_dir = tmp / "build"
                build_dir.mkdir()
                shutil.copy(tmp / "launch.c", build_dir / "launch.c")
                names = [k.name for k in plan.kernels]
                keys = kernel_keys(json.loads(files["manifest.json"])["plan"], tmp)
                reused = set() if force else reuse_unchanged(final / "build", build_dir, keys)
                # Kernels of one module compile in one worker: it renders and imports once.
                by_module: dict[str, list[str]] = {}
                for k in plan.kernels:
                    if k.name not in reused:
                        by_module.setdefault(k.module, []).append(k.name)
                todo = len(names) - len(reused)
                jobs = jobs or max(1, min(todo, os.cpu_count() or 1))
                log(f"{plan.variant}: compiling {todo} kernels for {plan.target['arch']} ({jobs} processes)"
                    + (f"; {len(reused)} unchanged since the last build, reused" if reused else ""))
                _compile(tmp, build_dir, list(by_module.values()), jobs, log)
                _link(build_dir, names)
                import importlib.metadata as md

                (build_dir / "build.json").write_text(json.dumps({
                    "manifest": json.loads(files["manifest.json"])["files"],
                    "mokgen_version": __version__,
                    "cute_dsl_version": md.version("nvidia-cutlass-dsl"),
                    "seconds": round(time.time() - t0, 1),
                    "kernels": names,
                    "kernel_keys": keys,  # (reuse_unchanged)
                }, indent=1, sort_keys=True))
            _publish(tmp, final)
            log(f"{plan.variant}: built in {time.time() - t0:.1f}s -> {final}")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _remove_leftovers(out: Path, variant: str) -> None:
    """(under the variant's lock) Remove the half-written trees of builds that were killed
    (kill -9 skips their cleanup): nothing ever loads them, this only frees the disk."""
    for d in list(out.glob(f".tmp-{variant}-*")) + list(out.glob(f".old-{variant}-*")):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _publish(tmp: Path, final: Path) -> None:
    """Swap the finished tree into place; the old one is removed only afterwards."""
    old = None
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
