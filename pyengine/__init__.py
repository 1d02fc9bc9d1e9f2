"""pyengine: a single-node LLM inference engine.

The public names are imported lazily, so `import pyengine.ops` (or the server's light imports)
does not pull in the engine, torch models or the Cython modules.
"""
from importlib import import_module

_EXPORTS = {
    "LLM": "pyengine.llm",
    "AsyncLLM": "pyengine.engine.async_engine",
    "SamplingParams": "pyengine.sampling_params",
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
