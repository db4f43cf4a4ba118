"""When each token's combine can start in the single launch, from a profiling build's records:
what bounds the time between the last down tile and the end of the launch.

    python benchmarks/combine_tail.py [--variant profile/e64_k8_h2048_i1024_bf16_sm90a]
                                      [--tokens 1024,256] [--runs 3] [--json FILE]
    python benchmarks/combine_tail.py --from-json FILE     # the analysis again, no GPU

On the GPU: each run draws a uniform routing (seed = the run's index), calls the profiling build
at each T and keeps its raw records (every tile at its claim index, each CTA's combine phase)
with the routing. The analysis (CPU):
  - an M tile is done when the last of its down tiles ends; the launch places an expert's rows in
    (token, slot) order into ceil(rows / tile_m) M tiles, experts in order, and claims down tiles
    M tile after M tile, so a token can be summed once the last M tile holding one of its rows is
    done ("ready");
  - how many tokens are ready 0.5 / 2 / 5 / 10 / 20 us before the last tile ends, and how long
    the combine runs after it;
  - a queue model of the combine: each CTA's consumer warps free when its combine phase starts,
    a task (a token's part: the launch splits a token into the most parts that give no warp two
    tasks) claimed by the first free warp, started once its token is ready, taking `task_us`;
    `task_us` is fitted so that the model ends when the launch did, and the model then says what
    claiming tokens in the order they become ready would give instead of token order;
  - with --task-cost FIXED,PER_KB (us, and us per KB of y a task reads), the model's end again with
    each number of parts the launch can make a token, a task costing FIXED + PER_KB x its KB;
  - with --split-last N,N,.. the tail before the last tile: a replay of the claims (each tile's
    recorded time, given in claim order to the CTA that is free first, from its dispatch phase's
    end) as it was and with the last N down tiles each split into two halves of --half of a tile
    (a half streams half the weights and all the token rows again).
Prints one line per run and T; --json writes the raw records and the analysis.
"""
import argparse
import heapq
import json
import sys

READY_BEFORE_US = (0.5, 2, 5, 10, 20)


def m_tiles_done(rows: list, params: dict) -> list[float]:
    """The end (ns) of each used M tile's last down tile, from a single launch's raw records
    (mokgen.profile.single_launch_kinds splits them: down tiles in claim order, M tile after M tile)."""
    from mokgen.profile import single_launch_kinds

    if params.get("wave_lag") or params.get("s_size"):
        raise ValueError("only a single launch of the routed experts' gate/up tiles, then down tiles")
    down = single_launch_kinds("launch", params, rows, 0)["launch down tiles"]  # (T sizes only shared tiles)
    per_m = params["n2_tiles"]
    return [max(r[2] for r in down[m:m + per_m]) for m in range(0, len(down), per_m)]


