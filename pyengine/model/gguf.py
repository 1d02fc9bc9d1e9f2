"""GGUF files: metadata -> ModelConfig, tensors -> dequantized torch tensors in Hugging Face naming.

Dequantization is vectorised over whole tensors with torch (block layouts from ggml-quants.h):
  Q8_0: 34-byte blocks of 32 values: fp16 d, 32 x int8 q          -> d * q
  Q4_0: 18-byte blocks of 32 values: fp16 d, 16 bytes of nibbles   -> d * (q - 8)
  Q4_1: 20-byte blocks of 32 values: fp16 d, fp16 m, 16 bytes      -> d * q + m
  Q5_0 / Q5_1: as Q4_0 / Q4_1 (22 / 24 bytes) with a 4-byte mask of the 32 values' fifth bits after
        d (and m); Q5_0 is d * (q - 16)
  (nibbles: the low 4 bits of byte j are value j, the high 4 bits value j + 16)
  k-quants, 256-value super-blocks:
  Q4_K: 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of
        nibbles (bytes 32i..32i+31: low nibbles sub-block 2i, high 2i+1)   -> d*sc*q - dmin*m
  Q5_K: 176 bytes: as Q4_K, with 32 bytes of fifth bits (bit i of byte k: sub-block i, value k)
        before the nibbles
  Q6_K: 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (sub-blocks
        of 16), fp16 d                                                        -> d * sc * (q - 32)
`GGUFFile.blocks` hands the raw blocks of quantized tensors to QuantLinear (pyengine/ops/qlinear.py),
which keeps them quantized; `requantize` rewrites a file in another type (benchmarks, accuracy tests).
llama.cpp's converter permutes the Q/K projection rows of `llama` checkpoints (interleaved RoPE
pairs); `_unpermute` undoes it so the neox-style rotary kernel matches the original model.
"""
from __future__ import annotations

import functools
import math
import mmap
import os
import struct
import warnings
from typing import Any, NamedTuple

import numpy as np
import torch

from pyengine.config import ModelConfig
from pyengine.model.families import scaled_context

# GGUF architecture -> (HF architecture, Q/K rows permuted by the converter)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "phi3": ("Phi3ForCausalLM", False),
    "gemma2": ("Gemma2ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
}
# llama.cpp's Gemma 27B models scale attention by (hidden / heads)^-1/2, not head_dim^-1/2 (by layer count)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
               12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS", 30: "BF16"}
