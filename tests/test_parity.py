"""Parity with transformers: the default GGUF model (greedy continuations, first-step logits) and tiny
random-weight checkpoints of every supported architecture, all in fp32 through the paged cache."""
import pytest
import torch

from pyengine.model.loader import load_model
from pyengine.tokenizer import Tokenizer
from tests.model_helpers import TINY_ARCHS, SequenceRunner, default_model_path, gguf_folder_and_name, \
    write_tiny_checkpoint

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works, step by step.",
    "List five tips for writing clean Python code.",
    "What are the main differences between a cat and a dog as pets?",
    "Describe the water cycle to a ten year old.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    folder, name = gguf_folder_and_name()
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours():
    return load_model(default_model_path(), torch.float32, "cpu", weights="dequantize")


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.from_model_path(default_model_path())
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in PROMPTS], set(tok.eos_token_ids)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_ids: set[int]):
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
    assert sum(n == NEW_TOKENS for n in lengths) >= 3  # most prompts ran the full 64 tokens


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


@pytest.mark.parametrize("kind", TINY_ARCHS)
def test_tiny_checkpoint_parity(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = write_tiny_checkpoint(str(tmp_path), kind)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg, model = load_model(folder, torch.float32, "cpu")
    assert cfg.tie_word_embeddings == (kind == "llama_tied")
    assert (model.lm_head is model.embed) == (kind == "llama_tied")
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
