import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _has_cutlass() -> bool:
    import importlib.util

    return importlib.util.find_spec("nvidia_cutlass_dsl") is not None


HAS_CUDA = _has_cuda()
HAS_CUTLASS = _has_cutlass()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (Hopper) and built variants")
    config.addinivalue_line("markers", "compile: needs nvidia-cutlass-dsl (compiles for sm_90a, no GPU)")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU")
    skip_cc = pytest.mark.skip(reason="nvidia-cutlass-dsl not installed")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "compile" in item.keywords and not HAS_CUTLASS:
            item.add_marker(skip_cc)
