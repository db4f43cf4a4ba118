"""One call of one path, bracketed for Nsight Compute: what a launch moves and where.

    ncu --profile-from-start off --clock-control none --print-units base --csv \\
        --metrics $(python benchmarks/ncu_call.py --metrics) \\
        python benchmarks/ncu_call.py [--variant V] [--path one_launch|multi|apart|train] [--tokens T] [--build NAME]
    python benchmarks/ncu_call.py --summary FILE.csv   # per kernel: time, bytes, TB/s

The call is made three times first (loads, workspace, L2 state like a steady stream of calls);
only the fourth runs between cudaProfilerStart and cudaProfilerStop, so `--profile-from-start
off` profiles that call's kernels alone. Routing as `small_t.py`'s (router logits, seeded by T).
`train` is the training step: autograd's forward (forward_train) and the backward it saves for.
`--build NAME` runs the experiment build NAME (benchmarks/build_gpu_variants.py) of the variant
for one_launch or train.
`METRICS` is the list `gpu_session.sh ncu` passes; `--summary` reads ncu's CSV back and prints
each kernel's duration, DRAM and L2 bytes, the bytes delivered from L2 into the SMs and their
rate, the tensor pipe's activity, and the bytes across the fabric between the L2's two
partitions with how busy it was.
"""
import argparse
import csv
import sys

METRICS = ",".join([
    "gpu__time_duration.sum",
    "sm__cycles_elapsed.avg.per_second",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_bytes.sum",
    "l1tex__m_xbar2l1tex_read_bytes.sum",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    # the fabric between the L2's two partitions: it carries the lines homed in the far one, about
    # half of a weight stream from DRAM, and is what bounds the single launch (docs/perf.md)
    "lts__ltcfabric2ltc_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sectors_srcunit_ltcfabric.sum",
])
SECTOR = 32  # bytes

# ncu's units to bytes, seconds and Hz (--print-units base gives byte, ns and hz; the others are
# what it prints without that flag)
UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "ns": 1e-9, "us": 1e-6, "ms": 1e-3,
         "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "hz": 1.0, "Khz": 1e3, "Mhz": 1e6, "Ghz": 1e9,
         "cycle/nsecond": 1e9, "%": 1.0, "sector": 1.0}


def summary(path: str) -> None:
    """Print one line per profiled kernel from ncu's --csv output (one row per metric)."""
    kernels: dict = {}
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu's own log lines come first
    if not lines:
        sys.exit(f"{path}: no metric rows (did ncu profile a kernel? its log says why not)")
    for row in csv.DictReader(lines):
        k = kernels.setdefault(row["ID"], {"name": row["Kernel Name"][:48]})
        value = row["Metric Value"].replace(",", "")
        unit = row["Metric Unit"]
        if unit not in UNITS:
            sys.exit(f"{path}: unit {unit!r} of {row['Metric Name']} is not one this summary knows")
        k[row["Metric Name"]] = float(value) * UNITS[unit]
    print(f"{'kernel':48s} {'us':>8s} {'MHz':>6s} {'DRAM MB':>8s} {'L2 MB':>8s} {'into SMs MB':>11s} "
          f"{'TB/s':>6s} {'tensor %':>8s} {'fabric MB':>9s} {'fabric %':>8s}")
    total = {"t": 0.0, "dram": 0.0, "l2": 0.0, "xbar": 0.0, "fabric": 0.0}
    for k in kernels.values():
        t = k.get("gpu__time_duration.sum", 0.0)
        dram = k.get("dram__bytes_read.sum", 0.0) + k.get("dram__bytes_write.sum", 0.0)
        l2, xbar = k.get("lts__t_bytes.sum", 0.0), k.get("l1tex__m_xbar2l1tex_read_bytes.sum", 0.0)
        fabric = k.get("lts__t_sectors_srcunit_ltcfabric.sum", 0.0) * SECTOR
        for key, v in zip(total, (t, dram, l2, xbar, fabric)):
            total[key] += v
        print(f"{k['name']:48s} {t * 1e6:8.1f} {k.get('sm__cycles_elapsed.avg.per_second', 0) / 1e6:6.0f} "
              f"{dram / 1e6:8.1f} {l2 / 1e6:8.1f} {xbar / 1e6:11.1f} {xbar / max(t, 1e-12) / 1e12:6.2f} "
              f"{k.get('sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active', 0):8.1f} "
              f"{fabric / 1e6:9.1f} {k.get('lts__ltcfabric2ltc_cycles_active.avg.pct_of_peak_sustained_elapsed', 0):8.1f}")
    t = total["t"]
    print(f"{'all':48s} {t * 1e6:8.1f} {'':6s} {total['dram'] / 1e6:8.1f} {total['l2'] / 1e6:8.1f} "
          f"{total['xbar'] / 1e6:11.1f} {total['xbar'] / max(t, 1e-12) / 1e12:6.2f} {'':8s} {total['fabric'] / 1e6:9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="e64_k8_h2048_i1024_bf16_sm90a")
    ap.add_argument("--path", default="one_launch", choices=("one_launch", "multi", "apart", "train"))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--build", metavar="NAME", help="profile this experiment build (one_launch or train)")
    ap.add_argument("--summary", metavar="CSV", help="summarise ncu's --csv output instead of running")
    ap.add_argument("--metrics", action="store_true", help="print the metric list for ncu and exit")
    args = ap.parse_args()
    if args.build and args.path not in ("one_launch", "train"):
        ap.error("--build goes with --path one_launch or train (the other paths are experiment builds themselves)")
    if args.metrics:
        print(METRICS)
        return
    if args.summary:
        summary(args.summary)
        return

    import torch

    import mokgen
    from mokgen.bench import experiment_build
    from mokgen.verify import make_inputs

    plain = mokgen.load(args.variant)
    build = args.path if args.path in ("multi", "apart") else args.build  # (those paths are experiment builds)
    v = experiment_build(build, args.variant) if build else plain
    T = args.tokens
    gen = torch.Generator("cuda").manual_seed(T)
    x, ids, w, wg, wu, wd, shared = make_inputs(v.spec, T, "uniform", gen)
    logits = torch.randn(T, v.spec.experts, device="cuda", generator=gen)
    ids, w = plain.route(logits)  # the routing small_t.py gives every path

    def call():
        if args.path != "train":
            return v.forward(x, ids, w, wg, wu, wd, *shared)
        out, *saved = v.forward_train(x, ids, w, wg, wu, wd, *shared)
        return v.backward(dout, x, ids, w, wg, wu, wd, *shared, saved=saved)

    dout = torch.randn(T, v.spec.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    v.check_errors()
    print(f"profiled one {args.path} call of {args.variant} at T={T}", file=sys.stderr)


if __name__ == "__main__":
    main()
