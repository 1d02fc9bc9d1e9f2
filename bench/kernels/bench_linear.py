"""PackedLinear (the native bf16 linear) vs torch F.linear in bf16 and fp32, at the SmolLM2-135M
decode shapes, 2 threads; with --fp32, Fp32Linear (the native fp32 linear of AVX2 builds) vs torch's
fp32 F.linear, from decode to prefill rows.

Weights are streamed from memory, not cache: each call uses the next of enough copies of the weight
to overflow the L3 (>= 256 MB), as in a real decode step where ~270 MB of weights pass once per token.
"decode_step" runs one token's worth of projections (30 layers x qkv/o/gate_up/down + lm_head, all
distinct weights) and reports what that alone allows in tokens/s.

    PYTHONPATH=. python bench/kernels/bench_linear.py    # table: min time, GB/s of weights (M=1, 4, 16, 64)
    PYTHONPATH=. python bench/kernels/bench_linear.py --fp32    # GFLOP/s, M=1 .. 512, the two alternating
    python -m pytest bench/kernels/bench_linear.py --benchmark-group-by=param:shape,param:rows \
        --benchmark-columns=min,median,rounds
"""
from __future__ import annotations

import functools
import itertools
import sys
from typing import Callable

import pyengine  # noqa: F401  (first: sets libgomp's spin count before torch loads it, as the engine does)
import pytest
import torch
import torch.nn.functional as F

import os

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import min_time
from pyengine import _C
from pyengine.ops.linear import Fp32Linear, PackedLinear

