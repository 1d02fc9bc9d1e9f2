"""CUDA kernels against the card's copy bandwidth and torch, timed with CUDA events (needs a GPU).

Run: python bench/bench_cuda.py
Decode attention over a shuffled paged bf16 cache (one query token per sequence) at a Llama-8B-like
shape (32 q heads, 8 kv heads, head_dim 128, block 16) and the default model's (9/3 heads, D 64):
GB/s = K/V bytes read / time, beside a device-to-device copy of the same bytes (read + write
counted) and torch SDPA on already-gathered contiguous K/V. Sampling: top-k 50 + top-p 0.9 at vocab
128256 beside torch's sort + cumsum. Median of 50 timed runs after 5 warm-ups.
"""
from __future__ import annotations

import pyengine  # noqa: F401  (before torch, as everywhere)
import torch
import torch.nn.functional as F

from pyengine.ops.attention import paged_attention
from pyengine.ops.sampling import sample

DEV = torch.device("cuda")


def median_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def attention_row(batch: int, ctx: int, H: int, KVH: int, D: int, bs: int = 16) -> str:
    g = torch.Generator(device=DEV).manual_seed(0)
    nblk = ctx // bs
    num_blocks = batch * nblk
    k = torch.randn(num_blocks, KVH, bs, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    tables = torch.randperm(num_blocks, device=DEV, generator=g).to(torch.int32).view(batch, nblk)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, H, D, device=DEV, dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(q)
    scale = D ** -0.5
    t_paged = median_ms(lambda: paged_attention(q, k, v, tables, seq_lens, qsl, scale, max_seq_len=ctx, out=out))
    kv = 2 * k.numel() * k.element_size()
    src = torch.empty(kv // 2, dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    t_copy = median_ms(lambda: dst.copy_(src))  # reads kv/2 and writes kv/2: kv bytes moved
    kg = k[tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, KVH, ctx, D).contiguous()
    vg = v[tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, KVH, ctx, D).contiguous()
    q4 = q.view(batch, H, 1, D)
    t_sdpa = median_ms(lambda: F.scaled_dot_product_attention(q4, kg, vg, enable_gqa=True))
    ref = F.scaled_dot_product_attention(q4.float(), kg.float(), vg.float(), enable_gqa=True).view(batch, H, D)
    err = float((out.float() - ref).norm() / ref.norm())
    return (f"{batch:>5} {ctx:>6} {H:>3}/{KVH:<2} {D:>4} {t_paged * 1e3:>9.1f} {kv / t_paged / 1e6:>8.0f} "
            f"{kv / t_copy / 1e6:>8.0f} {100 * t_copy / t_paged:>5.0f}% {t_sdpa * 1e3:>8.1f} {err:>8.1e}")


def sampling_row(batch: int, vocab: int = 128256) -> str:
    g = torch.Generator(device=DEV).manual_seed(1)
    logits = torch.randn(batch, vocab, device=DEV, generator=g) * 3
    temp = torch.full((batch,), 0.8, device=DEV)
    top_k = torch.full((batch,), 50, dtype=torch.int32, device=DEV)
    top_p = torch.full((batch,), 0.9, device=DEV)
    min_p = torch.zeros(batch, device=DEV)
    seeds = torch.arange(batch, dtype=torch.int64, device=DEV)
    steps = torch.zeros(batch, dtype=torch.int64, device=DEV)
    ours = median_ms(lambda: sample(logits, temp, top_k, top_p, min_p, seeds, steps))

    def torch_ref():
        probs, idx = torch.sort(torch.softmax(logits / 0.8, -1), descending=True)
        probs[:, 50:] = 0
        cum = probs.cumsum(-1)
        probs[(cum - probs) > 0.9] = 0
        return idx.gather(1, torch.multinomial(probs, 1))

    ref = median_ms(torch_ref)
    return f"{batch:>5} {vocab:>7} {ours * 1e3:>9.1f} {ref * 1e3:>9.1f} {ref / ours:>7.1f}x"


def main() -> None:
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("decode attention, bf16 cache: median us; GB/s of K/V read; copy GB/s (read+write); sdpa us; rel err")
    print(f"{'batch':>5} {'ctx':>6} {'H/KVH':>6} {'D':>4} {'paged us':>9} {'GB/s':>8} {'copy':>8} {'%copy':>6} "
          f"{'sdpa us':>8} {'err':>8}")
    for H, KVH, D in ((32, 8, 128), (9, 3, 64)):
        for batch, ctx in ((1, 2048), (1, 32768), (32, 2048), (32, 8192), (128, 2048)):
            print(attention_row(batch, ctx, H, KVH, D), flush=True)
    print("\nsampling, top-k 50 + top-p 0.9, temperature 0.8: median us, torch sort+cumsum+multinomial us")
    print(f"{'batch':>5} {'vocab':>7} {'ours us':>9} {'torch us':>9} {'speedup':>8}")
    for batch in (1, 32, 128):
        print(sampling_row(batch), flush=True)


if __name__ == "__main__":
    main()
