"""Engine end to end. Part 1: plumbing with the PagedEcho stand-in (tests/engine_fakes.py), where
the next token depends on the whole context as read back from the paged KV cache. Part 2: the real
default model (fp32, greedy)."""
import random

import pytest

from pyengine.llm import LLM
from pyengine.sampling_params import SamplingParams

from engine_fakes import fake_engine, reference
from model_helpers import hf_greedy, hf_log_softmax, real_engine

GREEDY = dict(temperature=0.0)


def run(engine, prompts, params):
    llm = LLM.from_engine(engine)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def assert_all_free(engine):
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.scheduler.running and engine.scheduler.num_waiting == 0 and not engine.groups


def test_fake_mixed_batch_matches_reference():
    engine = fake_engine(max_num_batched_tokens=64, max_num_seqs=16)
    prompts = prompts_of([1, 5, 17, 33, 64, 100, 3, 16, 15, 47, 80, 2] * 2)
    outs = run(engine, prompts, SamplingParams(max_tokens=12, **GREEDY))
    assert outs == [reference(p, 12) for p in prompts]
    assert_all_free(engine)


def test_fake_preemption_same_output_and_counted():
    prompts = prompts_of([40, 33, 50, 21, 60, 45], seed=1)
    params = SamplingParams(max_tokens=40, **GREEDY)
    engine = fake_engine(kv_tokens=160, block_size=8, max_num_batched_tokens=64)
    outs = run(engine, prompts, params)
    assert outs == [reference(p, 40) for p in prompts]
    assert engine.scheduler.num_preemptions > 0
    assert engine.metrics.preemptions._value.get() == engine.scheduler.num_preemptions
    assert_all_free(engine)


def test_fake_prefix_caching_and_chunked_prefill():
    shared = prompts_of([500], seed=2)[0]
    a, b = shared + [7, 8, 9], shared + [10, 11]
    engine = fake_engine(max_num_batched_tokens=128)
    llm = LLM.from_engine(engine)
    params = SamplingParams(max_tokens=8, **GREEDY)
    llm.generate([a], params, use_tqdm=False)
    out = llm.generate([b], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(b, 8)
    assert out.metrics.num_cached_tokens == 496  # 31 full blocks of 16
    req_computed = engine.scheduler.prefix_hit_tokens
    assert req_computed == 496
    assert_all_free(engine)


def test_fake_aborts_and_finishes_leave_pool_free():
    engine = fake_engine(kv_tokens=160, block_size=8, max_num_batched_tokens=32, max_num_seqs=6)
    prompts = prompts_of([30, 12, 50, 9, 41, 25, 17, 60], seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=30, **GREEDY))
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps in (3, 7, 12):
            engine.queue_abort(str(steps % 8))
        if steps == 5:
            out = engine.abort_request("5")
            assert out.finished and out.outputs[0].finish_reason == "abort"
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert_all_free(engine)


def test_fake_stop_reasons_and_n():
    engine = fake_engine()
    prompt = prompts_of([10], seed=4)[0]
    ref = reference(prompt, 20)
    llm = LLM.from_engine(engine)
    out = llm.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[ref[4]], **GREEDY), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.token_ids == ref[:5] and c.finish_reason == "stop" and c.stop_reason == ref[4]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and out.finished
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=5, seed=7, temperature=1.0), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 5 for c in out.outputs)
    assert_all_free(engine)


def test_fake_n_children_share_prompt_blocks():
    engine = fake_engine()
    prompt = prompts_of([100], seed=6)[0]
    llm = LLM.from_engine(engine)
    hits0 = engine.scheduler.prefix_hit_tokens
    out = llm.generate([prompt], SamplingParams(n=4, max_tokens=6, seed=1, temperature=2.0), use_tqdm=False)[0]
    assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct streams
    assert engine.scheduler.prefix_hit_tokens == hits0  # children 1..3 forked from child 0: no cache lookups
    engine.add_request("ab", prompt, SamplingParams(n=3, max_tokens=50))
    engine.step()
    engine.abort_request("ab")  # children 1, 2 were still deferred
    assert_all_free(engine)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("prompt_len", [100, 96])  # the last prompt block partial / full