HIDDEN, INTER, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = {  # name: (N, K)
    "qkv": (960, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}
ROWS = [1, 4, 16, 64]
IMPLS = ["pyengine", "torch_bf16", "torch_fp32"]
IMPLS_FP32 = ["pyengine_fp32", "torch_fp32"]
ROWS_FP32 = [1, 4, 16, 64, 256, 512]
COLD_BYTES = 256 << 20


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    _C.set_num_threads(n)


def make_calls(impl: str, weights: list[torch.Tensor], x: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    """One zero-argument call per weight, for `impl`."""
    if impl == "pyengine":
        lins = [PackedLinear(w) for w in weights]
        return [lambda lin=lin: lin(x) for lin in lins]
    if impl == "torch_bf16":
        return [lambda w=w: F.linear(x, w) for w in weights]
    xf = x.float()
    wf = [w.float() for w in weights]
    if impl == "pyengine_fp32":
        lins = [Fp32Linear(w) for w in wf]
        return [lambda lin=lin: lin(xf) for lin in lins]
    return [lambda w=w: F.linear(xf, w) for w in wf]


@functools.lru_cache(maxsize=1)
def cold_weights(shape: str) -> list[torch.Tensor]:
    """Copies of the shape's weight, COLD_BYTES in all (cached for the runs of one shape)."""
    n, k = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=g).bfloat16() for _ in range(max(1, -(-COLD_BYTES // (n * k * 2))))]


def shape_calls(impl: str, shape: str, rows: int) -> tuple[Callable[[], torch.Tensor], int]:
    """A call that streams the next cold copy of the shape's weight; bytes of bf16 weight per call."""
    n, k = SHAPES[shape]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    cycle = itertools.cycle(make_calls(impl, cold_weights(shape), x))
    return lambda: next(cycle)(), n * k * 2


def step_calls(impl: str, rows: int) -> tuple[Callable[[], None], int]:
    """One decode step's projections (distinct weights per layer); bytes of bf16 weight per step."""
    g = torch.Generator().manual_seed(1)
    calls, nbytes = [], 0
    for name, (n, k) in SHAPES.items():
        count = 1 if name == "lm_head" else LAYERS
        weights = [torch.randn(n, k, generator=g).bfloat16() for _ in range(count)]
        calls += make_calls(impl, weights, torch.randn(rows, k, generator=g).bfloat16())
        nbytes += count * n * k * 2

    def step() -> None:
        for call in calls:
            call()

    return step, nbytes


@pytest.fixture(autouse=True)
def two_threads():
    old = torch.get_num_threads(), _C.num_threads()
    set_threads(2)
    yield
    torch.set_num_threads(old[0])
    _C.set_num_threads(old[1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_linear(benchmark, shape, rows, impl):
    fn, nbytes = shape_calls(impl, shape, rows)
    benchmark.extra_info["weight_bytes"] = nbytes
    benchmark(fn)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows", [1, 4])
def test_decode_step(benchmark, rows, impl):
    fn, nbytes = step_calls(impl, rows)
    benchmark.extra_info["weight_bytes"] = nbytes
    benchmark.pedantic(fn, rounds=10, warmup_rounds=1)


def read_bandwidth() -> float:
    """GB/s of a plain read (torch sum of 256 MB fp32) now: the ceiling for the rows above."""
    x = torch.ones(COLD_BYTES // 4)
    return x.numel() * 4 / min_time(x.sum, 10) / 1e9


def main_fp32() -> None:
    """GFLOP/s of Fp32Linear and torch's fp32 F.linear per shape and M, alternating in rounds (weights
    cold at decode sizes, where they bound the call, as in the bf16 table)."""
    print(f"threads: torch {torch.get_num_threads()}, pyengine {_C.num_threads()}; fp32 weights and x; best of "
          "5 rounds, the two alternating")
    header = f"{'shape':>8} {'N x K':>11} {'M':>4} |" + "|".join(f"{i:^14}" for i in IMPLS_FP32) + "| ratio"
    print(header)
    print("-" * len(header))
    for shape, (n, k) in SHAPES.items():
        for rows in ROWS_FP32:
            fns = {impl: shape_calls(impl, shape, rows)[0] for impl in IMPLS_FP32}
            best = {impl: float("inf") for impl in IMPLS_FP32}
            reps = max(2, min(200, int(2e9 / (2 * rows * n * k))))
            for r in range(5):
                for impl in IMPLS_FP32 if r % 2 == 0 else IMPLS_FP32[::-1]:
                    best[impl] = min(best[impl], min_time(fns[impl], reps))
            cells = [f"{2 * rows * n * k / best[i] / 1e9:8.1f} GF/s" for i in IMPLS_FP32]
            print(f"{shape:>8} {f'{n}x{k}':>11} {rows:>4} |" + "|".join(f"{c:^14}" for c in cells)
                  + f"| {best['torch_fp32'] / best['pyengine_fp32']:4.2f}x")
            cold_weights.cache_clear()


def main() -> None:
    set_threads(2)
    if "--fp32" in sys.argv:
        main_fp32()
        return
    print(f"threads: torch {torch.get_num_threads()}, pyengine {_C.num_threads()}; min time over reps, "
          "weights cold (rotating copies >= 256 MB); GB/s = bf16 weight bytes / time")
    print(f"plain 2-thread read (torch sum, 256 MB): {read_bandwidth():.1f} GB/s")
    header = f"{'shape':>8} {'N x K':>11} {'M':>3} |" + "|".join(f"{i:^21}" for i in IMPLS)
    print(header)
    print("-" * len(header))
    for shape, (n, k) in SHAPES.items():
        for rows in ROWS:
            cells = []
            for impl in IMPLS:
                fn, nbytes = shape_calls(impl, shape, rows)
                t = min_time(fn, 20 if shape == "lm_head" else 200)
                cells.append(f"{t * 1e6:9.1f}us {nbytes / t / 1e9:6.1f}GB/s")
            print(f"{shape:>8} {f'{n}x{k}':>11} {rows:>3} |" + "|".join(f"{c:^21}" for c in cells))
    print("\ndecode step: 30 x (qkv, o, gate_up, down) + lm_head, distinct weights")
    for rows in [1, 4]:
        cells = []
        for impl in IMPLS:
            fn, nbytes = step_calls(impl, rows)
            t = min_time(fn, 10)
            cells.append(f"{impl} {t * 1e3:6.2f}ms {nbytes / t / 1e9:5.1f}GB/s {1 / t:6.1f}steps/s")
        print(f"M={rows}: " + " | ".join(cells))
    print(f"plain 2-thread read (torch sum, 256 MB): {read_bandwidth():.1f} GB/s")


if __name__ == "__main__":
    main()