def tokens_ready(ids: list, done: list, tile_m: int, experts: int) -> list[float]:
    """When each token's last M tile is done: an expert's rows in (token, slot) order fill its
    M tiles, experts in order (ids < 0 are dropped slots, which hold no row)."""
    count = [0] * experts
    for row in ids:
        for e in row:
            if e >= 0:
                count[e] += 1
    first, m = [], 0
    for e in range(experts):
        first.append(m)
        m += -(-count[e] // tile_m)
    if m != len(done):
        raise ValueError(f"the routing fills {m} M tiles, the records hold {len(done)}")
    placed = [0] * experts
    ready = []
    for row in ids:
        t = float("-inf")
        for e in row:
            if e >= 0:
                t = max(t, done[first[e] + placed[e] // tile_m])
                placed[e] += 1
        ready.append(t)
    return ready


def combine_parts(tokens: int, params: dict, ctas: int, warps: int) -> int:
    """The parts of a token's row the launch makes tasks of (templates/gemm_after_tiles.py.j2)."""
    return max([1] + [p for p in params.get("combine_parts", [1]) if tokens * p <= ctas * warps])


def queue_end(ready: list, free: list, order, parts: int, task_us: float, warps: int) -> float:
    """The combine's end in the queue model: each token of `order` as `parts` tasks, each task
    to the first free warp."""
    heap = [t for t in free for _ in range(warps)]
    heapq.heapify(heap)
    end = float("-inf")
    for i in order:
        for _ in range(parts):
            t = heapq.heappop(heap)
            finish = max(t, ready[i]) + task_us
            end = max(end, finish)
            heapq.heappush(heap, finish)
    return end


def replay_claims(rows: list, params: dict, split_last: int = 0, half: float = 0.6) -> float:
    """The last tile's end (ns) when the recorded tiles are claimed again in order, each by the
    CTA free first (from its dispatch phase's end), the last split_last tiles in two halves."""
    c = params["prof_cta_rows"]
    took = [r[2] - r[1] for r in rows[2 * c:] if r[2] > 0]
    took = took[:len(took) - split_last] + [t * half for t in took[len(took) - split_last:] for _ in range(2)]
    free = [r[2] for r in rows[:c] if r[2] > 0]
    heapq.heapify(free)
    for t in took:
        heapq.heappush(free, heapq.heappop(free) + t)
    return max(free)


def analyse(case: dict, warps: int = 8, task_cost: tuple[float, float] | None = None,
            split_last: tuple[int, ...] = (), half: float = 0.6) -> dict:
    """One run at one T: the figures above, in us from the first record."""
    rows, params, ids = case["rows"], case["params"], case["ids"]
    t0 = min(r[1] for r in rows if r[2] > 0)
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731
    c = params["prof_cta_rows"]
    done = [us(t) for t in m_tiles_done(rows, params)]
    ready = tokens_ready(ids, done, params["tile_m"], case["experts"])
    last_tile = max(us(r[2]) for r in rows[2 * c:] if r[2] > 0)
    combine = [(us(r[1]), us(r[2])) for r in rows[c:2 * c] if r[2] > 0]
    end = max(e for _, e in combine)
    free = [s for s, _ in combine]
    tokens = len(ids)
    parts = combine_parts(tokens, params, c, warps)

    def model(order, task_us):
        return queue_end(ready, free, order, parts, task_us, warps) - last_tile

    fit = min((abs(model(range(tokens), k / 10) - (end - last_tile)), k / 10) for k in range(1, 400))[1]
    in_order = sorted(range(tokens), key=lambda i: ready[i])
    out = dict(tokens=tokens, parts=parts, last_tile_us=last_tile, end_us=end, after_us=end - last_tile,
               ready_before={str(x): sum(1 for t in ready if t <= last_tile - x) / tokens for x in READY_BEFORE_US},
               task_us=fit, model_token_order_after_us=model(range(tokens), fit),
               model_ready_order_after_us=model(in_order, fit))
    if task_cost:
        token_kb = len(ids[0]) * params["n2_size"] * 2 / 1024  # a token's K rows of y, bf16
        out["model_parts_after_us"] = {
            str(n): queue_end(ready, free, range(tokens), n, task_cost[0] + task_cost[1] * token_kb / n, warps)
            - last_tile for n in params.get("combine_parts", [1])}
    if split_last:
        out["replay_last_tile_us"] = {str(n): us(replay_claims(rows, params, n, half)) for n in (0, *split_last)}
    return out


def line(key: str, a: dict) -> str:
    ready = " ".join(f"{x}: {f:.0%}" for x, f in a["ready_before"].items())
    return (f"{key}: last tile {a['last_tile_us']:.1f} us, combine ends {a['end_us']:.1f} (+{a['after_us']:.1f}); "
            f"tokens ready this many us before the last tile: {ready}; model: a task ({a['parts']} a token) "
            f"{a['task_us']:.1f} us, "
            f"+{a['model_token_order_after_us']:.1f} in token order, +{a['model_ready_order_after_us']:.1f} "
            f"in the order tokens become ready" + "".join(
                f"; {n} parts a token +{x:.1f}" for n, x in a.get("model_parts_after_us", {}).items()) + "".join(
                f"; replayed claims, the last {n} down tiles split: last tile {x:.1f}"
                for n, x in a.get("replay_last_tile_us", {}).items()))


def collect(variant: str, tokens: list[int], runs: int) -> dict:
    import mokgen
    from mokgen.profile import raw_records

    v = mokgen.load(variant)
    if not v.profiling:
        raise SystemExit(f"{variant} is not a profiling build (build it with `mokgen build --profile`)")
    params = {k["name"]: k["params"] for k in v.plan["kernels"]}
    cases = {}
    for t in tokens:
        for run in range(runs):  # (routing seed = run)
            ids, raw = raw_records(v, t, "uniform", seed=run)
            kernel = next((k for k in raw if params[k].get("prof_cta_rows")), None)
            if kernel is None:
                raise SystemExit(f"{variant} serves T = {t} without the single launch")
            cases[f"T={t} run {run}"] = dict(kernel=kernel, rows=raw[kernel], ids=ids.cpu().tolist(),
                                             params=params[kernel], experts=v.spec.local_experts)
    return cases


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="profile/e64_k8_h2048_i1024_bf16_sm90a")
    ap.add_argument("--tokens", default="1024,256")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", help="write the raw records and the analysis here")
    ap.add_argument("--from-json", help="analyse the records a GPU run wrote (no GPU)")
    ap.add_argument("--task-cost", help="FIXED,PER_KB: also model each number of parts a token (us; us per KB)")
    ap.add_argument("--split-last", help="N,N,..: also replay the claims with the last N down tiles split")
    ap.add_argument("--half", type=float, default=0.6, help="a split tile's half, as a share of the tile's time")
    args = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
        assert all(t > 0 for t in tokens) and args.runs > 0
        cost = tuple(float(x) for x in args.task_cost.split(",")) if args.task_cost else None
        assert cost is None or (len(cost) == 2 and min(cost) >= 0)
        split = tuple(int(n) for n in args.split_last.split(",")) if args.split_last else ()
        assert all(n > 0 for n in split) and 0 < args.half <= 1
    except (ValueError, AssertionError):
        ap.error("--tokens: positive integers, comma-separated; --runs: positive; --task-cost: two numbers >= 0; "
                 "--split-last: positive integers; --half: in (0, 1]")
    if args.from_json:
        with open(args.from_json) as f:
            cases = json.load(f)["cases"]
    else:
        cases = collect(args.variant, tokens, args.runs)
    results = {key: analyse(case, task_cost=cost, split_last=split, half=args.half) for key, case in cases.items()}
    for key, a in results.items():
        print(line(key, a))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cases=cases, results=results), f)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
