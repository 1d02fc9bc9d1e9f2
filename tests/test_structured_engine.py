"""Grammar-constrained decoding in the engine (no server): the PagedEcho stand-in model with the
default model's real tokenizer, so grammars compile against a real vocabulary while steps stay fast."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pyengine.config import EngineConfig, ModelConfig
from pyengine.engine.engine import Engine
from pyengine.llm import LLM
from pyengine.model.loader import resolve_model_path
from pyengine.sampling_params import SamplingParams, StructuredOutputsParams
from pyengine.tokenizer import Tokenizer

from engine_fakes import EOS, VOCAB, PagedEchoModel

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["a", "b"]}}, "required": ["id", "tag"]}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_model_path(resolve_model_path(None))


def engine_with(tokenizer, kv_tokens: int = 4096, **config) -> Engine:
    """The PagedEcho model over the first VOCAB ids of the real vocabulary (bytes and punctuation)."""
    assert tokenizer.eos_token_ids == [EOS]
    cfg = ModelConfig(architecture="PagedEcho", vocab_size=VOCAB, hidden_size=1, intermediate_size=1,
                      num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=2,
                      max_position_embeddings=8192, eos_token_ids=[EOS])
    config.setdefault("kv_cache_memory", kv_tokens * 16 + config.get("block_size", 16) * 16 - 1)
    config.setdefault("max_model_len", kv_tokens)  # the engine refuses a pool smaller than one full sequence
    return Engine(EngineConfig(dtype="float32", **config), parts=(cfg, PagedEchoModel(), tokenizer, "echo"))


def generate(engine, prompts, params):
    return [o.outputs[0] for o in LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)]


def test_json_schema_outputs_are_valid_and_end_with_eos(tokenizer):
    engine = engine_with(tokenizer)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = generate(engine, [[5 + i, 40, 41] for i in range(8)], params)
    for o in outs:
        assert o.finish_reason == "stop" and o.token_ids[-1] == EOS  # EOS only once the grammar accepts
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_matchers_survive_preemption(tokenizer):
    """A tight KV pool preempts requests mid-grammar; they resume under the same matcher and give the
    tokens an unpreempted run gives."""
    prompts = [[7 + i] * (20 + 5 * i) for i in range(6)]
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,8}( [a-z]{3,8}){2,4}\."))
    roomy = generate(engine_with(tokenizer), prompts, params)
    tight_engine = engine_with(tokenizer, kv_tokens=160, block_size=8, max_num_batched_tokens=64)
    tight = generate(tight_engine, prompts, params)
    assert tight_engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    for o in tight:
        assert re.fullmatch(r"[a-z]{3,8}( [a-z]{3,8}){2,4}\.", o.text), o.text


def test_choice_and_bad_params(tokenizer):
    engine = engine_with(tokenizer)
    outs = generate(engine, [[9, 9, 9]] * 4, SamplingParams(temperature=1.0, seed=1, max_tokens=10, n=1,
                    structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    assert {o.text for o in outs} <= {"yes", "no"}
    with pytest.raises(ValueError, match="logit_bias has token id 500"):
        engine.add_request("x", [3, 4], SamplingParams(logit_bias={VOCAB: 1.0}))
    with pytest.raises(ValueError, match="unsupported keyword 'not'"):
        engine.add_request("y", [3, 4], SamplingParams(
            structured_outputs=StructuredOutputsParams(json={"type": "object", "not": {}})))
    assert not engine.groups and engine.pool.num_free == engine.pool.num_blocks
