"""ctypes access to a built variant's libmokgen.so: one Launcher per kernel.

The library's C shim gives every kernel the same entry point
(`mokgen_K_launch(void **data, const int32_t *dyn, void *stream)`), so this module
needs no per-kernel code, no CuTe-DSL and no compiler.
"""
from __future__ import annotations

import ctypes
import glob
from pathlib import Path

import torch

# The Plan's element types (KernelArg.dtype, Buffer.dtype) as torch dtypes.
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32, "i64": torch.int64,
          "e4m3": torch.float8_e4m3fn}


class LaunchError(RuntimeError):
    """A kernel launch returned a CUDA error."""


def _preload_cudart() -> None:
    """Make libcudart.so.13 resolvable: PyTorch's CUDA build ships it in its nvidia/ packages."""
    roots = [Path(torch.__file__).parent.parent / "nvidia"]
    for root in roots:
        for pat in ("cu13/lib/libcudart.so.13*", "cuda_runtime/lib/libcudart.so.13*"):
            for lib in sorted(glob.glob(str(root / pat))):
                try:
                    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                    return
                except OSError:
                    pass


def open_library(path: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        _preload_cudart()
        try:
            return ctypes.CDLL(str(path))
        except OSError as e:
            raise LaunchError(f"cannot load {path}: {e}") from None


class Launcher:
    """Launches one compiled kernel with torch tensors bound to its arguments."""

    def __init__(self, lib: ctypes.CDLL, kernel: dict):
        self.name = kernel["name"]
        self.args = kernel["args"]
        # The shim's entry point, given the addresses of the pointer and extent arrays: a launch
        # makes its own arrays; BoundEntry passes each kernel its slice of one made per entry.
        self.raw = getattr(lib, f"mokgen_{self.name}_launch")
        self.raw.restype = ctypes.c_int
        self.raw.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._err = lib.mokgen_error_string
        self._err.restype = ctypes.c_char_p
        self._err.argtypes = [ctypes.c_int]
        # (argument index, dimension) of every symbolic extent, in the shim's order.
        self._dyn = [(i, d) for i, a in enumerate(self.args) for d, s in enumerate(a["shape"]) if isinstance(s, str)]
        self._static = [(i, d, s) for i, a in enumerate(self.args) for d, s in enumerate(a["shape"])
                        if not isinstance(s, str)]
        # ctypes array types made once (making one per launch showed in the host profile)
        self._data_t = ctypes.c_void_p * len(self.args)
        self._dyn_t = ctypes.c_int32 * max(1, len(self._dyn))

    def check(self, tensors) -> None:
        """Shape/contiguity check of the bound tensors (cheap, host-only)."""
        if len(tensors) != len(self.args):
            raise LaunchError(f"{self.name}: {len(tensors)} tensors for {len(self.args)} arguments")
        for i, d, s in self._static:
            if tensors[i].shape[d] != s:
                raise LaunchError(f"{self.name}: argument {self.args[i]['name']} has extent "
                                  f"{tensors[i].shape[d]} in dim {d}, the kernel was built for {s}")
        for t, a in zip(tensors, self.args):
            if t.dim() != len(a["shape"]) or not t.is_contiguous():
                raise LaunchError(f"{self.name}: argument {a['name']} must be a contiguous "
                                  f"{len(a['shape'])}-d tensor, got shape {tuple(t.shape)}")

    def __call__(self, tensors, stream: int) -> None:
        data = self._data_t(*[t.data_ptr() for t in tensors])
        dyn = self._dyn_t(*[tensors[i].shape[d] for i, d in self._dyn])
        err = self.raw(ctypes.addressof(data), ctypes.addressof(dyn), stream)
        if err:
            self.fail(err)

    def fail(self, err: int) -> None:
        raise LaunchError(
            f"kernel {self.name} failed to launch: {self._err(err).decode()} (cudaError {err}); "
            "an error from an earlier kernel surfaces here too (a generated kernel traps when a "
            "pipeline wait exceeds its timeout), and the CUDA context is then unusable"
        )


_POINTER, _EXTENT = ctypes.sizeof(ctypes.c_void_p), ctypes.sizeof(ctypes.c_int32)


class BoundEntry:
    """An entry point's kernels, launched in order from one array of pointers and one of
    extents made per call, each kernel given its slice by address. Binding each launch's
    arguments into two ctypes arrays of its own was most of a launch's host time on the GPU
    machines (docs/perf.md); the shim's entry points are the same."""

    def __init__(self, launchers: list, bound: list):
        """launchers: the kernels' Launchers, in order; bound: the env name of each one's
        arguments."""
        self.kernels, self.tensors, self.extents = [], [], []
        for launcher, names in zip(launchers, bound):
            self.kernels.append((launcher.raw, launcher, len(self.tensors) * _POINTER, len(self.extents) * _EXTENT))
            self.tensors += names
            self.extents += [(names[i], d) for i, d in launcher._dyn]
        self._data_t = ctypes.c_void_p * max(1, len(self.tensors))
        self._dyn_t = ctypes.c_int32 * max(1, len(self.extents))

    def __call__(self, env: dict, stream: int) -> None:
        data = self._data_t(*[env[n].data_ptr() for n in self.tensors])
        dyn = self._dyn_t(*[env[n].shape[d] for n, d in self.extents])
        base, dyn_base = ctypes.addressof(data), ctypes.addressof(dyn)
        for raw, launcher, offset, dyn_offset in self.kernels:
            err = raw(base + offset, dyn_base + dyn_offset, stream)
            if err:
                launcher.fail(err)


def cuda_stream(device: torch.device) -> int:
    """The raw handle of the current stream on device."""
    return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())


# The host path of a small call runs these several times: torch.cuda.current_stream(device)
# builds a Stream object (about 3 us on the H200 machine's host) where a launch needs only the
# handle (0.1 us through the function torch's generated code calls), and entering
# torch.cuda.device(...) costs 3 us where the exchange it makes is one C call.
_get_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(index: int) -> int:
    return _get_raw(index) if _get_raw is not None else torch.cuda.current_stream(index).cuda_stream


class on_device:
    """`with on_device(t.device):` the current CUDA device is t's inside (the kernels launch on
    the current device's context), as with torch.cuda.device, at less host cost."""

    __slots__ = ("index", "prev")

    def __init__(self, device: torch.device):
        self.index = device.index if device.index is not None else -1  # (-1: the current device)

    def __enter__(self):
        self.prev = torch.cuda._exchange_device(self.index)
        return self

    def __exit__(self, *exc):
        torch.cuda._maybe_exchange_device(self.prev)
        return False


__all__ = ["BoundEntry", "LaunchError", "Launcher", "open_library", "cuda_stream", "on_device"]
