"""Shared plumbing for the op wrappers: native module lookup and argument checks.

Every wrapper in pyengine/ops validates its tensors here before handing raw
pointers to native code, so a wrong dtype, device, shape or layout is a
Python exception naming the argument, never a crash inside a kernel.
"""
from __future__ import annotations

from types import ModuleType
from typing import Iterable, Sequence

import torch

# Must match enum class DType in native/include/pyengine/dtype.h.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.int8: 4,
}


def dtype_code(t: torch.Tensor) -> int:
    return DTYPE_CODES[t.dtype]


def native(device: torch.device) -> ModuleType:
    """The native module for a device: pyengine._C on CPU, pyengine._cuda on CUDA."""
    if device.type == "cpu":
        from pyengine import _C

        return _C
    if device.type == "cuda":
        try:
            from pyengine import _cuda
        except ImportError as exc:
            raise RuntimeError(
                "pyengine was built without its CUDA extension (nvcc not found at build time, "
                "or PYENGINE_SKIP_CUDA=1); rebuild with nvcc on PATH to run on the GPU"
            ) from exc
        return _cuda
    raise ValueError(f"pyengine kernels run on cpu or cuda tensors, got device {device}")


def cuda_stream(device: torch.device) -> int:
    """The current CUDA stream handle for kernels on `device` (0 on CPU)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """Raise TypeError/ValueError naming `name` unless `t` is a tensor as described.

    `shape` entries of None match any size.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}; expected one of: {allowed}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None and t.shape != shape:  # (a tuple of sizes only: equal sizes pass at C speed)
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other arguments are on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    return t
