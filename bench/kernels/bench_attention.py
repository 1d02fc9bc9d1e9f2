"""Decode and prefill attention at the default model's shape, beside the machine's read bandwidth, the
GEMMs and torch SDPA.

Run: python -m pytest bench/kernels/bench_attention.py -q --benchmark-columns=min,mean,rounds
     BENCH_ATTENTION_FULL=1 python -m pytest bench/kernels/bench_attention.py ...   (the full decode grid)
     (-k decode / -k prefill for one half; the prefill half takes a few minutes: 8k-token prompts)

Decode.
Shape: 9 q heads, 3 kv heads, head_dim 64, block 16 (BENCH_ATTENTION_BLOCK=N for another), bf16 q;
KV cache bf16, int8 and fp8 (one fp32 scale per token and kv head), and fp32 with fp32 q (an fp32
model's decode: what CPUs without AVX512-BF16 run by default); batch 8/32 x context 2k/8k and
batch 1 x 8k by default, batch 1/8/32/64 x context 512/2k/8k/32k with BENCH_ATTENTION_FULL=1; 2 threads
for pyengine and torch.
Per point, in the same run:
  bf16, int8, fp8, fp32  pyengine paged_attention over a shuffled paged cache (one decode token per
                   sequence)
  fp8@bf16         the fp8 cache on the avx512_bf16 decode path (codes widened to bf16, vdpbf16ps),
                   where the build's best, avx512_fp16, computes it in fp16 FMAs (skipped elsewhere)
  read2, read1, read4  pyengine read_bandwidth over a buffer of as many bytes as the bf16 (read2), the
                   int8/fp8 (read1: codes and scales) or the fp32 (read4) kernel reads
  scat2, scat1, scat4  pyengine read_tiles over the same bytes as tiles, one per block of K and of V (each
                   kv block's share), in a shuffled block table's order, sequence by sequence, each
                   block's K tile then its V tile: a plain read of the bytes where the kernel meets them
  sdpa             torch scaled_dot_product_attention (enable_gqa) on already-gathered contiguous bf16 K/V
The caches and the plain reads' buffers are on 2 MB pages, as the engine allocates its KV cache
(ops.huge_pages: on 4 KB pages, in shuffled blocks, the kernels ran 2-12% slower, plain reads 12-26%).
GB/s = bytes read / time; %read = the plain read's time over the kernel's (100%: as fast as a read of
the same bytes); %scat the same against the scattered read. Every round starts from a cold last-level
cache, as each layer's K/V does in a model step, and with the call's code warm, as a step has it: a
call of the same kind on a tiny problem of its own follows the flush (cold_operands). A table of the
fastest round of each (min: robust to slow rounds; the means are in pytest-benchmark's own table) is
printed at the end of the module. The kinds of a point run back to back, but seconds apart, and this
host's memory bandwidth swings by +-30% within minutes, in bursts: one fast round of a plain read moved
a point's %read from ~90% to ~50%. So the table adds %pair, the median over rounds of the plain read's
time over the kernel's with the two taken in turn (paired_read_share): a ratio of neighbours in time.

Prefill (one prompt of 512 / 2048 / 8192 tokens, bf16, same heads, 2 threads), GFLOP/s of the causal
attention (4 H D L (L + 1) / 2 flops) per path of the prefill kernel (native/cpu/attention/prefill.cpp
and its prefill_*.h: amx, avx512_fp16, avx512_fp32, avx512_bf16), torch SDPA (is_causal, contiguous K/V),
and beside them the GEMMs at M = L rows on the gate_up shape (N 3072, K 576): pyengine's PackedLinear and
torch's F.linear (oneDNN) in bf16.
End to end: LLM.generate of one (L - 1)-token prompt and max_tokens=1 (L positions: 8192 is the model's
context), default model and settings (prefix caching off), prompt tokens/s of the fastest of two runs.
"""
from __future__ import annotations

import os
import statistics
import time
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import CAPPED_DECODE as CAPPED
from pyengine import _C
from pyengine.ops.attention import paged_attention, to_cache_layout
from pyengine.ops.huge_pages import HugePageArena, huge_page_buffer

H, KVH, D, DTYPE = 9, 3, 64, torch.bfloat16
BS = int(os.environ.get("BENCH_ATTENTION_BLOCK", "16"))
if os.environ.get("BENCH_ATTENTION_FULL") == "1":
    POINTS = [(b, c) for b in (1, 8, 32, 64) for c in (512, 2048, 8192, 32768)]
else:
    POINTS = [(1, 8192), (8, 2048), (8, 8192), (32, 2048), (32, 8192)]
CACHES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}
READ_OF = {"bf16": "read2", "int8": "read1", "fp8": "read1", "fp8@bf16": "read1", "fp32": "read4"}
SCAT_OF = {"bf16": "scat2", "int8": "scat1", "fp8": "scat1", "fp8@bf16": "scat1", "fp32": "scat4"}
RESULTS: dict[tuple[int, int, str], float] = {}
PAIRED: dict[tuple[int, int, str], float] = {}  # (batch, ctx, kernel kind): paired_read_share
PROMPTS = (512, 2048, 8192)
PREFILL_KINDS = ("amx", "avx512_fp16", "avx512_fp32", "avx512_bf16", "sdpa", "gemm", "gemm_torch")
PREFILL: dict[tuple[int, str], float] = {}  # (prompt length, kind): GFLOP/s, or tok/s for "e2e"
GATE_UP = (3072, 576)