# read through the `gguf` package's numpy dequantizer (no torch path here; weights='auto' keeps them quantized)
_GGUF_DEQUANTIZED = ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}

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
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NAMES = {**_LAYER_NAMES, **_QK_NORMS, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_NAMES = {  # where an architecture's tensors differ from _LAYER_NAMES
    "qwen3": {**_LAYER_NAMES, **_QK_NORMS},
    "phi3": {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused, as in HF
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _ggml_type_name(type_id: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"#{type_id}"


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None for tensors we do not use)."""
    parts = gguf_name.split(".")
    layer_names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return None


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte `start` of each block, as fp32 [nb, 1, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float().view(-1, 1, 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[nb, 16] bytes -> [nb, 2, 16] uint8: the low nibbles (values 0..15), then the high ones (16..31)."""
    return torch.stack([qs & 0xF, qs >> 4], dim=1)


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF tensor data -> fp32 (or the stored float dtype for F32/F16/BF16) tensor of `shape`.

    Quantized types: one fused multiply-add pass per tensor over a [blocks, 2, 16] view; the integer
    operand is promoted inside the kernel, never materialised as floats.
    """
    with warnings.catch_warnings():  # the memmap is read-only; we never write through these views
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.ascontiguousarray(raw))
    if type_name == "F32":
        return data.view(torch.float32).reshape(shape).clone()  # own memory, not the read-only map
    if type_name == "F16":
        return data.view(torch.float16).reshape(shape).clone()  # own memory, not the read-only map
    if type_name == "BF16":
        return data.view(torch.uint8).view(torch.bfloat16).reshape(shape).clone()
    if type_name in _GGUF_DEQUANTIZED:
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)
        return torch.from_numpy(values).reshape(shape)
    blocks = data.view(torch.uint8).reshape(-1, _BLOCK_BYTES[type_name])
    if type_name == "Q8_0":
        values = _half(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).view(-1, 2, 16)
    elif type_name == "Q4_0":
        values = _half(blocks, 0) * (_nibbles(blocks[:, 2:]).view(torch.int8) - 8)
    elif type_name == "Q4_1":
        values = torch.addcmul(_half(blocks, 2), _half(blocks, 0), _nibbles(blocks[:, 4:]))
    elif type_name == "Q5_0":
        values = _half(blocks, 0) * (_with_fifth_bits(blocks[:, 6:], blocks[:, 2:6]).view(torch.int8) - 16)
    elif type_name == "Q5_1":
        values = torch.addcmul(_half(blocks, 2), _half(blocks, 0), _with_fifth_bits(blocks[:, 8:], blocks[:, 4:8]))
    elif type_name == "Q6_K":
        values = _q6_k(blocks)
    else:  # Q4_K, Q5_K
        values = _q45_k(blocks, fifth_bits=type_name == "Q5_K")
    return values.reshape(shape)


def _with_fifth_bits(qs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: [nb, 16] nibble bytes + [nb, 4] bytes of a little-endian 32-bit mask -> [nb, 2, 16]."""
    bits = (mask.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [nb, 4, 8]: bit j of byte i
    return _nibbles(qs) | (bits.reshape(-1, 2, 16) << 4)


def _q45_k(blocks: torch.Tensor, fifth_bits: bool) -> torch.Tensor:
    """Q4_K / Q5_K super-blocks -> [nb, 8, 32] fp32."""
    nb = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc = blocks[:, 4:16].reshape(nb, 3, 4)
    # eight 6-bit (scale, min) pairs: scales 0-3 and mins 0-3 in the low 6 bits of bytes 0-3 and 4-7;
    # scales/mins 4-7 in the nibbles of bytes 8-11 with their top 2 bits in the top bits of bytes 0-7
    lo, hi, mix = sc[:, 0], sc[:, 1], sc[:, 2]
    scale = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=1).float().view(nb, 8, 1)
    low = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=1).float().view(nb, 8, 1)
    qs = blocks[:, -128:].reshape(nb, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32)
    if fifth_bits:
        qh = blocks[:, 16:48]  # [nb, 32]: bit i of byte k is value k of sub-block i
        q = q | (((qh.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1) << 4)
    return (d * scale) * q - dmin * low


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks -> [nb, 16, 16] fp32."""
    nb = blocks.shape[0]
    ql = blocks[:, :128].reshape(nb, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    q = ((ql & 0x0F).reshape(nb, 8, 32) | ((qh & 0x03).reshape(nb, 8, 32) << 4)).view(torch.int8) - 32
    scale = blocks[:, 192:208].contiguous().view(torch.int8).float().view(nb, 16, 1)
    d = blocks[:, 208:210].contiguous().view(torch.float16).float().view(nb, 1, 1)
    return (d * scale) * q.reshape(nb, 16, 16)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows: [H, 2, D/2] pairs were stored as [H, D/2, 2]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
               12: "<f8"}
_STRING, _ARRAY = 8, 9
# type id -> (values per block, bytes per block) for the types we read
_TYPE_SIZES = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
               10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 20: (32, 18),
               23: (256, 136)}


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # torch order (GGUF stores ne0 first; we reverse it)
    type_id: int
    offset: int  # absolute, in the file


class _Parser:
    """GGUF v2/v3 header parser (gguf.GGUFReader builds numpy views per array item: seconds per file)."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        if self.pos > len(self.buf):
            raise ValueError("string runs past the end of the file")
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype in _NP_SCALARS:
                arr = np.frombuffer(self.buf, dtype=_NP_SCALARS[itype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(itype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.scalar(_SCALARS[vtype])


class GGUFFile:
    """An open GGUF file: its metadata as plain Python values and its tensors by Hugging Face name."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            p = _Parser(memoryview(self._mmap))
            if bytes(p.buf[:4]) != b"GGUF":
                raise ValueError("bad magic (not a GGUF file)")
            p.pos = 4
            version, n_tensors, n_kv = p.scalar("<I"), p.scalar("<Q"), p.scalar("<Q")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (supported: 2, 3)")
            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = p.string()
                self.fields[key] = p.value(p.scalar("<I"))
            infos = []
            for _ in range(n_tensors):
                name, ndim = p.string(), p.scalar("<I")
                dims = [p.scalar("<Q") for _ in range(ndim)]
                infos.append((name, tuple(reversed(dims)), p.scalar("<I"), p.scalar("<Q")))
            align = int(self.fields.get("general.alignment", 32))
            data_start = (p.pos + align - 1) // align * align
        except (ValueError, struct.error, OSError) as exc:  # truncated or not a GGUF at all
            raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.tensors = {n: TensorInfo(n, shape, t, data_start + off) for n, shape, t, off in infos}
        self.arch = str(self.meta("general.architecture", ""))

    def meta(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def arch_meta(self, key: str, default: Any = None) -> Any:
        return self.meta(f"{self.arch}.{key}", default)

    def config(self) -> ModelConfig:
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{self.path}: GGUF architecture {self.arch!r} is not supported; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        if "rope_factors_long.weight" in self.tensors:
            raise ValueError(f"{self.path}: LongRoPE (rope_factors_long/short) is not supported")
        hidden = int(self.arch_meta("embedding_length"))
        heads = int(self.arch_meta("attention.head_count"))
        layers = int(self.arch_meta("block_count"))
        vocab = self.arch_meta("vocab_size") or len(self.meta("tokenizer.ggml.tokens", []))
        if not vocab:
            vocab = int(self.tensors["token_embd.weight"].shape[0])
        rope_scaling, max_pos = scaled_context(*self._rope_scaling(int(self.arch_meta("context_length", 2048))))
        eos = [self.meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[self.arch][0],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.arch_meta("feed_forward_length")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(self.arch_meta("attention.head_count_kv", heads)),
            head_dim=int(self.arch_meta("attention.key_length", hidden // heads)),
            rms_norm_eps=float(self.arch_meta("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self.arch_meta("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            bos_token_id=self.meta("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(int(e) for e in eos if e is not None)),
            **self._family_fields(hidden, heads, layers),
        )

    def _rope_scaling(self, max_pos: int) -> tuple[dict | None, int]:
        """(RoPE scaling from the metadata or the `rope_freqs` frequency factors (Llama 3.x), context length)."""
        if "rope_freqs.weight" in self.tensors:
            factors = self.tensor("rope_freqs.weight", None).float().flatten().tolist()
            return {"rope_type": "freq_factors", "factors": factors}, max_pos
        kind = self.arch_meta("rope.scaling.type")
        if not kind or kind == "none":
            return None, max_pos
        factor = float(self.arch_meta("rope.scaling.factor"))
        if kind == "linear":
            return {"rope_type": "linear", "factor": factor}, max_pos
        if kind == "yarn":
            old_len = int(self.arch_meta("rope.scaling.original_context_length", max_pos))
            return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": old_len}, max_pos
        raise ValueError(f"{self.path}: rope scaling type {kind!r} is not supported (linear, yarn, rope_freqs)")

    def _family_fields(self, hidden: int, heads: int, layers: int) -> dict[str, Any]:
        """ModelConfig's family fields (model/families.py) from the metadata. Gemma's converter has
        already added the 1 of its (1 + w) norms to the weights."""
        window = self.arch_meta("attention.sliding_window")
        fields: dict[str, Any] = dict(qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
                                      sliding_window=int(window) if window else None)
        if self.arch in ("gemma2", "gemma3"):
            # the sliding layers: a pattern n (the last of every n layers is global; llama.cpp's defaults:
            # 2 for Gemma 2, 6 for Gemma 3) or one flag per layer
            pattern = self.arch_meta("attention.sliding_window_pattern", 2 if self.arch == "gemma2" else 6)
            sliding = pattern if isinstance(pattern, list) else [i % pattern < pattern - 1 for i in range(layers)]
            if self.arch == "gemma3":
                fields["rope_local_theta"] = float(self.arch_meta("rope.freq_base_swa", 10000.0))
            fields.update(
                layer_types=["sliding_attention" if x else "full_attention" for x in sliding],
                hidden_act="gelu_pytorch_tanh", post_norms=True, embed_scale=math.sqrt(hidden),
                query_pre_attn_scalar=hidden / heads if layers == _GEMMA_27B_LAYERS[self.arch] else None,
                attn_logit_softcap=self.arch_meta("attn_logit_softcapping"),
                final_logit_softcap=self.arch_meta("final_logit_softcapping"),
            )
        return fields

    def hf_names(self) -> dict[str, str]:
        """HF name -> GGUF name for every tensor the model uses."""
        return {h: name for name in self.tensors if (h := hf_name(name, self.arch)) is not None}

    def type_name(self, gguf_name: str) -> str:
        t = self.tensors[gguf_name]
        return _TYPE_NAMES.get(t.type_id) or _ggml_type_name(t.type_id)

    def _raw(self, gguf_name: str) -> tuple[str, np.ndarray]:
        """(type name, the tensor's bytes as a read-only view of the file)."""
        t = self.tensors[gguf_name]
        type_name = _TYPE_NAMES.get(t.type_id)
        if type_name is None:
            raise ValueError(
                f"{self.path}: tensor {gguf_name!r} has GGML type {_ggml_type_name(t.type_id)}, which is not "
                f"supported; supported: {', '.join(_TYPE_NAMES.values())}"
            )
        per_block, block_bytes = _TYPE_SIZES[t.type_id]
        nbytes = math.prod(t.shape) // per_block * block_bytes
        if t.offset + nbytes > len(self._mmap):
            raise ValueError(f"{self.path}: tensor {gguf_name!r} runs past the end of the file (truncated?)")
        return type_name, np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes, offset=t.offset)

    def _unpermute_rows(self, w: torch.Tensor, gguf_name: str, cfg: ModelConfig | None) -> torch.Tensor:
        if GGUF_ARCHITECTURES[self.arch][1]:
            if ".attn_q." in gguf_name:
                return _unpermute(w, cfg.num_attention_heads)
            if ".attn_k." in gguf_name:
                return _unpermute(w, cfg.num_key_value_heads)
        return w

    def tensor(self, gguf_name: str, cfg: ModelConfig | None) -> torch.Tensor:
        """One tensor, dequantized (fp32 for quantized types), Q/K rows un-permuted where needed."""
        type_name, raw = self._raw(gguf_name)
        return self._unpermute_rows(dequantize(raw, type_name, self.tensors[gguf_name].shape), gguf_name, cfg)

    def blocks(self, gguf_name: str, cfg: ModelConfig) -> tuple[str, torch.Tensor]:
        """(type name, uint8 [rows, row bytes]): a 2-D tensor's quantized blocks as stored (a view of the
        read-only file where no rows move: never write to it), Q/K rows un-permuted where needed."""
        type_name, raw = self._raw(gguf_name)
        rows = self.tensors[gguf_name].shape[0]
        with warnings.catch_warnings():  # read-only map: torch warns, and the copy below never writes it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(raw).view(rows, -1)
        return type_name, self._unpermute_rows(data, gguf_name, cfg)


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


def requantize(src: str, dst: str, type_name: str) -> str:
    """Write `src` to `dst` with every quantized tensor requantized to `type_name` (e.g. "Q8_0", "Q6_K"), or
    to llama.cpp's per-tensor mix for "Q4_K_M" / "Q5_K_M" (pyengine.model.kquants.mix_type); float
    tensors and the metadata are copied as they are. Through the `gguf` package's reference quantizer,
    and kquants' for the K-quants and IQ4_NL (with llama.cpp's fallback type for rows that are not whole
    super-blocks: IQ4_NL for Q2_K / Q3_K). For benchmarks and accuracy tests on one model in several types."""
    import gguf

    from pyengine.model.kquants import K_FALLBACK, mix_type, quantize_k

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=None)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.alignment":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    names = {t.name for t in reader.tensors}
    n_layers = 1 + max((int(n.split(".")[1]) for n in names if n.startswith("blk.")), default=0)
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape)]  # torch order
        if t.tensor_type in float_types:
            writer.add_tensor(t.name, np.asarray(t.data), raw_shape=list(np.asarray(t.data).shape),
                              raw_dtype=t.tensor_type)
            continue
        if type_name in ("Q4_K_M", "Q5_K_M"):
            target = mix_type(type_name, t.name, shape[-1], n_layers, tied="output.weight" not in names)
        else:
            target = K_FALLBACK[type_name] if type_name in K_FALLBACK and shape[-1] % 256 else type_name
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        blocks = (quantize_k(values, target) if target in K_FALLBACK or target == "IQ4_NL"
                  else gguf.quants.quantize(values, gguf.GGMLQuantizationType[target]))
        writer.add_tensor(t.name, blocks, raw_shape=list(blocks.shape), raw_dtype=gguf.GGMLQuantizationType[target])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
