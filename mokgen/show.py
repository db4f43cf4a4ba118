"""Plain-text rendering of a Plan (for `mokgen show`)."""
from __future__ import annotations


def _table(rows: list[list[str]], head: list[str]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{w}s}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*["-" * w for w in widths])] + [fmt.format(*map(str, r)) for r in rows]
    return [line.rstrip() for line in lines]


def format_plan(plan: dict) -> str:
    s = plan["spec"]
    t = plan["target"]
    out = [
        f"variant   {plan['variant']}   (mokgen {plan['mokgen_version']}, plan format {plan['format']})",
        f"layer     E={s['experts']} K={s['topk']} H={s['hidden']} I={s['intermediate']} "
        f"shared={s['shared_intermediate']} {s['dtype']} world={s['world_size']} ({s['topology']})",
        f"target    {t['name']} {t['arch']}: {t['sms']} SMs, {t['smem_per_block'] // 1024} KiB smem/block",
        f"FLOPs     {plan['flops']} (routed forward)",
        "SM roles  " + ", ".join(f"{k}: {v}" for k, v in plan["sm_roles"].items()),
        f"queues    {len(plan['queues']) or 'none (one GPU)'}",
        f"reduction {plan['reduction_order']}",
        "",
        "kernels (launch order: " + " -> ".join(plan["steps"]["forward"]) + "; route: "
        + " -> ".join(plan["steps"]["route"]) + ")",
    ]
    rows = []
    for k in plan["kernels"]:
        p = k["params"]
        tile = f"{p['tile_m']}x{p['tile_n']}x{p['tile_k']}" if "tile_n" in p else "-"
        stages = str(p.get("stages", "-"))
        rows.append([k["name"], k["stage"], tile, stages, k["grid"], str(k["block"]),
                     f"{k['smem_bytes'] // 1024} KiB" if k["smem_bytes"] else "-", "; ".join(k["warp_roles"])])
    out += _table(rows, ["kernel", "stage", "tile", "stages", "grid", "block", "smem", "warp roles"])
    out += ["", "workspace buffers"]
    out += _table([[b["name"], b["dtype"], "[" + ", ".join(b["shape"]) + "]", b["init"]] for b in plan["buffers"]],
                  ["buffer", "dtype", "shape", "init"])
    out += ["", "decisions"] + [f"  - {d}" for d in plan["decisions"]]
    return "\n".join(out)
