"""The mokgen command line: build, list, show, verify, bench.

The CLI composes the library's layers and has no logic of its own. Bad flags and
illegal specs exit with code 2 and a one-line reason.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import click

from . import __version__
from .ir import DEFAULT_PRESET, PRESETS, MoESpec, SpecError
from .ir.spec import ARCHS, DTYPES, TOPOLOGIES


def fail(msg: str, code: int = 2):
    click.echo(f"mokgen: error: {msg}", err=True)
    sys.exit(code)


def parse_tokens(text: str) -> list[int]:
    """--tokens: comma-separated non-negative integers."""
    try:
        toks = [int(t) for t in text.split(",")]
    except ValueError:
        fail(f"--tokens must be comma-separated integers, got {text!r}")
    if any(t < 0 for t in toks):
        fail(f"--tokens must be non-negative, got {text!r}")
    return toks


def spec_options(fn):
    """Every MoESpec field as a flag; unset flags take the preset's value."""
    opts = [
        click.option("--preset", type=click.Choice(sorted(PRESETS)), default=None,
                     help=f"Start from a named layer (default: {DEFAULT_PRESET})."),
        click.option("--experts", type=int, help="Number of routed experts E."),
        click.option("--topk", type=int, help="Experts per token K."),
        click.option("--hidden", type=int, help="Hidden size H (multiple of 64)."),
        click.option("--intermediate", type=int, help="Expert intermediate size I (multiple of 64)."),
        click.option("--shared-intermediate", type=int, help="Shared-expert intermediate size (0: none)."),
        click.option("--dtype", type=click.Choice(DTYPES), help="Data type."),
        click.option("--world-size", type=int, help="GPUs in the expert-parallel group."),
        click.option("--topology", type=click.Choice(TOPOLOGIES), help="How the GPUs are linked."),
        click.option("--nodes", type=int, help="Nodes the GPUs are in (> 1: tokens cross between nodes through "
                                                "NCCL, inside a node through the topology)."),
        click.option("--arch", type=click.Choice(ARCHS), help="Target architecture."),
        click.option("--renormalize/--no-renormalize", default=None, help="Renormalise the router's top-k weights."),
    ]
    for o in reversed(opts):
        fn = o(fn)

    @functools.wraps(fn)
    def wrapper(*args, preset, **kw):
        fields = {f.name for f in dataclasses.fields(MoESpec)}
        given = {k: v for k, v in kw.items() if k in fields and v is not None}
        rest = {k: v for k, v in kw.items() if k not in fields}
        base = PRESETS[preset or DEFAULT_PRESET]
        try:
            spec = dataclasses.replace(base, **given)
        except SpecError as e:
            fail(str(e))
        return fn(*args, spec=spec, **rest)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mokgen")
def main():
    """mokgen: generate fused Mixture-of-Experts kernels (CuTe-DSL, Hopper) for one exact layer."""


