"""Decode and prefill attention at the default model's shape, beside the machine's read bandwidth, the
GEMMs and torch SDPA.

Run: python -m pytest bench/bench_attention.py -q --benchmark-columns=mean,stddev,rounds
     (-k decode / -k prefill for one half; the prefill half takes a few minutes: 8k-token prompts)

Decode.
Shape: 9 q heads, 3 kv heads, head_dim 64, block 16, bf16 cache; batch 1/8/32 x context 512/2048/8192;
2 threads for both pyengine and torch. Per point, in the same run:
  paged  pyengine paged_attention over a shuffled paged cache (one decode token per sequence)
  read   pyengine read_bandwidth over a buffer of the same size as the K/V the kernel reads
  sdpa   torch scaled_dot_product_attention (enable_gqa) on already-gathered contiguous K/V
GB/s = K/V bytes / time. Every round starts from a cold last-level cache, as each layer's K/V does in a
model step. A table of the fastest round of each (min: the most robust figure on a shared machine; the
means are in pytest-benchmark's own table) is printed at the end of the module. The three kinds of a
point run back to back: this host's memory bandwidth drifts by +-30% over minutes.

Prefill (one prompt of 512 / 2048 / 8192 tokens, bf16, same heads, 2 threads), GFLOP/s of the causal
attention (4 H D L (L + 1) / 2 flops) per path of the prefill kernel (native/cpu/prefill_attention.cpp:
amx, avx512_bf16), torch SDPA (is_causal, contiguous K/V), and beside them the GEMMs at M = L rows on
the gate_up shape (N 3072, K 576): pyengine's PackedLinear and torch's F.linear (oneDNN) in bf16.
End to end: LLM.generate of one (L - 1)-token prompt and max_tokens=1 (L positions: 8192 is the model's
context), default model and settings (prefix caching off), prompt tokens/s of the fastest of two runs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyengine import _C
from pyengine.ops.attention import paged_attention, to_cache_layout

H, KVH, D, BS, DTYPE = 9, 3, 64, 16, torch.bfloat16
BATCHES, CONTEXTS = (1, 8, 32), (512, 2048, 8192)
RESULTS: dict[tuple[int, int, str], float] = {}
PROMPTS = (512, 2048, 8192)
PREFILL_KINDS = ("amx", "avx512_bf16", "sdpa", "gemm", "gemm_torch")
PREFILL: dict[tuple[int, str], float] = {}  # (prompt length, kind): GFLOP/s, or tok/s for "e2e"
GATE_UP = (3072, 576)


def kv_bytes(batch: int, ctx: int) -> int:
    return 2 * batch * ctx * KVH * D * DTYPE.itemsize


@pytest.fixture(scope="module", autouse=True)
def two_threads_and_table(request):
    threads = (torch.get_num_threads(), _C.num_threads())
    torch.set_num_threads(2)
    _C.set_num_threads(2)
    yield
    torch.set_num_threads(threads[0])
    _C.set_num_threads(threads[1])
    lines = ["", "decode attention (bf16, 9/3 heads, D 64, block 16, 2 threads): min us, GB/s of K/V read",
             f"{'batch':>5} {'ctx':>5} {'paged us':>9} {'GB/s':>6} {'read us':>8} {'GB/s':>6} {'%read':>6} "
             f"{'sdpa us':>8} {'x sdpa':>7}"]
    for b in BATCHES:
        for c in CONTEXTS:
            t = {k: RESULTS.get((b, c, k)) for k in ("paged", "read", "sdpa")}
            if None in t.values():
                continue
            gb = kv_bytes(b, c) / 1e9
            lines.append(f"{b:>5} {c:>5} {t['paged'] * 1e6:>9.1f} {gb / t['paged']:>6.1f} {t['read'] * 1e6:>8.1f} "
                         f"{gb / t['read']:>6.1f} {100 * t['read'] / t['paged']:>5.0f}% {t['sdpa'] * 1e6:>8.1f} "
                         f"{t['sdpa'] / t['paged']:>6.1f}x")
    lines += ["", "prefill (bf16, 9/3 heads, D 64, 2 threads): GFLOP/s at min time; GEMMs at M = L on gate_up "
              "(3072 x 576); end-to-end tok/s",
              f"{'L':>5} " + " ".join(f"{k:>11}" for k in PREFILL_KINDS) + f" {'e2e tok/s':>10}"]
    for n in PROMPTS:
        row = [PREFILL.get((n, k)) for k in (*PREFILL_KINDS, "e2e")]
        if any(v is not None for v in row):
            lines.append(f"{n:>5} " + " ".join(f"{v:>11.1f}" if v is not None else f"{'-':>11}" for v in row[:-1])
                         + (f" {row[-1]:>10.0f}" if row[-1] is not None else f" {'-':>10}"))
    # printed after pytest's own summary, once output capture is over
    request.config.add_cleanup(lambda: print("\n".join(lines)))


def record(benchmark, batch: int, ctx: int, kind: str) -> None:
    best = benchmark.stats.stats.min
    RESULTS[(batch, ctx, kind)] = best
    benchmark.extra_info["kv_GBps_at_min"] = kv_bytes(batch, ctx) / best / 1e9


def decode_batch(batch: int, ctx: int):
    """q, logical [NB, KVH, BS, D] K/V caches over shuffled blocks, and the step's metadata."""
    g = torch.Generator().manual_seed(0)
    nb = ctx // BS
    k_cache = torch.randn(batch * nb, KVH, BS, D, generator=g).to(DTYPE)
    v_cache = torch.randn(batch * nb, KVH, BS, D, generator=g).to(DTYPE)
    block_tables = torch.randperm(batch * nb, generator=g).int().view(batch, nb)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, H, D, generator=g).to(DTYPE)
    return q, k_cache, v_cache, block_tables, seq_lens, qsl


