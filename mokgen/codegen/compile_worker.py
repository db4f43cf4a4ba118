"""Compile kernels of a rendered variant ahead of time (run as a separate process).

    python -m mokgen.codegen.compile_worker VARIANT_DIR BUILD_DIR KERNEL [KERNEL ...]

cute.compile is neither thread-safe nor cached, so each build compiles in worker
processes. Compiling needs no GPU: CUTE_DSL_ARCH is set from the Plan's target
before cutlass is imported, tensors are fake (symbolic extents for T-dependent
dimensions), and no CUDA call is made. Output per kernel: KERNEL.o (host launcher +
embedded cubin), KERNEL.h, and KERNEL.ptx / KERNEL.cubin kept for inspection.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_kernels(variant_dir: Path, build_dir: Path, names: list[str]) -> None:
    manifest = json.loads((variant_dir / "manifest.json").read_text())
    plan = manifest["plan"]
    os.environ["CUTE_DSL_ARCH"] = plan["target"]["arch"]
    build_dir.mkdir(parents=True, exist_ok=True)
    # --keep-ptx/--keep-cubin write into the working directory as of `import cutlass`;
    # a private scratch directory keeps parallel workers' dumps apart.
    scratch = Path(tempfile.mkdtemp(prefix=".dump-", dir=build_dir))
    os.chdir(scratch)
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    dtypes = {"bf16": cutlass.BFloat16, "f32": cutlass.Float32, "i32": cutlass.Int32, "i64": cutlass.Int64,
              "e4m3": cutlass.Float8E4M3FN}
    kernels = {k["name"]: k for k in plan["kernels"]}

    class Fake:
        """Fake tensors for one kernel's arguments; one symbol per symbolic extent name."""

        def __init__(self, kernel):
            self.args = {a["name"]: a for a in kernel["args"]}
            self.syms = {}

        def __call__(self, name):
            a = self.args[name]
            shape = tuple(self.syms.setdefault(d, cute.sym_int()) if isinstance(d, str) else d for d in a["shape"])
            return make_fake_compact_tensor(
                dtypes[a["dtype"]], shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=16
            )

        def stream(self):
            return cuda.CUstream(0)

    for name in names:
        k = kernels[name]
        t0 = time.time()
        mod = _load_module(variant_dir / f"{k['module']}.py", f"mokgen_gen_{plan['variant']}_{k['module']}")
        fn, args = mod.compile_entry(Fake(k), k["entry"])
        before = set(os.listdir("."))
        compiled = cute.compile(fn, *args, options="--keep-ptx --keep-cubin")
        compiled.export_to_c(str(build_dir), name, f"mokgen_{name}")
        for f in sorted(set(os.listdir(".")) - before):
            for ext in (".ptx", ".cubin"):
                if f.endswith(ext):
                    os.replace(f, build_dir / f"{name}{ext}")
        print(f"compiled {name} in {time.time() - t0:.1f}s", flush=True)
    os.chdir(build_dir)
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    compile_kernels(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve(), sys.argv[3:])
