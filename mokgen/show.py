"""Plain-text rendering of a Plan (for `mokgen show`)."""
from __future__ import annotations

from .schedule.backward import backward_decision


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
        *(f"          {q['name']}: {q['direction']}, {q['slots']} slots of {q['slot_bytes']} B (C = tokens per rank "
          f"the peer workspace holds, RC = rows a rank receives per call at most), order {q['order']}, announced by "
          f"{q['flag']}" for q in plan["queues"]),
        f"reduction {plan['reduction_order']}",
        "",
    ]
    # Where a single launch serves the small calls, the per-GEMM launch order is the large calls'.
    above = f" of calls with T > {plan['fused_max_tokens']}" if "forward_fused" in plan["steps"] else ""
    if any(entry == "forward" for _, entry in plan.get("launch_bands", [])):
        above += " and those the bands below give it"
    out.append(f"kernels (launch order{above}: " + " -> ".join(plan["steps"]["forward"])
               + ("; route: " + " -> ".join(plan["steps"]["route"]) if "route" in plan["steps"] else "")
               + ("; its backward: " + " -> ".join(plan["steps"]["route_backward"])
                  if "route_backward" in plan["steps"] else "")
               + ")")
    if plan.get("side_stream"):
        out.append("          on a second stream, beside the kernels after them: " + ", ".join(plan["side_stream"]))
    from .runtime.variant import routed_twin

    low = 1
    for top, entry in plan.get("launch_bands", []):
        if entry == "forward":  # (a range of T given to the per-GEMM path: Plan override per_gemm_tokens)
            out.append(f"          calls with {low} <= T <= {top}: the per-GEMM launches above (measured faster)")
            low = top + 1
            continue
        routed = routed_twin(entry)
        out.append(f"          calls with {low} <= T <= {top}: " + " -> ".join(plan["steps"][entry])
                   + (" (from router logits: " + " -> ".join(plan["steps"][routed]) + ")"
                      if routed in plan["steps"] else ""))
        low = top + 1
    for gpu, gpu_bands in sorted(plan.get("launch_bands_on", {}).items()):
        lows = [1] + [top + 1 for top, _ in gpu_bands[:-1]]
        ranges = [f"{lo}-{top}" for lo, (top, entry) in zip(lows, gpu_bands) if entry == "forward"]
        out.append(f"          on an {gpu} (the runtime's choice there): the per-GEMM launches at T = "
                   + ", ".join(ranges) + " (`mokgen tune --paths` measured them faster there)")
    bands = bool(plan.get("launch_bands"))  # (the band lines above already name every small call's launch)
    if "forward_fused" in plan["steps"] and not bands:
        out.append(f"          calls with T <= {plan['fused_max_tokens']}: "
                   + " -> ".join(plan["steps"]["forward_fused"]))
    if "forward_routed" in plan["steps"] and not bands:
        when = f" with T <= {plan['fused_max_tokens']}" if "forward_fused" in plan["steps"] else ""
        out.append(f"          from router logits (mokgen.moe_routed){when}: " + " -> ".join(plan["steps"]["forward_routed"]))
    for entry, what in (("forward_train", "training forward (autograd)"), ("backward", "backward"),
                        ("backward_recompute", "backward, recompute=True")):
        if entry in plan["steps"]:
            zeroed = plan.get("zeroed", {}).get(entry)
            out.append(f"          {what}: " + " -> ".join(plan["steps"][entry])
                       + (f" (the runtime zeroes {', '.join(zeroed)} first)" if zeroed else ""))
    if plan["spec"].get("dtype") == "fp8":
        if "backward_data" in plan["steps"]:
            out.append("          backward, data gradients (Variant.backward_data_fp8; mokgen.moe_fp8's autograd): "
                       + " -> ".join(plan["steps"]["backward_data"]))
        if "backward_fp8" in plan["steps"]:
            out.append("          backward, every gradient (Variant.backward_fp8): "
                       + " -> ".join(plan["steps"]["backward_fp8"]))
        out.append("          the FP8 weight gradients reach no autograd yet (docs/fp8.md)")
    elif "backward" not in plan["steps"]:
        out.append("          " + backward_decision(plan))
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
    if plan.get("task_graph"):
        out += ["", format_task_graph(plan)]
    return "\n".join(out)


def _spec_target(plan: dict):
    from .ir import MoESpec
    from .schedule.target import Target

    t = dict(plan["target"])
    t["row_tile_efficiency"] = {int(k): v for k, v in (t.get("row_tile_efficiency") or {}).items()}
    return MoESpec.from_dict(plan["spec"]), Target(**t)


