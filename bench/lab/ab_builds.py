"""Builds of the native extension side by side in one process, their GEMM calls alternating, on the
default model's projections: on a shared machine whose speed drifts by tens of percent within minutes,
the way a few percent of kernel change shows at all. Copy pyengine/_C*.so aside before and after a change
(or build each variant), then:

    python bench/lab/ab_builds.py OLD.so NEW.so [--m 16] [--weights auto|dequantize] [--threads 2] [--rounds 8]
                              [--model PATH]   (a GGUF file or HF folder; default: the default model)

Per build, the fastest of `rounds` rounds (the builds take turns within each round):
  hot       each projection of layer 0 and the lm_head, called 20 times in a row (us per call)
  in order  one step's projections in model order, 30 layers x qkv, o, gate_up, down, after a 64 MB
            sweep: the weights come cold from memory, as in a decode step (ms per step)
weights="auto" keeps the GGUF's quantized weights (qlinear's int8 kernels); "dequantize" runs the bf16
ones (linear_bf16, on AVX512-BF16 CPUs).

Each build is loaded under a module name of its own. CPython keeps a single-phase extension module
(pybind11's) by its name: loading another file as "pyengine._C" hands back the first one loaded, so
a comparison that way times one build against itself.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import time

import os

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

import bench.common  # noqa: F401  (puts the checkout first on sys.path)
import pyengine  # noqa: F401  (before torch: it sets the OpenMP spin policy)
import torch

from pyengine.model.loader import load_model, resolve_model_path

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def load_build(path: str, index: int):
    """The extension module in `path`, under a name no other build has."""
    name = f"pyengine_build{index}._C"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
    loader.exec_module(module)
    return module


def load_builds(paths: list[str], threads: int) -> list:
    """The builds in `paths` (each under a name of its own), their thread pools and torch's at `threads`."""
    builds = [load_build(path, i) for i, path in enumerate(paths)]
    for b in builds:
        b.set_num_threads(threads)
    torch.set_num_threads(threads)
    return builds


def use(build, layers) -> None:
    for layer in layers:
        layer._kernel = getattr(build, layer._kernel.__name__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+", help="paths of _C*.so builds")
    ap.add_argument("--m", type=int, default=16, help="rows of x (decode: the batch)")
    ap.add_argument("--weights", choices=("auto", "dequantize"), default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the default model)")
    args = ap.parse_args()

    builds = load_builds(args.builds, args.threads)
    _, model = load_model(resolve_model_path(args.model), torch.bfloat16, torch.device("cpu"), weights=args.weights)
    step = [getattr(layer, name) for layer in model.linears for name in PROJECTIONS]
    hot = {name: getattr(model.linears[0], name) for name in PROJECTIONS} | {"lm_head": model.lm_head_linear}
    if any(getattr(layer, "_kernel", None) is None for layer in [*step, *hot.values()]):
        raise SystemExit("these weights run no native kernel on this CPU (nothing to compare)")
    x = {layer.in_features: torch.randn(args.m, layer.in_features).bfloat16() for layer in [*step, *hot.values()]}
    sweep = torch.empty(64 << 20, dtype=torch.uint8)

    best_hot = [{name: float("inf") for name in hot} for _ in builds]
    best_step = [float("inf")] * len(builds)
    for _ in range(args.rounds):
        for i, build in enumerate(builds):
            use(build, [*step, *hot.values()])
            sweep.add_(1)
            t0 = time.perf_counter()
            for layer in step:
                layer(x[layer.in_features])
            best_step[i] = min(best_step[i], time.perf_counter() - t0)
            for name, layer in hot.items():
                for _ in range(20):
                    t0 = time.perf_counter()
                    layer(x[layer.in_features])
                    best_hot[i][name] = min(best_hot[i][name], time.perf_counter() - t0)

    print(f"{args.model or 'default model'}, weights={args.weights}, M = {args.m}, {args.threads} threads, best of {args.rounds} rounds")
    print(f"{'build':<32}" + "".join(f"{name:>10}" for name in hot) + f"{'in order':>12}")
    for path, h, s in zip(args.builds, best_hot, best_step):
        print(f"{path[-32:]:<32}" + "".join(f"{h[name] * 1e6:>8.0f}us" for name in hot) + f"{s * 1e3:>10.2f}ms")


if __name__ == "__main__":
    main()
