"""`mokgen profile`: the device timeline of one forward, from a profiling build.

A profiling build (`mokgen build --profile`, Plan override "profile") has every task
record its SM and its start and end time (globaltimer, ns) on the device:
one row per GEMM tile, dispatch CTA and combine CTA. This module runs a forward,
reads the rows back, and reports per kernel: tasks, time span and median task time.
Per SM it reports busy time (the union of its task intervals) and idle time inside the
forward's span. It draws one horizontal bar per task, per SM, as a PNG.

globaltimer ticks are coarse on some GPUs (about 1 us). The figures are for seeing
where the time goes; the benchmark figures come from `mokgen bench`.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path


def collect(variant, tokens: int, routing: str = "uniform", seed: int = 0, warmup: int = 3) -> dict:
    """Run the forward of a profiling build and return its task records, in us from the
    first task's start: {kernel: [(sm, start_us, end_us), ...]} in launch order."""
    import torch

    from .verify import make_inputs

    if not variant.profiling:
        raise ValueError(f"{variant.path} is not a profiling build (build it with `mokgen build --profile`)")
    x, ids, w, wg, wu, wd, (sg, su, sd) = make_inputs(variant.spec, tokens, routing,
                                                      torch.Generator("cuda").manual_seed(seed))
    for _ in range(warmup + 1):
        variant.forward(x, ids, w, wg, wu, wd, sg, su, sd)
    torch.cuda.synchronize()
    raw = {k: r[r[:, 2] > 0].cpu().tolist() for k, r in variant.last_records.items()}
    t0 = min(row[1] for rows in raw.values() for row in rows)
    order = [k for k in variant.plan["steps"]["forward"] if k in raw]
    return {k: sorted(((int(sm), (s - t0) / 1e3, (e - t0) / 1e3) for sm, s, e in raw[k]), key=lambda r: r[1])
            for k in order}


def _union(intervals) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize(records: dict, sms: int) -> dict:
    span = max(e for rows in records.values() for _, _, e in rows)
    kernels = {}
    for k, rows in records.items():
        kernels[k] = dict(tasks=len(rows), start_us=min(r[1] for r in rows), end_us=max(r[2] for r in rows),
                          median_task_us=statistics.median(r[2] - r[1] for r in rows))
    busy = [_union([(s, e) for rows in records.values() for sm, s, e in rows if sm == i]) for i in range(sms)]
    idle = [span - b for b in busy]
    return dict(span_us=span, kernels=kernels, sm_busy_us=busy, idle_us_total=sum(idle),
                idle_fraction=sum(idle) / (span * sms))


def format_summary(name: str, tokens: int, summary: dict) -> str:
    lines = [f"{name} T={tokens}: forward span {summary['span_us']:.1f} us (first task start to last task end)",
             f"  {'kernel':18s} {'tasks':>7s} {'start us':>9s} {'end us':>9s} {'median task us':>15s}"]
    for k, s in summary["kernels"].items():
        lines.append(f"  {k:18s} {s['tasks']:7d} {s['start_us']:9.1f} {s['end_us']:9.1f} {s['median_task_us']:15.2f}")
    lines.append(f"  idle SM time inside the span: {summary['idle_us_total'] / 1e3:.2f} SM-ms "
                 f"({100 * summary['idle_fraction']:.1f}% of {len(summary['sm_busy_us'])} SMs x span)")
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
