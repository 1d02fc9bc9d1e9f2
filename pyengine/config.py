"""Plain dataclasses for configuration; no framework."""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from typing import Any

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def memory_size(text: str) -> float | int:
    """'0.5' -> fraction 0.5; '2GiB', '512M', '1073741824' -> bytes (an argparse type)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use a fraction like 0.5 or bytes like 2GiB)")
    value = float(m.group(1))
    if not m.group(2) and not m.group(3) and 0 < value <= 1:
        return value
    return int(value * _UNITS[m.group(2)])


@dataclass
class ModelConfig:
    """The architecture of a Llama-family checkpoint, read from config.json or GGUF metadata."""

    architecture: str  # e.g. "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # QKV projection bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Family features; the defaults are plain Llama (model/families.py reads them from checkpoints).
    sliding_window: int | None = None  # attention window of the "sliding_attention" layers (Mistral, Gemma)
    layer_types: list[str] | None = None  # per layer "sliding_attention" | "full_attention" (None: all sliding
    # when sliding_window is set)
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers (unscaled)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # MLP activation: "silu" | "gelu_pytorch_tanh" (Gemma's GeGLU)
    post_norms: bool = False  # Gemma 2/3: the attention and MLP outputs are RMS-normed before the residual add
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    norm_weight_offset: float = 0.0  # Gemma's HF checkpoints store w of the (1 + w) RMSNorm (GGUF stores 1 + w)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma; default head_dim)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits

    def layer_window(self, layer: int) -> int:
        """The attention window of a layer (0: none)."""
        if not self.sliding_window or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return 0
        return self.sliding_window


# Running sequences above which no request speculates (SpeculativeConfig.disable_by_batch_size's default):
# past it a step is no longer bound by reading the weights, so rejected drafts cost real compute.
SPEC_DISABLE_BATCH_SIZE = 4


@dataclass
class SpeculativeConfig:
    """Speculative decoding, vLLM's --speculative-config keys. Only method "ngram" (prompt lookup) is
    implemented: the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked up in the
    prompt and output so far, and the tokens that followed the latest match are proposed as drafts."""

    method: str = "ngram"  # only "ngram"; a draft model ("model": PATH) is refused at start
    num_speculative_tokens: int = 5  # most drafts verified per step and request (k)
    prompt_lookup_max: int = 4  # longest suffix matched
    prompt_lookup_min: int = 2  # shortest suffix matched (1 would propose after any repeated token)
    # No request speculates while more sequences than this run (None: SPEC_DISABLE_BATCH_SIZE)
    disable_by_batch_size: int | None = None

    _KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
             "disable_by_batch_size")

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method must be 'ngram' (the only one implemented), got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is None:
            self.disable_by_batch_size = SPEC_DISABLE_BATCH_SIZE
        v = self.disable_by_batch_size
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"speculative disable_by_batch_size must be an integer >= 1, got {v!r}")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig") -> "SpeculativeConfig":
        """From the JSON text of --speculative-config or a dict (a TOML table); ValueError names what is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls._KEYS))
        if unknown:
            raise ValueError(f"speculative config has unknown keys {unknown}; known: {list(cls._KEYS)}")
        fields = dict(value)
        if "model" in fields:
            raise ValueError("speculative decoding with a draft model is not implemented; use method 'ngram'")
        return cls(**fields)


