"""Plain dataclasses for configuration; no framework."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Sizes are in tokens unless named otherwise."""

    model: str | None = None  # HF folder or .gguf file; None = the bundled default model
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    # "auto": GGUF Q8_0/Q4_0/Q4_1 tensors stay quantized on the CPU (native int8 kernels), other types
    # are dequantized to dtype; "dequantize": every tensor is dequantized to dtype at load
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
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority"
    num_threads: int | None = None  # CPU threads for torch and the native kernels
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.weights not in ("auto", "dequantize"):
            raise ValueError(f"weights must be auto or dequantize, got {self.weights!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto, fp8 or int8, got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
