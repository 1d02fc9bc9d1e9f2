"""Helpers other test files may import: the default model, tiny HF checkpoints, a one-sequence runner."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pyengine.config import ModelConfig
from pyengine.model.loader import default_model_path  # noqa: F401  (re-exported for other tests)
from pyengine.model.metadata import AttentionMetadata, allocate_kv_caches

TINY_ARCHS = ("llama", "llama_tied", "llama3_rope", "mistral", "qwen2", "qwen2_yarn", "mistral_window", "qwen3",
              "phi3", "gemma2", "gemma3")
# the Llama-shaped kinds, which run bf16 steps in one native call (decoder_layers); the others run op by op
TINY_NATIVE_ARCHS = ("llama", "llama_tied", "llama3_rope", "mistral", "qwen2", "qwen2_yarn", "phi3", "mistral_window")
TINY_WINDOW = 24  # sliding window of the windowed kinds: well inside the parity tests' 130-token prompts


def write_tiny_checkpoint(folder: str, kind: str = "llama", seed: int = 0, vocab_size: int = 256) -> str:
    """A random-weight HF checkpoint (config.json + model.safetensors) written by transformers.

    kind: llama (untied, GQA 4:2), llama_tied, llama3_rope (rope_scaling llama3), mistral (GQA 4:1),
    qwen2 (QKV bias, GQA 6:2, head_dim 8), qwen2_yarn (Qwen2.5-style YaRN: 64 -> 256 positions),
    llama_dynamic (dynamic NTK: 64 -> 128 positions), llama_d64 (head_dim 64, GQA 9:3, 1024 positions),
    llama_k256 (hidden 256, intermediate 512: K-quantizable rows), mistral_window (sliding window on every layer),
    qwen3 (q/k norms), phi3 (fused qkv and gate_up), gemma2 (GeGLU, sandwich norms, a sliding and a
    global layer, soft-caps that bite), gemma3 (q/k norms, local and linear-scaled global RoPE,
    query_pre_attn_scalar != head_dim).
    Weights are scaled up so logits are not all ~0.
    """
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    if kind in ("llama", "llama_tied"):
        config = tf.LlamaConfig(**common, tie_word_embeddings=kind == "llama_tied", rope_theta=500.0)
        cls = tf.LlamaForCausalLM
    elif kind == "llama3_rope":
        config = tf.LlamaConfig(**common, rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":
        config = tf.MistralConfig(**{**common, "num_key_value_heads": 1}, sliding_window=None)
        cls = tf.MistralForCausalLM
    elif kind == "qwen2":
        config = tf.Qwen2Config(**{**common, "num_attention_heads": 6, "num_key_value_heads": 2})
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen2_yarn":
        config = tf.Qwen2Config(**{**common, "max_position_embeddings": 64}, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
        cls = tf.Qwen2ForCausalLM
    elif kind == "llama_d64":  # the default model's attention shape: head_dim 64, GQA 9:3
        config = tf.LlamaConfig(**{**common, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                                   "max_position_embeddings": 1024})
        cls = tf.LlamaForCausalLM
    elif kind == "llama_k256":  # rows of whole 256-value super-blocks, for K-quant tensors
        config = tf.LlamaConfig(**{**common, "hidden_size": 256, "intermediate_size": 512})
        cls = tf.LlamaForCausalLM
    elif kind == "llama_dynamic":
        config = tf.LlamaConfig(**{**common, "max_position_embeddings": 64}, rope_scaling={
            "rope_type": "dynamic", "factor": 2.0})
        cls = tf.LlamaForCausalLM
    elif kind == "mistral_window":
        config = tf.MistralConfig(**common, sliding_window=TINY_WINDOW)
        cls = tf.MistralForCausalLM
    elif kind == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=12)
        cls = tf.Qwen3ForCausalLM
    elif kind == "phi3":
        config = tf.Phi3Config(**common, pad_token_id=0)
        cls = tf.Phi3ForCausalLM
    elif kind == "gemma2":
        config = tf.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=TINY_WINDOW,
                                 attn_logit_softcapping=2.0, final_logit_softcapping=3.0, pad_token_id=0)
        cls = tf.Gemma2ForCausalLM
    elif kind in ("gemma3", "gemma3_gguf"):  # gemma3_gguf: the scale GGUF implies (head_dim)
        config = tf.Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=10 if kind == "gemma3" else 16,
            sliding_window=TINY_WINDOW, pad_token_id=0,
            layer_types=["sliding_attention", "full_attention"], rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(f"unknown tiny checkpoint kind {kind!r}; one of {TINY_ARCHS}")
    torch.manual_seed(seed)
    model = cls(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "bias" in name else 0.15))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def step_metadata(block_table: torch.Tensor, block_size: int, start: int, length: int) -> AttentionMetadata:
    """Metadata for one sequence computing tokens [start, start+length) over `block_table` [max_blocks]."""
    pos = torch.arange(start, start + length)
    slots = block_table.long()[pos // block_size] * block_size + pos % block_size
    return AttentionMetadata(
        slot_mapping=slots,
        block_tables=block_table[None].to(torch.int32).contiguous(),
        seq_lens=torch.tensor([start + length], dtype=torch.int32),
        query_start_loc=torch.tensor([0, length], dtype=torch.int32),
        max_seq_len=start + length,
    )


class SequenceRunner:
    """Run one sequence through a model: prompt (optionally in chunks) then decode steps, over a paged
    cache whose block table is a shuffled permutation (so paging bugs cannot hide)."""

    def __init__(self, model, cfg: ModelConfig, max_tokens: int, block_size: int = 16,
                 cache_dtype: torch.dtype | None = None, device: str = "cpu"):
        self.model, self.cfg, self.block_size, self.device = model, cfg, block_size, torch.device(device)
        nb = (max_tokens + block_size - 1) // block_size + 1
        self.caches = allocate_kv_caches(cfg, nb + 2, block_size, cache_dtype or model.dtype, self.device)
        self.block_table = torch.randperm(nb + 2, generator=torch.Generator().manual_seed(0))[:nb].to(torch.int32)
        self.length = 0

    def step(self, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Compute `ids` (appended to the sequence): logits [V] fp32 of the last one ([n, V] if all_logits)."""
        n = len(ids)
        meta = step_metadata(self.block_table, self.block_size, self.length, n)
        dev = self.device
        meta = AttentionMetadata(meta.slot_mapping.to(dev), meta.block_tables.to(dev), meta.seq_lens.to(dev),
                                 meta.query_start_loc.to(dev), meta.max_seq_len)
        rows = torch.arange(n) if all_logits else torch.tensor([n - 1])
        out = self.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                         torch.arange(self.length, self.length + n, device=dev), self.caches, meta, rows.to(dev))
        self.length += n
        out = out.cpu()
        return out if all_logits else out[0]

    def prefill(self, ids: list[int], chunk: int | None = None) -> torch.Tensor:
        chunk = chunk or len(ids)
        for i in range(0, len(ids), chunk):
            logits = self.step(ids[i : i + chunk])
        return logits

    def greedy(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int] = frozenset()):
        """(generated ids, first-step logits): greedy decoding one token per step."""
        first = logits = self.prefill(prompt)
        out: list[int] = []
        for _ in range(max_new_tokens):
            tok = int(torch.argmax(logits))
            out.append(tok)
            if tok in stop_ids or len(out) == max_new_tokens:
                break
            logits = self.step([tok])
        return out, first