def test_fake_n_children_fork_from_the_first_and_compute_one_token_each(prompt_len, caching):
    """n > 1: child 0 computes the prompt; each other child shares its full blocks, gets a copy of the
    block holding the last prompt token and computes only that token (for its own first draw), with
    or without the prefix cache. PagedEcho reads every position back, so a wrong copy changes tokens."""
    engine = fake_engine(enable_prefix_caching=caching)
    prompt = prompts_of([prompt_len], seed=8)[0]
    out = LLM.from_engine(engine).generate([prompt], SamplingParams(n=4, max_tokens=6, **GREEDY),
                                           use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [reference(prompt, 6)] * 4
    # the prompt once, then per child its last prompt token (children 1..3) and 5 decodes
    assert engine.stats().num_computed_tokens == prompt_len + 3 * 1 + 4 * 5
    assert_all_free(engine)


def test_fake_seeded_sampling_alone_equals_batched():
    engine = fake_engine(max_num_batched_tokens=64)
    llm = LLM.from_engine(engine)
    prompts = prompts_of([9, 30, 4, 22], seed=5)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(4)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone


def test_fake_logprobs_and_cumulative_logprob():
    llm = LLM.from_engine(fake_engine())
    prompts = prompts_of([5, 12], seed=3)
    with_lp = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.8, seed=1, logprobs=2),
                           use_tqdm=False)
    for o in with_lp:
        c = o.outputs[0]
        assert [lp.token_id for lp in c.logprobs] == c.token_ids and all(len(lp.top) == 2 for lp in c.logprobs)
        assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs))
        assert c.cumulative_logprob < 0
    without = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.8, seed=1), use_tqdm=False)
    assert all(o.outputs[0].logprobs is None and o.outputs[0].cumulative_logprob is None for o in without)


def test_prompt_rejected_with_numbers():
    engine = fake_engine(kv_tokens=112, max_model_len=100)
    with pytest.raises(ValueError, match="100 tokens; this model's maximum context length is 100"):
        engine.add_request("x", [5] * 100, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("z", [], SamplingParams())
    assert not engine.has_unfinished()


# ---- Part 2: the real default model, fp32 ------------------------------------------------------

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
        "Books became cheaper, literacy spread across Europe, and ideas travelled faster than ever. ")


def real_llm(parts, kv_tokens=4096, **config):
    return LLM.from_engine(real_engine(parts, kv_tokens, **config))


