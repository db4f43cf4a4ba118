import json

from click.testing import CliRunner

from mokgen.cli import main


def test_build_render_only_show_and_list(tmp_path):
    r = CliRunner().invoke(main, ["build", "--experts", "16", "--topk", "4", "--hidden", "512",
                                  "--intermediate", "256", "--no-compile", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    variant = "e16_k4_h512_i256_bf16_sm90a"
    assert (tmp_path / variant / "manifest.json").exists()
    assert not list(tmp_path.glob(".tmp-*"))
    r = CliRunner().invoke(main, ["list", "--out", str(tmp_path)])
    assert variant in r.output and "source only" in r.output
    r = CliRunner().invoke(main, ["show", str(tmp_path / variant)])
    assert r.exit_code == 0 and "gemm_gateup" in r.output and "decisions" in r.output
    r = CliRunner().invoke(main, ["show", str(tmp_path / variant), "--json"])
    assert json.loads(r.output)["variant"] == variant


def test_show_preset_without_building():
    r = CliRunner().invoke(main, ["show", "deepseek-v3"])
    assert r.exit_code == 0 and "shared_gateup" in r.output
    # Both forward paths, and which tasks of the planned single launch are generated.
    assert "calls with T <= 2048: gemm_fused" in r.output
    assert "from router logits (mokgen.moe_routed) with T <= 2048: gemm_fused_routed" in r.output
    assert "gemm_fused runs the count, scatter, gate/up, shared gate/up, down, shared down and combine tasks" \
        in r.output and "gemm_fused_routed (mokgen.moe_routed) the route tasks first" in r.output


def test_show_names_one_launch_per_token_band():
    r = CliRunner().invoke(main, ["show", "olmoe"])
    assert r.exit_code == 0
    # The per-GEMM launch order is the large calls'; every small call's launch is named once, by its band.
    assert "kernels (launch order of calls with T > 2048: dispatch_count" in r.output
    assert "calls with 936 <= T <= 1300: gemm_fused_n160 (from router logits: gemm_fused_n160_routed)" in r.output
    assert "calls with T <= 2048: gemm_fused\n" not in r.output and "logits (mokgen.moe_routed) with T" not in r.output
    # T ranges given to the per-GEMM path (override per_gemm_tokens, tune --paths) are named as such
    from mokgen.ir import PRESETS
    from mokgen.schedule import make_plan
    from mokgen.show import format_plan

    text = format_plan(make_plan(PRESETS["olmoe"], overrides={"per_gemm_tokens": [[1301, 2048]]}).to_dict())
    assert "launch order of calls with T > 2048 and those the bands below give it: dispatch_count" in text
    assert "calls with 1301 <= T <= 2048: the per-GEMM launches above (measured faster)" in text


def test_bad_flags_exit_2_with_one_line(tmp_path):
    for args in (["build", "--topk", "100"], ["build", "--hidden", "1000"], ["build", "--world-size", "3",
                 "--topology", "nvlink", "--experts", "10"], ["show", "no-such-variant"]):
        r = CliRunner(mix_stderr=False).invoke(main, args) if "mix_stderr" in CliRunner.__init__.__code__.co_varnames \
            else CliRunner().invoke(main, args)
        assert r.exit_code == 2, (args, r.output)


def test_console_script_formats_usage_errors(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", "from mokgen.cli import run; run()", "build", "--dtype", "fp4"],
                       capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "mokgen: error:" in p.stderr


def test_bad_token_lists_exit_2_before_any_gpu_work():
    for args in (["verify", "olmoe", "--tokens", "1,x"], ["bench", "--tokens", "-5"], ["tune", "olmoe", "--tokens", "a"],
                 ["bench", "--rounds", "0"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2, (args, r.output)


def test_verify_refuses_an_unknown_routing_before_any_gpu_work():
    r = CliRunner().invoke(main, ["verify", "olmoe", "--routing", "uniform,zipf"])
    assert r.exit_code == 2 and "'zipf' is not one of uniform, skewed, dropped" in r.output


def test_bench_refuses_an_unknown_baseline_before_any_gpu_work():
    r = CliRunner().invoke(main, ["bench", "--baselines", "torch_grouped_mm,megablocks"])
    assert r.exit_code == 2 and "unknown megablocks (choose from torch_grouped_mm, torch_loop)" in r.output


def test_verify_of_an_expert_parallel_variant_runs_a_process_per_rank(monkeypatch, tmp_path):
    """mokgen.verify_ranks under torchrun, a rank per GPU, or every rank on GPU 0 where there are
    fewer GPUs than ranks (told to the user); its exit code is verify's."""
    import subprocess

    import torch

    from mokgen import cli

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, env: calls.append((cmd, env)) or
                        subprocess.CompletedProcess(cmd, 3))
    for gpus, shares in ((8, False), (1, True)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        assert cli._verify_ranks(tmp_path / "v", 8, "1,513", "uniform,skewed", forward_only=True) == 3
        cmd, env = calls[-1]
        i = cmd.index("--nproc-per-node=8")
        assert cmd[i + 1:i + 8] == ["-m", "mokgen.verify_ranks", str((tmp_path / "v").resolve()), "--tokens", "1,513",
                                    "--routing", "uniform,skewed"]
        assert ("--share-gpu" in cmd) == shares and "--forward-only" in cmd
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_build_from_manifest(tmp_path):
    r = CliRunner().invoke(main, ["build", "--experts", "8", "--topk", "2", "--hidden", "256", "--intermediate",
                                  "128", "--no-compile", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    manifest = tmp_path / "a" / "e8_k2_h256_i128_bf16_sm90a" / "manifest.json"
    r = CliRunner().invoke(main, ["build", "--from-manifest", str(manifest), "--no-compile", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "b" / "e8_k2_h256_i128_bf16_sm90a" / "manifest.json").read_text() == manifest.read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert CliRunner().invoke(main, ["build", "--from-manifest", str(bad)]).exit_code == 2


def test_profiling_build_renders_apart_and_profile_explains_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("MOKGEN_HOME", str(tmp_path))
    args = ["--experts", "16", "--topk", "4", "--hidden", "512", "--intermediate", "256", "--no-compile"]
    assert CliRunner().invoke(main, ["build", *args]).exit_code == 0
    variant = "e16_k4_h512_i256_bf16_sm90a"
    # No profiling build yet: a clear error naming the command that makes one.
    r = CliRunner().invoke(main, ["profile", variant])
    assert r.exit_code == 1 and "mokgen build --profile" in r.output
    r = CliRunner().invoke(main, ["build", "--profile", *args])
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "profile" / variant / "manifest.json").read_text())
    assert manifest["plan"]["overrides"] == {"profile": True}
    assert any(b["name"] == "prof_gemm_gateup" for b in manifest["plan"]["buffers"])
    normal = json.loads((tmp_path / variant / "manifest.json").read_text())
    assert not any(b["name"].startswith("prof_") for b in normal["plan"]["buffers"])
    assert CliRunner().invoke(main, ["profile", variant, "--tokens", "0"]).exit_code == 2


def test_a_rank_out_of_gpu_memory_in_verify_says_what_to_pass(monkeypatch, tmp_path):
    """mokgen.verify_ranks: a rank that runs out of GPU memory exits with the reason (and torchrun
    stops the others), where every rank's workspace shares one GPU above all."""
    import types

    import pytest
    import torch

    from mokgen import verify_ranks

    class OutOfMemory:
        def __init__(self, *a):
            pass

        def forward(self, T, routing):
            raise torch.OutOfMemoryError("CUDA out of memory")

    v = types.SimpleNamespace(name="e64_k8_h2048_i1024_bf16_w8nvlink_sm90a", spec=types.SimpleNamespace(world_size=8))
    monkeypatch.setattr(verify_ranks, "init_ranks", lambda share: (3, 8))
    monkeypatch.setattr(verify_ranks, "shared_seed", lambda: 1)
    monkeypatch.setattr(verify_ranks, "RankCheck", OutOfMemory)
    monkeypatch.setattr("mokgen.runtime.load", lambda path, build: v)
    monkeypatch.setenv("MOKGEN_HOME", str(tmp_path))  # (main points it at the variant's directory)
    with pytest.raises(SystemExit) as e:
        verify_ranks.main([str(tmp_path / v.name), "--tokens", "4096", "--share-gpu"])
    assert str(e.value) == (f"{v.name} rank 3: out of GPU memory at T=4096 tokens per rank with all 8 ranks' "
                            "workspaces on one GPU: pass fewer --tokens")


def test_every_command_and_option_has_help_text():
    """`mokgen CMD --help` explains every flag: a new option without help fails here."""
    for name, cmd in main.commands.items():
        assert cmd.help, name
        for p in cmd.params:
            if p.param_type_name == "option":
                assert p.help, (name, p.opts)
