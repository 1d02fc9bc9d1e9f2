"""sample() and apply_penalties() against plain torch references.

The statistical tests use fixed seeds, so they are deterministic: a pass is a pass on every run.
"""
import math

import pytest
import torch

from pyengine import _C
from pyengine.ops.sampling import SampleResult, apply_penalties, sample


def params(batch, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, steps=None):
    """Per-row parameter tensors for sample(); steps default to 0..batch-1."""
    full = lambda v, dtype: torch.full((batch,), v, dtype=dtype)  # noqa: E731
    return dict(temperature=full(temperature, torch.float32), top_k=full(top_k, torch.int32),
                top_p=full(top_p, torch.float32), min_p=full(min_p, torch.float32),
                seeds=full(seed, torch.int64), steps=torch.arange(batch) if steps is None else steps)


def ref_filtered_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The distribution sample() draws from (vLLM order: min-p, top-k, then top-p), float64."""
    x = logits.double()
    probs = torch.softmax(x / temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if 0 < top_k < x.shape[-1]:
        keep &= x >= torch.topk(x, top_k).values[-1]
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    q = torch.where(keep, probs, 0.0)
    q /= q.sum()
    if top_p < 1:
        sorted_q, order = torch.sort(q, descending=True)
        mass_before = torch.cumsum(sorted_q, 0) - sorted_q
        assert ((mass_before - top_p).abs() > 1e-6).all(), "test distribution too close to the top-p boundary"
        q = torch.zeros_like(q).scatter(0, order, torch.where(mass_before < top_p, sorted_q, 0.0))
        q /= q.sum()
    return q


def draw(logits_row, n, chunk=4000, seed=7, **kw):
    """n draws for one row of logits (rows of one batch, steps 0..n-1); returns counts per token."""
    counts = torch.zeros(logits_row.shape[0], dtype=torch.int64)
    for start in range(0, n, chunk):
        b = min(chunk, n - start)
        res = sample(logits_row.expand(b, -1).contiguous(), **params(b, seed=seed, steps=torch.arange(start, start + b), **kw))
        counts += torch.bincount(res.token_ids.long(), minlength=logits_row.shape[0])
    return counts


def chi2_pvalue(counts, q):
    """Pearson chi-square p-value of counts against probabilities q (all q > 0)."""
    n = counts.sum().item()
    expected = n * q
    stat = (((counts.double() - expected) ** 2) / expected).sum()
    df = torch.tensor(float(len(q) - 1), dtype=torch.float64)
    return torch.special.gammaincc(df / 2, stat / 2).item()


STAT_CASES = {
    "temperature": dict(temperature=1.0),
    "temperature+top_k": dict(temperature=0.8, top_k=5),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.3, min_p=0.1),
    "all": dict(temperature=0.7, top_k=12, top_p=0.85, min_p=0.02),
}


@pytest.mark.parametrize("case", list(STAT_CASES))
def test_sampled_frequencies_follow_filtered_distribution(case):
    kw = STAT_CASES[case]
    logits = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 1.5
    q = ref_filtered_probs(logits, **kw)
    counts = draw(logits, 20000, **kw)
    kept = q > 0
    assert counts[~kept].sum() == 0, "a filtered token was sampled"
    assert chi2_pvalue(counts[kept], q[kept]) > 1e-3


def test_top_p_nucleus_is_exact_on_large_candidate_sets():
    """A nucleus of ~180 tokens (the radix threshold search, not the small sort): every kept token is
    drawn and no other, over shuffled ids."""
    vocab = 1000
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))
    logits = torch.empty(vocab).scatter_(0, perm, -torch.arange(vocab, dtype=torch.float32) / 200)
    q = ref_filtered_probs(logits, 1.0, top_p=0.6)
    assert 150 < (q > 0).sum() < 250
    counts = draw(logits, 24000, top_p=0.6)
    assert torch.equal(counts > 0, q > 0)
    assert chi2_pvalue(counts[q > 0], q[q > 0]) > 1e-3


def test_filters_never_emit_filtered_tokens_at_model_vocab():
    batch, vocab = 24, 49152
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(batch, vocab, generator=g) * 3
    kw = [dict(top_k=50, top_p=0.9, temperature=0.8), dict(top_p=0.5, temperature=1.0),
          dict(min_p=0.3, temperature=1.0), dict(top_k=1, temperature=1.5)]
    for i, k in enumerate(kw):
        res = sample(logits, **params(batch, seed=i, **k))
        for b in range(batch):
            q = ref_filtered_probs(logits[b], **k)
            assert q[res.token_ids[b]] > 0, (k, b)


@pytest.mark.parametrize("batch,vocab", [(1, 7), (64, 1000), (3, 49152)])
def test_greedy_is_argmax_with_ties_to_lowest_id(batch, vocab):
    logits = torch.randint(0, 4, (batch, vocab), generator=torch.Generator().manual_seed(vocab)).float()
    logits[0, -1] = 9.0  # a unique maximum at the last id
    res = sample(logits, **params(batch, temperature=0.0, top_k=3, top_p=0.5, seed=5))
    want = torch.argmax(logits, dim=-1).to(torch.int32)  # first maximal index
    assert torch.equal(res.token_ids, want)
    assert res.logprobs is None and res.top_ids is None


def test_all_masked_but_one_and_tiny_temperature():
    logits = torch.full((2, 100), float("-inf"))
    logits[0, 42] = 0.0
    logits[1, 17], logits[1, 18] = 5.0, 4.0
    res = sample(logits, **params(2, temperature=1e-30, seed=1))
    assert res.token_ids.tolist() == [42, 17]


@pytest.mark.parametrize("top_k", [0, 50])
def test_masked_tokens_are_never_drawn(top_k):
    logits = torch.full((1, 3000), float("-inf"))
    logits[0, [5, 900, 2999]] = torch.tensor([0.0, 1.0, -1.0])
    counts = draw(logits[0], 3000, top_k=top_k, top_p=0.999)
    assert counts.sum() == 3000 and counts[[5, 900, 2999]].sum() == 3000 and (counts[[5, 900, 2999]] > 0).all()


def test_seeded_draws_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 5000, generator=g) * 2
    p = dict(temperature=torch.rand(16, generator=g) + 0.5, top_k=torch.randint(0, 100, (16,), generator=g).int(),
             top_p=torch.rand(16, generator=g) * 0.5 + 0.5, min_p=torch.rand(16, generator=g) * 0.1,
             seeds=torch.randint(0, 2**62, (16,), generator=g), steps=torch.randint(0, 10**6, (16,), generator=g))
    full = sample(logits, **p).token_ids
    alone = torch.cat([sample(logits[b:b + 1], **{k: v[b:b + 1] for k, v in p.items()}).token_ids for b in range(16)])
    assert torch.equal(full, alone)
    perm = torch.randperm(16, generator=g)
    permuted = sample(logits[perm], **{k: v[perm] for k, v in p.items()}).token_ids
    assert torch.equal(permuted, full[perm])
    again = sample(logits, **p).token_ids
    assert torch.equal(again, full)
    # a different step gives (almost always) a different draw
    p2 = dict(p, steps=p["steps"] + 1, top_k=torch.zeros(16, dtype=torch.int32), top_p=torch.ones(16),
              min_p=torch.zeros(16))
    p1 = dict(p2, steps=p["steps"])
    assert not torch.equal(sample(logits, **p1).token_ids, sample(logits, **p2).token_ids)


def test_philox_known_answers():
    """Random123's kat_vectors for philox4x32_10 (the CUDA sampler draws the same numbers)."""
    assert _C.philox4x32_10([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert _C.philox4x32_10([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert _C.philox4x32_10([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0]) == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]
    u = [_C.philox_uniform(123, s) for s in range(1000)]
    assert all(0.0 <= v < 1.0 for v in u) and abs(sum(u) / 1000 - 0.5) < 0.05


@pytest.mark.parametrize("num_logprobs", [0, 1, 5])
def test_logprobs_match_log_softmax_and_topk(num_logprobs):
    logits = torch.randn(8, 3000, generator=torch.Generator().manual_seed(4)) * 4
    res = sample(logits, **params(8, temperature=0.7, top_k=20), num_logprobs=num_logprobs)
    assert isinstance(res, SampleResult)
    ref = torch.log_softmax(logits.double(), dim=-1).float()
    torch.testing.assert_close(res.logprobs, ref.gather(1, res.token_ids.long()[:, None])[:, 0], atol=1e-5, rtol=1e-5)
    if num_logprobs == 0:
        assert res.top_ids is None and res.top_logprobs is None
        return
    top = torch.topk(ref, num_logprobs, dim=-1)
    assert torch.equal(res.top_ids, top.indices.int())
    torch.testing.assert_close(res.top_logprobs, top.values, atol=1e-5, rtol=1e-5)


def ref_penalties(logits, prompts, outputs, presence, frequency, repetition):
    """vLLM's apply_penalties on dense masks."""
    out = logits.clone()
    vocab = logits.shape[1]
    for b in range(logits.shape[0]):
        counts = torch.bincount(torch.tensor(outputs[b], dtype=torch.int64), minlength=vocab).float()
        seen = (torch.bincount(torch.tensor(prompts[b], dtype=torch.int64), minlength=vocab) > 0) | (counts > 0)
        rep = torch.where(seen, repetition[b], 1.0)
        row = out[b]
        row = torch.where(row > 0, row / rep, row * rep)
        row = row - frequency[b] * counts
        row = row - presence[b] * (counts > 0).float()
        out[b] = row
    return out


def csr(lists):
    ids = torch.tensor([t for lst in lists for t in lst], dtype=torch.int32)
    offsets = torch.tensor([0] + [len(lst) for lst in lists], dtype=torch.int32).cumsum(0).int()
    return ids, offsets


@pytest.mark.parametrize("batch", [1, 5, 40])
def test_penalties_match_reference(batch):
    g = torch.Generator().manual_seed(batch)
    vocab = 300
    logits = torch.randn(batch, vocab, generator=g) * 3
    prompts = [torch.randint(0, vocab, (int(torch.randint(0, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(batch)]
    outputs = [torch.randint(0, 50, (int(torch.randint(0, 400, (1,), generator=g)),), generator=g).tolist()
               for _ in range(batch)]
    presence = torch.rand(batch, generator=g) - 0.3
    frequency = torch.rand(batch, generator=g) * 0.5
    repetition = torch.rand(batch, generator=g) + 0.6
    repetition[0] = 1.0
    want = ref_penalties(logits, prompts, outputs, presence, frequency, repetition)
    pid, poff = csr(prompts)
    oid, ooff = csr(outputs)
    apply_penalties(logits, pid, poff, oid, ooff, presence, frequency, repetition)
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    # the per-thread scratch is clean again: a second call with no tokens changes nothing
    before = logits.clone()
    empty = torch.zeros(0, dtype=torch.int32)
    apply_penalties(logits, empty, torch.zeros(batch + 1, dtype=torch.int32), empty,
                    torch.zeros(batch + 1, dtype=torch.int32), presence, frequency, repetition)
    assert torch.equal(logits, before)


def test_sample_bad_arguments():
    logits = torch.randn(2, 10)
    p = params(2)
    with pytest.raises(TypeError, match="logits"):
        sample(logits.double(), **p)
    with pytest.raises(ValueError, match="logits must have 2 dimensions"):
        sample(logits[0], **p)
    with pytest.raises(ValueError, match="contiguous"):
        sample(torch.randn(10, 2).t(), **p)
    with pytest.raises(TypeError, match="top_k"):
        sample(logits, **dict(p, top_k=p["top_k"].long()))
    with pytest.raises(ValueError, match="seeds"):
        sample(logits, **dict(p, seeds=torch.zeros(3, dtype=torch.int64)))
    with pytest.raises(TypeError, match="steps must be a torch.Tensor"):
        sample(logits, **dict(p, steps=[0, 1]))
    with pytest.raises(ValueError, match="num_logprobs"):
        sample(logits, **p, num_logprobs=11)
    with pytest.raises(ValueError, match="num_logprobs"):
        sample(logits, **p, num_logprobs=-1)
    with pytest.raises(ValueError, match=r"temperature\[1\]"):
        sample(logits, **dict(p, temperature=torch.tensor([1.0, -0.5])))
    with pytest.raises(ValueError, match=r"temperature\[0\]"):
        sample(logits, **dict(p, temperature=torch.tensor([math.nan, 1.0])))
    with pytest.raises(ValueError, match=r"top_p\[0\]"):
        sample(logits, **dict(p, top_p=torch.tensor([0.0, 1.0])))
    with pytest.raises(ValueError, match=r"min_p\[1\]"):
        sample(logits, **dict(p, min_p=torch.tensor([0.0, 1.5])))


def test_penalties_bad_arguments():
    logits = torch.randn(2, 10)
    ids, offsets = csr([[1, 2], [3]])
    ones, zeros = torch.ones(2), torch.zeros(2)
    with pytest.raises(TypeError, match="prompt_ids"):
        apply_penalties(logits, ids.long(), offsets, ids, offsets, zeros, zeros, ones)
    with pytest.raises(ValueError, match="output_offsets"):
        apply_penalties(logits, ids, offsets, ids, offsets[:2], zeros, zeros, ones)
    with pytest.raises(ValueError, match="repetition"):
        apply_penalties(logits, ids, offsets, ids, offsets, zeros, zeros, torch.ones(3))
    with pytest.raises(ValueError, match=r"output_ids\[1\]"):
        apply_penalties(logits, ids, offsets, torch.tensor([1, 10, 3], dtype=torch.int32), offsets, zeros, zeros, ones)
    with pytest.raises(ValueError, match="prompt_offsets"):
        apply_penalties(logits, ids, torch.tensor([0, 3, 2], dtype=torch.int32), ids, offsets, zeros, zeros, ones)
    with pytest.raises(ValueError, match=r"repetition\[0\]"):
        apply_penalties(logits, ids, offsets, ids, offsets, zeros, zeros, torch.tensor([0.0, 1.0]))


def test_first_parallel_call_after_import_returns():
    """Regression: the thread pool's workers once missed a parallel_for issued before they first ran,
    and the first multi-row sample() after import hung forever."""
    import os
    import subprocess
    import sys

    code = ("import torch; from pyengine.ops.sampling import sample; b = 2; "
            "print(sample(torch.randn(b, 20000), torch.ones(b), torch.zeros(b, dtype=torch.int32), torch.ones(b), "
            "torch.zeros(b), torch.arange(b), torch.arange(b)).token_ids.shape[0])")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYENGINE_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr


# ---- token bitmask (grammar-constrained decoding) -------------------------------------------------

def random_bitmask(batch, vocab, density, seed):
    """[batch, ceil(vocab/32)] int32 in xgrammar's layout and the bool [batch, vocab] it encodes."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(batch, vocab, generator=g) < density
    allowed[torch.arange(batch), torch.randint(vocab, (batch,), generator=g)] = True  # never all masked
    return pack_bitmask(allowed), allowed


def pack_bitmask(allowed):
    """bool [B, V] -> int32 [B, ceil(V/32)], bit j of word i = token 32*i + j (the torch reference)."""
    batch, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = torch.zeros(batch, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(batch, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.mark.parametrize("vocab", [49152, 1000, 37])
@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=20, top_p=0.9)])
def test_bitmask_matches_torch_reference(vocab, kw):
    """sample(bitmask=m) == sample(logits with disallowed tokens at -inf), and in place: the masked logits."""
    batch = 12
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    mask, allowed = random_bitmask(batch, vocab, 0.05, seed=vocab + 1)
    ref_logits = logits.masked_fill(~allowed, float("-inf"))
    want = sample(ref_logits.clone(), **params(batch, seed=5, **kw), num_logprobs=3)
    got_logits = logits.clone()
    got = sample(got_logits, **params(batch, seed=5, **kw), num_logprobs=3, bitmask=mask)
    assert torch.equal(got.token_ids, want.token_ids)
    assert bool(allowed.gather(1, got.token_ids[:, None].long()).all())
    torch.testing.assert_close(got.logprobs, want.logprobs)
    assert torch.equal(got_logits, ref_logits)


def test_bitmask_all_ones_changes_nothing_and_bad_shape_raises():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    ones = torch.full((3, 4), -1, dtype=torch.int32)
    copy = logits.clone()
    got = sample(copy, **params(3, seed=2), bitmask=ones)
    assert torch.equal(got.token_ids, sample(logits, **params(3, seed=2)).token_ids)
    assert torch.equal(copy, logits)
    with pytest.raises(ValueError, match="bitmask"):
        sample(logits, **params(3), bitmask=torch.zeros(3, 3, dtype=torch.int32))
