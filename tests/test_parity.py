"""Parity with transformers: the default GGUF model (greedy continuations, first-step logits) and tiny
random-weight checkpoints of every supported architecture, all in fp32 through the paged cache."""
import pytest
import torch

from pyengine.config import ModelConfig
from pyengine.model.loader import load_model
from pyengine.tokenizer import Tokenizer
from tests.model_helpers import TINY_ARCHS, SequenceRunner, default_model_path, \
    hf_greedy, write_tiny_checkpoint, write_tiny_gguf

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works, step by step.",
    "List five tips for writing clean Python code.",
    "What are the main differences between a cat and a dog as pets?",
    "Describe the water cycle to a ten year old.",
]
# 32 greedy tokens a prompt (positions to ~70, past several 16-token blocks): 64 took two minutes of
# a 2-core machine, most of it transformers' own decode steps, and checked the same code
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def ours(real_parts):
    return real_parts[:2]


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.from_model_path(default_model_path())
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in PROMPTS], set(tok.eos_token_ids)


@pytest.mark.accuracy  # a greedy continuation of 5 prompts against transformers, step by step
def test_default_model_greedy_parity(hf_model, ours, prompts):
    cfg, model = ours
    ids, stop = prompts
    lengths = []
    for prompt in ids:
        want, want_logits = hf_greedy(hf_model, prompt, NEW_TOKENS, stop)
        got, got_logits = SequenceRunner(model, cfg, len(prompt) + NEW_TOKENS).greedy(prompt, NEW_TOKENS, stop)
        span = float(want_logits.max() - want_logits.min())
        assert float((got_logits - want_logits).abs().max()) <= 1e-3 * span
        assert got == want
        lengths.append(len(got))
    assert sum(n == NEW_TOKENS for n in lengths) >= 3  # most prompts ran the full NEW_TOKENS


def test_chunked_prefill_matches_whole_prompt(ours, prompts):
    cfg, model = ours
    prompt = prompts[0][1]
    whole = SequenceRunner(model, cfg, 128).prefill(prompt)
    chunked = SequenceRunner(model, cfg, 128, block_size=8).prefill(prompt, chunk=7)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-3)


def test_default_model_bf16(ours, prompts):
    cfg, model32 = ours
    _, model = load_model(default_model_path(), torch.bfloat16, "cpu", weights="dequantize")
    qkv = model.linears[0].qkv
    assert (qkv.packed if qkv.packed is not None else model.layers[0].qkv).dtype == torch.bfloat16
    prompt = prompts[0][2]
    ref = SequenceRunner(model32, cfg, 96).prefill(prompt)
    got = SequenceRunner(model, cfg, 96).prefill(prompt)
    assert got.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.99
    assert int(got.argmax()) == int(ref.argmax())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiny_half_precision(dtype, tmp_path):
    folder = write_tiny_checkpoint(str(tmp_path), "qwen2")
    cfg, model32 = load_model(folder, torch.float32, "cpu")
    _, model = load_model(folder, dtype, "cpu")
    prompt = list(range(3, 60))
    ref = SequenceRunner(model32, cfg, 64).prefill(prompt)
    got = SequenceRunner(model, cfg, 64).prefill(prompt)
    assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.99


def assert_matches_transformers(hf_folder: str, model_path: str) -> ModelConfig:
    """fp32 logits of a 130-token prompt and one decode step within 1e-4 of the logit span of
    transformers on the HF checkpoint (eager attention), the next token its argmax."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32, attn_implementation="eager").eval()
    cfg, model = load_model(model_path, torch.float32, "cpu")
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (model.lm_head is model.embed) == cfg.tie_word_embeddings
    prompt = torch.randint(0, cfg.vocab_size, (130,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    runner = SequenceRunner(model, cfg, 160)
    got_all = runner.step(prompt, all_logits=True)
    span = float(want.max() - want.min())
    assert float((got_all - want).abs().max()) <= 1e-4 * span
    nxt = int(want[-1].argmax())
    got = runner.step([nxt])
    with torch.inference_mode():
        want_next = hf(torch.tensor([prompt + [nxt]])).logits[0, -1]
    assert float((got - want_next).abs().max()) <= 1e-4 * span
    assert int(got.argmax()) == int(want_next.argmax())
    return cfg


@pytest.mark.parametrize("kind", TINY_ARCHS)
def test_tiny_checkpoint_parity(kind, tmp_path):
    folder = write_tiny_checkpoint(str(tmp_path), kind)
    assert_matches_transformers(folder, folder)


@pytest.mark.parametrize("kind", ["llama3_rope", "qwen2_yarn", "qwen3", "phi3", "gemma2", "gemma3_gguf"])
def test_tiny_gguf_parity(kind, tmp_path):
    """The same checkpoints converted to GGUF as llama.cpp does: Llama 3's scaling as rope_freqs,
    Qwen2.5's YaRN (served over factor x the original context), Qwen3's q/k norms, Phi-3's fused tensors,
    Gemma's 1 + w norms and metadata."""
    folder = write_tiny_checkpoint(str(tmp_path), kind)
    cfg = assert_matches_transformers(folder, write_tiny_gguf(str(tmp_path / "model.gguf"), folder))
    assert cfg.max_position_embeddings == (256 if kind == "qwen2_yarn" else 512)


def test_dynamic_rope_parity(tmp_path):
    """Dynamic NTK: our base is the one for the whole served context (64 x 2 positions), which is what
    transformers computes for a sequence of exactly that length."""
    from transformers import AutoModelForCausalLM

    folder = write_tiny_checkpoint(str(tmp_path), "llama_dynamic")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    cfg, model = load_model(folder, torch.float32, "cpu")
    assert cfg.max_position_embeddings == 128
    prompt = torch.randint(0, cfg.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    got = SequenceRunner(model, cfg, 128).step(prompt, all_logits=True)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.max() - want.min())
