"""Speculative decoding (n-gram drafts, pyengine/engine/spec_decode.py): the proposer, the config, and the
engine's output with speculation against the same engine without it (fake model, then the default model in
fp32 and bf16)."""
import json

import pytest
import torch

from pyengine.config import EngineConfig, SpeculativeConfig
from pyengine.engine.spec_decode import NgramSpeculator, SpecState, ngram_propose
from pyengine.llm import LLM
from pyengine.sampling_params import SamplingParams

from engine_fakes import fake_engine, reference
from model_helpers import real_engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# The fake model's tokens are hashes: only single repeated tokens match, so its drafts are mostly rejected.
NGRAM_1 = dict(NGRAM, prompt_lookup_min=1)


# ---- the proposer and the config ---------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_longest_match():
    toks = [1, 2, 3, 9, 8, 7, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert ngram_propose(toks, 3, 2, 4) == [4, 5, 6]  # "1 2 3" last seen before 4 5 6
    assert ngram_propose(toks, 10, 2, 4) == [4, 5, 6, 1, 2, 3]  # up to the end of the sequence
    assert ngram_propose([5, 6, 7, 8], 3, 2, 4) == []  # no suffix occurs earlier
    assert ngram_propose([5, 6, 5, 6], 3, 2, 4) == [5, 6]
    assert ngram_propose([1, 2, 7, 1, 2], 3, 3, 4) == []  # the match is shorter than prompt_lookup_min
    assert ngram_propose([1, 2, 7, 1, 2], 0, 2, 4) == []


def test_k_adapts_down_to_zero_and_comes_back():
    s = SpecState(4)
    s.record(4, 4, 4, 10)
    assert s.k == 4
    s.record(4, 1, 4, 12)
    assert s.k == 1
    s.record(1, 0, 4, 13)
    assert s.k == 0 and s.pause_until > 13
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 9, 5)
    assert s.accepted_per_pos == [2, 1, 1, 1]


def test_speculative_config_from_json_and_clear_errors():
    cfg = EngineConfig(speculative=json.dumps(NGRAM))
    assert cfg.speculative == SpeculativeConfig(**NGRAM, disable_by_batch_size=cfg.speculative.disable_by_batch_size)
    assert EngineConfig(speculative={"num_speculative_tokens": 2}).speculative.prompt_lookup_max == 4
    for bad, match in [("{not json", "not valid JSON"), ("[1]", "JSON object"),
                       ('{"method": "eagle"}', "must be 'ngram'"), ('{"num_speculative_tokens": 0}', ">= 1"),
                       ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min"),
                       ('{"model": "draft.gguf", "num_speculative_tokens": 4}', "draft model"),
                       ('{"num_spec_tokens": 4}', "unknown keys"), ('{"disable_by_batch_size": 0}', ">= 1")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative=bad)


def test_cli_flag_and_config_file_key(tmp_path, capsys):
    from server import config_file
    from server.__main__ import build_parser, engine_config
    from server.models import ConfigError

    args = build_parser().parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert engine_config(args).speculative.num_speculative_tokens == 5
    assert engine_config(build_parser().parse_args([])).speculative is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'])
    assert "num_speculative_tokens must be an integer >= 1" in capsys.readouterr().err
    path = tmp_path / "server.toml"
    path.write_text('[[models]]\nname = "m"\nspeculative = {method = "ngram", num_speculative_tokens = 3}\n')
    assert config_file.load(str(path)).models[0].engine["speculative"]["num_speculative_tokens"] == 3
    path.write_text('[[models]]\nname = "m"\nspeculative = {num_speculative_tokens = 0}\n')
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        config_file.load(str(path))


# ---- the engine with the fake model: verification, rollback, aborts -----------------------------