def kv_bytes(batch: int, ctx: int, kind: str) -> int:
    """Bytes of K and V the kernel reads: bf16 or fp32 elements, or 1-byte codes plus an fp32 scale per row."""
    rows = 2 * batch * ctx * KVH
    if kind in ("fp32", "read4", "scat4"):
        return rows * D * 4
    return rows * D * 2 if kind in ("bf16", "read2", "scat2", "sdpa") else rows * (D + 4)


@pytest.fixture(scope="module", autouse=True)
def two_threads_and_table(request):
    threads = (torch.get_num_threads(), _C.num_threads())
    torch.set_num_threads(2)
    _C.set_num_threads(2)
    yield
    torch.set_num_threads(threads[0])
    _C.set_num_threads(threads[1])
    kinds = [k for k in (*CACHES, *CAPPED) if any(key[2] == k for key in RESULTS)]
    reads = ("read2", "scat2", "read1", "scat1", "read4", "scat4")
    head = f"{'batch':>5} {'ctx':>5} " + " ".join(f"{r + ' GB/s':>10}" for r in reads)
    for c in kinds:
        head += f" | {c + ' us':>11} {'GB/s':>5} {'%read':>5} {'%pair':>5} {'%scat':>5}"
    lines = ["", f"decode attention (9/3 heads, D 64, block {BS}, bf16 q (fp32: fp32 q), 2 threads): min us, GB/s of K/V read, "
             "% of a plain read of the same bytes, in order and as scattered tiles",
             head + f" | {'sdpa us':>8} {'bf16 x':>6}"]
    for b, c in POINTS:
        t = {k: RESULTS.get((b, c, k)) for k in (*kinds, *reads, "sdpa")}
        if None in t.values():
            continue
        line = f"{b:>5} {c:>5} " + " ".join(f"{kv_bytes(b, c, r) / t[r] / 1e9:>10.1f}" for r in reads)
        for k in kinds:
            line += f" | {t[k] * 1e6:>11.0f} {kv_bytes(b, c, k) / t[k] / 1e9:>5.1f} {100 * t[READ_OF[k]] / t[k]:>4.0f}%" \
                    f" {100 * PAIRED.get((b, c, k), float('nan')):>4.0f}% {100 * t[SCAT_OF[k]] / t[k]:>4.0f}%"
        lines.append(line + f" | {t['sdpa'] * 1e6:>8.0f} {t['sdpa'] / t['bf16']:>5.1f}x")
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
    benchmark.extra_info["kv_GBps_at_min"] = kv_bytes(batch, ctx, kind) / best / 1e9


def decode_batch(batch: int, ctx: int, cache: str):
    """q, logical [NB, KVH, BS, D] K/V caches (and scales) over shuffled blocks, and the step's metadata."""
    g = torch.Generator().manual_seed(0)
    nb = ctx // BS
    k_cache = torch.randn(batch * nb, KVH, BS, D, generator=g, dtype=torch.bfloat16)
    v_cache = torch.randn(batch * nb, KVH, BS, D, generator=g, dtype=torch.bfloat16)
    scales = None
    if cache == "fp32":
        k_cache, v_cache = k_cache.float(), v_cache.float()
    elif cache != "bf16":  # per (block, head, token) row, as the engine's cache writes do
        qmax = 127.0 if cache == "int8" else 448.0
        scales = [c.float().abs().amax(-1) / qmax for c in (k_cache, v_cache)]
        codes = [c.float() / s[..., None] for c, s in zip((k_cache, v_cache), scales)]
        k_cache, v_cache = (x.round().to(torch.int8) if cache == "int8" else x.to(torch.float8_e4m3fn) for x in codes)
    block_tables = torch.randperm(batch * nb, generator=g).int().view(batch, nb)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, H, D, generator=g).to(torch.float32 if cache == "fp32" else torch.bfloat16)
    return q, k_cache, v_cache, scales, block_tables, seq_lens, qsl


def on_huge_pages(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies of `tensors` in memory like the engine's KV cache (ops.huge_pages)."""
    arena = HugePageArena()
    return [arena.zeros(tuple(t.shape), t.dtype).copy_(t) for t in tensors]


def paged_call(batch: int, ctx: int, cache: str):
    q, kc, vc, scales, bt, sl, qsl = decode_batch(batch, ctx, cache)
    kc, vc, *scales = on_huge_pages(*to_cache_layout(kc, vc, "cpu"), *(scales or ()))
    ks, vs = scales or (None, None)
    out = torch.empty_like(q)
    return lambda: paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5, k_scales=ks, v_scales=vs, max_seq_len=ctx, out=out)


