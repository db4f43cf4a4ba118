"""Build (here, no GPU needed) every variant the GPU tests and benchmarks load, so that
`generated/` can travel to a GPU machine that has no CuTe-DSL compiler.

    python benchmarks/build_gpu_variants.py [--force]
"""
import sys
from pathlib import Path

from mokgen.codegen import build, default_out
from mokgen.codegen.build import build_profiling
from mokgen.ir import PRESETS, MoESpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_golden_gpu import (BROKEN_BUILDS, FUSED_OVERRIDES, SAME_BITS_EXPERIMENTS, SHAPES, WAVE_OVERRIDES,  # noqa: E402
                             deadlock_dir, experiment_dir, fused_dir, spec_of)

force = "--force" in sys.argv
specs = [spec_of(s) for s in SHAPES]
specs += [MoESpec(**{**spec_of(s).to_dict(), "renormalize": True}) for s in SHAPES[:4]]
specs.append(MoESpec(experts=256, topk=8, hidden=7168, intermediate=2048))  # the bench's DeepSeek-V3 layer
from test_expert_parallel_gpu import EP_SHAPES, ep_spec  # noqa: E402

ep_specs = [ep_spec(s) for s in EP_SHAPES]  # expert parallel over 2 GPUs
ep_specs += [ep_spec(s, w) for w in (4, 8) for s in EP_SHAPES]  # and over 4 and 8 (ranks sharing a GPU)
ep_specs.append(ep_spec((40, 6, 1536, 640, 0)))  # benchmarks/train_demo.py under torchrun
for i, spec in enumerate(specs + ep_specs):
    print(f"[{i + 1}/{len(specs) + len(ep_specs) + 1}] {spec.variant}", flush=True)
    build(spec, default_out(), force=force, log=lambda m: None)
# 2 nodes x 1 GPU (tests/multinode_worker.py, benchmarks/multinode_bench.py): the node-local layer
# (top-K over each node's experts, the other nodes' slots empty) and the levels beside it.
build(MoESpec(**{**ep_specs[0].to_dict(), "nodes": 2}), default_out(), force=force, log=lambda m: None)
# The FP8 kernels generated so far (tests/test_fp8_gpu.py).
from test_fp8_gpu import FP8_BROKEN_BUILDS, FP8_EXPERIMENTS, FP8_SHAPES, ROWS_SHAPES, fp8_debug_dir  # noqa: E402

