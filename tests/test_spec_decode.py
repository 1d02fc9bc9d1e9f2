"""Speculative decoding (n-gram drafts, pyengine/engine/spec_decode.py): the proposer, the config, and the
engine's output with speculation against the same engine without it (fake model, then the default model in
fp32 and bf16)."""
import asyncio
import json
import re

import pytest
import torch

from pyengine.config import EngineConfig, SpeculativeConfig
from pyengine.engine.spec_decode import SpecState, best_k, ngram_propose
from pyengine.llm import LLM
from pyengine.sampling_params import SamplingParams

from engine_fakes import abort_while_speculating, fake_engine, reference
from model_helpers import real_engine
from test_qlinear_strips import strip_rows  # noqa: F401  (fixture)

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


def test_k_adapts_to_the_acceptance_down_to_zero():
    assert [best_k(a, 5) for a in (0.05, 0.2, 0.5, 0.9, 1.0)] == [0, 1, 2, 5, 5]
    assert best_k(0.9, 3) == 3 and best_k(0.9, 5, token_cost=2.0) == 0
    s = SpecState(2)
    s.record(2, 2, 5, 10)
    assert s.k == 5  # all accepted: more drafts
    s.record(5, 1, 5, 12)
    s.record(5, 0, 5, 13)
    assert 0 < s.k < 5
    fails = 0
    while s.k:
        s.record(s.k, 0, 5, 14)
        fails += 1
    assert fails < 8 and s.pause_until > 14  # drafts keep failing: no proposals for a while
    assert s.num_accepted_tokens == 3
    assert s.accepted_per_pos == [2, 1, 0, 0, 0]


def test_speculative_config_from_json_and_clear_errors():
    cfg = EngineConfig(speculative=json.dumps(NGRAM))
    assert cfg.speculative == SpeculativeConfig(**NGRAM, disable_by_batch_size=cfg.speculative.disable_by_batch_size)
    assert EngineConfig(speculative={"num_speculative_tokens": 2}).speculative.prompt_lookup_max == 4
    for bad, match in [("{not json", "not valid JSON"), ("[1]", "JSON object"),
                       ('{"method": "eagle"}', "must be 'ngram'"), ('{"num_speculative_tokens": 0}', ">= 1"),
                       ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min"),
                       ('{"method": "ngram", "model": "draft.gguf"}', "'ngram' takes none"),
                       ('{"num_spec_tokens": 4}', "unknown keys"), ('{"disable_by_batch_size": 0}', ">= 1")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative=bad)


def test_cli_flag_and_config_file_key(tmp_path, capsys):
    from server import config_file
    from server.cli import build_parser, engine_config
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
    engine = fake_engine(block_size=block_size, speculative=dict(NGRAM_1, disable_by_batch_size=8),
                         max_num_batched_tokens=64)
    prompts = [repetitive(20 + 13 * i, i) for i in range(6)]
    outs = LLM.from_engine(engine).generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                                            use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference(p, 40)
    drafted = engine.metrics.spec_draft_tokens._value.get()
    assert drafted > 0  # drafts were verified (and rolled back)
    assert sum(o.metrics.num_draft_tokens for o in outs) == drafted  # per request, as the request log shows
    assert_all_free(engine)


def test_fake_aborts_mid_speculation_free_every_block():
    """Aborts while drafts wait for their step, and while that step runs (the client left meanwhile)."""
    engine = fake_engine(speculative=dict(NGRAM_1, disable_by_batch_size=8), block_size=8)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", repetitive(30, i), params)
    for _ in range(50):
        if any(r.spec_token_ids for r in engine.scheduler.running):
            break
        engine.step()
    queued, aborted = abort_while_speculating(engine)
    while engine.has_unfinished():
        engine.step()
    assert aborted and aborted[0] != queued
    assert_all_free(engine)


def test_fake_seeded_sampling_penalties_logprobs_equal_without_speculation():
    """Each row of a verification is sampled as the step at its output position (seeded draw, penalties,
    min_tokens), so sampled output and its logprobs are the non-speculative engine's."""
    prompts = [repetitive(25 + 7 * i, i) for i in range(5)]
    params = [SamplingParams(max_tokens=30, temperature=0.8, seed=11 + i, ignore_eos=True) for i in range(3)]
    params += [SamplingParams(max_tokens=30, temperature=0.5, seed=3, presence_penalty=0.5, repetition_penalty=1.2,
                              logprobs=2, min_tokens=10),
               SamplingParams(max_tokens=30, temperature=1.0, top_k=20, top_p=0.9, logprobs=0)]

    def run(**config):
        engine = fake_engine(block_size=8, **config)
        outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
        assert_all_free(engine)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].cumulative_logprob) for o in outs], engine

    want, _ = run()
    got, engine = run(speculative=dict(NGRAM_1, disable_by_batch_size=8))
    assert got == want
    assert engine.metrics.spec_draft_tokens._value.get() > 0


class FixedDistributionModel(torch.nn.Module):
    """Every logits row is the same: tokens 3..3+len(P) with probabilities P, whatever the context."""

    P = torch.tensor([0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01])

    def weight_bytes(self) -> int:
        return 0

    def forward(self, input_ids, positions, kv_caches, meta, logits_indices, interrupt=None):
        rows = len(input_ids) if logits_indices is None else len(logits_indices)
        logits = torch.full((rows, 500), float("-inf"))
        logits[:, 3 : 3 + len(self.P)] = self.P.log()
        return logits


