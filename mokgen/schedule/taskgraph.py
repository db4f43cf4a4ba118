"""The task graph of the fused forward: what one persistent launch will do.

Every stage of the multi-kernel path becomes a kind of task at a fixed granularity
(an expert, an output tile, a block of tokens). Tasks wait on device-side counters
and bump counters when done; a persistent CTA takes the highest-priority task whose
counters are met. No grid-wide barrier, no host sync. This module is pure data plus
a cost model: per-task time estimates from the target's measured rates, and a list
scheduler that predicts the timeline on the target's SMs (what `mokgen show` prints
and `mokgen show --png` draws).
"""
from __future__ import annotations

import functools
import heapq
import math
import random
from dataclasses import asdict, dataclass, field

import sympy

from ..ir.graph import T
from .target import Target


# Tokens per combine task: small, so the reduction spreads over every SM at small T.
COMBINE_TOKENS = 16


@dataclass
class Counter:
    name: str
    length: str  # number of counters (expression of T)
    meaning: str


@dataclass
class TaskKind:
    name: str
    stage: str
    granularity: str
    count: str  # tasks of this kind (upper bound, expression of T)
    waits_on: str  # counter condition before a task may start
    signals: str  # counters bumped when it ends
    priority: int  # lower runs first among ready tasks
    role: str = "compute"
    fill: bool = False  # may run whenever an SM would otherwise wait


@dataclass
class TaskGraph:
    kinds: list
    counters: list
    sm_roles: dict
    rule: str
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _e(x) -> str:
    return str(sympy.simplify(x))


GEMM_TILE_TASKS = ("gateup", "shared_gateup", "down", "shared_down")  # the kinds a GEMM launch runs
# A task kind and the kinds whose counters it waits on: they must be claimed before it.
TILE_TASK_DEPS = {"down": ("gateup",), "shared_down": ("shared_gateup",)}


def fused_tile_order(task_graph: dict) -> list[str]:
    """The order in which the single launch claims its GEMM tiles: the task graph's GEMM
    tile kinds by priority. A kind must come after every kind it waits on, so that a tile
    only ever waits on tiles claimed before it (no deadlock)."""
    kinds = sorted((k for k in task_graph["kinds"] if k["name"] in GEMM_TILE_TASKS), key=lambda k: k["priority"])
    order = [k["name"] for k in kinds]
    for kind, deps in TILE_TASK_DEPS.items():
        for dep in deps:
            if kind in order and (dep not in order or order.index(dep) > order.index(kind)):
                raise ValueError(f"task graph: {kind} tiles wait on {dep} tiles, which must be claimed first")
    return order


def wavefront_tile(tile: int, used_m: int, n_gateup: int, n_down: int, lag: int) -> tuple[str, int, int]:
    """(kind, M tile, N tile) of the single launch's claimed tile index `tile` in wavefront
    order (templates/gemm_tile_order.py.j2, fused_tile_at, computes the same): the
    gate/up tiles of the first `lag` M tiles, then per step j the gate/up tiles of M tile
    j + lag followed by the down tiles of M tile j, then the remaining down tiles. Every down
    tile comes after all gate/up tiles of its M tile (it waits on them: no deadlock), and down
    tiles start after about `lag` M tiles of gate/up tiles instead of after all of them."""
    lag = min(lag, used_m)
    mixed = used_m - lag
    step = n_gateup + n_down
    if tile < lag * n_gateup:
        return "gateup", tile // n_gateup, tile % n_gateup
    rest = tile - lag * n_gateup
    if rest < mixed * step:
        j, w = divmod(rest, step)
        return ("gateup", lag + j, w) if w < n_gateup else ("down", j, w - n_gateup)
    rest -= mixed * step
    return "down", mixed + rest // n_down, rest % n_down


def gemm_model_params(params_by_kernel: dict) -> dict:
    """Kernel params by name, with the fused routed GEMM (if the Plan has one) seen as the
    gate/up and down GEMMs it runs, which is what the cost model prices."""
    out = dict(params_by_kernel)
    fused = out.get("gemm_fused")
    if fused and "gemm_gateup" not in out:  # a fused-only Plan
        out["gemm_gateup"] = fused
        out["gemm_down"] = dict(fused, n_size=fused["n2_size"], k_size=fused["k2_size"],
                                tile_n=2 * fused["tile_n"], epilogue="store", gather_a=False)
        if fused.get("s_size"):  # and the shared expert's two GEMMs
            out["shared_gateup"] = dict(fused, n_size=fused["s_size"], groups=1, gather_a=False)
            out["shared_down"] = dict(out["gemm_down"], k_size=fused["s_size"], groups=1)
    return out


