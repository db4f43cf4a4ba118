"""`mokgen profile`: the device timeline of one forward, from a profiling build.

A profiling build (`mokgen build --profile`, Plan override "profile") has every task
record its SM and its start and end time (globaltimer, ns) on the device:
one row per GEMM tile, dispatch CTA and combine CTA, and in a single launch one per CTA for its
dispatch phase (from the launch's start) and its combine phase. This module runs the forward
path the Plan takes at the given T (so at small T the single launch), reads the rows back, and
reports per kernel (a single launch per phase and tile kind): tasks, time span and median
task time.
Per SM it reports busy time (the union of its task intervals) and idle time inside the
forward's span, and per launch the tail of its tiles (how far apart its SMs' last tiles end).
It draws one horizontal bar per task, per SM, as a PNG.

globaltimer ticks are coarse on some GPUs (about 1 us). The figures are for seeing
where the time goes; the benchmark figures come from `mokgen bench`.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path


def raw_records(variant, tokens: int, routing: str = "uniform", seed: int = 0, warmup: int = 3):
    """Run the forward of a profiling build (the path the Plan takes at this T: the per-GEMM
    kernels, the single launch, in its tiles for this T) and return the call's topk_ids and the
    last call's raw records, {kernel: [[sm, start_ns, end_ns], ...]} in launch order, each row
    where the kernel wrote it (a single launch's tiles at their claim index)."""
    import torch

    from .verify import make_inputs

    if not variant.profiling:
        raise ValueError(f"{variant.path} is not a profiling build (build it with `mokgen build --profile`)")
    x, ids, w, wg, wu, wd, (sg, su, sd) = make_inputs(variant.spec, tokens, routing,
                                                      torch.Generator("cuda").manual_seed(seed))
    for _ in range(warmup + 1):
        variant.forward(x, ids, w, wg, wu, wd, sg, su, sd)
    torch.cuda.synchronize()
    return ids, {k: variant.last_records[k].cpu().tolist()
                 for k in variant.plan["steps"][variant.forward_entry(tokens)] if k in variant.last_records}


def collect(variant, tokens: int, routing: str = "uniform", seed: int = 0, warmup: int = 3) -> dict:
    """The forward's task records (raw_records), in us from the first task's start: {task kind:
    [(sm, start_us, end_us), ...]} in launch order. A single launch's records are split by what
    they time (see single_launch_kinds)."""
    params = {k["name"]: k["params"] for k in variant.plan["kernels"]}
    raw = {}
    for k, rows in raw_records(variant, tokens, routing, seed, warmup)[1].items():
        if params[k].get("prof_cta_rows"):
            raw.update(single_launch_kinds(k, params[k], rows, tokens))
        else:
            raw[k] = [r for r in rows if r[2] > 0]
    raw = {k: rows for k, rows in raw.items() if rows}
    t0 = min(row[1] for rows in raw.values() for row in rows)
    return {k: sorted(((int(sm), (s - t0) / 1e3, (e - t0) / 1e3) for sm, s, e in rows), key=lambda r: r[1])
            for k, rows in raw.items()}


KIND_LABELS = {"gateup": "gate/up tiles", "down": "down tiles", "shared_gateup": "shared gate/up tiles",
               "shared_down": "shared down tiles"}


def single_launch_kinds(name: str, p: dict, rows: list, tokens: int) -> dict:
    """A single launch's records (templates/grouped_gemm_persistent.py.j2, PROF_CTA_ROWS): with
    c = p["prof_cta_rows"], rows [0, c) each CTA's dispatch phase (from the launch's start),
    [c, 2 c) its combine phase, then one per tile at its claim index, whose kinds follow each
    other in the Plan's tile order (p["tile_order"]). Returns {"<name> <what>": rows} in the
    order they run."""
    cta_rows = p["prof_cta_rows"]
    tiles = rows[2 * cta_rows:]
    valid = sum(1 for r in tiles if r[2] > 0)
    per_m = {"gateup": -(-p["n_size"] // p["tile_n"]), "down": p["n2_tiles"],
             "shared_gateup": p.get("s_size", 0) // p["tile_n"], "shared_down": p["n2_tiles"]}
    order = p.get("tile_order", ["gateup", "down"])
    shared_m = -(-tokens // p["tile_m"]) if p.get("s_size") else 0
    shared = sum(per_m[t] for t in order if t.startswith("shared")) * shared_m
    routed = sum(per_m[t] for t in order if not t.startswith("shared"))
    out = {f"{name} dispatch": [r for r in rows[:cta_rows] if r[2] > 0]}
    if p.get("wave_lag"):  # gate/up and down tiles interleaved (the wavefront order)
        out[f"{name} tiles"] = [r for r in tiles if r[2] > 0]
    else:
        used = (valid - shared) // routed if routed else 0
        start = 0
        for t in order:
            n = per_m[t] * (shared_m if t.startswith("shared") else used)
            out[f"{name} {KIND_LABELS[t]}"] = [r for r in tiles[start:start + n] if r[2] > 0]
            start += n
    out[f"{name} combine"] = [r for r in rows[cta_rows:2 * cta_rows] if r[2] > 0]
    return out


def _union(intervals) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


TILE_LABELS = frozenset(KIND_LABELS.values()) | {"tiles"}  # (a single launch's tile kinds; "tiles": wavefront order)


def is_tiles(kind: str) -> bool:
    """Whether a record kind is GEMM tiles: a single launch's "<launch> gate/up tiles" and the
    like, or a per-GEMM kernel's records."""
    what = kind.partition(" ")[2]
    return what in TILE_LABELS or (
        not what and kind.startswith(("gemm_", "shared_", "bwd_dgrad", "bwd_recompute", "wgrad_")))


def tile_groups(records: dict) -> dict:
    """The record kinds that are GEMM tiles, grouped per launch: a single launch's tile kinds
    ("<launch> gate/up tiles", ...) together, each per-GEMM kernel on its own."""
    groups: dict[str, list] = {}
    for k, rows in records.items():
        if is_tiles(k):
            groups.setdefault(k.partition(" ")[0], []).extend(rows)
    return groups


def tiles_per_sm(rows, sms: int) -> dict:
    """How many SMs ran how many of these tiles: {tiles: SMs}, SMs with none included. Where tiles
    are long and about as many as the SMs, an SM with two while another has none is the tail
    (a CTA claims its next tile a tile ahead: docs/perf.md, Mixtral's down tiles)."""
    counts = [0] * sms
    for sm, _, _ in rows:
        counts[sm] += 1
    return {n: counts.count(n) for n in sorted(set(counts))}


def tail(rows) -> dict:
    """How unevenly a launch's SMs finish their tiles: the first and the last SM's last tile end
    (us) and how long before the last one an SM's last tile ends on average (the tail: SM time
    the launch's last units leave idle, which finer last units would shorten)."""
    last: dict[int, float] = {}
    for sm, _, e in rows:
        last[sm] = max(last.get(sm, e), e)
    ends = list(last.values())
    return dict(first_end_us=min(ends), last_end_us=max(ends), mean_before_last_us=max(ends) - statistics.mean(ends))


def summarize(records: dict, sms: int) -> dict:
    span = max(e for rows in records.values() for _, _, e in rows)
    kernels = {}
    for k, rows in records.items():
        kernels[k] = dict(tasks=len(rows), start_us=min(r[1] for r in rows), end_us=max(r[2] for r in rows),
                          median_task_us=statistics.median(r[2] - r[1] for r in rows))
    busy = [_union([(s, e) for rows in records.values() for sm, s, e in rows if sm == i]) for i in range(sms)]
    idle = [span - b for b in busy]
    return dict(span_us=span, kernels=kernels, sm_busy_us=busy, idle_us_total=sum(idle),
                idle_fraction=sum(idle) / (span * sms),
                tails={g: tail(rows) for g, rows in tile_groups(records).items()},
                per_sm={k: tiles_per_sm(rows, sms) for k, rows in records.items() if is_tiles(k)})


def format_summary(name: str, tokens: int, summary: dict) -> str:
    width = max([6] + [len(k) for k in summary["kernels"]])
    lines = [f"{name} T={tokens}: forward span {summary['span_us']:.1f} us (first task start to last task end)",
             f"  {'kernel':{width}s} {'tasks':>7s} {'start us':>9s} {'end us':>9s} {'median task us':>15s}"]
    for k, s in summary["kernels"].items():
        lines.append(f"  {k:{width}s} {s['tasks']:7d} {s['start_us']:9.1f} {s['end_us']:9.1f} "
                     f"{s['median_task_us']:15.2f}")
    lines.append(f"  idle SM time inside the span: {summary['idle_us_total'] / 1e3:.2f} SM-ms "
                 f"({100 * summary['idle_fraction']:.1f}% of {len(summary['sm_busy_us'])} SMs x span)")
    for g, t in summary.get("tails", {}).items():
        lines.append(f"  tail of {g}: SMs' last tiles end {t['first_end_us']:.1f}-{t['last_end_us']:.1f} us, "
                     f"{t['mean_before_last_us']:.1f} us before the last on average")
    for k, spread in summary.get("per_sm", {}).items():
        lines.append(f"  {k} per SM: " + ", ".join(f"{n} on {c} SM{'s' * (c != 1)}" for n, c in spread.items()))
    return "\n".join(lines)


def draw(records: dict, summary: dict, sms: int, path: Path, title: str) -> Path | None:
    """One row per SM, one bar per task, a colour per kernel. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    fig, ax = plt.subplots(figsize=(14, 7))
    colours = plt.get_cmap("tab10")
    for i, (k, rows) in enumerate(records.items()):
        by_sm: dict[int, list] = {}
        for sm, s, e in rows:
            by_sm.setdefault(sm, []).append((s, max(e - s, 1e-3)))
        for sm, bars in by_sm.items():
            ax.broken_barh(bars, (sm - 0.4, 0.8), facecolors=colours(i % 10), label=k if sm == min(by_sm) else None)
    ax.set_xlabel("time (us) from the first task's start")
    ax.set_ylabel("SM")
    ax.set_ylim(-1, sms)
    ax.set_title(f"{title}: span {summary['span_us']:.0f} us, idle {100 * summary['idle_fraction']:.1f}% of SM time",
                 fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(variant, tokens: int, routing: str, png: Path | None, json_path: Path | None, log=print) -> dict:
    records = collect(variant, tokens, routing)
    sms = variant.plan["target"]["sms"]
    summary = summarize(records, sms)
    log(format_summary(variant.name, tokens, summary))
    if json_path:
        Path(json_path).write_text(json.dumps(dict(variant=variant.name, tokens=tokens, routing=routing,
                                                   summary=summary, records=records), indent=1))
        log(f"wrote {json_path}")
    if png and draw(records, summary, sms, Path(png), f"{variant.name} T={tokens} ({routing})"):
        log(f"wrote {png}")
    return summary