def text_ids(tok, n, offset=0):
    ids = tok.encode(TEXT * (1 + (n + offset) // 40), add_special_tokens=False)
    return ids[offset:offset + n]


def greedy_tokens(llm, prompts, max_tokens):
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_same_or_tie(llm_alone, prompts, got, want, tol=2e-3):
    """Equal greedy tokens, or the first difference is a floating-point tie: at that position the
    top-2 logprobs (= logit gap) of the alone run differ by less than tol."""
    for p, g, w in zip(prompts, got, want):
        if g == w:
            continue
        k = next(i for i, (a, b) in enumerate(zip(g, w)) if a != b)
        out = llm_alone.generate([p + w[:k]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=2),
                                 use_tqdm=False)[0].outputs[0]
        top = out.logprobs[0].top
        gap = top[0][1] - top[1][1]
        assert {top[0][0], top[1][0]} == {g[k], w[k]} and gap < tol, f"mismatch at {k} is not a tie (gap {gap})"


def test_real_64_mixed_prompts_batch_equals_alone(real_parts):
    tok = real_parts[2]
    rng = random.Random(0)
    prompts = [text_ids(tok, rng.randint(3, 40), offset=rng.randint(0, 60)) for _ in range(64)]
    # 3 tokens: the batched prompts' chunks, then two decode steps of all 64; the alone run, 64 requests one
    # at a time, is most of the cost (it was 5 tokens)
    batched = real_llm(real_parts, max_num_seqs=64, max_num_batched_tokens=1024)
    got = greedy_tokens(batched, prompts, 3)
    alone = real_llm(real_parts, max_num_seqs=1)
    want = greedy_tokens(alone, prompts, 3)
    assert_same_or_tie(alone, prompts, got, want)
    assert sum(g == w for g, w in zip(got, want)) >= 62
    assert_all_free(batched.engine)


@pytest.mark.parametrize("block_size", [16, 128])
def test_real_prefix_caching_computes_only_suffix(real_parts, block_size):
    tok = real_parts[2]
    shared = text_ids(tok, 500)
    a = shared + tok.encode(" Question: who invented it?", add_special_tokens=False)
    b = shared + tok.encode(" In one word, the topic is", add_special_tokens=False)
    cached = real_llm(real_parts, block_size=block_size)
    greedy_tokens(cached, [a], 4)
    before = cached.engine.stats().num_computed_tokens
    got = greedy_tokens(cached, [b], 6)
    computed = cached.engine.stats().num_computed_tokens - before
    hit = 500 // block_size * block_size  # the full blocks of the shared 500 tokens: 496 or 384
    assert computed == (len(b) - hit) + 5  # the suffix, then 5 decode steps
    plain = real_llm(real_parts, enable_prefix_caching=False)
    assert got == greedy_tokens(plain, [b], 6)
    assert_all_free(cached.engine)


def test_real_preemption_same_outputs(real_parts):
    tok = real_parts[2]
    prompts = [text_ids(tok, 30 + 5 * i, offset=5 * i) for i in range(6)]
    big = real_llm(real_parts, max_num_seqs=8)
    want = greedy_tokens(big, prompts, 16)
    small = real_llm(real_parts, kv_tokens=192, max_num_seqs=8)
    got = greedy_tokens(small, prompts, 16)
    assert small.engine.scheduler.num_preemptions > 0
    assert_same_or_tie(big, prompts, got, want)
    assert_all_free(small.engine)


def test_real_chunked_prefill_with_concurrent_decodes(real_parts):
    tok = real_parts[2]
    long = text_ids(tok, 1500)  # in 12 chunks: the long prompt was 3,000 tokens in 256s, twice the time
    shorts = [text_ids(tok, 6, offset=i * 9) for i in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    whole = real_llm(real_parts, kv_tokens=1792, max_num_batched_tokens=2048, enable_prefix_caching=False)
    want = greedy_tokens(whole, [long], 4)[0]

    chunked = real_llm(real_parts, kv_tokens=1792, max_num_batched_tokens=128, enable_prefix_caching=False)
    engine = chunked.engine
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, s in enumerate(shorts):
        engine.add_request(f"s{i}", s, sp)
    engine.step()  # the short prompts prefill
    engine.add_request("long", long, params)
    long_tokens, steps_with_prefill = [], 0
    while engine.has_unfinished():
        outs = {o.request_id: o for o in engine.step()}
        req = engine.groups.get("long")
        if req is not None and req.children[0].num_output_tokens == 0:
            steps_with_prefill += 1
            # while the long prompt is prefilled in chunks, every short request still decodes
            assert all(f"s{i}" in outs for i in range(3) if f"s{i}" in engine.groups)
        if "long" in outs:
            long_tokens += outs["long"].outputs[0].token_ids
    assert steps_with_prefill >= 11  # 1500 tokens over a 128-token budget shared with 3 decodes
    assert long_tokens == want
    assert_all_free(engine)


def test_real_n_children_forked_equal_a_single_request(real_parts):
    """Children 1..n-1 run on a copy of child 0's last prompt block (in the real cache layout): their
    greedy tokens equal a request of its own."""
    tok = real_parts[2]
    prompt = text_ids(tok, 70)
    llm = real_llm(real_parts)
    want = greedy_tokens(llm, [prompt], 6)[0]
    llm.engine.pool.reset_prefix_cache()
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [want] * 3
    assert_all_free(llm.engine)


def test_real_seeded_sampling_alone_equals_batch(real_parts):
    tok = real_parts[2]
    prompts = [text_ids(tok, n, offset=n) for n in (5, 23, 41, 12)]
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234 + i) for i in range(4)]
    llm = real_llm(real_parts)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone


def hf_text(hf_model, tok, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    """transformers' greedy continuation of `prompt` (stopping at EOS): the expected ids and text."""
    ids, _ = hf_greedy(hf_model, tok.encode(prompt), max_tokens, set(tok.eos_token_ids))
    return ids, tok.decode(ids, skip_special_tokens=True)


def tokens_spanned(tok, ids: list[int], start: int, end: int) -> int:
    """How many of `ids` the characters [start, end) of their decoded text come from."""
    ends = [len(tok.decode(ids[: i + 1], skip_special_tokens=True)) for i in range(len(ids))]
    first = next(i for i, e in enumerate(ends) if e > start)
    last = next(i for i, e in enumerate(ends) if e >= end)
    return last - first + 1


def test_real_llm_text_api(real_parts, hf_model):
    llm = real_llm(real_parts)
    tok = llm.tokenizer
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for prompt, o in zip(prompts, outs):
        want_ids, want_text = hf_text(hf_model, tok, prompt, 12)
        assert o.outputs[0].token_ids == want_ids and o.outputs[0].text == want_text
    assert "Paris" in outs[0].outputs[0].text
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
    assert "Paris" in chat.outputs[0].text
    assert_all_free(llm.engine)


def test_real_stop_strings_across_tokens_and_stop_ids(real_parts, hf_model):
    """Stops against transformers' greedy text: a stop string that spans several tokens is cut
    exactly (and kept when asked), a stop token id ends the output on that token."""
    llm = real_llm(real_parts)
    tok = llm.tokenizer
    prompt = "1, 2, 3, 4,"
    want_ids, want = hf_text(hf_model, tok, prompt, 16)
    assert want.startswith(" 5, 6, 7, 8, 9,")  # what any sane model says: the reference is not garbage
    for stop in ("7, 8", ", 6"):
        at = want.index(stop)
        assert tokens_spanned(tok, want_ids, at, at + len(stop)) >= 2
        for keep in (False, True):
            params = SamplingParams(max_tokens=16, temperature=0.0, stop=["no such text", stop],
                                    include_stop_str_in_output=keep)
            c = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert c.text == want[: at + (len(stop) if keep else 0)]
            assert c.finish_reason == "stop" and c.stop_reason == stop
    k = next(i for i in range(3, len(want_ids)) if want_ids[i] not in want_ids[:i])  # first occurrence
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[want_ids[k]])
    c = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == want_ids[: k + 1] and c.finish_reason == "stop" and c.stop_reason == want_ids[k]
    assert_all_free(llm.engine)


def test_real_sampled_logprobs_match_transformers(real_parts, hf_model):
    """logprobs of sampled tokens (temperature 0.8, top-3) against transformers' log_softmax of the
    same sequence: the sampled token's value, every reported top entry, and their cumulative sum."""
    tok = real_parts[2]
    prompts = [tok.encode("The capital of France is"), text_ids(tok, 20, offset=11)]
    llm = real_llm(real_parts)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.8, seed=5, logprobs=3,
                                                ignore_eos=True), use_tqdm=False)
    for prompt, o in zip(prompts, outs):
        c = o.outputs[0]
        want = hf_log_softmax(hf_model, prompt + c.token_ids)[len(prompt) - 1 : -1]  # row i: before output i
        assert len(c.logprobs) == len(c.token_ids) == 10
        for i, (t, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            assert lp.token_id == t and lp.logprob == pytest.approx(float(want[i, t]), abs=2e-3)
            assert len(lp.top) == 3 and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
            third = float(want[i].topk(3).values[-1])
            for tid, v in lp.top:  # each reported entry is the model's value, and among its top 3
                assert v == pytest.approx(float(want[i, tid]), abs=2e-3) and v >= third - 2e-3
        assert c.cumulative_logprob == pytest.approx(sum(float(want[i, t]) for i, t in enumerate(c.token_ids)),
                                                     abs=1e-2)
    assert_all_free(llm.engine)


def test_real_prefix_cache_on_off_same_greedy_across_preemption(real_parts):
    """A KV pool far too small for the batch: requests are preempted and recomputed, and with the
    prefix cache on they re-enter through cache hits (their own blocks and the shared prefix)."""
    tok = real_parts[2]
    shared = text_ids(tok, 64)
    prompts = [shared + text_ids(tok, 6 + 3 * i, offset=70 + 9 * i) for i in range(6)]
    runs = {}
    for caching in (True, False):
        llm = real_llm(real_parts, kv_tokens=256, max_num_seqs=8, enable_prefix_caching=caching)
        runs[caching] = llm, greedy_tokens(llm, prompts, 16)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        assert (stats.prefix_cache_hits > 0) == caching
        assert_all_free(llm.engine)
    (_, got), (off, want) = runs[True], runs[False]
    assert_same_or_tie(off, prompts, got, want)
    assert sum(g == w for g, w in zip(got, want)) >= 5


def test_real_prompt_logprobs_match_the_model_and_skip_the_prefix_cache(real_parts):
    import torch
    from model_helpers import SequenceRunner

    cfg, model, tok = real_parts[0], real_parts[1], real_parts[2]
    prompt = text_ids(tok, 300, offset=7)  # unchunked: 299 rows, more than one 256-row slice
    with torch.inference_mode():
        want = torch.log_softmax(SequenceRunner(model, cfg, 320).step(prompt, all_logits=True), dim=-1)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    chunked = real_llm(real_parts, max_num_batched_tokens=64)  # the prompt in 5 chunks
    for llm in (chunked, chunked, real_llm(real_parts)):  # the 2nd run would hit the prefix cache
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        for j in range(1, len(prompt)):
            assert lps[j].token_id == prompt[j]
            assert lps[j].logprob == pytest.approx(float(want[j - 1, prompt[j]]), abs=2e-4)
            top = want[j - 1].topk(3)
            assert [t for t, _ in lps[j].top] == top.indices.tolist()
        assert out.num_cached_tokens == 0
        assert_all_free(llm.engine)
    plain = chunked.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # the others still use the cache


def test_cpu_kv_cache_defaults_to_what_the_configuration_can_use():
    """No kv_cache_memory: max_num_seqs x max_model_len tokens (+ one block), not the whole default space."""
    engine = fake_engine(kv_cache_memory=None, max_num_seqs=3, max_model_len=100)
    assert engine.pool.num_blocks == (3 * 100 + 16) // 16
    explicit = fake_engine(kv_cache_memory=1000 * 16, max_num_seqs=3, max_model_len=100)  # still overrides
    assert explicit.pool.num_blocks == 1000 // 16
