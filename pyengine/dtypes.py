"""Which torch dtypes a configuration means: the model's ("auto" resolved for the device) and its KV
cache's. The engine and the memory planner both resolve them here, so they agree."""
from __future__ import annotations

import torch

from pyengine.config import EngineConfig


def _cpu_has_bf16() -> bool:
    """Native bf16 dot products (AVX512-BF16 or AMX); without them bf16 GEMMs are emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bf16 on GPUs and on CPUs with bf16 dot products (measured ~2x fp32's decode speed on the
    default model, bench/engine/bench_decode.py), else fp32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or _cpu_has_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def cache_dtype_of(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for a model running in `dtype`."""
    return {"auto": dtype, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[config.kv_cache_dtype]