for E, K, H, I in FP8_SHAPES:
    fp8 = MoESpec(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8")
    build(fp8, default_out(), force=force, log=lambda m: None)
    for name, overrides in FP8_EXPERIMENTS.items():
        build(fp8, default_out() / "experiments" / name, overrides=overrides, force=force, log=lambda m: None)
for E, K, H, I in sorted(set(ROWS_SHAPES) - set(FP8_SHAPES)):  # (the rows' quantiser's golden test)
    build(MoESpec(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8"), default_out(), force=force,
          log=lambda m: None)
# FP8 debug builds with a stage that never fills (their waits must give up and report it).
for name, (overrides, *_) in FP8_BROKEN_BUILDS.items():
    E, K, H, I = FP8_SHAPES[0]
    build(MoESpec(experts=E, topk=K, hidden=H, intermediate=I, dtype="fp8"), fp8_debug_dir(name),
          overrides=overrides, force=force, log=lambda m: None)
# Each GPU's half of E64 in FP8 (tests/fp8_ep_worker.py: mokgen.moe_fp8 over 2 GPUs).
build(MoESpec(experts=32, topk=8, hidden=2048, intermediate=1024, dtype="fp8"), default_out(), force=force,
      log=lambda m: None)
# The training demo's layer in FP8 (benchmarks/train_demo.py --dtype fp8: mokgen.MoE(dtype="fp8")).
build(MoESpec(experts=40, topk=6, hidden=1536, intermediate=640, dtype="fp8"), default_out(), force=force,
      log=lambda m: None)
# The FP8 benchmark's DeepSeek-V3 layer (benchmarks/fp8_gemm.py --shape 256,8,7168,2048).
build(MoESpec(experts=256, topk=8, hidden=7168, intermediate=2048, dtype="fp8"), default_out(), force=force,
      log=lambda m: None)
# Expert parallel, the gate/up launch sending its rows itself (Plan override gemm_sends): the
# golden worker and ep_bench --variants run it from this directory (MOKGEN_HOME).
build(ep_specs[0], default_out() / "experiments" / "ep_gemm_sends", overrides={"gemm_sends": True}, force=force,
      log=lambda m: None)
# Expert parallel without the single launch (every call on the per-GEMM path): ep_bench --variants
# times it beside the default build, whose small calls run the single launch.
build(ep_specs[0], default_out() / "experiments" / "ep_multi", overrides={"fuse_gemms": False}, force=force,
      log=lambda m: None)
# The single launch's tile order: every gate/up tile first (wave lag 0), and a shorter lag than
# the default's two rounds of CTAs (ep_bench --variants); one GPU, the wavefront order in its
# fused launch (compare_experiment.py wave).
for lag in (0, 12):
    build(ep_specs[0], default_out() / "experiments" / f"ep_lag{lag}", overrides={"gemm_fused.wave_lag": lag},
          force=force, log=lambda m: None)
# The single launch after the dispatch, publish and layout kernels (ep_bench --variants).
build(ep_specs[0], default_out() / "experiments" / "ep_apart", overrides={"dispatch_in_launch": False}, force=force,
      log=lambda m: None)
# The single launch that also waits for the returned rows and combines them.
build(ep_specs[0], default_out() / "experiments" / "ep_fused_combine", overrides={"ep_fused_combine": True},
      force=force, log=lambda m: None)
for shape in (SHAPES[0], SHAPES[3]):
    build(spec_of(shape), default_out() / "experiments" / "wave", overrides=WAVE_OVERRIDES, force=force,
          log=lambda m: None)
# Without the single launch's bands by T (the plain 128-row launch down to T = 1): compare_experiment.py
# nosmall times the default build's bands against it.
for spec in [spec_of(s) for s in (SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[3])] + specs[-1:]:
    build(spec, default_out() / "experiments" / "nosmall", overrides={"fused_small": False}, force=force,
          log=lambda m: None)
# Without weight pairs (the 64-row tiles' weights one K block at a time): compare_experiment.py
# nopairs times the default build's pairs against it.
for spec in (spec_of(SHAPES[0]), MoESpec(experts=128, topk=8, hidden=2048, intermediate=768)):
    build(spec, default_out() / "experiments" / "nopairs", overrides={"weight_pairs": False}, force=force,
          log=lambda m: None)
# The single launch as before the early combine and the status mirrored by its last CTA (the
# combine after every down tile, a status_mirror launch behind it): compare_experiment.py late.
for spec in (spec_of(SHAPES[0]), MoESpec(experts=40, topk=6, hidden=1536, intermediate=640),
             MoESpec(experts=128, topk=8, hidden=2048, intermediate=768)):
    build(spec, default_out() / "experiments" / "late", overrides={"combine_early": False, "mirror_status": False},
          force=force, log=lambda m: None)
# The swapped tiles' combine without its L2 discards (discard_consumed false), with each part of the
# combine's alone, and with h's lines dropped by the combine in every band (by default the bands of 96
# rows and more have the M tile's last down tile drop them): compare_experiment.py nodiscard,discard_rows,
# discard_pad,h_by_combine.
e40 = MoESpec(experts=40, topk=6, hidden=1536, intermediate=640)
for name, overrides, layers in (("nodiscard", {"discard_consumed": False}, (spec_of(SHAPES[0]), e40)),
                                ("discard_rows", {"discard_what": "rows"}, (spec_of(SHAPES[0]),)),
                                ("discard_pad", {"discard_what": "padding"}, (spec_of(SHAPES[0]),)),
                                ("h_by_combine", {"discard_h_early": False}, (spec_of(SHAPES[0]), e40))):
    for spec in layers:
        build(spec, default_out() / "experiments" / name, overrides=overrides, force=force, log=lambda m: None)
print(f"[{len(specs) + len(ep_specs) + 1}/{len(specs) + len(ep_specs) + 1}] debug variants with an injected deadlock or broken dependency; profiling builds", flush=True)
for name, (overrides, *_) in BROKEN_BUILDS.items():
    build(spec_of(SHAPES[0]), deadlock_dir(name), overrides=overrides, force=force, log=lambda m: None)
for shape in (SHAPES[0], SHAPES[4]):
    build_profiling(spec_of(shape), force=force, log=lambda m: None)
# The fused-launch experiment, and the layers with a shared expert it is benchmarked on.
shared_layers = [PRESETS["deepseek-v2-lite"], PRESETS["deepseek-v3"]]
for spec in shared_layers:
    build(spec, default_out(), force=force, log=lambda m: None)
for spec in [spec_of(s) for s in (SHAPES[0], SHAPES[3], SHAPES[4])] + shared_layers:
    build(spec, fused_dir(), overrides=FUSED_OVERRIDES, force=force, log=lambda m: None)
# The same-bits experiments: tested on three shapes, benchmarked on the bench's three (and, for the
# late claims and the per-GEMM path, on Mixtral, where the single launch loses at T = 298-467).
for name, overrides in SAME_BITS_EXPERIMENTS.items():
    for spec in [spec_of(s) for s in (SHAPES[0], SHAPES[1], SHAPES[3], SHAPES[4])] + specs[-1:] \
            + (shared_layers if name == "multi" else []) \
            + ([spec_of(SHAPES[2])] if name in ("multi", "claim_late") else []):
        build(spec, experiment_dir(name), overrides=overrides, force=force, log=lambda m: None)
