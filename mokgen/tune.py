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

    mokgen tune VARIANT --paths        (on the GPU) which T the per-GEMM path serves better

A built Plan holds both the single launch (its bands of tiles by T) and the per-GEMM path; the
model gives every T up to FUSED_MAX_TOKENS to the single launch. --paths times both, in the
built variant, at points across every band (path_tokens), each T in its own process, and writes
<out>/tuning/<variant>.paths.<gpu>.json: the T ranges where the per-GEMM path was faster by more
than PATHS_MARGIN with the same bits, on that GPU model (one record per model: an H100 and an
H200 can differ). The next build applies every record (Plan override per_gemm_tokens_on: the
manifest's launch_bands_on, which the runtime takes on that GPU); no kernel changes, so that
build only rewrites the manifest (tune --paths runs it). The record keeps a hash of the Plan's
kernels it was measured in (plan_key): once a change of the Plan's defaults gives the layer other
kernels, the record is stale and no longer applied (a warning says so).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
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


def _in_own_process(args: list[str], timeout_s: int) -> dict:
    """`python -m mokgen.tune ARGS` (one candidate, or one T of --paths) in a process of its own,
    which a kernel that traps or hangs cannot take the caller down with: its JSON result, or
    {"error": why}."""
    import subprocess
    import sys

    try:
        p = subprocess.run([sys.executable, "-m", "mokgen.tune", *args], capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(error=f"no result within {timeout_s} s")
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if p.returncode == 0 and lines else \
        dict(error=(p.stderr.strip().splitlines() or ["no output"])[-1][:300])


def run(spec: MoESpec, out: Path, tokens: list[int], log=print, timeout_s: int = 300, fresh: bool = False) -> dict:
    """Time every prepared candidate on this GPU; write and return the record. Candidates an
    earlier, stopped run timed here are kept (resumable) unless fresh.

    Each candidate runs in its own process with a time limit, so one that fails (a
    kernel that traps leaves its CUDA context unusable) or hangs cannot take the
    others down; it is recorded as failed and cannot win. A candidate must also pass
    the golden check (relative error against the float64 reference <= 1e-2)."""
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
        res = _in_own_process([str(root / f"c{i}" / spec.variant), ",".join(map(str, tokens))], timeout_s)
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


def _read_record(path: Path, spec: MoESpec) -> dict | None:
    if not path.exists():
        return None
    try:
        rec = json.loads(path.read_text())
    except ValueError as e:
        raise PlanError(f"{path}: not a readable tuning record ({e}); delete it or run `mokgen tune` again") from None
    if not isinstance(rec, dict) or rec.get("format") != RECORD_FORMAT or rec.get("spec") != spec.to_dict():
        return None
    return rec


def candidates_winner(out: Path, spec: MoESpec) -> tuple[dict, str] | None:
    """The candidate search's recorded winner for this spec, if its record exists: (overrides, source)."""
    rec = _read_record(record_path(out, spec.variant), spec)
    if rec is None:
        return None
    return rec["winner"], f"tuning/{spec.variant}.json ({rec['device']}, T={rec['tokens']})"


def winner(out: Path, spec: MoESpec) -> tuple[dict, str] | None:
    """The recorded tuning for this spec: (overrides, source), or None. The candidate search's
    winner, and the per-GEMM path's ranges of T on each GPU model (`tune --paths`, override
    per_gemm_tokens_on) where they were measured against the Plan that winner gives (a paths
    record of another Plan is not applied)."""
    found = candidates_winner(out, spec)
    overrides, source = found or ({}, "")
    on, key = {}, None
    for path in paths_records(out, spec.variant):
        rec = _read_record(path, spec)
        if rec is None or rec["base_overrides"] != overrides or not rec["per_gemm_tokens"]:
            continue
        key = key or plan_key(spec, overrides)
        if rec.get("plan_key") != key:
            warnings.warn(f"tuning/{path.name} was measured in other kernels than today's Plan gives: not applied; "
                          f"run `mokgen tune {spec.variant} --paths` again on an {rec['device']}", stacklevel=2)
            continue
        on[rec["device"]] = rec["per_gemm_tokens"]
        source = "; ".join(filter(None, [source, f"tuning/{path.name} ({rec['device']})"]))
    if on:
        overrides = {**overrides, "per_gemm_tokens_on": on}
    return (overrides, source) if source else None


# ---- which T the per-GEMM path serves better (tune --paths) ------------------------------
# A point goes to the per-GEMM path only where it is this much faster than the single launch's
# entry (interleaved rounds of CUDA-graph replays differ by about 1% from run to run).
PATHS_MARGIN = 0.02
PATHS_ROUNDS = 3
# Points are at most this ratio of T apart inside a band (and one in every band).
PATHS_STEP = 1.3


def plan_key(spec: MoESpec, overrides: dict) -> str:
    """A hash of the kernels (each one's template and parameters) of the Plan `overrides` give:
    what a paths record's times were measured in (per_gemm_tokens changes no kernel)."""
    kernels = make_plan(spec, overrides=overrides).to_dict()["kernels"]
    return hashlib.sha256(json.dumps(kernels, sort_keys=True).encode()).hexdigest()[:16]


def paths_record_path(out: Path, variant: str, device: str) -> Path:
    """Where `tune --paths` on GPU model `device` writes its record."""
    gpu = re.sub(r"[^a-z0-9]+", "-", device.lower().removeprefix("nvidia ")).strip("-") or "gpu"
    return Path(out) / "tuning" / f"{variant}.paths.{gpu}.json"


def paths_records(out: Path, variant: str) -> list[Path]:
    """The variant's paths records, one per GPU model (and one of mokgen 0.1's unnamed ones,
    <variant>.paths.json, read first: a record of the same GPU named by model replaces it)."""
    tuning = Path(out) / "tuning"
    return sorted(tuning.glob(f"{variant}.paths.json")) + sorted(tuning.glob(f"{variant}.paths.*.json"))


def path_tokens(bands: list) -> list[int]:
    """The T at which `tune --paths` times both paths: in each band (a, b] of the single launch
    (launch_bands: [[b, entry]]), points spaced evenly in log T between a (b / 2 for the first)
    and b, at most PATHS_STEP apart (at least one, mid-band)."""
    out, a = [], 0
    for b, _ in bands:
        lo = a or b / 2
        n = max(1, math.ceil(math.log(b / lo) / math.log(PATHS_STEP))) if b > lo else 1
        out += sorted({min(b, max(a + 1, round(lo * (b / lo) ** ((i + 0.5) / n)))) for i in range(n)})
        a = b
    return out


def per_gemm_ranges(bands: list, points: list[dict], margin: float = PATHS_MARGIN) -> list[list[int]]:
    """The T ranges [lo, hi] to give the per-GEMM path (override per_gemm_tokens): each measured
    point owns the T of its band nearest to it (the band split half way between its points); a
    point whose per-GEMM time beat the band's entry by more than margin, with the same bits, gives
    its T to the per-GEMM path. Bands without a point keep their entry."""
    ranges: list[list[int]] = []
    a = 0
    for b, entry in bands:
        mine = sorted((p for p in points if a < p["T"] <= b), key=lambda p: p["T"])
        for i, p in enumerate(mine):
            lo = a + 1 if i == 0 else (mine[i - 1]["T"] + p["T"]) // 2 + 1
            hi = b if i == len(mine) - 1 else (p["T"] + mine[i + 1]["T"]) // 2
            if p["same_bits"] and p["ms"]["forward"] < (1 - margin) * p["ms"][p["entry"]]:
                if ranges and ranges[-1][1] == lo - 1:
                    ranges[-1][1] = hi
                else:
                    ranges.append([lo, hi])
        a = b
    return ranges


def measure_paths(variant_dir: Path, tokens: int, entry: str) -> dict:
    """(in its own process, see run_paths) The band's entry (the model's at T = tokens) and the
    per-GEMM path at T = tokens: CUDA-graph replays, PATHS_ROUNDS interleaved rounds
    (bench.time_rounds), and whether they give the same bits."""
    import torch

    from .bench import _capture, forced_call, time_rounds
    from .runtime import Variant
    from .verify import make_inputs

    v = Variant(variant_dir)
    inputs = make_inputs(v.spec, tokens, "uniform", torch.Generator("cuda").manual_seed(tokens))
    outs, calls = {}, {}
    for e in (entry, "forward"):
        call = forced_call(v, e, *inputs)
        outs[e] = call().clone()
        graph = _capture(call)
        if graph is None:
            raise RuntimeError(f"{e}: CUDA graph capture failed")
        calls[e] = graph.replay
    v.check_errors()
    ms = time_rounds(calls, PATHS_ROUNDS, [], T=tokens)
    v.check_errors()
    return dict(T=tokens, entry=entry, ms=ms, same_bits=torch.equal(outs[entry], outs["forward"]))


def run_paths(spec: MoESpec, out: Path, log=print, timeout_s: int = 120) -> dict:
    """Time the single launch's entry and the per-GEMM path at path_tokens of the built variant
    (each T in its own process, which a failure cannot take down with the rest); write the
    paths record and return it."""
    import torch

    variant_dir = Path(out) / spec.variant
    if not (variant_dir / "manifest.json").exists():
        raise FileNotFoundError(f"{spec.variant} is not built in {out}: run `mokgen build` first")
    built = json.loads((variant_dir / "manifest.json").read_text())["plan"]
    base = {k: x for k, x in built["overrides"].items() if k not in ("per_gemm_tokens", "per_gemm_tokens_on")}
    bands = make_plan(spec, overrides=base).launch_bands
    if not bands:
        raise PlanError(f"{spec.variant}: its Plan has no single launch served by T beside the per-GEMM path: "
                        "nothing to choose")
    device = torch.cuda.get_device_name()
    points = []
    tokens = path_tokens(bands)
    for i, T in enumerate(tokens):
        entry = next(e for t, e in bands if T <= t)
        res = _in_own_process(["--paths", str(variant_dir), str(T), entry], timeout_s)
        if "error" in res:
            log(f"[{i + 1}/{len(tokens)}] T={T}: FAILED: {res['error']} (its band keeps the single launch there)")
            continue
        points.append(res)
        e, f = res["ms"][res["entry"]], res["ms"]["forward"]
        log(f"[{i + 1}/{len(tokens)}] T={T}: {res['entry']} {e * 1e3:.1f} us, per-GEMM {f * 1e3:.1f} us "
            f"({e / f:.3f}x){'' if res['same_bits'] else '  OTHER BITS: not eligible'}")
    ranges = per_gemm_ranges(bands, points)
    record = dict(format=RECORD_FORMAT, variant=spec.variant, spec=spec.to_dict(), device=device,
                  torch=torch.__version__, base_overrides=base, plan_key=plan_key(spec, base), launch_bands=bands,
                  margin=PATHS_MARGIN, points=points, per_gemm_tokens=ranges)
    path = write_text_atomic(paths_record_path(out, spec.variant, device),
                             json.dumps(record, indent=1, sort_keys=True))
    log(("per-GEMM path at T in " + ", ".join(f"[{lo}, {hi}]" for lo, hi in ranges) if ranges else
         "the single launch everywhere it serves (the model's bands kept)") + f"; wrote {path}")
    tuned = candidates_winner(out, spec)
    if tuned and tuned[0] != base:
        log(f"note: {spec.variant} was built without its candidate search's winner; the record applies to "
            "that Plan only once it is built")
    return record


if __name__ == "__main__":  # one candidate (see run()), or one T of --paths (run_paths), in its own process
    import sys

    if sys.argv[1] == "--paths":
        print(json.dumps(measure_paths(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))
    else:
        print(json.dumps(measure(Path(sys.argv[1]), [int(t) for t in sys.argv[2].split(",")])))