def real_engine(parts, kv_tokens: int = 4096, **config):
    """An Engine on already-loaded parts (the `real_parts` fixture) with a KV pool of `kv_tokens`."""
    from pyengine.config import EngineConfig
    from pyengine.engine.engine import Engine
    from pyengine.model.metadata import kv_bytes_per_token

    config.setdefault("dtype", "float32")
    config.setdefault("max_model_len", kv_tokens)  # the engine refuses a pool smaller than one full sequence
    config["kv_cache_memory"] = kv_tokens * kv_bytes_per_token(parts[0], parts[1].dtype)
    return Engine(EngineConfig(**config), parts=parts)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_ids: set[int] = frozenset()):
    """transformers' greedy continuation (ids) and its first-step logits, one token per step."""
    out = model(torch.tensor([prompt]), use_cache=True)
    first = logits = out.logits[0, -1]
    past, tokens = out.cache, []
    for _ in range(max_new_tokens):
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        if tok in stop_ids or len(tokens) == max_new_tokens:
            break
        out = model(torch.tensor([[tok]]), cache=past, use_cache=True)
        past, logits = out.cache, out.logits[0, -1]
    return tokens, first


@torch.inference_mode()
def hf_log_softmax(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] fp32: transformers' next-token log-probabilities after each prefix of `ids`."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


