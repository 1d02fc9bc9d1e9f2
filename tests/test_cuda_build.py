"""The CUDA extension builds and imports wherever nvcc exists (no GPU needed).

pyengine._cuda must register the same op names as pyengine._C with the same
argument lists, so the device-agnostic wrappers in pyengine/ops can call
either module the same way.
"""
from __future__ import annotations

import importlib
import os
import re
import shutil

import pytest

# The ops pyengine._cuda implements; the CPU-only helpers (num_threads, isa, ...) are not among them.
CUDA_OPS = (
    "rms_norm",
    "add_rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "reshape_and_cache",
    "paged_attention",
    "sample",
    "apply_penalties",
)


def cuda_expected() -> bool:
    """setup.py builds pyengine._cuda when nvcc is found and PYENGINE_SKIP_CUDA is unset/0."""
    skip = os.environ.get("PYENGINE_SKIP_CUDA", "0") not in ("", "0")
    return not skip and shutil.which("nvcc") is not None


def params(fn) -> list[str]:
    """Parameters (name: type) from a pybind11 signature line, e.g. 'f(x: int, eps: float) -> None'."""
    sig = fn.__doc__.splitlines()[0]
    inner = sig[sig.index("(") + 1 : sig.rindex(")")]
    return [p.strip() for p in re.split(r",\s*(?=\w+:)", inner) if p.strip()]


def load_cuda():
    """pyengine._cuda, or None where it was (rightly) not built."""
    try:
        return importlib.import_module("pyengine._cuda")
    except ImportError:
        if cuda_expected():
            raise  # nvcc is here, so the build must have produced the module
        return None


def require_cuda():
    """pyengine._cuda; the test is skipped (with the reason) where it was rightly not built."""
    mod = load_cuda()
    if mod is None:
        pytest.skip("pyengine._cuda is not built here (no nvcc, or PYENGINE_SKIP_CUDA set)")
    return mod


def test_module_imports_or_wrappers_say_why():
    mod = load_cuda()
    if mod is None:
        import torch

        from pyengine.ops._common import native

        with pytest.raises(RuntimeError, match="without its CUDA extension"):
            native(torch.device("cuda"))
    else:
        n = mod.device_count()
        assert isinstance(n, int) and n >= 0
        assert isinstance(mod.is_available(), bool)
        assert mod.is_available() == (n > 0)
        assert mod.runtime_version() >= 11000


def test_same_ops_and_argument_lists_as_cpu():
    from pyengine import _C

    mod = require_cuda()
    for name in CUDA_OPS:
        assert hasattr(_C, name) and hasattr(mod, name), f"{name} is missing from pyengine._C or pyengine._cuda"
        assert params(getattr(mod, name)) == params(getattr(_C, name)), name


def test_bad_call_is_a_python_error_not_a_crash():
    mod = require_cuda()
    # No GPU: the device lookup fails (RuntimeError); with one: the dtype code 99 (ValueError).
    with pytest.raises((ValueError, RuntimeError)):
        mod.silu_and_mul(0, 0, 1, 8, 99, 0)


def test_prefill_attention_takes_paged_attention_arguments_plus_max_query_len():
    """pyengine.ops.paged_attention hands the same argument tuple to either kernel (tensor_cores=True adds
    max_query_len); a bad size is a Python error from both."""
    mod = require_cuda()
    names = lambda fn: [p.split(":")[0] for p in params(fn)]  # noqa: E731
    assert names(mod.prefill_attention) == names(mod.paged_attention) + ["max_query_len"]
    with pytest.raises((ValueError, RuntimeError)):  # 4 heads over 3 kv heads
        mod.prefill_attention(*([0] * 9), 1, 4, 3, 64, 64, 1, 16, 1, 1, 16, 0.1, 1, 1, 0, 0, 0.0, 16)