def forward_task_graph(spec, plan_params: dict, target: Target) -> TaskGraph:
    """Task kinds, counters and roles of the fused forward for one spec."""
    E, K, S = spec.local_experts, spec.topk, spec.shared_intermediate
    gu, dn = plan_params["gemm_gateup"], plan_params["gemm_down"]
    bm = gu["tile_m"]
    m_tiles = sympy.ceiling(T * K / bm) + E
    ng = math.ceil(gu["n_size"] / gu["tile_n"])
    nd = math.ceil(dn["n_size"] / dn["tile_n"])
    chunk = plan_params.get("gemm_fused", {}).get("dispatch", {}).get("chunk")
    early = bool(plan_params.get("gemm_fused", {}).get("combine_early"))
    if chunk:  # the launch's CTAs count and place chunks of pairs (templates/dispatch_chunks.py.j2)
        chunks = _e(sympy.ceiling(T * K / chunk))
        dispatch = [TaskKind("count", "send", f"a chunk of {chunk} pairs", chunks, "routed == CTAs",
                             "counted += 1", 1),
                    TaskKind("scatter", "send", "a CTA: its experts' tables, its chunk's pairs", "CTAs",
                             f"counted == {chunks}", "placed += 1", 2)]
        placed = "placed == CTAs"
    else:
        dispatch = [TaskKind("count", "send", "one expert", str(E), "routed == CTAs", "counted += 1", 1),
                    TaskKind("scatter", "send", "one expert", str(E), f"counted == {E}", "placed += 1", 2)]
        placed = f"placed == {E}"
    kinds = [
        TaskKind("route", "route", "a CTA's tokens (one per warp)", "CTAs", "-", "routed += 1", 0),
        *dispatch,
        TaskKind("gateup", "gemm_gateup", f"{bm}x{gu['tile_n']} tile of h", _e(m_tiles * ng),
                 placed, "h_ready[m] += 1", 3),
        TaskKind("down", "gemm_down", f"{bm}x{dn['tile_n']} tile of y", _e(m_tiles * nd),
                 f"h_ready[m] >= {ng}", "h_ready[m] += 1" if early else "y_done += 1", 5),
    ]
    counters = [
        Counter("routed", "1", "CTAs that routed their tokens"),
        Counter("counted", "1", "chunks counted" if chunk else "experts counted"),
        Counter("placed", "1", "CTAs whose tables and chunks are placed" if chunk
                else "experts whose rows are placed and tile table written"),
        Counter("h_ready", _e(m_tiles), "gate/up, then down tiles finished per M tile" if early
                else "gate/up tiles finished per M tile"),
    ] + ([] if early else [Counter("y_done", "1", "down tiles finished")])
    # The early combine (Plan combine_early): a task waits only for the M tiles of its token's rows.
    combine_wait = f"h_ready[m] == {ng + nd} for the M tile of each of its token's {K} rows" if early \
        else "y_done == tiles used"
    if S:
        sg, sd = plan_params["shared_gateup"], plan_params["shared_down"]
        s_tiles = sympy.ceiling(T / bm)
        nsg = math.ceil(sg["n_size"] / sg["tile_n"])
        nsd = math.ceil(sd["n_size"] / sd["tile_n"])
        # The shared expert's gate/up tasks come right after the routed ones (they fill the SMs
        # that would wait for h_ready), its down tasks after the routed down tasks.
        kinds.insert(4, TaskKind("shared_gateup", "shared_gateup", f"{bm}x{sg['tile_n']} tile of hs",
                                 _e(s_tiles * nsg), "-", "hs_ready[s] += 1", 4, fill=True))
        kinds.append(TaskKind("shared_down", "shared_down", f"{bm}x{sd['tile_n']} tile of ys", _e(s_tiles * nsd),
                              f"hs_ready[s] == {nsg}", "ys_ready[s] += 1", 6, fill=True))
        counters += [Counter("hs_ready", _e(s_tiles), "shared gate/up tiles finished per M tile"),
                     Counter("ys_ready", _e(s_tiles), "shared down tiles finished per M tile")]
        combine_wait += f" and ys_ready[block] == {nsd}"
    kinds.append(TaskKind("combine", "reduce", f"{COMBINE_TOKENS} tokens", _e(sympy.ceiling(T / COMBINE_TOKENS)),
                          combine_wait + " (per 128-token block)" if S else combine_wait, "-", 7))
    if spec.world_size > 1:
        return _expert_parallel_graph(spec, kinds, counters, plan_params, target)
    return TaskGraph(
        kinds=kinds,
        counters=counters,
        sm_roles={"compute": target.sms, "communication": 0},
        rule=("each persistent CTA takes the lowest-priority-number task whose wait is met; "
              "fill tasks (shared expert) run whenever nothing else is ready; every wait is bounded "
              "(timeout -> error code, never a hang); the tile counters are zeroed by the launch's CTA 0 "
              "before it counts, the dispatch counters left zeroed by the launch before"),
        notes=["route tasks run only on the routing entry point (mokgen.moe_routed: gemm_fused_routed); "
               "with precomputed routing, count starts at once"],
    )