# Prose topics of the Python reference manual, shipped with every CPython (pydoc_data): a long,
# natural text that needs no download, for teacher-forced agreement tests.
_PROSE_TOPICS = ("naming", "execmodel", "exceptions", "truth", "types")


def natural_text_ids(tokenizer, n: int) -> list[int]:
    """The first n token ids (no BOS) of a fixed natural English text."""
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in _PROSE_TOPICS)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= n, f"the text has only {len(ids)} tokens"
    return ids[:n]


def gguf_folder_and_name(path: str | None = None) -> tuple[str, str]:
    path = path or default_model_path()
    return os.path.dirname(path), os.path.basename(path)


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py's Q/K row permutation (what our loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# HF -> GGUF tensor names as llama.cpp's converter writes them (gguf-py tensor_mapping), per architecture
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}
_GGUF_GEMMA_NAMES = {**_GGUF_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                     "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_GGUF_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}


def llama3_rope_freqs(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py: the llama3 scaling of a checkpoint as `rope_freqs` factors."""
    import math

    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_tiny_gguf(path: str, hf_folder: str, types: dict[str, str] | None = None) -> str:
    """Convert a tiny HF checkpoint (write_tiny_checkpoint: llama kinds, qwen2, qwen3, phi3, gemma2, gemma3)
    to GGUF the way llama.cpp does: Q/K rows permuted (llama), llama3 scaling as `rope_freqs`, YaRN in
    the metadata, Gemma's norms stored as 1 + w, its soft-caps and window in the metadata.

    types: GGUF tensor-name substring (the first that matches) -> "F32" | "F16" | "BF16" (default F32): the
    file holds exactly the HF weights rounded to that type; or a type pyengine.model.kquants quantizes
    ("Q2_K", "Q3_K", ...; rows of whole blocks). Tokenizer metadata is a dummy byte vocabulary.
    """
    import json

    import gguf
    from safetensors.torch import load_file

    from pyengine.model.kquants import quantize_k

    with open(os.path.join(hf_folder, "config.json")) as f:
        c = json.load(f)
    sd = load_file(os.path.join(hf_folder, "model.safetensors"))
    arch = _GGUF_ARCHS[c["architectures"][0]]
    gemma = arch.startswith("gemma")
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rope = c["rope_parameters"]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, rope["rope_theta"], head_dim))
    if c.get("sliding_window"):
        w.add_sliding_window(c["sliding_window"])
    if arch == "gemma3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if rope["full_attention"]["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_vocab_size(c["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(c["vocab_size"])])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
    layer_names = _GGUF_GEMMA_NAMES if gemma else _GGUF_LAYER_NAMES
    for name, t in sd.items():
        parts = name.split(".")
        if parts[1] == "layers":
            gname = f"blk.{parts[2]}.{layer_names['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            gname = f"{names[parts[-2] if parts[0] == 'model' else parts[0]]}.weight"
        if gemma and name.endswith("norm.weight"):
            t = t + 1
        if arch == "llama" and ".attn_q." in gname:
            t = _llama_cpp_permute(t, c["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in gname:
            t = _llama_cpp_permute(t, c["num_key_value_heads"])
        kind = next((v for k, v in (types or {}).items() if k in gname), "F32")
        if kind == "BF16":
            raw = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
            w.add_tensor(gname, raw, raw_shape=list(raw.shape), raw_dtype=gguf.GGMLQuantizationType.BF16)
        elif kind not in ("F32", "F16"):
            blocks = quantize_k(t.numpy(), kind)
            w.add_tensor(gname, blocks, raw_shape=list(blocks.shape), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            w.add_tensor(gname, t.numpy().astype(np.float16 if kind == "F16" else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def smaps_field(addr: int, name: str) -> str:
    """Field `name` (e.g. "Rss:") of the memory map holding `addr` in /proc/self/smaps: its first value."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a map's first line: start-end perms ...
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == name:
                return line.split()[1]
    raise AssertionError(f"no {name} line for address {addr:#x}")


def huge_page_eligible(addr: int) -> bool:
    """Whether the memory map holding `addr` may get transparent huge pages (its THPeligible in
    /proc/self/smaps); skips where the OS has no THP or it is off."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                pytest.skip("transparent huge pages are off")
        return smaps_field(addr, "THPeligible:") == "1"
    except FileNotFoundError:
        pytest.skip("no transparent huge pages on this OS")
