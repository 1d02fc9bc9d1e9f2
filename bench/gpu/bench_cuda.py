"""CUDA kernels against the card's copy bandwidth and torch, timed with CUDA events (needs a GPU).

Run: python bench/gpu/bench_cuda.py [--quick]
- Copy bandwidth: a 4 GiB device-to-device copy (bytes read + written / time), the yardstick below.
- Decode attention over a shuffled paged cache (one query token per sequence) at a Llama-8B-like shape
  (32 q heads, 8 kv heads, head_dim 128, block 16) and the default model's (9/3 heads, D 64): GB/s = K/V
  bytes read / time against the copy bandwidth (goal >= 80%), torch SDPA on already-gathered K/V beside it;
  fp8/int8 caches against bf16 at 8k+ context (goal >= 1.6x).
- Prefill attention: the tensor-core kernel (tensor_cores=True) and the split-KV kernel against torch SDPA's
  flash backend on the same causal shapes, K/V expanded to all heads for SDPA (goal: tensor cores >= 0.8x).
- Sampling: top-k 50 + top-p 0.9 at vocab 128256, batch up to 256 (goal <= 100 us at 256), beside torch's
  sort + cumsum + multinomial.
Median of 20-50 timed runs after warm-ups; every line says PASS/MISS against its goal.
"""
from __future__ import annotations

import argparse

import pyengine  # noqa: F401  (before torch, as everywhere)
import torch
import torch.nn.functional as F

from pyengine.ops.attention import paged_attention
from pyengine.ops.sampling import sample

DEV = torch.device("cuda")