def _expert_parallel_graph(spec, kinds: list, counters: list, plan_params: dict, target: Target) -> TaskGraph:
    """The expert-parallel forward's tasks on each of the W ranks: dispatch runs over the E
    global experts in the send order, the counts go to every rank (publish), each rank lays
    out its received rows once every rank's counts are in (layout), the rows go to their
    experts' ranks (send) and come back after the down tiles (return); flags at system scope
    carry the call's epoch between ranks, counters at GPU scope order the tasks of one launch."""
    W, E = spec.world_size, spec.experts
    fused = plan_params.get("gemm_fused", {})
    send_ctas = fused.get("send_ctas", "comm")
    by = {k.name: k for k in kinds}
    by["count"].count = by["scatter"].count = str(E)
    by["scatter"].granularity = by["count"].granularity = "one global expert (send order: local expert first)"
    by["scatter"].waits_on = f"counted == {E}"
    by["gateup"].waits_on = f"ready[expert, r] == epoch for all {W} ranks r (system scope)"
    by["down"].signals = "its rows' columns stored to their ranks (return)"
    ep_kinds = [
        TaskKind("publish", "send_peers", "this rank's counts", "1", f"counted == {E}",
                 f"ep_counts and counts flag on all {W} ranks (epoch)", 1, role="communication"),
        TaskKind("layout", "send_peers", "one global expert", str(E),
                 f"placed == {E} and every rank's counts flag == epoch", "laid += 1", 2),
        TaskKind("send", "send_peers", "32 rows of the send order per warp", f"{send_ctas} CTAs",
                 f"laid == {E}", "ready[e, rank] on e's rank once all its rows are stored; rows flag", 3,
                 role="communication"),
    ]
    by["count"].waits_on = "-"  # (routing runs before the launch: mokgen.route)
    order = ["count", "publish", "scatter", "layout", "send", "gateup", "down", "combine"]
    kinds = sorted([k for k in kinds if k.name in order] + ep_kinds, key=lambda k: order.index(k.name))
    for i, k in enumerate(kinds):
        k.priority = i
    by_name = {k.name: k for k in kinds}
    by_name["combine"].waits_on = "every rank's returns flag == epoch (the combine kernel, after the launch)"
    counters = [c for c in counters if c.name not in ("routed", "y_done")] + [
        Counter("laid", "1", "global experts laid out"),
        Counter("ready", f"{spec.local_experts} x {W}", "per local expert and source rank: its rows are here "
                "(flag, system scope)"),
        Counter("flags", f"3 x {W}", "counts, rows, returns per rank (flags, system scope, the call's epoch)"),
    ]
    return TaskGraph(
        kinds=kinds,
        counters=counters,
        sm_roles={"compute": target.sms, "communication": f"the first {send_ctas} CTAs send first"},
        rule=("one launch per call up to the fused path's bound: every CTA takes part in count, scatter and "
              "layout (every grid-th global expert; CTA 0 publishes), the first CTAs then send, every CTA takes "
              "GEMM tiles in wavefront order, each down tile returns its rows' columns; every wait is bounded "
              "(timeout -> error code, never a hang); the wait for the returned rows and the combine follow"),
        notes=["routing runs before the launch under expert parallelism (mokgen.route)"],
    )


