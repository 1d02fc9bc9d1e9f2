"""Memory plan: how the engine splits memory between weights, the KV cache and an activation
reserve, and what fits. The engine sizes its KV cache with plan_memory() and logs summary(); the
planner CLI calls the same function, so its numbers are the ones the engine will log.

    python -m pyengine.plan [--model PATH] [--dtype auto] [--weights auto] [--kv-cache-dtype auto|fp8|int8|all]
        [--max-model-len N] [--memory 24GiB | --device cuda | --kv-cache-memory 2GiB]
        [--prompt-len 512 --output-len 256]

KV bytes per token = 2 (K and V) x layers x kv_heads x (head_dim x element bytes + scale bytes),
where fp8/int8 caches keep one fp32 scale per token per kv head.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from pyengine.config import CPU_DEFAULT_KV_BYTES, KV_FRACTION_DEFAULT, EngineConfig, ModelConfig, memory_size
from pyengine.dtypes import cache_dtype_of, resolve_dtype
from pyengine.engine_args import add_engine_arguments, engine_fields
from pyengine.model.metadata import QUANTIZED_CACHE_DTYPES, kv_bytes_per_token

_GiB = 1 << 30


def available_memory(device: torch.device) -> int:
    """Free memory now: the GPU's free bytes, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def activation_reserve(cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """A generous bound on one step's activations: per batched token the hidden/QKV/MLP buffers,
    per sequence one fp32 logits row and its sampling copies; plus framework slack."""
    elt = torch.finfo(dtype).bits // 8
    per_token = (6 * cfg.hidden_size + 3 * cfg.intermediate_size) * elt
    per_seq = 3 * cfg.vocab_size * 4
    slack = _GiB if config.device == "cuda" else 256 << 20
    return config.max_num_batched_tokens * per_token + config.max_num_seqs * per_seq + slack


@dataclass
class MemoryPlan:
    weight_bytes: int
    dtype: str
    kv_cache_dtype: str
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    activation_reserve_bytes: int
    max_model_len: int

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    def max_sequences(self, prompt_len: int, output_len: int) -> int:
        """Sequences of prompt + output tokens whose KV blocks fit at once."""
        blocks = math.ceil(min(prompt_len + output_len, self.max_model_len) / self.block_size)
        return self.num_blocks // blocks

    def summary(self) -> str:
        """The line the engine logs at start-up (and the planner prints)."""
        return (f"memory plan: weights {self.weight_bytes} B ({_mib(self.weight_bytes)}, {self.dtype}); "
                f"KV cache {self.num_blocks} blocks x {self.block_size} = {self.kv_tokens} tokens, "
                f"{self.kv_bytes} B ({_mib(self.kv_bytes)}, {self.kv_bytes_per_token} B/token, {self.kv_cache_dtype}); "
                f"activation reserve {self.activation_reserve_bytes} B ({_mib(self.activation_reserve_bytes)}); "
                f"{self.max_sequences(self.max_model_len, 0)} sequences at full context ({self.max_model_len} tokens)")

    def as_dict(self) -> dict:
        return {**asdict(self), "kv_tokens": self.kv_tokens, "kv_bytes": self.kv_bytes,
                "max_sequences_full_context": self.max_sequences(self.max_model_len, 0)}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < _GiB else f"{n / _GiB:.2f} GiB"


def plan_memory(cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype, max_model_len: int,
                weight_bytes: int, available_after_weights: Callable[[], int]) -> MemoryPlan:
    """Size the KV cache. config.kv_cache_memory: bytes (> 1) as given; a fraction of what is left
    after weights and activation reserve; or None: 90% of that (on CPU at most 4 GiB, and at most
    what max_num_seqs sequences of max_model_len tokens can use). Raises ValueError when the cache
    cannot hold one sequence of max_model_len tokens.
    available_after_weights is only called when the budget depends on it."""
    cache_dtype = cache_dtype_of(config, dtype)
    bpt = kv_bytes_per_token(cfg, cache_dtype)
    reserve = activation_reserve(cfg, config, dtype)
    mem = config.kv_cache_memory
    if mem is not None and mem > 1:
        budget = int(mem)
    else:
        free = available_after_weights() - reserve
        if mem is not None:
            if not 0 < mem <= 1:
                raise ValueError(f"kv_cache_memory must be a byte count > 1 or a fraction in (0, 1], got {mem}")
            budget = int(free * mem)
        else:
            budget = int(free * KV_FRACTION_DEFAULT)
            if config.device == "cpu":  # what the configuration can use, at most the default space
                usable = (config.max_num_seqs * max_model_len + config.block_size) * bpt
                budget = min(budget, CPU_DEFAULT_KV_BYTES, usable)
    num_blocks = budget // (bpt * config.block_size)
    if num_blocks * config.block_size < max_model_len:  # vLLM refuses too: never advertise what cannot fit
        need = -(-max_model_len // config.block_size) * config.block_size * bpt
        raise ValueError(f"the KV cache ({budget} bytes: {num_blocks * config.block_size} tokens of {bpt} "
                         f"bytes) cannot hold one sequence of max_model_len {max_model_len} tokens "
                         f"({need} bytes); raise kv_cache_memory or lower max_model_len")
    name = str(cache_dtype).removeprefix("torch.")
    if cache_dtype in QUANTIZED_CACHE_DTYPES:
        name += " + fp32 scales"
    return MemoryPlan(weight_bytes, str(dtype).removeprefix("torch."), name, bpt, config.block_size, num_blocks,
                      reserve, max_model_len)


# The settings that change the plan: the planner takes them as the server does.
PLAN_SETTINGS = ("model", "dtype", "weights", "device", "max_model_len", "block_size", "kv_cache_memory",
                 "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pyengine.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p, PLAN_SETTINGS, extra_choices={"kv_cache_dtype": {"all": "one plan per KV cache dtype"}})
    g = p.add_argument_group("planner")
    g.add_argument("--memory", type=memory_size, default=None,
                   help="total memory to plan for (e.g. 24GiB) instead of measuring the device's free memory "
                        "(with --device cuda: the GPU's)")
    g.add_argument("--prompt-len", type=int, default=512, help="for the concurrency estimate")
    g.add_argument("--output-len", type=int, default=256, help="for the concurrency estimate")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    from pyengine.model.loader import load_model, resolve_model_path

    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    path = resolve_model_path(args.model)
    available = (lambda: int(args.memory)) if args.memory is not None else (lambda: available_memory(device))
    # Weights are counted as the engine holds them (quantized layouts included): load on CPU.
    cfg, model = load_model(path, dtype, torch.device("cpu"), args.weights)
    weights = model.weight_bytes()
    max_len = args.max_model_len or cfg.max_position_embeddings
    print(f"model: {path}\n  {cfg.architecture}, {cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} KV heads "
          f"x head_dim {cfg.head_dim}, dtype {str(dtype).removeprefix('torch.')}, context {max_len} tokens")
    for kv in (["auto", "fp8", "int8"] if args.kv_cache_dtype == "all" else [args.kv_cache_dtype]):
        config = EngineConfig(**(engine_fields(args, PLAN_SETTINGS) | dict(max_model_len=max_len, kv_cache_dtype=kv)))
        plan = plan_memory(cfg, config, dtype, max_len, weights, lambda: available() - weights)
        total = weights + plan.kv_bytes + plan.activation_reserve_bytes
        cache_dtype = cache_dtype_of(config, dtype)
        scale = " + 4 B scale" if cache_dtype in QUANTIZED_CACHE_DTYPES else ""
        print(f"\nKV cache dtype {kv}:\n  {plan.summary()}\n"
              f"  KV bytes per token: {plan.kv_bytes_per_token} = 2 (K, V) x {cfg.num_hidden_layers} layers x "
              f"{cfg.num_key_value_heads} KV heads x ({cfg.head_dim} x {cache_dtype.itemsize} B{scale})\n"
              f"  tokens that fit: {plan.kv_tokens}\n"
              f"  max concurrent sequences at {args.prompt_len} prompt + {args.output_len} output tokens: "
              f"{plan.max_sequences(args.prompt_len, args.output_len)}\n"
              f"  memory split: weights {_mib(weights)} | KV cache {_mib(plan.kv_bytes)} | activation reserve "
              f"{_mib(plan.activation_reserve_bytes)} | total {_mib(total)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
