"""The native build: pyengine._C is importable, reports its ISA, and every .pyx became a module."""
import importlib
import pathlib

import pytest

from pyengine import _C

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_cpu_module_reports_isa():
    assert _C.isa() in ("avx512_bf16", "avx512", "avx2", "scalar")


def test_thread_pool_resizes():
    before = _C.num_threads()
    try:
        _C.set_num_threads(3)
        assert _C.num_threads() == 3
        _C.set_num_threads(1)
        assert _C.num_threads() == 1
    finally:
        _C.set_num_threads(before)
    assert _C.num_threads() == before


@pytest.mark.parametrize("module", sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                                           for p in (ROOT / "pyengine").rglob("*.pyx")))
def test_cython_module_is_compiled(module):
    mod = importlib.import_module(module)
    assert mod.__file__.endswith(".so"), f"{module} imported from {mod.__file__}, not a compiled extension"


def test_native_code_prefetches_only_through_prefetch_h():
    """GCC deletes the calls of a function or lambda whose only effect is an _mm_prefetch /
    __builtin_prefetch (it models them as touching no memory, so the function is const): the prefill
    kernels', the cache writes' and the AVX2 decode kernel's prefetches were once absent from the binary.
    pyengine::prefetch (native/include/pyengine/prefetch.h) emits volatile asm, which stays."""
    helper = ROOT / "native" / "include" / "pyengine" / "prefetch.h"
    sources = [p for ext in ("*.cpp", "*.h", "*.cu", "*.cuh") for p in (ROOT / "native").rglob(ext) if p != helper]
    assert sources
    raw = [f"{p.relative_to(ROOT)}:{i}" for p in sources for i, line in enumerate(p.read_text().splitlines(), 1)
           if "_mm_prefetch(" in line or "__builtin_prefetch(" in line]
    assert not raw, f"prefetch with pyengine::prefetch<hint> / prefetch_for_write instead: {raw}"