def paged_call(batch: int, ctx: int):
    q, kc, vc, bt, sl, qsl = decode_batch(batch, ctx)
    kc, vc = to_cache_layout(kc, vc, "cpu")
    out = torch.empty_like(q)
    return lambda: paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5, max_seq_len=ctx, out=out)


def read_call(batch: int, ctx: int):
    buf = torch.ones(kv_bytes(batch, ctx), dtype=torch.uint8)
    return lambda: _C.read_bandwidth(buf.data_ptr(), buf.numel(), 0)


def sdpa_call(batch: int, ctx: int):
    q, kc, vc, bt, _, _ = decode_batch(batch, ctx)
    k = kc[bt.long()].permute(0, 2, 1, 3, 4).reshape(batch, KVH, ctx, D).contiguous()
    v = vc[bt.long()].permute(0, 2, 1, 3, 4).reshape(batch, KVH, ctx, D).contiguous()
    qq = q.view(batch, H, 1, D)
    return lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True)


# kind varies fastest, so the three measurements of a point run back to back (the machine's memory
# bandwidth drifts over minutes on a shared host)
@pytest.mark.parametrize("kind", ["paged", "read", "sdpa"])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("ctx", CONTEXTS)
def test_decode_attention(benchmark, kind, ctx, batch):
    fn = {"paged": paged_call, "read": read_call, "sdpa": sdpa_call}[kind](batch, ctx)
    # Each round starts from a cold last-level cache (a 3 x L3 read in setup, untimed): otherwise
    # whatever part of the operands the L3 keeps between rounds flatters some kinds more than
    # others (a sequential re-read of 50 MB kept 30-80% hits, varying run to run).
    rounds = max(5, min(100, int(2e8 / kv_bytes(batch, ctx))))
    benchmark.pedantic(fn, setup=flush_caches, rounds=rounds, warmup_rounds=1)
    record(benchmark, batch, ctx, kind)


_FLUSH = torch.ones(96 << 20, dtype=torch.uint8)


def flush_caches() -> None:
    _C.read_bandwidth(_FLUSH.data_ptr(), _FLUSH.numel(), 0)


def prompt_step(n: int):
    """One n-token prompt over a shuffled paged cache: q, cache-layout K/V, and the step's metadata."""
    g = torch.Generator().manual_seed(0)
    nb = n // BS
    k = torch.randn(nb, KVH, BS, D, generator=g).to(DTYPE)
    v = torch.randn(nb, KVH, BS, D, generator=g).to(DTYPE)
    kc, vc = to_cache_layout(k, v, "cpu")
    bt = torch.randperm(nb, generator=g).int().view(1, nb)
    q = torch.randn(n, H, D, generator=g).to(DTYPE)
    return q, kc, vc, bt, torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), k, v


def prefill_call(n: int, kind: str):
    """(call, flops) for one kind of the prefill table."""
    from pyengine.ops.linear import PackedLinear

    q, kc, vc, bt, sl, qsl, k, v = prompt_step(n)
    attn_flops = 4 * H * D * n * (n + 1) / 2
    if kind in ("amx", "avx512_bf16"):
        _C.set_prefill_attention_path(kind)
        if _C.prefill_attention_path() != kind:
            pytest.skip(f"no {kind} path on this build/CPU")
        out = torch.empty_like(q)
        return (lambda: paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5, max_seq_len=n, out=out)), attn_flops
    if kind == "sdpa":
        kk = k[bt[0].long()].permute(1, 0, 2, 3).reshape(1, KVH, n, D).contiguous()
        vv = v[bt[0].long()].permute(1, 0, 2, 3).reshape(1, KVH, n, D).contiguous()
        qq = q.permute(1, 0, 2).unsqueeze(0).contiguous()
        return (lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)), attn_flops
    x = torch.randn(n, GATE_UP[1]).to(DTYPE)
    w = torch.randn(GATE_UP).to(DTYPE)
    gemm_flops = 2 * n * GATE_UP[0] * GATE_UP[1]
    if kind == "gemm":
        lin = PackedLinear(w)
        return (lambda: lin(x)), gemm_flops
    return (lambda: F.linear(x, w)), gemm_flops


@pytest.mark.parametrize("kind", PREFILL_KINDS)
@pytest.mark.parametrize("n", PROMPTS)
def test_prefill_attention(benchmark, kind, n):
    try:
        fn, flops = prefill_call(n, kind)
        benchmark.pedantic(fn, rounds=3 if n >= 8192 else 10, warmup_rounds=1)
    finally:
        _C.set_prefill_attention_path("amx")
    PREFILL[(n, kind)] = flops / benchmark.stats.stats.min / 1e9


@pytest.fixture(scope="module")
def llm():
    from pyengine import LLM

    engine = LLM(num_threads=2, enable_prefix_caching=False)
    engine.generate([[1, 2, 3]], use_tqdm=False)  # warm-up
    return engine


@pytest.mark.parametrize("n", PROMPTS)
def test_prefill_end_to_end(benchmark, llm, n):
    from pyengine import SamplingParams

    prompt = torch.randint(100, 40000, (n - 1,), generator=torch.Generator().manual_seed(n)).tolist()
    params = SamplingParams(max_tokens=1)
    benchmark.pedantic(lambda: llm.generate([prompt], params, use_tqdm=False), rounds=2, warmup_rounds=0)
    PREFILL[(n, "e2e")] = (n - 1) / benchmark.stats.stats.min