# ---- cost model ---------------------------------------------------------------------

def task_costs_us(spec, plan_params: dict, target: Target, tokens: int) -> dict:
    """Estimated time of one task of each kind on one SM, in microseconds.

    GEMM tiles: the larger of FLOPs over the measured grouped-GEMM rate and the tile's
    share of weight bytes over the copy bandwidth, both split evenly over the SMs.
    Dispatch and combine: bytes over the measured dispatch scan rate and the per-SM
    share of the copy bandwidth (target numbers; docs/perf.md has the runs).
    """
    K, H = spec.topk, spec.hidden
    per_sm_flops = target.grouped_gemm_tflops * 1e12 / target.sms
    per_sm_bytes = target.copy_gbs * 1e9 / target.sms

    def tile(p, rows_per_group):
        # The larger of its FLOPs and its share of the weight bytes (a weight tile is read
        # once per group and shared through L2 by that group's M tiles).
        nb = 2 if p["epilogue"] == "swiglu" else 1
        flops_us = 2 * p["tile_m"] * p["tile_n"] * p["k_size"] * nb / per_sm_flops * 1e6
        m_tiles = max(1, math.ceil(rows_per_group / p["tile_m"]))
        weight_bytes = p["tile_n"] * p["k_size"] * 2 * nb / m_tiles
        return max(flops_us, weight_bytes / per_sm_bytes * 1e6)

    costs = {
        "route": 128 * spec.experts * 4 * (K + 2) / per_sm_bytes * 1e6,
        "count": tokens * K * 4 / (target.dispatch_scan_gbs * 1e9) * 1e6,
        "scatter": tokens * K * 4 / (target.dispatch_scan_gbs * 1e9) * 1e6 * target.scatter_over_count,
        "gateup": tile(plan_params["gemm_gateup"], tokens * K / spec.local_experts),
        "down": tile(plan_params["gemm_down"], tokens * K / spec.local_experts),
        "combine": COMBINE_TOKENS * (K + 1 + (1 if spec.shared_intermediate else 0)) * H * 2 / per_sm_bytes * 1e6,
    }
    if spec.shared_intermediate:
        costs["shared_gateup"] = tile(plan_params["shared_gateup"], tokens)
        costs["shared_down"] = tile(plan_params["shared_down"], tokens)
    return costs


def uniform_m_tiles(spec, tokens: int, tile_m: int) -> int:
    """M tiles of `tile_m` rows the experts' rows fill at `tokens` with uniform routing."""
    return spec.local_experts * math.ceil(tokens * spec.topk / spec.local_experts / tile_m)