@main.command()
@spec_options
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Variants directory (default: $MOKGEN_HOME or the source tree's generated/).")
@click.option("--jobs", "-j", type=int, default=None, help="Parallel compile processes.")
@click.option("--force", is_flag=True, help="Rebuild even if up to date, compiling every kernel (no artifacts reused).")
@click.option("--no-compile", is_flag=True, help="Render the source only (no CuTe-DSL needed).")
@click.option("--from-manifest", "manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Build the spec recorded in a variant's manifest.json (other spec flags ignored).")
@click.option("--profile", is_flag=True,
              help="Profiling build (under <out>/profile): every task records its SM and times for `mokgen profile`.")
@click.option("--comm-sms", type=int, default=None,
              help="Expert parallel: SMs of the forward's send beside the gate/up GEMM (default: the cost model's; "
                   "Plan overrides bwd_send_sms and bwd_return_sms set the backward's).")
def build(spec, out, jobs, force, no_compile, manifest, profile, comm_sms):
    """Plan, render and compile one MoE layer. With no flags: the OLMoE-1B-7B layer."""
    from .codegen import BuildError, build as do_build
    from .codegen.build import build_profiling
    from .schedule import PlanError

    if manifest:
        try:
            spec = MoESpec.from_dict(json.loads(manifest.read_text())["spec"])
        except (KeyError, ValueError) as e:
            fail(f"{manifest} is not a mokgen manifest: {e}")

    kw = {}
    if comm_sms is not None:
        if spec.world_size == 1:
            fail("--comm-sms needs --world-size > 1 (it sizes the expert-parallel send and return kernels)")
        if profile:
            fail("--comm-sms and --profile together are not supported")
        from .codegen import default_out
        from .codegen.build import resolve_plan

        try:
            kw["overrides"] = {**resolve_plan(spec, out or default_out()).overrides, "comm_sms": comm_sms}
        except (PlanError, SpecError) as e:
            fail(str(e))
    try:
        path = (build_profiling if profile else do_build)(spec, out, jobs=jobs, force=force, compile=not no_compile,
                                                          **kw)
    except (PlanError, SpecError) as e:
        fail(str(e))
    except BuildError as e:
        fail(str(e), code=1)
    click.echo(str(path))


@main.command("list")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Variants directory (default: $MOKGEN_HOME or the source tree's generated/).")
def list_(out):
    """Variants on disk and whether they are compiled."""
    from .codegen import default_out, is_built

    root = out or default_out()
    rows = sorted(p.parent for p in [*root.glob("*/manifest.json"), *root.glob("*/hierarchy.json")])
    if not rows:
        click.echo(f"no variants in {root}")
        return
    for p in rows:
        if (p / "hierarchy.json").exists():  # a layer over several nodes: its node-local layer is built or not
            levels = json.loads((p / "hierarchy.json").read_text())
            s, h = levels["spec"], levels["hierarchy"]
            state = f"{h['nodes']} nodes x {h['gpus_per_node']} GPU(s), node-local {levels['node_local']} " + (
                "built" if is_built(p.parent / levels["node_local"]) else "source only")
        else:
            s = json.loads((p / "manifest.json").read_text())["spec"]
            state = "built" if is_built(p) else "source only"
        click.echo(f"{p.name:40s} E={s['experts']:<4d} K={s['topk']:<3d} H={s['hidden']:<6d} "
                   f"I={s['intermediate']:<6d} S={s['shared_intermediate']:<5d} {state}")


def _resolve_variant(name: str) -> Path:
    from .codegen import default_out

    p = Path(name)
    if (p / "manifest.json").exists() or (p / "hierarchy.json").exists():
        return p
    p = default_out() / name
    if (p / "manifest.json").exists() or (p / "hierarchy.json").exists():
        return p
    if name in PRESETS:
        return default_out() / PRESETS[name].variant
    fail(f"no variant {name!r} (see `mokgen list`, or build it with `mokgen build`)")


@main.command()
@click.argument("variant")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--png", "png", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also draw the SM roles and the predicted task timeline of the fused forward.")
@click.option("--tokens", "png_tokens", type=int, default=4096, show_default=True, help="T for --png.")
def show(variant, as_json, png, png_tokens):
    """Print a variant's Plan as a readable table (VARIANT: name, directory or preset)."""
    from .schedule import make_plan

    path = _resolve_variant(variant)
    if (path / "hierarchy.json").exists():  # a layer over several nodes: its levels, then its node-local layer
        from .schedule.multinode import describe

        levels = json.loads((path / "hierarchy.json").read_text())
        if as_json:
            click.echo(json.dumps(levels, indent=1, sort_keys=True))
            return
        click.echo(describe(levels["hierarchy"]))
        click.echo(f"\nnode-local layer ({levels['node_local']}):")
        path = path.parent / levels["node_local"]
        if not (path / "manifest.json").exists():
            fail(f"the node-local layer {levels['node_local']} is not built: run `mokgen build` again", code=1)
    if (path / "manifest.json").exists():
        plan = json.loads((path / "manifest.json").read_text())["plan"]
    else:
        plan = make_plan(PRESETS[variant]).to_dict()
    if as_json:
        click.echo(json.dumps(plan, indent=1, sort_keys=True))
        return
    from .show import format_plan

    click.echo(format_plan(plan))
    if png:
        if not plan.get("task_graph"):
            fail(f"{variant} was planned by an older mokgen (no task graph): rebuild it with `mokgen build`", code=1)
        try:
            from .show import draw_schedule
        except ImportError:
            fail("--png needs matplotlib (pip install matplotlib)", code=1)
        if png_tokens < 1:
            fail("--tokens must be at least 1")
        click.echo(f"wrote {draw_schedule(plan, png, png_tokens)}")


@main.command()
@click.argument("variant")
@click.option("--tokens", type=int, default=4096, show_default=True,
              help="Token count T of the profiled forward; it runs the path the Plan takes at this T (at small T "
                   "the single launch, whose dispatch and combine phases are tasks too).")
@click.option("--routing", type=click.Choice(["uniform", "skewed"]), default="uniform", show_default=True,
              help="The routing drawn for the profiled call: uniform, or skewed (half of the experts empty, one "
                   "expert in every token).")
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path), default=Path("profile.png"), show_default=True,
              help="Where to draw the per-SM timeline.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the task records and the summary as JSON.")