def test_rejection_sampling_keeps_the_target_distribution_chi_square():
    """Many sampled tokens of a model whose next-token distribution is fixed: with drafts proposed (and
    often accepted) their frequencies still follow it (chi-square, 7 degrees of freedom, p > 0.001)."""
    from engine_fakes import FakeTokenizer
    from pyengine.config import ModelConfig
    from pyengine.engine.engine import Engine

    cfg = ModelConfig(architecture="Fixed", vocab_size=500, hidden_size=1, intermediate_size=1, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=2, max_position_embeddings=4096)
    spec = dict(NGRAM_1, num_speculative_tokens=3, disable_by_batch_size=256)
    engine = Engine(EngineConfig(dtype="float32", kv_cache_memory=(1 << 16) * 16, max_model_len=256, seed=1,
                                 speculative=spec), parts=(cfg, FixedDistributionModel(), FakeTokenizer(), "fixed"))
    outs = LLM.from_engine(engine).generate([[3, 4, 3, 4, 5]] * 200, SamplingParams(max_tokens=60, ignore_eos=True),
                                            use_tqdm=False)
    toks = torch.tensor([t for o in outs for t in o.outputs[0].token_ids])
    counts = torch.bincount(toks - 3, minlength=8).double()
    expected = FixedDistributionModel.P.double() * len(toks)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, (counts, expected)  # the 0.999 quantile of chi-square with 7 degrees of freedom
    assert engine.metrics.spec_accepted_tokens._value.get() > 500  # many tokens came from accepted drafts
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


def test_real_stops_max_tokens_bias_and_n_as_without_speculation(bf16_parts, strip_rows):
    """A stop string inside accepted drafts cuts the output there; max_tokens is never passed; logit_bias
    (each row of a verification gets the request's bias), min_tokens, n, and seeded sampling with a penalty
    and logprobs behave alike. The int8 kernels at every step size: on AMX hosts, steps of 8 rows or more
    otherwise take the bf16 strips, whose rounding differs, and a verification step has more rows than the
    plain decode step beside it, so a sampled token could differ by the kernel alone."""
    strip_rows(0)
    prompt = held_prompts(bf16_parts[2])[0]
    free, _ = generate(bf16_parts, [prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                       dtype="bfloat16")
    stop = free[0].text[len(free[0].text) // 2:][:6]  # a string the greedy output reaches midway
    params = [SamplingParams(max_tokens=32, temperature=0.0, stop=[stop]),
              SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, logit_bias={int(free[0].token_ids[5]): -100.0}),
              SamplingParams(max_tokens=20, temperature=0.0, n=2, min_tokens=4),
              SamplingParams(max_tokens=24, temperature=0.7, seed=5, logprobs=1, frequency_penalty=0.3)]

    def run(**config):
        engine = real_engine(bf16_parts, 2048, max_num_seqs=8, dtype="bfloat16", **config)
        outs = LLM.from_engine(engine).generate([prompt] * len(params), params, use_tqdm=False)
        assert_all_free(engine)
        return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs], \
            [lp.logprob for lp in outs[-1].outputs[0].logprobs], engine

    want, want_lps, _ = run()
    got, got_lps, engine = run(speculative=dict(NGRAM, disable_by_batch_size=8))  # 6 sequences, all speculating
    assert got == want
    # a verification row's logits come from a several-row step: equal up to bf16 rounding
    assert got_lps == pytest.approx(want_lps, abs=0.15)
    assert want[0][0][3] == stop and want[1][0][2] == "length" and len(want[1][0][0]) == 23
    assert engine.metrics.spec_accepted_tokens._value.get() > 0


# ---- the server: clients leaving mid-speculation -------------------------------------------------

async def test_server_disconnects_mid_speculation_free_blocks_and_count_drafts():
    from test_server_engine import start, wait_idle

    engine = fake_engine(max_num_batched_tokens=256, speculative=dict(NGRAM_1, disable_by_batch_size=64))
    client, llm = await start(engine=engine)
    try:
        async def one(i: int) -> str:
            leaves = i % 3 == 0
            r = await client.post("/v1/completions", json={"prompt": "abcabcabcabc" * (1 + i % 4), "stream": True,
                                                           "max_tokens": 4000 if leaves else 40, "ignore_eos": True,
                                                           "temperature": 0})
            seen = 0
            async for line in r.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    seen += 1
                    if leaves and seen == 3:
                        r.close()
                        return "left"
            return "done"

        results = await asyncio.gather(*(one(i) for i in range(12)))
        assert results.count("left") == 4
        await wait_idle(client)  # every block free again
        metrics = await (await client.get("/metrics")).text()
        drafts = re.search(r'^pyengine:spec_decode_num_draft_tokens_total\{model_name="paged-echo"\} (\S+)$', metrics, re.M)
        assert drafts and float(drafts.group(1)) > 0
        assert "pyengine:spec_decode_num_drafts_total" in metrics and "pyengine:spec_decode_num_accepted_tokens_total" in metrics
    finally:
        await client.close()
