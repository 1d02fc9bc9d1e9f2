"""Sampling benchmark: pyengine's native sampler vs a torch sort+cumsum reference, same run.

vocab 49152 (SmolLM2), batch 1/32/128, temperature 0.8, top-k 50 + top-p 0.9, 2 threads for both.
The torch reference is the usual masked-sort pipeline (as in vLLM's torch fallback): sort each row,
mask below the k-th value, softmax + cumsum for the nucleus, softmax again, then an exponential race
(argmax of probs / Exp(1) noise, vLLM's replacement for the slower torch.multinomial).
"torch_topk" is a smarter torch baseline that avoids the full sort: topk(50) first, nucleus on those.

    python -m pytest bench/kernels/bench_sampling.py --benchmark-group-by=param:batch \
        --benchmark-columns=min,median,mean,rounds
"""
import pytest
import torch

from pyengine import _C
from pyengine.ops.sampling import sample

VOCAB = 49152
THREADS = 2


def torch_sample(logits, temperature, top_k, top_p, generator):
    x = logits / temperature[:, None]
    sorted_x, order = x.sort(dim=-1, descending=False)
    kth = sorted_x.gather(1, (x.shape[1] - top_k.long())[:, None])
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - top_p[:, None]
    drop[:, -1] = False
    probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
    choice = probs.div_(torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=-1)
    return order.gather(1, choice[:, None])[:, 0]


def torch_topk_sample(logits, temperature, top_k, top_p, generator):
    """Same distribution, valid when every row has the same top_k: no full sort of the vocabulary."""
    vals, idx = (logits / temperature[:, None]).topk(int(top_k[0]), dim=-1)  # sorted descending
    probs = vals.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p[:, None]
    probs = vals.masked_fill(drop, float("-inf")).softmax(dim=-1)
    choice = probs.div_(torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=-1)
    return idx.gather(1, choice[:, None])[:, 0]


@pytest.fixture(autouse=True)
def two_threads():
    old = torch.get_num_threads(), _C.num_threads()
    torch.set_num_threads(THREADS)
    _C.set_num_threads(THREADS)
    yield
    torch.set_num_threads(old[0])
    _C.set_num_threads(old[1])


@pytest.mark.parametrize("impl", ["pyengine", "torch", "torch_topk"])
@pytest.mark.parametrize("batch", [1, 32, 128])
def test_sample_topk_topp(benchmark, batch, impl):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, VOCAB, generator=g) * 4
    temperature = torch.full((batch,), 0.8)
    top_k = torch.full((batch,), 50, dtype=torch.int32)
    top_p = torch.full((batch,), 0.9)
    if impl == "pyengine":
        min_p = torch.zeros(batch)
        seeds = torch.arange(batch, dtype=torch.int64)
        steps = torch.zeros(batch, dtype=torch.int64)
        res = benchmark(sample, logits, temperature, top_k, top_p, min_p, seeds, steps)
        ids = res.token_ids.long()
    else:
        fn = torch_sample if impl == "torch" else torch_topk_sample
        ids = benchmark(fn, logits, temperature, top_k, top_p, g)
    # both must pick inside the top-50 of every row
    top50 = torch.topk(logits, 50, dim=-1).indices
    assert (top50 == ids[:, None]).any(dim=-1).all()
