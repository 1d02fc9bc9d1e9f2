"""Structured output with speculation (pyengine/engine/spec_decode.py, pyengine/structured.py): drafts cut
where the grammar refuses them, each verification row masked by the grammar state after the drafts before
it, and jump-forward (the text a grammar forces becomes the next step's drafts). The output equals the
engine's without any of it, and stays valid."""
import json
import re

import jsonschema
import pytest
import torch

from pyengine.engine.spec_decode import accepted_prefix
from pyengine.llm import LLM
from pyengine.sampling_params import SamplingParams, StructuredOutputsParams
from server.tools import ToolSpec

from model_helpers import real_engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "London", "Tokyo"]},
                                           "member": {"type": "boolean"}},
          "required": ["name", "age", "city", "member"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TOOL_CALL = ToolSpec([WEATHER], "required").schema()  # what the server constrains tool_choice "required" to
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"


def load_parts(dtype: torch.dtype):
    from pyengine.model.loader import load_model, resolve_model_path
    from pyengine.tokenizer import Tokenizer

    path = resolve_model_path(None)
    cfg, model = load_model(path, dtype, torch.device("cpu"), "auto")
    return cfg, model, Tokenizer.from_model_path(path), "smollm2-135m"


@pytest.fixture(scope="module")
def parts():
    """The default model as served: Q4_1 weights with bf16 activations."""
    return load_parts(torch.bfloat16)


@pytest.fixture(scope="module")
def fp32_parts():
    return load_parts(torch.float32)


@pytest.fixture(scope="module")
def structured(parts):
    from pyengine.structured import StructuredOutputs

    so = StructuredOutputs(parts[2], parts[0].vocab_size, parts[2].eos_token_ids)
    yield so
    so.close()


class _Req:
    """What fill_bitmask reads of a request."""

    def __init__(self, grammar, drafts):
        self.grammar, self.spec_token_ids = grammar, drafts


def test_drafts_cut_at_the_first_token_the_grammar_refuses(parts, structured):
    tok = parts[2]
    m = structured.matcher(StructuredOutputsParams(json=PERSON))
    good = tok.encode('{"name": "Al",', add_special_tokens=False)
    bad = tok.encode("}", add_special_tokens=False)
    assert accepted_prefix(m, good + bad + good) == good
    assert accepted_prefix(m, good) == good and accepted_prefix(m, bad) == []  # the matcher is left as it was


def test_each_draft_row_gets_the_mask_after_the_drafts_before_it(parts, structured):
    """A request verifying 3 drafts has 4 rows: row j holds the mask a matcher that accepted the first j
    drafts gives; a request without drafts and one without a grammar keep their one row each."""
    tok = parts[2]
    params = StructuredOutputsParams(json=PERSON)
    drafts = tok.encode('{"name', add_special_tokens=False) + tok.encode('":', add_special_tokens=False)
    assert len(drafts) == 3
    spec, plain, free = _Req(structured.matcher(params), drafts), _Req(structured.matcher(params), []), _Req(None, [])
    rows = [spec] * 4 + [plain, free]
    got = structured.fill_bitmask(rows, structured.new_bitmask(8)).clone()
    ref = structured.matcher(params)
    for j in range(4):
        want = structured.new_bitmask(1)
        ref.fill_next_token_bitmask(want, 0)
        assert torch.equal(got[j], want[0]), j
        if j < 3:
            assert ref.accept_token(drafts[j])
    first = structured.new_bitmask(1)
    structured.matcher(params).fill_next_token_bitmask(first, 0)
    assert torch.equal(got[4], first[0]) and not torch.equal(got[1], got[0])
    assert (got[5] == -1).all()
    assert spec.grammar.accept_token(drafts[0])  # the matcher is back where it was


def test_jump_forward_tokens_spell_the_forced_text(parts, structured):
    m = structured.matcher(StructuredOutputsParams(json=TOOL_CALL))
    forced = structured.jump_forward_tokens(m)
    assert parts[2].decode(forced) == '[{"name": "get_weather", "arguments": {"city": "'
    assert structured.jump_forward_tokens(structured.matcher(StructuredOutputsParams(regex="[a-z]+"))) == []


def run(parts, prompts, params, **config):
    config.setdefault("dtype", "bfloat16")
    engine = real_engine(parts, 2048, max_num_seqs=8, **config)
    outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    assert engine.pool.num_free == engine.pool.num_blocks
    return [o.outputs[0] for o in outs], engine


def grammar_params(temperature=0.0, seed=None):
    return [SamplingParams(max_tokens=80, temperature=temperature, seed=seed, structured_outputs=s) for s in
            (StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json=TOOL_CALL),
             StructuredOutputsParams(regex=DATE))]


PROMPTS = ["Describe Alice, 31, from Paris, a member, as JSON:\n",
           "What is the weather in Tokyo? Call the tool.\n",
           "The first Moon landing, as a date written 2069-07-20 or 1969-07-20: 1969-07-20. Again: "]


def check_valid(outs):
    jsonschema.validate(json.loads(outs[0].text), PERSON)
    jsonschema.validate(json.loads(outs[1].text), TOOL_CALL)
    assert re.fullmatch(DATE, outs[2].text)


@pytest.mark.parametrize("temperature,seed,dtype", [(0.0, None, "bfloat16"), (0.8, 7, "float32")])
def test_grammar_outputs_with_speculation_and_jump_forward_equal_plain_decoding(parts, fp32_parts, temperature,
                                                                                  seed, dtype):
    """A json_schema with fixed keys, a tool call under tool_choice "required" and a regex, side by side in one
    batch: n-gram speculation with jump-forward gives the plain engine's tokens, greedy or seeded. Seeded runs
    in fp32: in bf16 a row's logits round differently in steps of other row counts, and a sampled token near a
    tie between two candidates may then differ (greedy ties are far rarer)."""
    parts = parts if dtype == "bfloat16" else fp32_parts
    params = grammar_params(temperature, seed)
    want, _ = run(parts, PROMPTS, params, jump_forward=False, dtype=dtype)
    got, engine = run(parts, PROMPTS, params, speculative=dict(NGRAM, disable_by_batch_size=8), dtype=dtype)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    check_valid(got)
    assert engine.speculator.num_forced_accepted > 0


@pytest.mark.parametrize("which", [0, 1])
def test_jump_forward_takes_fewer_forward_passes(parts, which):
    """Fixed keys (PERSON) and a tool call: at least 1.3x fewer steps with jump-forward, the same output."""
    params = grammar_params()[which]
    want, off = run(parts, [PROMPTS[which]], params, jump_forward=False)
    got, on = run(parts, [PROMPTS[which]], params)
    assert got[0].token_ids == want[0].token_ids
    assert off.num_steps >= 1.3 * on.num_steps, (off.num_steps, on.num_steps)


def test_setting_flag():
    from server.cli import build_parser, engine_config

    assert engine_config(build_parser().parse_args([])).jump_forward is True
    assert engine_config(build_parser().parse_args(["--no-jump-forward"])).jump_forward is False
