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


@pytest.mark.parametrize("pyx", sorted(p.stem for p in (ROOT / "pyengine" / "engine").glob("*.pyx")))
def test_cython_module_is_compiled(pyx):
    mod = importlib.import_module(f"pyengine.engine.{pyx}")
    assert mod.__file__.endswith(".so"), f"pyengine.engine.{pyx} imported from {mod.__file__}, not a compiled extension"
