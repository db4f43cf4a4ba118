"""Golden tests of the layer over 2 nodes x 1 GPU (tests/multinode_worker.py under torchrun):
two GPUs whose tokens cross through NCCL, as between nodes; and of its levels over 1 node x 2
GPUs (the node-local megakernel over both). They need two GPUs (or, for correctness only, both
ranks on one) and the node-local layer built (benchmarks/build_gpu_variants.py); elsewhere they
skip."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mokgen.ir import MoESpec
from mokgen.schedule.multinode import node_local_spec

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

SPEC = MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024, world_size=2, topology="nvlink", nodes=2)


def test_two_nodes_of_one_gpu_golden():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from mokgen.runtime import variants_root

    # (the levels over 1 node x 2 GPUs run the one-node layer itself as their node-local layer)
    for s in (node_local_spec(SPEC), MoESpec(**{**SPEC.to_dict(), "nodes": 1})):
        if not (variants_root() / s.variant / "build").is_dir():
            pytest.skip(f"{s.variant} is not built (benchmarks/build_gpu_variants.py)")
    run_workers("multinode_worker.py", "MULTINODE golden: PASS")


def test_two_nodes_of_one_gpu_golden_with_ranks_sharing_one_gpu():
    """The same worker with both ranks on one GPU (MOKGEN_TEST_RANKS_SHARE_GPU=1: a gloo group,
    the levels' peer buffers mapped by CUDA IPC): correctness where one GPU is all there is."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from mokgen.runtime import variants_root

    for s in (node_local_spec(SPEC), MoESpec(**{**SPEC.to_dict(), "nodes": 1})):
        if not (variants_root() / s.variant / "build").is_dir():
            pytest.skip(f"{s.variant} is not built (benchmarks/build_gpu_variants.py)")
    run_workers("multinode_worker.py", "MULTINODE golden: PASS", MOKGEN_TEST_RANKS_SHARE_GPU="1")


def run_workers(script: str, passed: str, **extra_env):
    """tests/<script> on 2 GPUs under torchrun (NVLink multicast off; extra_env: more of the
    workers' environment); asserts it printed `passed`."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", **extra_env)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                        str(root / "tests" / script)], env=env, capture_output=True, text=True, timeout=240, cwd=root)
    print(r.stdout[-6000:], r.stderr[-3000:])
    assert r.returncode == 0 and passed in r.stdout
