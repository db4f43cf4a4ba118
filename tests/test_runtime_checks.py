import pytest
import torch

from mokgen.runtime.checks import InputError, check_moe_inputs, check_tensor


def test_check_tensor_messages():
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    check_tensor("x", t, torch.bfloat16, (None, 8), None)
    with pytest.raises(InputError, match="x must be torch.float32, got torch.bfloat16"):
        check_tensor("x", t, torch.float32, (None, 8), None)
    with pytest.raises(InputError, match=r"must have shape \['\*', 16\]"):
        check_tensor("x", t, torch.bfloat16, (None, 16), None)
    with pytest.raises(InputError, match="contiguous"):
        check_tensor("x", t.t(), torch.bfloat16, (8, 4), None)
    with pytest.raises(InputError, match="3-d"):
        check_tensor("w", t, torch.bfloat16, (1, 4, 8), None)


def test_cpu_inputs_are_refused():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="must be on a CUDA device"):
        check_moe_inputs(x, None, None, None, None, None, None, None, None)