def profile(variant, tokens, routing, png, json_path):
    """The real device timeline of one forward: per-task SM and times from a profiling
    build (`mokgen build --profile`), per-kernel spans, idle SM time, and a PNG per SM."""
    import torch

    from .codegen.build import profile_dir
    from .profile import run as run_profile
    from .runtime import Variant, VariantNotBuilt

    if tokens < 1:
        fail("--tokens must be at least 1")
    name = _resolve_variant(variant).name
    path = profile_dir() / name
    if not (path / "manifest.json").exists():
        fail(f"no profiling build of {name}: run `mokgen build --profile --from-manifest "
             f"{_resolve_variant(variant) / 'manifest.json'}` where nvidia-cutlass-dsl is installed", code=1)
    if not torch.cuda.is_available():
        fail("profile needs a CUDA GPU", code=1)
    try:
        v = Variant(path)
    except VariantNotBuilt as e:
        fail(str(e), code=1)
    run_profile(v, tokens, routing, png, json_path, log=click.echo)


@main.command()
@click.argument("variant")
@click.option("--tokens", default="1,7,1000,4096", help="Comma-separated token counts.")
@click.option("--routing", default="uniform,skewed", help="Comma-separated: uniform, skewed, dropped (empty slots).")
@click.option("--forward-only", is_flag=True, help="Check the forward only.")
def verify(variant, tokens, routing, forward_only):
    """Golden-test a built variant on the GPU against the float64 reference: the forward,
    and every gradient of the backward where the variant has one (an FP8 variant: its forward
    and every gradient of its training path against the float64 emulation of the same
    quantisation). A backward whose float64 reference would not fit in the GPU's free memory
    (E256 K8 H7168 I2048's weights alone take 90 GB in float64) is reported as not checked."""
    import torch

    from . import load
    from .verify import (ROUTINGS, TOLERANCE, check_backward, check_backward_fp8, check_forward, check_forward_fp8,
                         free_gpu_bytes, reference_backward_bytes)

    toks = parse_tokens(tokens)
    routings = [r.strip() for r in routing.split(",")]
    if unknown := [r for r in routings if r not in ROUTINGS]:
        fail(f"--routing: {', '.join(map(repr, unknown))} is not one of {', '.join(ROUTINGS)}")
    if not torch.cuda.is_available():
        fail("verify needs a CUDA GPU", code=1)
    path = _resolve_variant(variant)
    if (path / "hierarchy.json").exists():
        fail(f"{path.name} is a layer across nodes: verify its node-local variant (named in "
             f"{path / 'hierarchy.json'}); tests/multinode_worker.py checks the levels under torchrun", code=1)
    v = load(path)
    if v.spec.world_size > 1:
        sys.exit(_verify_ranks(path, v.spec.world_size, tokens, ",".join(routings), forward_only))
    bad = unchecked = 0
    for r in routings:
        for T in toks:
            fp8 = v.spec.dtype == "fp8"  # (against its float64 emulation: mokgen/fp8.py)
            res = (check_forward_fp8 if fp8 else check_forward)(v, T, r.strip())
            bad += not res.ok
            click.echo(f"{v.name} T={T:<6d} {r:8s} forward  rel_err={res.rel_error:.3e}{' vs emulation' if fp8 else ''} "
                       f"{'unwritten rows ' if res.unwritten else ''}{'ok' if res.ok else 'FAIL'}")
            if forward_only or not (v.has_backward or "backward_fp8" in v.plan["steps"]):
                continue
            # (an FP8 backward's reference is its float64 emulation, checked without this bound)
            need = 0 if fp8 else reference_backward_bytes(v.spec, T)
            if need and need > (free := free_gpu_bytes()):
                unchecked += 1
                click.echo(f"{v.name} T={T:<6d} {r:8s} backward NOT CHECKED: its float64 reference needs about "
                           f"{need / 2**30:.0f} GiB of GPU memory, {free / 2**30:.0f} GiB free")
                continue
            b = (check_backward_fp8 if fp8 else check_backward)(v, T, r.strip())
            bad += not b.ok
            worst = max(b.rel_errors, key=b.rel_errors.get)
            click.echo(f"{v.name} T={T:<6d} {r:8s} backward worst rel_err={b.rel_errors[worst]:.3e} ({worst}) "
                       f"{'unwritten: ' + ','.join(b.unwritten) + ' ' if b.unwritten else ''}"
                       f"{'ok' if b.ok else 'FAIL'}")
    from .fp8 import REQUANTIZED_TOLERANCE

    tolerance = REQUANTIZED_TOLERANCE if v.spec.dtype == "fp8" else TOLERANCE
    click.echo(f"{'all passed' if not bad else f'{bad} failed'} (tolerance {tolerance})"
               + (f"; {unchecked} backward checks not run (their float64 reference does not fit)" if unchecked else ""))
    sys.exit(1 if bad else 0)


