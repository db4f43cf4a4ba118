"""Copy built variants out of generated/ for a GPU machine that has no CuTe-DSL compiler: only
what the runtime loads (manifest.json and build/libmokgen.so, or a multi-node layer's
hierarchy.json), in generated/'s layout, so that MOKGEN_HOME=DEST there finds them.

    python benchmarks/stage_builds.py DEST [--set NAME ...] [GLOB ...] [--max-mb N]

GLOBs name variant directories relative to generated/ (`e64_*`, `experiments/ep_*/*`). A set
names the builds one step of benchmarks/gpu_session.sh loads:
  top      every top-level variant (the default when neither a set nor a GLOB is given)
  golden   the bf16 golden suite and the small-T benchmarks (tests/test_golden_gpu.py, small_t.py)
  fp8      the FP8 suite and benchmarks on one GPU (tests/test_fp8_gpu.py, fp8_gemm.py)
  twogpu   the step twogpu: expert parallel and FP8 over two GPUs, golden and benchmarks
DEST is emptied first. The copy stops with an error above --max-mb (default 64), before
copying anything.
"""
import argparse
import shutil
import sys
import tarfile
from pathlib import Path

from mokgen.codegen import default_out

LOADED = ("manifest.json", "build/libmokgen.so", "hierarchy.json")  # what Variant and the multi-node layer read
SETS = {
    "top": ["e*_sm90a"],
    # bf16 only: the FP8 and 2-GPU variants are not loaded by the one-GPU bf16 suite.
    "golden": ["e*_bf16_sm90a", "e*_bf16_rn_sm90a", "debug/*/e*_bf16_sm90a", "profile/e*",
               "e*_bf16_w{2,4,8}nvlink_sm90a",  # (the expert-parallel and multi-node tests: ranks on one GPU)
               "experiments/{fused,cluster2,per_expert,multi,apart,wave,nosmall,nopairs,late,nodiscard,discard_rows,"
               "discard_pad,h_by_combine,claim_late}/e*_bf16{,_rn}_sm90a"],
    # FP8 on one GPU (tests/test_fp8_gpu.py, benchmarks/fp8_gemm.py) beside the bf16 layers it is compared with.
    "fp8": ["e*_fp8_sm90a", "e*_bf16_sm90a", "experiments/fp8_*/*", "debug/fp8_*/*"],
    "twogpu": ["e*_sm90a", "experiments/ep_*/*"],
}


def expand(pattern: str) -> list[str]:
    """Brace alternatives ({a,b}) expanded; the rest is a glob."""
    if "{" not in pattern:
        return [pattern]
    head, rest = pattern.split("{", 1)
    alts, tail = rest.split("}", 1)
    return [p for a in alts.split(",") for p in expand(head + a + tail)]


def pack(dest: Path, root: Path, files: list, n: int, size: float, max_mb: float) -> None:
    """The staged tree as one xz archive, written beside DEST and renamed into place when whole."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    with tarfile.open(part, "w:xz") as tar:
        for d, f in files:
            tar.add(d / f, arcname=str((d / f).relative_to(root)))
    packed = part.stat().st_size / 2**20
    if packed > max_mb:
        part.unlink()
        sys.exit(f"{n} variants pack into {packed:.1f} MB, over --max-mb {max_mb:g}: name fewer")
    part.replace(dest)
    print(f"{n} variants, {size:.1f} MB packed into {packed:.1f} MB -> {dest} "
          f"(on the GPU machine: mkdir HOME && tar xJf {dest} -C HOME, then MOKGEN_HOME=HOME)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path, help="a folder, or an archive DEST.tar.xz (the shared objects of many "
                    "variants are alike: 82 MB of builds pack into about 3 MB; unpack it there with "
                    "tar xJf DEST.tar.xz -C HOME)")
    ap.add_argument("globs", nargs="*", help="variant directories relative to generated/")
    ap.add_argument("--set", action="append", default=[], choices=sorted(SETS), help="a named set of builds")
    ap.add_argument("--max-mb", type=float, default=64, help="the most MB to write (of the archive, for .tar.xz)")
    a = ap.parse_args()
    root = default_out()
    patterns = [p for s in a.set for p in SETS[s]] + a.globs or SETS["top"]
    dirs = sorted({d for p in patterns for g in expand(p) for d in root.glob(g)
                   if any((d / f).is_file() for f in LOADED)})
    if not dirs:
        sys.exit(f"no built variant under {root} matches {patterns}: run benchmarks/build_gpu_variants.py")
    files = [(d, f) for d in dirs for f in LOADED if (d / f).is_file()]
    unbuilt = [d for d in dirs if (d / "manifest.json").is_file() and not (d / "build/libmokgen.so").is_file()]
    if unbuilt:
        sys.exit("rendered but not compiled: " + ", ".join(str(d.relative_to(root)) for d in unbuilt))
    size = sum((d / f).stat().st_size for d, f in files) / 2**20
    if a.dest.name.endswith(".tar.xz"):
        pack(a.dest, root, files, len(dirs), size, a.max_mb)
        return
    if size > a.max_mb:
        sys.exit(f"{len(dirs)} variants take {size:.1f} MB, over --max-mb {a.max_mb:g}: name fewer")
    if a.dest.resolve() == root.resolve():
        sys.exit("DEST is generated/ itself")
    shutil.rmtree(a.dest, ignore_errors=True)
    for d, f in files:
        target = a.dest / d.relative_to(root) / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(d / f, target)
    print(f"{len(dirs)} variants, {size:.1f} MB -> {a.dest} (set MOKGEN_HOME={a.dest} on the GPU machine)")


if __name__ == "__main__":
    main()
