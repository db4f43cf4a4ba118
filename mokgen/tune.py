"""Autotuning: a short, recorded search over the Plan decisions the cost model is
least sure of, timed on the GPU, applied by the next build.

    mokgen tune VARIANT --prepare      (where CuTe-DSL is installed) build the candidates
    mokgen tune VARIANT                (on the GPU) time them, write the record
    mokgen build ...                   applies the record's winner; the manifest names it

A candidate is the default Plan with one decision changed (coordinate search: few
candidates, each a full variant under <out>/tuning/<variant>/c<i>/). The record,
<out>/tuning/<variant>.json, holds every candidate's times, the device and the
winner: the same record always gives the same Plan, so a tuned build is reproducible.
Each candidate runs in its own process and must pass the golden check before it may win.
The candidates timed so far are kept in <out>/tuning/<variant>/progress.json after each one,
so a run that is stopped resumes where it was (on the same GPU, the same T and candidates;
`mokgen tune --fresh` times them all again).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .files import write_text_atomic
from .ir import MoESpec
from .schedule import make_plan
from .schedule.records import PlanError
from .schedule.tiling import tile_n_choices

RECORD_FORMAT = 1


def tuning_dir(out: Path, variant: str) -> Path:
    return Path(out) / "tuning" / variant


def record_path(out: Path, variant: str) -> Path:
    return Path(out) / "tuning" / f"{variant}.json"


def progress_path(out: Path, variant: str) -> Path:
    return tuning_dir(out, variant) / "progress.json"


def resumable(out: Path, variant: str, device: str, tokens: list[int], cands: list[dict], log=print) -> list[dict]:
    """The entries of an earlier, stopped run that this one may keep: its leading candidates,
    where it timed the same candidates at the same T on a GPU of the same name; [] otherwise."""
    path = progress_path(out, variant)
    if not path.exists():
        return []
    try:
        prog = json.loads(path.read_text())
        if (prog["device"], prog["tokens"], prog["candidates"]) == (device, tokens, cands):
            return prog["results"]
    except (ValueError, KeyError, TypeError):
        log(f"{path}: unreadable, ignored (the candidates are timed again)")
        return []
    log(f"{path}: from another GPU, T or candidate list; the candidates are timed again")
    return []


def candidates(spec: MoESpec) -> list[dict]:
    """The default ({}) first, then one changed decision at a time, in a fixed order."""
    plan = make_plan(spec)
    out: list[dict] = [{}]
    forward = set(plan.steps["forward"])  # the tuner times the forward; the backward keeps its defaults
    for k in plan.kernels:
        if k.template != "grouped_gemm_persistent.py.j2" or not k.params.get("groups", 0) > 1 or k.params.get("fused") \
                or k.name not in forward:
            continue  # the routed GEMMs only (the fused launch takes gemm_gateup's tiling)
        p = k.params
        for n in tile_n_choices(p["epilogue"], p["tile_m"]):
            if n != p["tile_n"] and n >= 64 and p["n_size"] % n == 0:
                out.append({f"{k.name}.tile_n": n})
        out.append({f"{k.name}.raster": "n" if p["raster"] == "m" else "m"})
        for epi in (2, 4, 8):
            if epi != p["epi_stages"]:
                out.append({f"{k.name}.epi_stages": epi})
        if p.get("gather_a") and p["stages"] - 2 > p["gather_lag"]:
            out.append({f"{k.name}.gather_lag": p["gather_lag"] + 1})
    # Whole-layer alternatives, where the Plan can make them: the fused launch at every T, or
    # never (the default runs it up to FUSED_MAX_TOKENS); 2-CTA clusters that multicast the
    # weight tiles (measured slower or level on the bench shapes, docs/perf.md, so not the
    # default); the per-expert dispatch kernels instead of the O(T*K) ones (the default since
    # they measured 8x faster at E64 T=16384). The tuner keeps whichever pays.
    # The other row tile: the cost model picks it from the rows an expert gets at a mid-sized
    # T, but a layer tuned for small calls (decode) may pay for 64 (E64 at T <= 256: 1.17x,
    # one more pipeline stage of weights in flight; slower from T = 1024 on, docs/perf.md).
    other_tile = {"row_tile": 64 if plan.row_tile == 128 else 128}
    for ov in ({"fuse_gemms": True}, {"fuse_gemms": False}, {"cluster_m": 2}, {"dispatch_chunked": False}, other_tile):
        try:
            make_plan(spec, overrides=ov)
            out.append(ov)
        except PlanError:
            pass
    return out


def prepare(spec: MoESpec, out: Path, log=print) -> list[Path]:
    """Build every candidate (needs CuTe-DSL, no GPU)."""
    from .codegen import build

    dirs = []
    cands = candidates(spec)
    for i, ov in enumerate(cands):
        log(f"[{i + 1}/{len(cands)}] candidate c{i}: {ov or 'default plan'}")
        dirs.append(build(spec, tuning_dir(out, spec.variant) / f"c{i}", overrides=ov, log=lambda m: None))
    progress_path(out, spec.variant).unlink(missing_ok=True)  # (timings of the builds these replaced)
    write_text_atomic(tuning_dir(out, spec.variant) / "candidates.json", json.dumps(cands, indent=1))
    return dirs


def measure(variant_dir: Path, tokens: list[int]) -> dict:
    """Golden check and timing of one candidate, in this process (see run())."""
    import torch

    from .bench import gpu_state, time_ms
    from .reference import moe_reference, rel_error
    from .runtime import Variant
    from .verify import make_inputs

    v = Variant(variant_dir)
    x, ids, w, wg, wu, wd, (sg, su, sd) = make_inputs(v.spec, 1000, "skewed", torch.Generator("cuda").manual_seed(7))
    got = v.forward(x, ids, w, wg, wu, wd, sg, su, sd)
    err = rel_error(got, moe_reference(x, ids, w, wg, wu, wd, sg, su, sd))
    ms, state = {}, {}
    for T in tokens:
        x, ids, w, wg, wu, wd, (sg, su, sd) = make_inputs(v.spec, T, "uniform", torch.Generator("cuda").manual_seed(T))
        # As many calls as `mokgen bench` makes: fewer (20) ran partly at boost clock before
        # the power cap bit and ranked candidates by up to 10% noise.
        ms[str(T)] = time_ms(lambda: v.forward(x, ids, w, wg, wu, wd, sg, su, sd), 10, 50)
        state[str(T)] = gpu_state()
    return dict(ms=ms, rel_err=err, gpu_state=state)


def run(spec: MoESpec, out: Path, tokens: list[int], log=print, timeout_s: int = 300, fresh: bool = False) -> dict:
    """Time every prepared candidate on this GPU; write and return the record. Candidates an
    earlier, stopped run timed here are kept (resumable) unless fresh.

    Each candidate runs in its own process with a time limit, so one that fails (a
    kernel that traps leaves its CUDA context unusable) or hangs cannot take the
    others down; it is recorded as failed and cannot win. A candidate must also pass
    the golden check (relative error against the float64 reference <= 1e-2)."""
    import subprocess
    import sys

    import torch

    from .verify import TOLERANCE

    root = tuning_dir(out, spec.variant)
    listing = root / "candidates.json"
    if not listing.exists():
        raise FileNotFoundError(f"no prepared candidates in {root}: run `mokgen tune {spec.variant} --prepare` "
                                "where nvidia-cutlass-dsl is installed")
    cands = json.loads(listing.read_text())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    results = [] if fresh else resumable(out, spec.variant, device, tokens, cands, log)
    for i, entry in enumerate(results):
        log(f"[{i + 1}/{len(cands)}] {entry['overrides'] or 'default plan'}: timed before, kept "
            f"({progress_path(out, spec.variant)})")
    for i, ov in enumerate(cands[len(results):], start=len(results)):
        cmd = [sys.executable, "-m", "mokgen.tune", str(root / f"c{i}" / spec.variant), ",".join(map(str, tokens))]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
            res = json.loads(lines[-1]) if p.returncode == 0 and lines else \
                dict(error=(p.stderr.strip().splitlines() or ["no output"])[-1][:300])
        except subprocess.TimeoutExpired:
            res = dict(error=f"no result within {timeout_s} s")
        ok = "error" not in res and res["rel_err"] <= TOLERANCE
        entry = dict(overrides=ov, eligible=ok, **res)
        if "ms" in res:
            entry["score_ms"] = math.exp(sum(math.log(t) for t in res["ms"].values()) / len(res["ms"]))
        results.append(entry)
        write_text_atomic(progress_path(out, spec.variant),
                          json.dumps(dict(device=device, tokens=tokens, candidates=cands, results=results), indent=1))
        what = ", ".join(f"T={T} {t:.3f} ms" for T, t in res.get("ms", {}).items())
        log(f"[{i + 1}/{len(cands)}] {ov or 'default plan'}: {what or 'FAILED: ' + res['error']}"
            + ("" if ok or "error" in res else f"  rel_err {res['rel_err']:.2e}: not eligible"))
    eligible = [r for r in results if r["eligible"]]
    if not eligible:
        raise RuntimeError("no candidate passed the golden check; nothing recorded")
    best = min(eligible, key=lambda r: r["score_ms"])
    record = dict(format=RECORD_FORMAT, variant=spec.variant, spec=spec.to_dict(), tokens=tokens,
                  device=device, torch=torch.__version__, candidates=results, winner=best["overrides"])
    path = write_text_atomic(record_path(out, spec.variant), json.dumps(record, indent=1, sort_keys=True))
    progress_path(out, spec.variant).unlink(missing_ok=True)
    log(f"winner: {best['overrides'] or 'default plan'} ({best['score_ms']:.3f} ms geometric mean); wrote {path}")
    return record


def winner(out: Path, spec: MoESpec) -> tuple[dict, str] | None:
    """The recorded winner for this spec, if a tuning record exists: (overrides, source)."""
    path = record_path(out, spec.variant)
    if not path.exists():
        return None
    try:
        rec = json.loads(path.read_text())
    except ValueError as e:
        raise PlanError(f"{path}: not a readable tuning record ({e}); delete it or run `mokgen tune` again") from None
    if not isinstance(rec, dict) or rec.get("format") != RECORD_FORMAT or rec.get("spec") != spec.to_dict():
        return None
    return rec["winner"], f"tuning/{spec.variant}.json ({rec['device']}, T={rec['tokens']})"


if __name__ == "__main__":  # one candidate, in its own process (see run())
    import sys

    print(json.dumps(measure(Path(sys.argv[1]), [int(t) for t in sys.argv[2].split(",")])))