def simulate(spec, plan_params: dict, target: Target, tokens: int, fused: bool = True) -> dict:
    """Predicted timeline at `tokens` with uniform routing: list scheduling of the task
    graph on the SMs (fused), or stage by stage with a barrier between stages (the
    current multi-kernel path). Returns the makespan and, for fused, every task's
    (sm, start, end, kind)."""
    costs = task_costs_us(spec, plan_params, target, tokens)
    E, K = spec.local_experts, spec.topk
    bm = plan_params["gemm_gateup"]["tile_m"]
    used_m = uniform_m_tiles(spec, tokens, bm)
    ng = math.ceil(plan_params["gemm_gateup"]["n_size"] / plan_params["gemm_gateup"]["tile_n"])
    nd = math.ceil(plan_params["gemm_down"]["n_size"] / plan_params["gemm_down"]["tile_n"])
    blocks = math.ceil(tokens / COMBINE_TOKENS)
    stages = [("count", E), ("scatter", E), ("gateup", used_m * ng), ("down", used_m * nd), ("combine", blocks)]
    if spec.shared_intermediate:
        st = math.ceil(tokens / bm)
        nsg = math.ceil(plan_params["shared_gateup"]["n_size"] / plan_params["shared_gateup"]["tile_n"])
        nsd = math.ceil(plan_params["shared_down"]["n_size"] / plan_params["shared_down"]["tile_n"])
        stages[4:4] = [("shared_gateup", st * nsg), ("shared_down", st * nsd)]
    sms = target.sms
    if not fused:
        launch_us = target.launch_gap_us
        total = 0.0
        for kind, n in stages:
            waves = math.ceil(n / sms)
            total += waves * costs[kind] + launch_us
        return {"makespan_us": total}
    # Fused: dependencies at the granularity of the task graph (uniform routing, so each
    # expert owns used_m / E consecutive M tiles).
    m_per_e = used_m // E
    done = {}
    free = [(0.0, sm) for sm in range(sms)]
    heapq.heapify(free)
    events = []

    def run(kind, ready_at):
        t_free, sm = heapq.heappop(free)
        start = max(t_free, ready_at)
        end = start + costs[kind]
        heapq.heappush(free, (end, sm))
        events.append((sm, start, end, kind))
        return end

    counted = max(run("count", 0.0) for _ in range(E))
    placed_all = max(run("scatter", counted) for _ in range(E))
    placed = [placed_all] * E
    shared_end = 0.0
    if spec.shared_intermediate:
        # Fill work: issued after the dispatch tasks, before the routed tiles are ready.
        hs = [max(run("shared_gateup", 0.0) for _ in range(nsg)) for _ in range(st)]
        shared_end = max(max(run("shared_down", h) for _ in range(nsd)) for h in hs)
    h_ready = [max(run("gateup", placed[m // m_per_e]) for _ in range(ng)) for m in range(used_m)]
    y_done = max(max(run("down", h_ready[m]) for _ in range(nd)) for m in range(used_m))
    end = max(run("combine", max(y_done, shared_end)) for _ in range(blocks))
    done["makespan_us"] = end
    done["events"] = events
    return done


@functools.lru_cache(maxsize=4096)  # a Plan asks the same shapes band after band
def tile_loop_us(n_m: int, n_gateup: int, n_down: int, cost_gateup: float, cost_down: float, sms: int,
                 claim_late: bool, spread: float = 0.0, seed: int = 0) -> float:
    """Predicted span of a single launch's tile loop (its gate/up tiles, then its down tiles, each
    M-major: the order the claims follow at wave lag 0), with `n_m` M tiles, by how each CTA claims.

    Claimed ahead (the default), a CTA claims its next tile as it reaches the top of the loop with
    the current one, before that tile's wait for its gate/up tiles (h_ready) and its MMAs; claimed
    late, once the current tile is done. The claims go in order to whichever CTA claims first (a
    queue of claim times, first come first served at equal times), so this is list scheduling
    with one tile of lookahead or none. Each tile's time is its kind's cost times a factor drawn
    uniformly within +-spread (seeded: the same answer every call), the variation that lets one
    CTA end up with two long tiles in a row."""
    rand = random.Random(seed)
    claims = [(0.0, s, s) for s in range(sms)]  # (claim time, arrival order, CTA)
    order = sms
    free = [0.0] * sms  # when each CTA is done with the tiles it holds
    h_end = [0.0] * n_m  # when each M tile's last gate/up tile ends
    for kind, n_per, cost in (("gateup", n_gateup, cost_gateup), ("down", n_down, cost_down)):
        for m in range(n_m):
            for _ in range(n_per):
                _, _, cta = heapq.heappop(claims)
                reach = free[cta]
                start = reach if kind == "gateup" else max(reach, h_end[m])
                end = start + cost * (1.0 + spread * (2.0 * rand.random() - 1.0))
                if kind == "gateup":
                    h_end[m] = max(h_end[m], end)
                free[cta] = end
                order += 1
                heapq.heappush(claims, (end if claim_late else reach, order, cta))
    return max(free)


def claim_late_gain(spec, params: dict, target: Target, tokens: int, spread: float, seeds: int) -> float:
    """Predicted span of the single launch's tile loop claimed ahead over claimed late (above 1:
    claiming late is faster), at `tokens` with uniform routing, for the fused kernel `params`; the
    mean over `seeds` draws of the tiles' times."""
    costs = task_costs_us(spec, gemm_model_params({"gemm_fused": params}), target, tokens)
    shape = (uniform_m_tiles(spec, tokens, params["tile_m"]), math.ceil(params["n_size"] / params["tile_n"]),
             params["n2_tiles"], costs["gateup"], costs["down"], target.sms)
    return sum(tile_loop_us(*shape, claim_late=False, spread=spread, seed=s) /
               tile_loop_us(*shape, claim_late=True, spread=spread, seed=s) for s in range(seeds)) / seeds
