"""Loading: GGUF dequantization and Q/K un-permutation, configs, KV cache sizing, bad inputs."""
import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from pyengine.config import ModelConfig
from pyengine.model.gguf import _unpermute, dequantize
from pyengine.model.loader import default_model_path, load_model, resolve_model_path
from pyengine.model.metadata import allocate_kv_caches, kv_bytes_per_token
from tests.model_helpers import (SequenceRunner, _llama_cpp_permute, huge_page_eligible, write_tiny_checkpoint,
                                 write_tiny_gguf)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")), "llama")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_matches_gguf_reference(qtype):
    x = np.random.default_rng(0).standard_normal((6, 256)).astype(np.float32)
    raw = gguf.quants.quantize(x, QT[qtype])
    want = gguf.quants.dequantize(raw, QT[qtype])
    got = dequantize(raw, qtype, (6, 256))
    assert got.dtype == torch.float32 and got.shape == (6, 256)
    torch.testing.assert_close(got, torch.from_numpy(want), rtol=0, atol=1e-6)
    assert (got - torch.from_numpy(x)).abs().max() < 0.5  # and it is a plausible reconstruction


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_random_blocks_match_gguf_reference(qtype):
    """Every bit pattern of the quants and scales (random bytes; the fp16 factors set to sane values)."""
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[QT[qtype]]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(40, block_bytes), dtype=np.uint8)
    halves = {"Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[qtype]
    for off in halves:
        raw[:, off:off + 2] = rng.uniform(-0.1, 0.1, 40).astype(np.float16).view(np.uint8).reshape(40, 2)
    want = gguf.quants.dequantize(raw.reshape(-1), QT[qtype]).reshape(-1)
    got = dequantize(raw.reshape(-1), qtype, (40 * per_block,))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.from_numpy(want), rtol=0, atol=0)


def test_dequantize_float_types():
    x = torch.randn(3, 8)
    assert torch.equal(dequantize(x.numpy(), "F32", (3, 8)), x)
    assert torch.equal(dequantize(x.half().numpy(), "F16", (3, 8)), x.half())
    raw = x.bfloat16().view(torch.int16).numpy().view(np.uint8)
    assert torch.equal(dequantize(raw, "BF16", (3, 8)), x.bfloat16())


@pytest.mark.parametrize("heads", [1, 3, 4])
def test_unpermute_inverts_llama_cpp_permute(heads):
    w = torch.randn(heads * 16, 10)
    assert torch.equal(_unpermute(_llama_cpp_permute(w, heads), heads), w)
    assert not torch.equal(_llama_cpp_permute(w, heads), w)