def repetitive(n, seed):
    """Prompts that repeat themselves, so the n-gram proposer finds matches."""
    base = [3 + (seed * 7 + i * 11) % 90 for i in range(9)]
    return (base * (n // len(base) + 1))[:n]


def assert_all_free(engine):
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.scheduler.running and engine.scheduler.num_waiting == 0 and not engine.groups


@pytest.mark.parametrize("block_size", [8, 16])
def test_fake_speculation_output_equals_reference_and_frees_blocks(block_size):
    engine = fake_engine(block_size=block_size, speculative=NGRAM_1, max_num_batched_tokens=64)
    prompts = [repetitive(20 + 13 * i, i) for i in range(6)]
    outs = LLM.from_engine(engine).generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                                            use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference(p, 40)
    assert engine.metrics.spec_draft_tokens._value.get() > 0  # drafts were verified (and rolled back)
    assert_all_free(engine)


def test_fake_aborts_mid_speculation_free_every_block():
    """Aborts while drafts wait for their step, and while that step runs (the client left meanwhile)."""
    engine = fake_engine(speculative=NGRAM_1, block_size=8)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", repetitive(30, i), params)
    while not any(r.spec_token_ids for r in engine.scheduler.running):
        engine.step()
    queued = next(r.parent_id for r in engine.scheduler.running if r.spec_token_ids)
    engine.queue_abort(queued)
    model = engine.runner.model
    aborted = []

    def forward_then_abort(*args, **kwargs):
        out = model(*args, **kwargs)
        for r in list(engine.scheduler.running):
            if r.spec_token_ids and not aborted:
                aborted.append(r.parent_id)
                engine.abort_request(r.parent_id)
        return out

    engine.runner.model = forward_then_abort
    while engine.has_unfinished():
        engine.step()
    assert aborted and aborted[0] != queued
    assert_all_free(engine)


# ---- the default model: greedy output equal to the non-speculative engine ----------------------

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''
QUOTE = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
         "combined movable metal type, oil-based ink and a wooden press adapted from wine making. ")


def held_prompts(tok):
    chat = lambda text: tok.apply_chat_template([{"role": "user", "content": text}])  # noqa: E731
    return [chat("Rewrite this function, renaming `values` to `xs`:\n\n" + CODE),
            chat("Quote the first sentence of this text exactly:\n\n" + QUOTE * 2),
            chat("Write a short poem about the sea."),
            tok.encode(QUOTE * 3)]


def generate(parts, prompts, params, **config):
    engine = real_engine(parts, 2048, max_num_seqs=8, **config)
    outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs], engine


@pytest.fixture(scope="module")
def bf16_parts():
    """The default model as served: Q4_1 weights with bf16 activations."""
    from pyengine.model.loader import load_model, resolve_model_path
    from pyengine.tokenizer import Tokenizer

    path = resolve_model_path(None)
    cfg, model = load_model(path, torch.bfloat16, torch.device("cpu"), "auto")
    return cfg, model, Tokenizer.from_model_path(path), "smollm2-135m"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_greedy_identical_with_ngram_speculation(real_parts, bf16_parts, dtype):
    parts = real_parts if dtype == "float32" else bf16_parts
    prompts = held_prompts(parts[2])
    if dtype == "float32":  # torch's fp32 GEMMs: the slower model, on the two prompts the drafts match most
        prompts = prompts[:2]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain, plain_engine = generate(parts, prompts, params, dtype=dtype)
    spec, engine = generate(parts, prompts, params, dtype=dtype, speculative=NGRAM)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    accepted = engine.metrics.spec_accepted_tokens._value.get()
    assert accepted > 0 and engine.num_steps < plain_engine.num_steps
    assert_all_free(engine)


def test_real_stops_max_tokens_bias_and_n_as_without_speculation(bf16_parts):
    """A stop string inside accepted drafts cuts the output there; max_tokens is never passed; logit_bias
    (each row of a verification gets the request's bias), min_tokens and n behave alike."""
    prompt = held_prompts(bf16_parts[2])[0]
    free, _ = generate(bf16_parts, [prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                       dtype="bfloat16")
    stop = free[0].text[len(free[0].text) // 2:][:6]  # a string the greedy output reaches midway
    params = [SamplingParams(max_tokens=32, temperature=0.0, stop=[stop]),
              SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, logit_bias={int(free[0].token_ids[5]): -100.0}),
              SamplingParams(max_tokens=20, temperature=0.0, n=2, min_tokens=4)]

    def run(**config):
        engine = real_engine(bf16_parts, 2048, max_num_seqs=8, dtype="bfloat16", **config)
        outs = LLM.from_engine(engine).generate([prompt] * len(params), params, use_tqdm=False)
        assert_all_free(engine)
        return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs], engine

    want, _ = run()
    got, engine = run(speculative=NGRAM)
    assert got == want
    assert want[0][0][3] == stop and want[1][0][2] == "length" and len(want[1][0][0]) == 23
    assert engine.metrics.spec_accepted_tokens._value.get() > 0