BLOCK_SIZES = (8, 16, 32, 64, 128)  # tokens per KV-cache block the kernels and flags take


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Sizes are in tokens unless named otherwise."""

    model: str | None = None  # HF folder or .gguf file; None = the bundled default model
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    # "auto": GGUF Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K tensors stay quantized on the CPU (native int8
    # kernels), other types are dequantized to dtype; "dequantize": every tensor is dequantized at load
    weights: str = "auto"
    device: str = "cpu"  # "cpu" | "cuda"
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    block_size: int = 16
    # KV cache budget: bytes (int > 1) or a fraction (0, 1] of the memory left after the weights.
    kv_cache_memory: float | int | None = None
    kv_cache_dtype: str = "auto"  # "auto" (= model dtype) | "fp8" | "int8"
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Most tokens one sequence computes in a step (0: up to max_num_batched_tokens): a long prompt is prefilled in
    # chunks of this size, and a request arriving meanwhile goes first (the chunk shrinks to make room for its first
    # chunk; scheduler.pyx), so it starts within about one chunk's time. None: 64 on CPU, 512 on CUDA (where small
    # steps leave the GPU idle). On the CPU the chunk bounds a newcomer's wait: with the heaviest step of an n=8
    # echo+logprobs 2k prompt in flight, its TTFT is 1.9-2.4x idle at 64 and 4.0x at 128 (bench/engine/bench_fairness.py
    # --cpu-steps; "heaviest" is the max of the heavy request's ~80 steps, 80-95 ms CPU against a 55-65 ms median
    # chunk, so it moves with noise). Prefill attention reads a bf16 cache in place, so 64-token chunks cost a long
    # prompt little: 1.2x (2k), about 1.0x (8k) the CPU time of unchunked steps (1 thread). On 2 threads a chunk's
    # ~300 kernel loops no longer wait for a helper thread the OS has not run (native/include/pyengine/parallel.h): on
    # shared cores a 64-token step took 3x a 1-thread one before (141 vs 43 ms), about 50 ms now. While nothing else
    # runs or waits, solo_prefill_tokens applies instead.
    long_prefill_tokens: int | None = None
    # The chunk of a prompt that has the engine to itself (the only request running or waiting), never below
    # long_prefill_tokens; None: 512 on CPU (engine.SOLO_PREFILL_TOKENS_CPU), long_prefill_tokens on CUDA. It
    # stalls nobody's decodes, and larger chunks run faster (a lone 2k prompt, bf16, 2 threads of a Zen 4 host:
    # 1,184 tok/s in chunks of 64, 1,303 in 256, 1,321 in 512; fp32 on a Zen 2 host: 325 in 256, 359 in 512). A
    # request that arrives meanwhile (AsyncLLM, the server) interrupts the chunk before the model's next layer
    # (pyengine/interrupt.py), so it waits about one layer of it; the prompt computes that chunk again.
    solo_prefill_tokens: int | None = None
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority"
    num_threads: int | None = None  # CPU threads for torch and the native kernels
    seed: int = 0  # seeds the RNG that draws a seed for each request without one
    # CUDA only. cuda_graphs: decode-only steps replay CUDA graphs captured at start-up, one per batch-size
    # bucket (pyengine/model/cuda_graphs.py). tensor_core_prefill: prompt chunks' attention runs
    # FlashAttention-2 on tensor cores (bf16/fp16, unquantized KV cache). Both off until measured on a device.
    cuda_graphs: bool = False
    tensor_core_prefill: bool = False
    # Speculative decoding (requests without a grammar): a SpeculativeConfig, or its JSON text / dict as
    # --speculative-config takes it. None: off.
    speculative: SpeculativeConfig | str | dict | None = None

    def __post_init__(self) -> None:
        if self.speculative is not None:
            self.speculative = SpeculativeConfig.parse(self.speculative)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.weights not in ("auto", "dequantize"):
            raise ValueError(f"weights must be auto or dequantize, got {self.weights!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto, fp8 or int8, got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.block_size not in BLOCK_SIZES:
            sizes = ", ".join(map(str, BLOCK_SIZES[:-1])) + f" or {BLOCK_SIZES[-1]}"
            raise ValueError(f"block_size must be {sizes}, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_tokens is not None and self.long_prefill_tokens < 0:
            raise ValueError(f"long_prefill_tokens must be >= 0, got {self.long_prefill_tokens}")
        if self.solo_prefill_tokens is not None and self.solo_prefill_tokens < 0:
            raise ValueError(f"solo_prefill_tokens must be >= 0, got {self.solo_prefill_tokens}")
        for name in ("cuda_graphs", "tensor_core_prefill"):
            if getattr(self, name) and self.device != "cuda":
                raise ValueError(f"{name} needs device='cuda', got device={self.device!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
