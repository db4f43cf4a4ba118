"""Input checks of the public ops: a clear Python error before any launch."""
from __future__ import annotations

import torch


class InputError(ValueError):
    """A user input the generated op cannot take (one-line message)."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise InputError(msg)


def check_tensor(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device | None) -> None:
    # Every call of the op runs these checks: the common, valid case is tested first without
    # formatting a single message (that formatting was most of the checks' host time).
    if isinstance(t, torch.Tensor) and t.dtype == dtype and t.dim() == len(shape) and \
            all(w is None or g == w for g, w in zip(t.shape, shape)) and t.is_contiguous() and \
            (device is None or t.device == device):
        return
    _need(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _need(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    _need(t.dim() == len(shape), f"{name} must be {len(shape)}-d {list(shape)}, got shape {list(t.shape)}")
    for d, (got, want) in enumerate(zip(t.shape, shape)):
        _need(want is None or got == want,
              f"{name} must have shape {[s if s is not None else '*' for s in shape]}, got {list(t.shape)}")
    _need(t.is_contiguous(), f"{name} must be contiguous (call .contiguous())")
    if device is not None:
        _need(t.device == device, f"{name} is on {t.device}, x is on {device}: all inputs must be on one GPU")


def check_moe_inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
    """Validate shapes, dtypes, devices, contiguity. Returns (E, K, H, I, S)."""
    _need(isinstance(x, torch.Tensor), f"x must be a torch.Tensor, got {type(x).__name__}")
    _need(x.dim() == 2, f"x must be 2-d [T, H], got shape {list(x.shape)}")
    _need(x.is_cuda, f"x must be on a CUDA device, got {x.device}")
    dev = x.device
    T, H = x.shape
    check_tensor("x", x, torch.bfloat16, (None, None), dev)
    _need(isinstance(w_gate, torch.Tensor) and w_gate.dim() == 3,
          f"w_gate must be 3-d [E, I, H], got {getattr(w_gate, 'shape', type(w_gate).__name__)}")
    E, I, _ = w_gate.shape
    check_tensor("w_gate", w_gate, torch.bfloat16, (None, None, H), dev)
    check_tensor("w_up", w_up, torch.bfloat16, (E, I, H), dev)
    check_tensor("w_down", w_down, torch.bfloat16, (E, H, I), dev)
    _need(isinstance(topk_ids, torch.Tensor) and topk_ids.dim() == 2,
          f"topk_ids must be 2-d [T, K], got {getattr(topk_ids, 'shape', type(topk_ids).__name__)}")
    K = topk_ids.shape[1]
    check_tensor("topk_ids", topk_ids, torch.int32, (T, K), dev)
    check_tensor("topk_weights", topk_weights, torch.float32, (T, K), dev)
    shared = [ws_gate, ws_up, ws_down]
    S = 0
    if any(s is not None for s in shared):
        _need(all(s is not None for s in shared), "ws_gate, ws_up and ws_down go together: pass all three or none")
        _need(ws_gate.dim() == 2, f"ws_gate must be 2-d [Is, H], got shape {list(ws_gate.shape)}")
        S = ws_gate.shape[0]
        check_tensor("ws_gate", ws_gate, torch.bfloat16, (S, H), dev)
        check_tensor("ws_up", ws_up, torch.bfloat16, (S, H), dev)
        check_tensor("ws_down", ws_down, torch.bfloat16, (H, S), dev)
    return E, K, H, I, S


def check_ids_in_range(topk_ids: torch.Tensor, experts: int, x: torch.Tensor | None = None) -> None:
    """ids in [0, E) or -1 (an empty slot), and x free of NaN and Inf. Reads one small tensor back to the host: a
    synchronisation, so it is skipped while a CUDA graph is being captured (the kernels then
    report bad ids through the error code; see Variant.check_errors)."""
    if topk_ids.numel() == 0 or torch.cuda.is_current_stream_capturing():
        return
    lo, hi = torch.aminmax(topk_ids)
    stats = [lo, hi] + ([torch.isfinite(x).all()] if x is not None else [])
    values = torch.stack([v.to(torch.int64) for v in stats]).tolist()  # one transfer
    lo, hi = values[0], values[1]
    _need(lo >= -1 and hi < experts, f"topk_ids must be in [0, {experts}) or -1 (an empty slot), found values in "
                                     f"[{lo}, {hi}]")
    _need(x is None or values[2] == 1, "x holds NaN or Inf values: the layer's output would be NaN")
