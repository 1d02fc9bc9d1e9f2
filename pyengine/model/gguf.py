"""GGUF files: metadata -> ModelConfig, tensors -> dequantized torch tensors in Hugging Face naming.

Dequantization is vectorised over whole tensors with torch (block layouts from ggml-quants.h):
  Q8_0: 34-byte blocks of 32 values: fp16 d, 32 x int8 q          -> d * q
  Q4_0: 18-byte blocks of 32 values: fp16 d, 16 bytes of nibbles   -> d * (q - 8)
  Q4_1: 20-byte blocks of 32 values: fp16 d, fp16 m, 16 bytes      -> d * q + m
  (nibbles: the low 4 bits of byte j are value j, the high 4 bits value j + 16)
llama.cpp's converter permutes the Q/K projection rows of `llama` checkpoints (interleaved RoPE
pairs); `_unpermute` undoes it so the neox-style rotary kernel matches the original model.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import numpy as np
import torch

from pyengine.config import ModelConfig

# GGUF architecture -> (HF architecture, Q/K rows permuted by the converter)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}
_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 30: "BF16"}
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None for tensors we do not use)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return None


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 0xF, qs >> 4], dim=1)


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF tensor data -> fp32 (or the stored float dtype for F32/F16/BF16) tensor of `shape`."""
    with warnings.catch_warnings():  # the memmap is read-only; we never write through these views
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.ascontiguousarray(raw))
    if type_name == "F32":
        return data.view(torch.float32).reshape(shape)
    if type_name == "F16":
        return data.view(torch.float16).reshape(shape)
    if type_name == "BF16":
        return data.view(torch.uint8).view(torch.bfloat16).reshape(shape)
    blocks = data.view(torch.uint8).reshape(-1, _BLOCK_BYTES[type_name])
    if type_name == "Q8_0":
        values = _half(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8)
    elif type_name == "Q4_0":
        values = _half(blocks, 0) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8)
    else:  # Q4_1
        values = _half(blocks, 0) * _nibbles(blocks[:, 4:]) + _half(blocks, 2)
    return values.reshape(shape)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows: [H, 2, D/2] pairs were stored as [H, D/2, 2]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFFile:
    """An open GGUF file: its metadata as plain Python values and its tensors by Hugging Face name."""

    def __init__(self, path: str):
        from gguf import GGUFReader

        self.path = path
        try:
            self.reader = GGUFReader(path, "r")
        except Exception as exc:  # truncated or not a GGUF at all
            raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = str(self.meta("general.architecture", ""))

    def meta(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value

    def arch_meta(self, key: str, default: Any = None) -> Any:
        return self.meta(f"{self.arch}.{key}", default)

    def config(self) -> ModelConfig:
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{self.path}: GGUF architecture {self.arch!r} is not supported; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        if "rope_freqs.weight" in self.tensors:
            raise ValueError(f"{self.path}: RoPE frequency factors (rope_freqs.weight) are not supported")
        hidden = int(self.arch_meta("embedding_length"))
        heads = int(self.arch_meta("attention.head_count"))
        vocab = self.arch_meta("vocab_size") or len(self.meta("tokenizer.ggml.tokens", []))
        if not vocab:
            vocab = int(self.tensors["token_embd.weight"].shape[1])
        scaling = self.arch_meta("rope.scaling.type")
        rope_scaling = None
        if scaling and scaling != "none":
            if scaling != "linear":
                raise ValueError(f"{self.path}: rope scaling type {scaling!r} is not supported (linear only)")
            rope_scaling = {"rope_type": "linear", "factor": float(self.arch_meta("rope.scaling.factor"))}
        eos = [self.meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[self.arch][0],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.arch_meta("feed_forward_length")),
            num_hidden_layers=int(self.arch_meta("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self.arch_meta("attention.head_count_kv", heads)),
            head_dim=int(self.arch_meta("attention.key_length", hidden // heads)),
            rms_norm_eps=float(self.arch_meta("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self.arch_meta("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(self.arch_meta("context_length", 2048)),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            bos_token_id=self.meta("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(int(e) for e in eos if e is not None)),
        )

    def hf_names(self) -> dict[str, str]:
        """HF name -> GGUF name for every tensor the model uses."""
        return {h: name for name in self.tensors if (h := hf_name(name)) is not None}

    def tensor(self, gguf_name: str, cfg: ModelConfig) -> torch.Tensor:
        """One tensor, dequantized (fp32 for quantized types), Q/K rows un-permuted where needed."""
        t = self.tensors[gguf_name]
        type_name = _TYPE_NAMES.get(int(t.tensor_type))
        if type_name is None:
            raise ValueError(
                f"{self.path}: tensor {gguf_name!r} has GGML type {t.tensor_type.name}, which is not supported; "
                f"supported: {', '.join(_TYPE_NAMES.values())}"
            )
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        w = dequantize(t.data, type_name, shape)
        if GGUF_ARCHITECTURES[self.arch][1]:
            if ".attn_q." in gguf_name:
                w = _unpermute(w, cfg.num_attention_heads)
            elif ".attn_k." in gguf_name:
                w = _unpermute(w, cfg.num_key_value_heads)
        return w


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime: float) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """A GGUFFile, shared between the model loader and the tokenizer (parsing the header takes seconds)."""
    try:
        mtime = os.path.getmtime(path)
    except OSError as exc:
        raise FileNotFoundError(f"{path}: cannot open GGUF file ({exc})") from exc
    return _open_cached(os.path.abspath(path), mtime)