def format_task_graph(plan: dict, tokens=(64, 256, 1024, 4096, 16384)) -> str:
    from .schedule.taskgraph import gemm_model_params, simulate

    tg = plan["task_graph"]
    fused = next((k for k in plan["kernels"] if k["name"] == "gemm_fused"), None)
    if fused is None:
        status = "planned; this build runs one launch per stage"
    else:
        p = fused["params"]
        tasks = ("count, publish, scatter, layout, send, " if p.get("ep_layout") else "send, " if p.get("send_in_gemm")
                 else "count, scatter, " if p.get("dispatch") else "") + "gate/up, " + \
            ("shared gate/up, " if p.get("s_size") else "") + "down" + (", shared down" if p.get("s_size") else "") + \
            (" and combine" if p.get("combine") else "")
        when = f"calls with T <= {plan['fused_max_tokens']}" if plan.get("fused_max_tokens") else "every call"
        if any(k["name"] == "gemm_fused_routed" for k in plan["kernels"]):
            status = (f"generated: for {when}, gemm_fused runs the {tasks} tasks in one launch, and "
                      "gemm_fused_routed (mokgen.moe_routed) the route tasks first")
            bands = [k for k in plan["kernels"] if k["params"].get("swap") and not k["name"].endswith("_routed")]
            if bands:
                status += ("; by T (launch_bands), the same tasks run in " + ", ".join(
                    f"{k['name']} ({k['params']['tile_m']} token rows)" for k in bands)
                    + ", swapped tiles, each with its routing twin")
        elif p.get("ep_return"):
            tasks += " (each down tile returning its rows)"
            after = "" if p.get("combine") else "; the wait for the returned rows and the combine follow it"
            apart = "" if p.get("ep_layout") else "; count, scatter, publish and layout run before it"
            status = f"generated: for {when}, gemm_fused runs the {tasks} tasks in one launch{apart}{after}"
        else:
            apart = "route is" if p.get("dispatch") else "route, count and scatter are"
            status = (f"generated in part: for {when}, gemm_fused runs the {tasks} tasks in one launch; "
                      f"{apart} still launches of their own")
    out = [f"task graph of the fused forward ({status})",
           "  SM roles: " + ", ".join(f"{k} {v}" for k, v in tg["sm_roles"].items()),
           f"  rule: {tg['rule']}"]
    rows = [[k["priority"], k["name"], k["granularity"], k["count"], k["waits_on"], k["signals"],
             "fill" if k["fill"] else ""] for k in tg["kinds"]]
    out += ["  " + line for line in _table(rows, ["prio", "task", "granularity", "tasks", "waits on", "signals", ""])]
    out += ["  counters: " + "; ".join(f"{c['name']}[{c['length']}] ({c['meaning']})" for c in tg["counters"])]
    spec, target = _spec_target(plan)
    params = gemm_model_params({k["name"]: k["params"] for k in plan["kernels"]})
    pred = []
    for T in tokens:
        fused = simulate(spec, params, target, T)["makespan_us"]
        multi = simulate(spec, params, target, T, fused=False)["makespan_us"]
        pred.append([T, f"{multi:.0f}", f"{fused:.0f}", f"{multi / fused:.2f}x"])
    out += ["  predicted forward time, uniform routing (cost model from measured rates" +
            ("; one rank's local work, the exchange not priced" if spec.world_size > 1 else "") + "):"]
    out += ["  " + line for line in _table(pred, ["T", "multi-kernel us", "fused us", "gain"])]
    return "\n".join(out)


def draw_schedule(plan: dict, path, tokens: int = 4096):
    """PNG: the SM roles and the predicted per-SM timeline of the fused forward at T=tokens,
    with the multi-kernel path's stages below for comparison. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .schedule.taskgraph import gemm_model_params, simulate, task_costs_us

    spec, target = _spec_target(plan)
    params = gemm_model_params({k["name"]: k["params"] for k in plan["kernels"]})
    sim = simulate(spec, params, target, tokens)
    kinds = [k["name"] for k in plan["task_graph"]["kinds"]]
    colors = {k: plt.cm.tab10(i % 10) for i, k in enumerate(kinds)}
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 7), gridspec_kw={"height_ratios": [4, 1]}, sharex=True)
    for sm, start, end, kind in sim["events"]:
        ax.barh(sm, end - start, left=start, height=0.9, color=colors[kind], linewidth=0)
    ax.set_ylabel(f"SM (all {target.sms}: compute role)")
    ax.set_title(f"{plan['variant']}: predicted fused forward at T={tokens}, "
                 f"{sim['makespan_us']:.0f} us (priority order: {' > '.join(kinds)})", fontsize=9)
    ax.invert_yaxis()
    costs = task_costs_us(spec, params, target, tokens)
    t = 0.0
    multi = simulate(spec, params, target, tokens, fused=False)["makespan_us"]
    for kind in kinds:
        if kind in costs and kind != "route":
            n = sum(1 for e in sim["events"] if e[3] == kind)
            d = -(-n // target.sms) * costs[kind] + target.launch_gap_us
            ax2.barh(0, d, left=t, color=colors[kind], height=0.6)
            t += d
    ax2.set_yticks([0], ["multi-kernel"])
    ax2.set_xlabel(f"time (us); multi-kernel path {multi:.0f} us")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in kinds]
    ax.legend(handles, kinds, fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