def test_default_model_config():
    path = resolve_model_path(None)
    assert path == default_model_path() and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    from pyengine.model.gguf import open_gguf

    cfg = open_gguf(path).config()
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers) == ("LlamaForCausalLM", 576, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0
    assert cfg.eos_token_ids == [2] and cfg.max_position_embeddings == 8192


def test_gguf_of_tiny_llama_matches_safetensors(tiny_llama, tmp_path):
    """llama.cpp-style conversion (permuted Q/K rows) loads back to the same model."""
    cfg_hf, hf_model = load_model(tiny_llama, torch.float32, "cpu")
    cfg_f32, f32_model = load_model(write_tiny_gguf(str(tmp_path / "f32.gguf"), tiny_llama), torch.float32, "cpu")
    assert cfg_f32.num_key_value_heads == 2 and not cfg_f32.tie_word_embeddings
    mixed = write_tiny_gguf(str(tmp_path / "mixed.gguf"), tiny_llama, {"attn_q": "F16", "attn_k": "BF16"})
    _, mixed_model = load_model(mixed, torch.float32, "cpu")
    ids = [int(i) for i in torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1))]
    want = SequenceRunner(hf_model, cfg_hf, 64).prefill(ids)
    torch.testing.assert_close(SequenceRunner(f32_model, cfg_f32, 64).prefill(ids), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(SequenceRunner(mixed_model, cfg_f32, 64).prefill(ids), want, rtol=0, atol=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_load_dtypes_and_weight_bytes(tiny_llama, dtype):
    cfg, model = load_model(tiny_llama, dtype, "cpu")
    assert model.embed.dtype == dtype
    # bf16 on a CPU with bf16 dot products, fp32 on an AVX2 build without AVX-512: the projections live only as
    # the packed copies of PackedLinear / Fp32Linear
    packed = getattr(model.linears[0].qkv, "packed", None) is not None
    proj = model.linears[0].qkv.packed if packed else model.layers[0].qkv
    assert proj.dtype == torch.bfloat16 if dtype == torch.bfloat16 else proj.dtype == dtype
    assert model.cos_sin_cache.dtype == torch.float32
    params = 256 * 48 * 2 + 2 * (48 * 48 * 2 + 2 * 48 * 24 + 3 * 48 * 96 + 2 * 48) + 48
    assert model.weight_bytes() == params * torch.empty((), dtype=dtype).element_size()


def test_kv_cache_allocation_and_bytes():
    cfg = ModelConfig("LlamaForCausalLM", 100, 64, 128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    caches = allocate_kv_caches(cfg, 5, 16, torch.bfloat16, "cpu")
    assert len(caches) == 3 and caches[0].k_scales is None
    assert caches[0].k.shape == (5, 2, 8, 16, 2) and caches[0].v.shape == (5, 2, 8, 16, 2)  # the CPU layout
    assert caches[0].k.numel() * 2 * 2 * 3 == 5 * 16 * kv_bytes_per_token(cfg, torch.bfloat16)
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 3 * 2 * 16 * 2
    q = allocate_kv_caches(cfg, 5, 16, torch.int8, "cpu")
    assert q[0].v.dtype == torch.int8 and q[0].v_scales.shape == (5, 2, 16)
    assert q[0].k_scales.dtype == torch.float32
    assert kv_bytes_per_token(cfg, torch.float8_e4m3fn) == 2 * 3 * 2 * (16 + 4)


def test_cpu_kv_caches_share_huge_pages():
    """CPU caches come from memory madvised for huge pages (decode attention streams them), zeroed, each
    tensor 64-byte aligned and clear of every other."""
    cfg = ModelConfig("LlamaForCausalLM", 100, 64, 128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    caches = allocate_kv_caches(cfg, 7, 16, torch.int8, "cpu")
    tensors = [t for c in caches for t in (c.k, c.v, c.k_scales, c.v_scales)]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(a % 64 == 0 for a, _ in spans)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all(huge_page_eligible(t.data_ptr()) for t in tensors)
    for t in tensors:
        assert not t.view(torch.uint8).any()
        t.view(torch.uint8).fill_(1)  # writes stay inside their own tensor
    assert all(t.view(torch.uint8).all() for t in tensors)


def test_folder_without_weights(tiny_llama, tmp_path):
    shutil.copy(os.path.join(tiny_llama, "config.json"), tmp_path)
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_truncated_safetensors(tiny_llama, tmp_path):
    for name in os.listdir(tiny_llama):
        shutil.copy(os.path.join(tiny_llama, name), tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors.*truncated"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unknown_architecture(tiny_llama, tmp_path):
    for name in os.listdir(tiny_llama):
        shutil.copy(os.path.join(tiny_llama, name), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*supported: LlamaForCausalLM, MistralForCausalLM.*"
                       "Qwen3ForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unsupported_gguf_type(tmp_path):
    path = str(tmp_path / "iq2.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for key, value in [("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256),
                       ("attention.head_count", 4)]:
        w.add_uint32(f"llama.{key}", value)
    raw = np.zeros((4, 66), np.uint8)  # four rows of one 256-value IQ2_XXS block
    w.add_tensor("token_embd.weight", raw, raw_shape=list(raw.shape), raw_dtype=QT.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"iq2\.gguf.*'token_embd\.weight'.*IQ2_XXS.*not supported"):
        load_model(path, torch.float32, "cpu")


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ValueError, match="junk.gguf.*not a readable GGUF"):
        load_model(str(tmp_path / "junk.gguf"), torch.float32, "cpu")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path / "junk.gguf")


def test_mistral_sliding_window_keeps_the_context(tmp_path):
    from pyengine.model.loader import config_from_hf

    write_tiny_checkpoint(str(tmp_path), "mistral")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert config_from_hf(str(tmp_path)).sliding_window is None
    raw["sliding_window"] = 128
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = config_from_hf(str(tmp_path))
    assert cfg.architecture == "MistralForCausalLM" and cfg.max_position_embeddings == 512
    assert [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)] == [128, 128]
    assert cfg.num_key_value_heads == 1 and cfg.eos_token_ids == [2]


def test_windowed_models_refused_on_gpus(tmp_path):
    """The CUDA attention kernel has no window or soft-cap: refused before any weight moves."""
    with pytest.raises(ValueError, match="Gemma2ForCausalLM: sliding-window and soft-capped attention run on the "
                                         "CPU only"):
        load_model(write_tiny_checkpoint(str(tmp_path), "gemma2"), torch.float32, "cuda")


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_kv_cache_forward(tiny_llama, cache_dtype):
    cfg, model = load_model(tiny_llama, torch.float32, "cpu")
    ids = list(range(3, 90))
    ref = SequenceRunner(model, cfg, 96).prefill(ids)
    runner = SequenceRunner(model, cfg, 96, cache_dtype=cache_dtype)
    runner.prefill(ids[:-1], chunk=32)
    got = runner.step(ids[-1:])
    assert runner.caches[0].k_scales.abs().sum() > 0
    assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.99
