"""Model steps of 1 / 16 / 64 rows on a real-size quantized model, per qlinear path, with a roofline line.

The model: random weights in SmolLM2-1.7B's shapes (hidden 2048, 24 layers, 32 heads, ffn 8192, vocab 49152,
tied embeddings) and the default model's tokenizer, written once with the `gguf` package into a cache folder
(--cache) and reused: Q8_0 through gguf's quantizer, Q4_K_M as llama.cpp mixes it (pyengine.model.kquants:
Q4_K, Q6_K for the embedding and some attn_v / ffn_down). One tensor of each (shape, type) is quantized and
written for every layer (the values do not matter for timing; each layer still has its own memory once loaded).

After a 128-token prompt, one step of M rows (a sequence's next M tokens: the projections see what M streams'
decode step gives them) is timed per path, the paths alternating, wall ms, min over --repeats:
  strips    the weight dequantized to bf16 for the bf16 AMX kernel (linear/quant_strips.cpp: the default
            from 8 rows on AMX hosts)
  int8      the int8 kernels (quant.cpp) at every M, on this host's best SIMD path (amx from 8 rows)
  vnni      the int8 kernels on the avx512_vnni path: what a host with VNNI but without AMX runs (shown
            where this host has AMX; its floor's GEMM rate is still this host's)
M = 1 runs the int8 kernels on every path. Roofline: the host's read bandwidth (the faster of a torch sum
over 1 GiB on --threads threads and the weight bytes over the fastest 1-row step: that step reads every
weight once, so it bounds the bandwidth from below) and the best GEMM rate this bench measures (bf16
PackedLinear, and QuantLinear's default path on a Q8_0 weight, each [8192, 2048] at M = 512); a step's floor is max(weight bytes / bandwidth, FLOPs / rate), FLOPs =
2 x M x the layers' weights + 2 x the lm_head's (one row: the last), and each step is shown as a fraction of it.

    python bench/engine/bench_quant_real.py [--types Q4_K_M,Q8_0] [--m 1,16,64] [--threads 2] [--repeats 3]
                                            [--layers 24] [--cache ~/.cache/pyengine-bench]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import ROOT, default_gguf

import pyengine  # noqa: F401  (before torch)
import numpy as np
import torch

sys.path.insert(0, os.path.join(ROOT, "tests"))

from model_helpers import SequenceRunner  # noqa: E402
from pyengine import _C  # noqa: E402
from pyengine.model.loader import load_model  # noqa: E402
from pyengine.ops.linear import PackedLinear  # noqa: E402
from pyengine.ops.qlinear import QuantLinear  # noqa: E402

HIDDEN, FFN, HEADS, VOCAB = 2048, 8192, 32, 49152
SHAPE_KEYS = {"llama.embedding_length": HIDDEN, "llama.feed_forward_length": FFN,
              "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": HEADS,
              "llama.rope.dimension_count": HIDDEN // HEADS}


def write_model(path: str, recipe: str, layers: int) -> None:
    """The random 1.7B-shaped GGUF of `recipe` ("Q8_0" or "Q4_K_M") at `path`."""
    import gguf

    from pyengine.model.kquants import mix_type, quantize_k

    reader = gguf.GGUFReader(os.path.join(*default_gguf()))
    writer = gguf.GGUFWriter(path, arch=None)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.alignment":
            continue
        value = {**SHAPE_KEYS, "llama.block_count": layers}.get(field.name, field.contents())
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    rng = np.random.default_rng(0)
    done: dict[tuple[tuple[int, int], str], np.ndarray] = {}

    def add(name: str, shape: tuple[int, int]) -> None:
        target = recipe if recipe == "Q8_0" else mix_type(recipe, name, shape[1], layers, tied=True)
        if (shape, target) not in done:
            values = (rng.standard_normal(shape) * 0.02).astype(np.float32)
            done[shape, target] = (gguf.quants.quantize(values, gguf.GGMLQuantizationType[target])
                                   if target == "Q8_0" else quantize_k(values, target))
        blocks = done[shape, target]
        writer.add_tensor(name, blocks, raw_shape=list(blocks.shape), raw_dtype=gguf.GGMLQuantizationType[target])

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(HIDDEN, dtype=np.float32))

    add("token_embd.weight", (VOCAB, HIDDEN))
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
            add(f"blk.{i}.{proj}.weight", (HIDDEN, HIDDEN))
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN))
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN))
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN))
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def model_path(cache: str, recipe: str, layers: int) -> str:
    """The cached file, written on first use."""
    path = os.path.join(cache, f"random-1.7b-shapes-{layers}l.{recipe}.gguf")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        print(f"writing {path} (once)", flush=True)
        write_model(path + ".part", recipe, layers)
        os.replace(path + ".part", path)
    return path


def read_bandwidth() -> float:
    """Bytes per second a torch sum reads from a 1 GiB buffer (best of 5)."""
    buf = torch.ones(1 << 28, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        float(buf.sum())
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def gemm_rate() -> tuple[float, str]:
    """(FLOP/s, which kernel) of the fastest GEMM this bench measures: [8192, 2048] weight, 512 rows."""
    x = torch.randn(512, HIDDEN, dtype=torch.bfloat16)
    w = torch.randn(FFN, HIDDEN) * 0.02
    bf16 = PackedLinear(w.to(torch.bfloat16))
    from gguf import GGMLQuantizationType, quants

    q8 = QuantLinear(quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0), "Q8_0")
    rates = {}
    for name, f in (("bf16 linear", lambda: bf16(x)), (f"Q8_0 {_C.qlinear_path(512, HIDDEN)}", lambda: q8(x))):
        f()
        best = min(_timed(f) for _ in range(5))
        rates[name] = 2 * 512 * FFN * HIDDEN / best
    name = max(rates, key=rates.get)
    return rates[name], name


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


# (strip rows or None: the default, int8 SIMD path or None: the host's best)
PATHS = {"strips": (None, None), "int8": (0, None), "vnni": (0, "avx512_vnni")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K_M,Q8_0")
    ap.add_argument("--m", default="1,16,64", help="comma-separated rows per step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/pyengine-bench"))
    args = ap.parse_args()
    _C.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    defaults = (_C.qlinear_strip_rows(), _C.qlinear_isa())
    amx = "amx" in _C.qlinear_isas().split(",")
    paths = [p for p in PATHS if p not in ("strips", "vnni") or amx]
    bandwidth = read_bandwidth()
    rate, rate_name = gemm_rate()
    print(f"{args.threads} thread(s); read bandwidth {bandwidth / 1e9:.1f} GB/s; best GEMM rate "
          f"{rate / 1e12:.2f} TFLOP/s ({rate_name})")
    sizes = [int(m) for m in args.m.split(",")]
    for recipe in args.types.split(","):
        path = model_path(args.cache, recipe, args.layers)
        cfg, model = load_model(path, torch.bfloat16, "cpu")
        weight_bytes = model.weight_bytes()
        lm_head = VOCAB * HIDDEN
        layer_params = args.layers * (4 * HIDDEN * HIDDEN + 3 * FFN * HIDDEN)
        ids = torch.randint(100, 40000, (128 + max(sizes),), generator=torch.Generator().manual_seed(0)).tolist()
        best: dict[tuple[str, int], float] = {}
        for _ in range(args.repeats):
            for m in sizes:
                for p in paths:
                    _C.set_qlinear_strip_rows(defaults[0] if PATHS[p][0] is None else PATHS[p][0])
                    _C.set_qlinear_isa(PATHS[p][1] or defaults[1])
                    runner = SequenceRunner(model, cfg, 128 + m)
                    runner.step(ids[:128])
                    t0 = time.perf_counter()
                    runner.step(ids[128 : 128 + m])
                    best[p, m] = min(best.get((p, m), float("inf")), (time.perf_counter() - t0) * 1e3)
        _C.set_qlinear_strip_rows(defaults[0])
        _C.set_qlinear_isa(defaults[1])
        if 1 in sizes:
            bandwidth = max(bandwidth, weight_bytes / (1e-3 * min(best[p, 1] for p in paths)))
        print(f"\n{recipe}: {weight_bytes / 1e9:.2f} GB of weights, {args.layers} layers; read bandwidth "
              f"{bandwidth / 1e9:.1f} GB/s; wall ms per step, min of {args.repeats}; (x.xx) = the floor's ms / "
              f"the step's ms")
        print(f"{'M':>4s} {'floor':>7s} " + " ".join(f"{p:>16s}" for p in paths))
        for m in sizes:
            floor = 1e3 * max(weight_bytes / bandwidth, 2 * (m * layer_params + lm_head) / rate)
            cells = " ".join(f"{best[p, m]:9.1f} ({floor / best[p, m]:.2f})" for p in paths)
            print(f"{m:4d} {floor:7.1f} {cells}")
        del model


if __name__ == "__main__":
    main()