def read_call(batch: int, ctx: int, kind: str):
    nbytes = kv_bytes(batch, ctx, kind) // 64 * 64
    buf = huge_page_buffer(nbytes)[:nbytes].fill_(1)
    return lambda: _C.read_bandwidth(buf.data_ptr(), buf.numel(), 0)


def scattered_read_call(batch: int, ctx: int, kind: str):
    """read_tiles over the bytes the kernel reads, a tile per block of K and of V, in a shuffled order."""
    nb = ctx // BS
    tile = kv_bytes(batch, ctx, kind) // (2 * batch * nb) // 64 * 64
    nbytes = 2 * batch * nb * tile
    buf = huge_page_buffer(nbytes)[:nbytes].fill_(1)
    table = torch.randperm(batch * nb, generator=torch.Generator().manual_seed(1))
    tiles = torch.stack([table, table + batch * nb], 1).flatten().contiguous()  # each block's K tile, then its V
    return lambda: _C.read_tiles(buf.data_ptr(), tile, tiles.data_ptr(), tiles.numel())


def sdpa_call(batch: int, ctx: int):
    q, kc, vc, _, bt, _, _ = decode_batch(batch, ctx, "bf16")
    k = kc[bt.long()].permute(0, 2, 1, 3, 4).reshape(batch, KVH, ctx, D).contiguous()
    v = vc[bt.long()].permute(0, 2, 1, 3, 4).reshape(batch, KVH, ctx, D).contiguous()
    qq = q.view(batch, H, 1, D)
    return lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True)


# kind varies fastest, so the measurements of a point run back to back (the machine's memory
# bandwidth drifts over minutes on a shared host)
@pytest.mark.parametrize("kind", ["bf16", "read2", "scat2", "int8", "fp8", "fp8@bf16", "read1", "scat1", "fp32",
                                  "read4", "scat4", "sdpa"])
@pytest.mark.parametrize("batch,ctx", POINTS)
def test_decode_attention(benchmark, kind, batch, ctx):
    path = _C.decode_attention_path()
    if kind in CAPPED:
        cache, capped = CAPPED[kind]
        if path != "avx512_fp16":
            pytest.skip(f"the decode path here is {path}: fp8 already runs on {capped} or below")
        _C.set_decode_attention_path(capped)
        make = partial(paged_call, cache=cache)
    elif kind in CACHES:
        make = partial(paged_call, cache=kind)
    elif kind == "sdpa":
        make = sdpa_call
    elif kind.startswith("scat"):
        make = partial(scattered_read_call, kind=kind)
    else:
        make = partial(read_call, kind=kind)
    fn, warm = make(batch, ctx), make(1, WARM_CTX)
    rounds = max(5, min(100, int(2e8 / kv_bytes(batch, ctx, kind))))
    try:
        benchmark.pedantic(fn, setup=lambda: cold_operands(warm), rounds=rounds, warmup_rounds=1)
        if kind in CACHES or kind in CAPPED:
            read = partial(read_call, kind=READ_OF[kind])
            PAIRED[batch, ctx, kind] = paired_read_share(fn, warm, read(batch, ctx), read(1, WARM_CTX), rounds)
    finally:
        _C.set_decode_attention_path(path)
    record(benchmark, batch, ctx, kind)


def llc_bytes() -> int:
    """This machine's last-level cache size (sysfs), 32 MiB if unknown."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            size = f.read().strip()
        return int(size[:-1]) << {"K": 10, "M": 20}[size[-1]]
    except (OSError, ValueError, KeyError):
        return 32 << 20


_FLUSH = torch.ones(max(96 << 20, 2 * llc_bytes()), dtype=torch.uint8)


def flush_caches() -> None:
    _C.read_bandwidth(_FLUSH.data_ptr(), _FLUSH.numel(), 0)


# The warm-up call's context: whole blocks, at least one 64-token chunk of the decode kernel.
WARM_CTX = max(64, BS) // BS * BS


def cold_operands(warm) -> None:
    """A decode round's setup (untimed): the last-level cache flushed, so the round reads its operands
    from memory as each layer's K/V comes in a model step (a sequential re-read of 50 MB kept 30-80%
    hits between rounds, varying run to run, which flattered some kinds more than others); then `warm`,
    the same kind's call on a problem of its own (1 x WARM_CTX tokens). The flush also evicts the
    code, the Python path and the thread pool's state of the call, which a model step finds warm (the
    ops before attention ran just before). Left cold they cost each call 100-180 us on a Zen 4 host,
    flat in the batch: up to half of an 8 x 2,048 int8 call, against ~10 us of a plain read's."""
    flush_caches()
    warm()


def paired_read_share(fn, warm, read, read_warm, rounds: int) -> float:
    """The median over `rounds` of read's time over fn's, the two timed in turn, each after
    cold_operands (with its own warm-up call)."""
    ratios = []
    for _ in range(rounds):
        times = []
        for call, warm_call in ((fn, warm), (read, read_warm)):
            cold_operands(warm_call)
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        ratios.append(times[1] / times[0])
    return statistics.median(ratios)


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
    if kind in ("amx", "avx512_fp16", "avx512_fp32", "avx512_bf16"):
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
