"""Speculative decoding with a draft model (pyengine/engine/draft_model.py): the config, the vocabulary check,
the drafts against the draft model's own greedy continuation (transformers), the engine's output against the
same engine without speculation (tiny random pair, then the default model drafting for itself), and aborts."""
import pytest
import torch

from pyengine.config import EngineConfig, ModelConfig
from pyengine.engine.draft_model import check_vocabulary
from pyengine.llm import LLM
from pyengine.model.loader import default_model_path, load_model
from pyengine.sampling_params import SamplingParams

from engine_fakes import FakeTokenizer, abort_while_speculating
from model_helpers import hf_greedy, real_engine, write_tiny_checkpoint


def draft(path, k=4, **extra):
    return {"model": path, "num_speculative_tokens": k, **extra}


def assert_both_pools_free(engine):
    assert not engine.groups and not engine.scheduler.running
    assert engine.pool.num_free == engine.pool.num_blocks
    spec = engine.speculator
    assert not spec.seqs and spec.pool.num_free == spec.pool.num_blocks


# ---- the config and the vocabulary check -------------------------------------------------------

def test_draft_model_config_and_clear_errors():
    cfg = EngineConfig(speculative='{"model": "draft.gguf", "num_speculative_tokens": 4}').speculative
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "draft.gguf", 4)
    assert EngineConfig(speculative={"num_speculative_tokens": 2}).speculative.method == "ngram"
    for bad in ['{"method": "draft_model"}', '{"method": "ngram", "model": "draft.gguf"}']:
        with pytest.raises(ValueError, match="'draft_model' needs a 'model'"):
            EngineConfig(speculative=bad)


class VocabTokenizer(FakeTokenizer):
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_vocabulary_check_compares_sizes_and_token_ids():
    def config(vocab_size):
        return ModelConfig(architecture="Llama", vocab_size=vocab_size, hidden_size=8, intermediate_size=8,
                           num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8)

    same = VocabTokenizer({"a": 0, "b": 1, "c": 2})
    check_vocabulary(config(3), same, config(3), VocabTokenizer(dict(same.vocab)), "d")
    check_vocabulary(config(3), same, config(3), None, "d")  # the draft has no tokenizer: sizes only
    with pytest.raises(ValueError, match="vocabulary of 4 tokens, the target model 3"):
        check_vocabulary(config(3), same, config(4), None, "d")
    with pytest.raises(ValueError, match="different token ids.*token 'b': id 2 in the draft, 1 in the target"):
        check_vocabulary(config(3), same, config(3), VocabTokenizer({"a": 0, "b": 2, "c": 1}), "d")


# ---- a tiny random pair --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target parts, target folder, draft folder): two random checkpoints of one 256-token vocabulary."""
    root = tmp_path_factory.mktemp("draft")
    target = write_tiny_checkpoint(str(root / "target"), seed=0)
    drafter = write_tiny_checkpoint(str(root / "draft"), seed=1)
    cfg, model = load_model(target, torch.float32, torch.device("cpu"))
    return (cfg, model, FakeTokenizer(), "tiny"), target, drafter


def tiny_engine(tiny, spec=None, **config):
    config.setdefault("block_size", 8)
    config.setdefault("max_num_batched_tokens", 32)  # prompts longer than this: the draft catches up in chunks
    return real_engine(tiny[0], kv_tokens=512, speculative=spec, **config)


PROMPTS = [[1] + [3 + (i * 37 + j * 11) % 250 for j in range(20 + 9 * i)] for i in range(4)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tiny_pair_output_equals_without_speculation(tiny, temperature):
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=7, ignore_eos=True)
    plain = LLM.from_engine(tiny_engine(tiny)).generate(PROMPTS, params, use_tqdm=False)
    engine = tiny_engine(tiny, draft(tiny[2], disable_by_batch_size=8))
    spec = LLM.from_engine(engine).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert engine.metrics.spec_draft_tokens._value.get() > 0
    assert_both_pools_free(engine)


def test_tiny_drafts_are_the_draft_models_greedy_continuation(tiny):
    """After every verification, each request's drafts are what transformers' greedy decoding of the draft
    checkpoint continues its tokens with: rejected drafts are rolled out of the draft's cache, also when the
    request decoded without drafts in between (a second request turned speculation off for a while)."""
    from transformers import AutoModelForCausalLM

    hf_draft = AutoModelForCausalLM.from_pretrained(tiny[2], dtype=torch.float32).eval()
    engine = tiny_engine(tiny, draft(tiny[2], k=3, disable_by_batch_size=1))
    engine.add_request("long", PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    checked = 0
    while engine.has_unfinished():
        engine.step()
        if engine.num_steps == 6:  # two running: no drafts until "short" finishes
            engine.add_request("short", PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        for req in engine.scheduler.running:
            if req.spec_token_ids:
                want, _ = hf_greedy(hf_draft, req.all_token_ids, len(req.spec_token_ids))
                assert req.spec_token_ids == want
                checked += 1
    m = engine.metrics
    assert checked > 5 and m.spec_accepted_tokens._value.get() < m.spec_draft_tokens._value.get()  # rejections
    assert_both_pools_free(engine)


def test_mismatched_vocabulary_refused_at_start(tiny, tmp_path):
    other = write_tiny_checkpoint(str(tmp_path / "other"), seed=2, vocab_size=320)
    with pytest.raises(ValueError, match="vocabulary of 320 tokens, the target model 256"):
        tiny_engine(tiny, draft(other))


def test_aborts_mid_speculation_free_both_caches(tiny):
    """An abort while drafts wait for their step, one while that step runs, then the rest at once."""
    engine = tiny_engine(tiny, draft(tiny[2], disable_by_batch_size=8))
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", PROMPTS[i % 4], params)
    while not any(r.spec_token_ids for r in engine.scheduler.running):
        engine.step()
    queued, aborted = abort_while_speculating(engine)
    for _ in range(3):
        engine.step()
    assert aborted and aborted[0] != queued
    assert engine.speculator.seqs and engine.speculator.pool.num_free < engine.speculator.pool.num_blocks
    for request_id in list(engine.groups):
        engine.queue_abort(request_id)
    engine.step()
    assert_both_pools_free(engine)


# ---- the default model drafting for itself -------------------------------------------------------

def test_default_model_as_its_own_draft_same_output_all_accepted(bf16_parts):
    tok = bf16_parts[2]
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain_engine = real_engine(bf16_parts, kv_tokens=1024, dtype="bfloat16")
    plain = LLM.from_engine(plain_engine).generate(prompts, params, use_tqdm=False)
    engine = real_engine(bf16_parts, kv_tokens=1024, dtype="bfloat16", speculative=draft(default_model_path()))
    spec = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    drafted = engine.metrics.spec_draft_tokens._value.get()
    accepted = engine.metrics.spec_accepted_tokens._value.get()
    # the same weights: only bf16 rounding (a k-token verification against one-token draft passes) can differ
    assert drafted > 0 and accepted >= 0.9 * drafted
    assert sum(o.metrics.num_draft_tokens for o in spec) == drafted
    assert engine.num_steps < plain_engine.num_steps / 2
    assert_both_pools_free(engine)