def median_ms(fn, reps: int = 50) -> float:
    for _ in range(3):
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


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def copy_bandwidth(gib: float = 4.0) -> float:
    """GB/s of a large device-to-device copy, bytes read + written (too large for L2)."""
    n = int(gib * 2**30) // 2 // 2  # bf16 elements of each half
    src = torch.empty(n, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    t = median_ms(lambda: dst.copy_(src), reps=20)
    return 2 * n * 2 / t / 1e6


def paged_cache(batch: int, ctx: int, KVH: int, D: int, bs: int, dtype: torch.dtype, g: torch.Generator):
    nblk = (ctx + bs - 1) // bs
    num_blocks = batch * nblk
    k = torch.randn(num_blocks, KVH, bs, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    ks = vs = None
    if dtype != torch.bfloat16:
        qmax = 448.0 if dtype == torch.float8_e4m3fn else 127.0
        ks, vs = k.float().abs().amax(-1) / qmax, v.float().abs().amax(-1) / qmax
        k, v = (k.float() / ks[..., None]), (v.float() / vs[..., None])
        k, v = (k.round().to(dtype), v.round().to(dtype)) if dtype == torch.int8 else (k.to(dtype), v.to(dtype))
    tables = torch.randperm(num_blocks, device=DEV, generator=g).to(torch.int32).view(batch, nblk)
    return k, v, ks, vs, tables


def decode_row(batch: int, ctx: int, H: int, KVH: int, D: int, copy_gbs: float, dtype=torch.bfloat16,
               bs: int = 16) -> tuple[str, float]:
    g = torch.Generator(device=DEV).manual_seed(0)
    k, v, ks, vs, tables = paged_cache(batch, ctx, KVH, D, bs, dtype, g)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, H, D, device=DEV, dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(q)
    t = median_ms(lambda: paged_attention(q, k, v, tables, seq_lens, qsl, D ** -0.5, k_scales=ks, v_scales=vs,
                                          max_seq_len=ctx, out=out))
    kv = 2 * batch * ctx * KVH * D * k.element_size() + (2 * batch * ctx * KVH * 4 if ks is not None else 0)
    gbs = kv / t / 1e6
    sdpa = ""
    if dtype == torch.bfloat16:
        kg = k[tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, KVH, -1, D)[:, :, :ctx].contiguous()
        vg = v[tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, KVH, -1, D)[:, :, :ctx].contiguous()
        q4 = q.view(batch, H, 1, D)
        t_sdpa = median_ms(lambda: F.scaled_dot_product_attention(q4, kg, vg, enable_gqa=True))
        ref = F.scaled_dot_product_attention(q4.float(), kg.float(), vg.float(), enable_gqa=True).view(batch, H, D)
        err = float((out.float() - ref).norm() / ref.norm())
        sdpa = f"{t_sdpa * 1e3:>8.1f} {err:>8.1e}"
        del kg, vg
    name = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8", torch.int8: "int8"}[dtype]
    pct = 100 * gbs / copy_gbs
    line = (f"{batch:>5} {ctx:>6} {H:>3}/{KVH:<2} {D:>4} {name:>5} {t * 1e3:>9.1f} {gbs:>8.0f} {pct:>5.0f}% "
            f"{verdict(pct >= 80):>5} {sdpa}")
    return line, t


def prefill_row(lens: list[int], H: int, KVH: int, D: int, bs: int = 16) -> str:
    """One step of fresh prompts (no cached context): tensor cores, split-KV, SDPA flash on the same causal work."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device=DEV).manual_seed(1)
    S, T = len(lens), sum(lens)
    nblk = [(L + bs - 1) // bs for L in lens]
    num_blocks = sum(nblk)
    k = torch.randn(num_blocks, KVH, bs, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    perm = torch.randperm(num_blocks, device=DEV, generator=g).to(torch.int32)
    tables = torch.zeros(S, max(nblk), dtype=torch.int32, device=DEV)
    off = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = perm[off:off + n]
        off += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16, generator=g)
    scale = D ** -0.5
    kw = dict(max_seq_len=max(lens), out=torch.empty_like(q))
    t_tc = median_ms(lambda: paged_attention(q, k, v, tables, seq_lens, qsl, scale, tensor_cores=True,
                                             max_query_len=max(lens), **kw), reps=20)
    tc = kw["out"].clone()
    t_split = median_ms(lambda: paged_attention(q, k, v, tables, seq_lens, qsl, scale, **kw), reps=20)
    err = float((tc.float() - kw["out"].float()).norm() / kw["out"].float().norm())
    # SDPA flash on the same work: per-sequence [1, H, L, D] with K/V gathered and expanded to H heads
    qs, ks, vs = [], [], []
    for s, L in enumerate(lens):
        blocks = tables[s, :nblk[s]].long()
        qs.append(q[int(qsl[s]):int(qsl[s + 1])].transpose(0, 1)[None])
        for src, dst in ((k, ks), (v, vs)):
            x = src[blocks].permute(1, 0, 2, 3).reshape(KVH, -1, D)[:, :L]
            dst.append(x.repeat_interleave(H // KVH, 0)[None].contiguous())

    def sdpa():
        for a, b, c in zip(qs, ks, vs):
            F.scaled_dot_product_attention(a, b, c, is_causal=True)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        t_sdpa = median_ms(sdpa, reps=20)
    flops = sum(2 * 2 * H * D * L * (L + 1) / 2 for L in lens)
    ratio = t_sdpa / t_tc
    shape = f"{S}x{lens[0]}" if len(set(lens)) == 1 else "+".join(map(str, lens))
    return (f"{shape:>12} {H:>3}/{KVH:<2} {D:>4} {t_tc * 1e3:>9.1f} {flops / t_tc / 1e9:>7.0f} "
            f"{t_split * 1e3:>9.1f} {t_sdpa * 1e3:>9.1f} {flops / t_sdpa / 1e9:>7.0f} {ratio:>6.2f}x "
            f"{verdict(ratio >= 0.8):>5} {err:>8.1e}")


def mixed_row(decodes: int, ctx: int, chunk: int, H: int, KVH: int, D: int, bs: int = 16) -> str:
    """A chunked-prefill step: `decodes` sequences at `ctx` cached tokens plus one `chunk`-token prompt chunk
    after `ctx` cached tokens; tensor cores (the chunk; the decodes stay on split-KV) against split-KV alone."""
    g = torch.Generator(device=DEV).manual_seed(2)
    S = decodes + 1
    seq_lens = [ctx + 1] * decodes + [ctx + chunk]
    q_lens = [1] * decodes + [chunk]
    nblk = (ctx + chunk + bs - 1) // bs
    k = torch.randn(S * nblk, KVH, bs, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    tables = torch.randperm(S * nblk, device=DEV, generator=g).to(torch.int32).view(S, nblk)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), H, D, device=DEV, dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(q)
    kw = dict(max_seq_len=ctx + chunk, out=out)
    t_tc = median_ms(lambda: paged_attention(q, k, v, tables, sl, qsl, D ** -0.5, tensor_cores=True,
                                             max_query_len=chunk, **kw), reps=20)
    t_split = median_ms(lambda: paged_attention(q, k, v, tables, sl, qsl, D ** -0.5, **kw), reps=20)
    return (f"{decodes:>4} decodes @ {ctx:>5} + chunk {chunk:>4} {H:>3}/{KVH:<2} {D:>4}  tc {t_tc * 1e3:>8.1f} us  "
            f"split {t_split * 1e3:>8.1f} us  split/tc {t_split / t_tc:5.2f}x")


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
    goal = f"{verdict(ours * 1e3 <= 100):>5}" if batch == 256 else ""
    return f"{batch:>5} {vocab:>7} {ours * 1e3:>9.1f} {ref * 1e3:>9.1f} {ref / ours:>7.1f}x {goal}"


def guarded(fn, *args) -> str:
    """One table row; an error ends that row, not the run (the device check wants every other figure)."""
    try:
        out = fn(*args)
        return out[0] if isinstance(out, tuple) else out
    except Exception as exc:  # noqa: BLE001
        torch.cuda.empty_cache()
        return f"ERROR {fn.__name__}{args[:5]}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes (the device check's time budget)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    copy_gbs = copy_bandwidth()
    print(f"device copy bandwidth (4 GiB device-to-device, read + write): {copy_gbs:.0f} GB/s")

    print("\ndecode attention: median us; GB/s of K/V read; % of copy bandwidth (goal >= 80%); sdpa us; rel err")
    print(f"{'batch':>5} {'ctx':>6} {'H/KVH':>6} {'D':>4} {'kv':>5} {'paged us':>9} {'GB/s':>8} {'%copy':>6} "
          f"{'goal':>5} {'sdpa us':>8} {'err':>8}")
    shapes = [(1, 1024), (1, 32768), (32, 8192), (256, 1024), (256, 4096)]
    if not args.quick:
        shapes += [(8, 32768), (128, 2048)]
    for H, KVH, D in ((32, 8, 128), (9, 3, 64)):
        for batch, ctx in shapes:
            print(guarded(decode_row, batch, ctx, H, KVH, D, copy_gbs), flush=True)

    print("\nquantized KV at 8k+ context: time of bf16 / time of fp8 or int8 (goal >= 1.6x)")
    for batch, ctx in ((1, 32768), (32, 8192)):
        def quant_rows(batch=batch, ctx=ctx):
            _, t_bf16 = decode_row(batch, ctx, 32, 8, 128, copy_gbs)
            for dtype in (torch.float8_e4m3fn, torch.int8):
                line, t = decode_row(batch, ctx, 32, 8, 128, copy_gbs, dtype)
                print(f"{line}  {t_bf16 / t:>5.2f}x vs bf16 {verdict(t_bf16 / t >= 1.6)}", flush=True)
            return ""

        print(guarded(quant_rows), end="", flush=True)

    print("\nprefill attention (fresh causal prompts, bf16): tensor cores vs split-KV vs SDPA flash "
          "(goal: tensor cores >= 0.8x SDPA)")
    print(f"{'prompts':>12} {'H/KVH':>6} {'D':>4} {'tc us':>9} {'TFLOP/s':>7} {'split us':>9} {'sdpa us':>9} "
          f"{'TFLOP/s':>7} {'tc/sdpa':>7} {'goal':>5} {'tc err':>8}")
    prefill = [([2048] * 4, 32, 8, 128), ([8192], 32, 8, 128), ([2048] * 4, 9, 3, 64), ([512] * 16, 9, 3, 64),
               ([100, 700, 1500, 33], 32, 8, 128)]
    for lens, H, KVH, D in prefill:
        print(guarded(prefill_row, lens, H, KVH, D), flush=True)

    print("\nmixed steps (decodes + one prompt chunk): tensor cores vs split-KV (no goal; decides the default)")
    for decodes, ctx, chunk in ((64, 4096, 512), (16, 1024, 2048)):
        print(guarded(mixed_row, decodes, ctx, chunk, 9, 3, 64), flush=True)

    print("\nsampling, top-k 50 + top-p 0.9, temperature 0.8: median us (goal <= 100 us at batch 256), torch us")
    print(f"{'batch':>5} {'vocab':>7} {'ours us':>9} {'torch us':>9} {'speedup':>8} {'goal':>5}")
    for batch in (1, 32, 256):
        print(guarded(sampling_row, batch), flush=True)


if __name__ == "__main__":
    main()
