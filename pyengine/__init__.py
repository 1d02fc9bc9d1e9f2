"""pyengine: a single-node LLM inference engine.

The public names are imported lazily, so `import pyengine.ops` (or the server's light imports)
does not pull in the engine, torch models or the Cython modules.
"""
import os
import sys
import warnings
from importlib import import_module

# torch's ops run on libgomp's team, our kernels on a pool of their own (native/include/pyengine/parallel.h).
# libgomp's default spin after each parallel region (300k iterations) starves small machines of their
# cores; 10k measured best, ahead of OMP_WAIT_POLICY=PASSIVE (docs/performance.md, "OpenMP spin").
# libgomp reads this once, when torch loads it, so it must be set first.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"
    if "torch" in sys.modules:
        warnings.warn("pyengine was imported after torch, so its OpenMP spin setting (GOMP_SPINCOUNT=10000) "
                      "cannot take effect; import pyengine first or set GOMP_SPINCOUNT yourself", stacklevel=2)

_EXPORTS = {
    "LLM": "pyengine.llm",
    "AsyncLLM": "pyengine.engine.async_engine",
    "SamplingParams": "pyengine.sampling_params",
    "StructuredOutputsParams": "pyengine.sampling_params",
    "EngineConfig": "pyengine.config",
    "RequestOutput": "pyengine.engine.output",
    "CompletionOutput": "pyengine.engine.output",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pyengine' has no attribute {name!r}")
