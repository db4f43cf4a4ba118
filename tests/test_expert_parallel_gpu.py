"""Golden tests of the expert-parallel layer (tests/ep_worker.py under torchrun): a rank per GPU
on GPUs linked by NVLink, and at N = 4 and 8 with the ranks sharing one GPU where there are fewer.

They need the variants built (benchmarks/build_gpu_variants.py builds them); elsewhere they skip.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mokgen.ir import MoESpec

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

WORLD = 2
# (experts, topk, hidden, intermediate, shared intermediate): the bench layer, and a small one
# with a shared expert and odd sizes.
EP_SHAPES = [(64, 8, 2048, 1024, 0), (16, 4, 1024, 512, 512)]


def ep_spec(shape, world=WORLD):
    E, K, H, I, S = shape
    return MoESpec(experts=E, topk=K, hidden=H, intermediate=I, shared_intermediate=S, world_size=world,
                   topology="nvlink")


def shape_id(shape) -> str:
    return "e{}_k{}_h{}_i{}_s{}".format(*shape)


def gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# Every world size with its variants built runs where the GPUs are there (2 here; 4 and 8 are
# planned and compiled by the CPU tests).
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("shape", EP_SHAPES, ids=shape_id)
def test_expert_parallel_golden(shape, world):
    if gpus() < world:
        pytest.skip(f"needs {world} GPUs")
    from mokgen.runtime import variants_root

    if not (variants_root() / ep_spec(shape, world).variant / "build").is_dir():
        pytest.skip(f"{ep_spec(shape, world).variant} is not built (benchmarks/build_gpu_variants.py)")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", str(root / "tests" / "ep_worker.py"),
           "--shape", ",".join(map(str, shape))]
    if shape != EP_SHAPES[0]:
        cmd += ["--tokens", "1,513,2048", "--no-timeout-case"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=root)
    print(r.stdout[-6000:], r.stderr[-3000:])
    assert r.returncode == 0 and "EP golden: PASS" in r.stdout


# The same worker with more ranks than GPUs: every rank on GPU 0, the group over gloo and the peer
# buffers mapped by CUDA IPC (MOKGEN_TEST_RANKS_SHARE_GPU=1). The GPU time-slices the ranks'
# processes, so this proves the generated exchange right at N = 4 and 8 where one GPU is all
# there is; what it costs needs a GPU per rank (benchmarks/ep_bench.py).
@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("shape", EP_SHAPES, ids=shape_id)
def test_expert_parallel_golden_with_ranks_sharing_one_gpu(shape, world):
    if gpus() == 0:
        pytest.skip("needs a GPU")
    if gpus() >= world:
        pytest.skip(f"{world} GPUs here: test_expert_parallel_golden runs a rank on each")
    from mokgen.runtime import variants_root

    if not (variants_root() / ep_spec(shape, world).variant / "build").is_dir():
        pytest.skip(f"{ep_spec(shape, world).variant} is not built (benchmarks/build_gpu_variants.py)")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, MOKGEN_TEST_RANKS_SHARE_GPU="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
           str(root / "tests" / "ep_worker.py"), "--shape", ",".join(map(str, shape)),
           "--tokens", "1,513,2048", "--grad-tokens", "1,513", "--no-timeout-case"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=root)
    print(r.stdout[-6000:], r.stderr[-3000:])
    assert r.returncode == 0 and "EP golden: PASS" in r.stdout


@pytest.mark.parametrize("world", [2, 4])
def test_mokgen_verify_checks_an_expert_parallel_variant_over_its_ranks(world):
    """`mokgen verify` of an expert-parallel build: a process per rank (every rank on GPU 0 where
    there are fewer GPUs), each rank's output and gradients against float64, every expert."""
    if gpus() == 0:
        pytest.skip("needs a GPU")
    from mokgen.runtime import variants_root

    path = variants_root() / ep_spec(EP_SHAPES[1], world).variant
    if not (path / "build").is_dir():
        pytest.skip(f"{path.name} is not built (benchmarks/build_gpu_variants.py)")
    r = subprocess.run([sys.executable, "-m", "mokgen.cli", "verify", str(path), "--tokens", "0,1,513",
                        "--routing", "uniform,skewed,dropped"], capture_output=True, text=True, timeout=240,
                       cwd=Path(__file__).resolve().parents[1])
    print(r.stdout[-6000:], r.stderr[-3000:])
    assert r.returncode == 0 and f"all passed on {world} ranks" in r.stdout
    # every rank, every case, forward and backward
    assert r.stdout.count(" ok") == world * 3 * 3 * 2


def test_ranks_sharing_a_gpu_over_symmetric_memory_are_refused_with_the_reason():
    """Two ranks on GPU 0 without MOKGEN_PEER_MEMORY=ipc: both raise InputError at their first
    call, naming the ranks, before any buffer is made (not torch's own error from inside the
    symmetric-memory rendezvous)."""
    if gpus() == 0:
        pytest.skip("needs a GPU")
    from mokgen.runtime import variants_root

    shape = EP_SHAPES[1]
    if not (variants_root() / ep_spec(shape).variant / "build").is_dir():
        pytest.skip(f"{ep_spec(shape).variant} is not built (benchmarks/build_gpu_variants.py)")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, MOKGEN_TEST_RANKS_SHARE_GPU="1", MOKGEN_PEER_MEMORY="symmetric", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", str(root / "tests" / "ep_worker.py"),
           "--shape", ",".join(map(str, shape)), "--tokens", "1", "--grad-tokens", "1", "--no-timeout-case"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=root)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "InputError" in out and "ranks 0 and 1 of the group are on the same GPU" in out, out[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_weights_on_another_gpu_are_refused_before_launch():
    import mokgen
    from mokgen.runtime import InputError

    x = torch.randn(8, 1024, device="cuda:0").bfloat16()
    ids = torch.zeros(8, 4, dtype=torch.int32, device="cuda:0")
    w = torch.full((8, 4), 0.25, device="cuda:0")
    wg = torch.randn(16, 512, 1024, device="cuda:1").bfloat16()
    with pytest.raises(InputError, match="cuda:1.*all inputs must be on one GPU"):
        mokgen.moe(x, ids, w, wg, wg.clone(), torch.randn(16, 1024, 512, device="cuda:1").bfloat16())