def _verify_ranks(path: Path, world: int, tokens: str, routing: str, forward_only: bool) -> int:
    """`mokgen verify` of an expert-parallel variant: mokgen.verify_ranks under torchrun, one
    process per rank, a rank per GPU, or every rank on GPU 0 where there are fewer GPUs (the GPU
    time-slices them: the results are checked, not the speed). Returns its exit code."""
    import os
    import subprocess

    import torch

    share = torch.cuda.device_count() < world
    if share:
        click.echo(f"{path.name}: {world} ranks, {torch.cuda.device_count()} GPU(s) here: every rank on GPU 0, "
                   "time-sliced (this checks the results, not the speed)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "mokgen.verify_ranks", str(path.resolve()), "--tokens", tokens, "--routing", routing]
    cmd += ["--forward-only"] * forward_only + ["--share-gpu"] * share
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # (no NVLink multicast: the layer does not use it)
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    return subprocess.run(cmd, env=env).returncode


@main.command()
@click.argument("variant")
@click.option("--prepare", is_flag=True, help="Build the candidates (needs nvidia-cutlass-dsl, no GPU).")
@click.option("--tokens", default="4096,16384", help="Comma-separated token counts to time (GPU step).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Variants directory, whose tuning/ holds the candidates and the record (default: $MOKGEN_HOME "
                   "or the source tree's generated/).")
@click.option("--fresh", is_flag=True,
              help="Time every candidate again (by default a stopped run resumes after the candidates it timed).")
@click.option("--paths", is_flag=True,
              help="(GPU) Time the single launch against the per-GEMM path across its bands of T in the built "
                   "variant, record the T the per-GEMM path serves faster on this GPU model (a record per model), and "
                   "rebuild (the manifest only) to apply it.")
def tune(variant, prepare, tokens, out, fresh, paths):
    """Autotune a variant: --prepare builds candidate Plans, then (on the GPU) time them
    and record the winner; the next `mokgen build` applies it. --paths (on the GPU, after
    either) chooses, per band of T, between the single launch and the per-GEMM path."""
    from .codegen import default_out
    from .schedule.records import PlanError
    from .tune import prepare as do_prepare, run as do_run, run_paths

    out = out or default_out()
    path = _resolve_variant(variant)
    spec = MoESpec.from_dict(json.loads((path / "manifest.json").read_text())["spec"]) \
        if (path / "manifest.json").exists() else PRESETS[variant]
    if prepare and paths:
        fail("--paths times the built variant on the GPU: nothing to prepare", code=2)
    if prepare:
        do_prepare(spec, out, log=click.echo)
        click.echo(f"prepared; now run `mokgen tune {spec.variant}` on the GPU")
        return
    import torch

    toks = parse_tokens(tokens)
    if not torch.cuda.is_available():
        fail("tuning needs a CUDA GPU (use --prepare to build the candidates here)", code=1)
    try:
        if not paths:
            do_run(spec, out, toks, log=click.echo, fresh=fresh)
            return
        run_paths(spec, out, log=click.echo)
    except (FileNotFoundError, PlanError) as e:
        fail(str(e), code=1)
    from .codegen import build

    try:  # (the same kernels: the build finds them current and rewrites the manifest's Plan)
        build(spec, out, log=click.echo)
    except ImportError as e:
        fail(f"recorded, not applied: {e}; run `mokgen build` for {spec.variant} where nvidia-cutlass-dsl is "
             "installed", code=1)


@main.command()
@spec_options
@click.option("--variant", "variant_name", default=None, help="Bench a built variant instead of --preset/flags.")
@click.option("--tokens", default="4096,16384", help="Comma-separated token counts.")
@click.option("--baselines", default="torch_grouped_mm,torch_loop",
              help="Comma-separated forward baselines to run: torch_grouped_mm, torch_loop (--backward always runs "
                   "torch grouped_mm with autograd).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("bench-out/bench.json"), show_default=True,
              help="Where the rows go, rewritten after every T (\"complete\": false until the run ends, so a "
                   "stopped run keeps what it measured); the plot beside it as .png.")
@click.option("--backward", is_flag=True,
              help="Time forward + backward through autograd against torch grouped_mm with autograd.")
@click.option("--rounds", type=click.IntRange(min=1), default=None,
              help="Rounds each implementation is timed in, the order rotating every round, the best kept (at "
                   "the power cap the one run second follows the first's heat). Default: mokgen.bench.BENCH_ROUNDS.")
def bench(spec, variant_name, tokens, baselines, json_path, backward, rounds):
    """Time the generated forward (or, with --backward, forward + backward) against torch
    grouped_mm and the per-expert loop. An FP8 variant (--dtype fp8) times mokgen.moe_fp8
    (with --backward, mokgen.moe_fp8_train); benchmarks/fp8_gemm.py sets it beside the bf16
    layer."""
    import torch

    from . import load
    from .bench import BASELINES, BENCH_ROUNDS, run

    toks = parse_tokens(tokens)
    names = tuple(b.strip() for b in baselines.split(",") if b.strip())
    unknown = [b for b in names if b not in BASELINES]
    if unknown:
        fail(f"--baselines: unknown {', '.join(unknown)} (choose from {', '.join(BASELINES)})")
    if not torch.cuda.is_available():
        fail("bench needs a CUDA GPU", code=1)
    v = load(_resolve_variant(variant_name)) if variant_name else load(spec)
    if backward and not v.has_backward and v.spec.dtype != "fp8":
        fail(f"{v.name}: {v.why_no_backward()}", code=1)
    run([v], toks, json_path, names, log=click.echo, backward=backward,
        rounds=rounds or BENCH_ROUNDS)




def run():
    """Console entry point: click's usage errors become one line and exit code 2."""
    try:
        rv = main(standalone_mode=False)
    except click.UsageError as e:
        hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx else ""
        fail(f"{e.format_message()}{hint}")
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        fail(e.format_message(), code=e.exit_code)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    run()
