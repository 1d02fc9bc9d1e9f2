"""The prefill attention kernel (native/cpu/attention/prefill.cpp) against the torch reference, on each
of its paths: prompts (>= 16 query tokens) of bf16 steps go to it, the rest of a step to the decode
kernel (native/cpu/attention/step.cpp splits the step)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from pyengine import _C
from pyengine.ops.attention import from_cache_layout, paged_attention, to_cache_layout
from tests.test_attention import make_batch, poison_unowned_slots, reference

PATHS = ["amx", "avx512_fp16", "avx512_fp32", "avx512_bf16", "portable", "paged"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Prompts and prompt chunks of ragged lengths (partial last blocks, a chunk after a cached prefix, one
# ending on a block boundary, the 16-query threshold), decodes and a sequence with no query this step.
PROMPTS = [(17, 17), (300, 300), (650, 70), (64, 16), (5, 1), (200, 15), (10, 0), (129, 129)]


@pytest.fixture(params=PATHS)
def path(request):
    """Runs the test with the prefill kernel capped at one path; skips paths this build/CPU lacks."""
    threads = _C.num_threads()
    _C.set_prefill_attention_path(request.param)
    _C.set_num_threads(2)  # items run in parallel
    try:
        if _C.prefill_attention_path() != request.param:
            pytest.skip(f"no {request.param} path here (the best is {_C.prefill_attention_path()})")
        yield request.param
    finally:
        _C.set_prefill_attention_path("amx")
        _C.set_num_threads(threads)


@pytest.fixture(scope="module")
def shared() -> dict:
    """Inputs and torch references that tests compute once for all paths (they do not depend on the path
    under test; the kernels only read them): the module's paths share them instead of rebuilding them."""
    return {}


def once(shared: dict, key, build):
    """build()'s result, computed on the first call with this key in the module."""
    if key not in shared:
        shared[key] = build()
    return shared[key]


@pytest.mark.parametrize("gqa,kv_heads,head_dim,block_size", [
    (3, 3, 64, 16),   # the default model's shape (GQA 3:1)
    (4, 2, 64, 8),    # GQA 4:1, blocks of 8
    (4, 2, 128, 32),  # head_dim 128
    (3, 1, 128, 16),
    (1, 2, 64, 24),   # no GQA; a block size that is no multiple of 16
    (3, 3, 64, 128),  # the largest blocks
])
def test_prompts_match_reference(path, gqa, kv_heads, head_dim, block_size, shared):
    scale = 1.0 / math.sqrt(head_dim)

    def build():
        q, kc, vc, bt, sl, qsl, _ = make_batch(PROMPTS, gqa * kv_heads, kv_heads, head_dim, block_size, torch.bfloat16)
        return q, kc, vc, bt, sl, qsl, reference(q, kc, vc, bt, sl, qsl, scale)

    q, kc, vc, bt, sl, qsl, ref = once(shared, ("prompts", gqa, kv_heads, head_dim, block_size), build)
    out = paged_attention(q, kc, vc, bt, sl, qsl, scale)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (8, 128), (64, 64)])
def test_quantized_cache(path, cache_dtype, block_size, head_dim, shared):
    def build():
        q, kc, vc, bt, sl, qsl, (ks, vs) = make_batch(PROMPTS, 9, 3, head_dim, block_size, torch.bfloat16,
                                                      cache_dtype=cache_dtype, seed=2)
        return q, kc, vc, bt, sl, qsl, ks, vs, reference(q, kc, vc, bt, sl, qsl, 0.1, ks, vs)

    q, kc, vc, bt, sl, qsl, ks, vs, ref = once(shared, ("quantized", cache_dtype, block_size, head_dim), build)
    out = paged_attention(q, kc, vc, bt, sl, qsl, 0.1, k_scales=ks, v_scales=vs)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window,softcap", [(1, 0.0), (40, 0.0), (64, 0.0), (100, 0.0), (0, 5.0), (33, 2.0)])
@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_window_and_softcap(path, window, softcap, cache_dtype, shared):
    """Sliding windows shorter than a chunk, equal to it and spanning several; Gemma 2's soft-cap."""
    def build():
        q, kc, vc, bt, sl, qsl, scales = make_batch(PROMPTS, 8, 2, 64, 16, torch.bfloat16, cache_dtype=cache_dtype,
                                                    seed=3)
        ks, vs = scales or (None, None)
        q = q * 3  # large scores, so the cap changes them
        return q, kc, vc, bt, sl, qsl, ks, vs, reference(q, kc, vc, bt, sl, qsl, 0.125, ks, vs, window=window,
                                                         softcap=softcap)

    q, kc, vc, bt, sl, qsl, ks, vs, ref = once(shared, ("window", window, softcap, cache_dtype), build)
    out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125, k_scales=ks, v_scales=vs, window=window, softcap=softcap)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_long_prompt_and_nan_in_unowned_slots(path, block_size, shared):
    """A 2k-token prompt (several kv chunks per query block, items of unequal causal work) beside a
    shorter chunk; NaN in every slot no sequence owns must not leak (a bf16 cache is read in place:
    the block holding a sequence's last position also holds slots past its end)."""
    def build():
        specs = [(2048, 2048), (1100, 100), (70, 37)]
        q, kc, vc, bt, sl, qsl, _ = make_batch(specs, 9, 3, 64, block_size, torch.bfloat16, seed=4)
        kc, vc = poison_unowned_slots(kc, vc, bt, specs, block_size)
        return q, kc, vc, bt, sl, qsl, reference(q, kc.nan_to_num(), vc.nan_to_num(), bt, sl, qsl, 0.125)

    q, kc, vc, bt, sl, qsl, ref = once(shared, ("long", block_size), build)
    out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def rising_score_batch(dtype):
    """A prompt of 1,024 tokens and a 40-token chunk at 700 (2 kv heads, GQA 3:1, head_dim 64, blocks of
    16) whose keys lie along q and grow with the position: ~1.3 log2 units of score per token at scale
    0.125. Returns q, k_cache, v_cache, block_tables, seq_lens, query_start_loc."""
    specs = [(1024, 1024), (700, 40)]
    q, kc, vc, bt, sl, qsl, _ = make_batch(specs, 6, 2, 64, 16, dtype, seed=7)
    k, v = from_cache_layout(kc, vc)
    g = torch.Generator().manual_seed(8)
    for s, (L, _) in enumerate(specs):
        pos = torch.arange(L)
        blocks, slots = bt[s, pos // 16].long(), pos % 16
        ramp = (pos.float() / 48)[:, None, None]
        k[blocks, :, slots] = (ramp + 0.3 * torch.randn(L, 2, 64, generator=g)).to(k.dtype)
    q = (1 + 0.3 * torch.randn(q.shape, generator=g)).to(q.dtype)
    kc, vc = to_cache_layout(k, v, "cpu")
    return q, kc, vc, bt, sl, qsl


def test_running_max_rising_through_the_prompt(path):
    """Scores that grow with the position (keys along q, scaled up by the position): the running max
    passes the old one by far more than the kernels' slack in every chunk, so each row is rescaled
    again and again, on full rows (the common row of the vectorized softmax) and on the causal edge."""
    q, kc, vc, bt, sl, qsl = rising_score_batch(torch.bfloat16)
    out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125)
    torch.testing.assert_close(out.float(), reference(q, kc, vc, bt, sl, qsl, 0.125), atol=2e-2, rtol=2e-2)


def test_keys_with_a_large_common_offset(path):
    """Keys sharing an offset 20x their spread (as a k bias gives, Qwen's): q . offset moves every score
    of a row alike, which its softmax cancels, but it swells the dot products ~30x. The avx512_fp16 path
    subtracts a mean key before its fp16 QK sums, without which their rounding (~2^-11 of each partial
    sum) moves the scores by ~0.1."""
    specs = [(1024, 1024), (700, 40)]
    q, kc, vc, bt, sl, qsl, _ = make_batch(specs, 6, 2, 64, 16, torch.bfloat16, seed=9)
    k, v = from_cache_layout(kc, vc)
    g = torch.Generator().manual_seed(10)
    offset = 20 * torch.randn(2, 1, 64, generator=g).sign()  # per kv head, over every position
    k = (offset + torch.randn(k.shape, generator=g)).to(k.dtype)
    q = (q.float() + 0.5 * offset.repeat_interleave(3, 0)[None, :, 0] / 20).to(q.dtype)  # q partly along it
    kc, vc = to_cache_layout(k, v, "cpu")
    out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125)
    torch.testing.assert_close(out.float(), reference(q, kc, vc, bt, sl, qsl, 0.125), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("v_scale", [1e6, 1.0, 1e-6])
def test_values_beyond_fp16s_range(path, v_scale):
    """V far beyond fp16's range either way (65504 at the top, 6e-8 its smallest subnormal), and a
    chunk's probabilities summing to 2^7.5 x 64: every key past the first chunk scores 7.5 log2 units
    above the first chunk's, less than the running max's slack (kMaxSlack), so the max stays and each
    probability is 2^7.5. The avx512_fp16 path scales V and the probabilities into fp16 by powers of
    two, so its sums neither overflow to inf nor sink to zero."""
    specs = [(600, 600), (300, 40)]
    q, kc, vc, bt, sl, qsl, _ = make_batch(specs, 6, 2, 64, 16, torch.bfloat16, seed=9)
    k, v = from_cache_layout(kc, vc)
    rise = 7.5 / (64 * 0.125 * math.log2(math.e))  # log2 units of score -> key value (q = 1, scale 0.125)
    for s, (L, _) in enumerate(specs):
        pos = torch.arange(L)
        k[bt[s, pos // 16].long(), :, pos % 16] = torch.where(pos < 64, 1.0, 1.0 + rise)[:, None, None].to(k.dtype)
    kc, vc = to_cache_layout(k, (v.float() * v_scale).bfloat16(), "cpu")
    q = torch.ones_like(q)
    out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125)
    ref = reference(q, kc, vc, bt, sl, qsl, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float() / v_scale, ref / v_scale, atol=2e-2, rtol=2e-2)


def test_strided_q_in_a_mixed_step(path):
    """q as a view of a fused QKV output, prompts beside decodes (whose rows the step gathers)."""
    q, kc, vc, bt, sl, qsl, _ = make_batch([(40, 1), (90, 33), (9, 1)], 4, 2, 64, 8, torch.bfloat16, seed=5)
    T = q.shape[0]
    qkv = torch.cat([q.reshape(T, -1), torch.randn(T, 2 * 2 * 64).bfloat16()], dim=1)
    out = torch.full_like(q, float("nan"))
    paged_attention(qkv[:, : 4 * 64].view(T, 4, 64), kc, vc, bt, sl, qsl, 0.3, out=out)
    torch.testing.assert_close(out.float(), reference(q, kc, vc, bt, sl, qsl, 0.3), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("head_dim,block_size,window,softcap", [(64, 16, 0, 0.0), (128, 8, 0, 0.0), (64, 24, 40, 2.0)])
def test_fp32_kernels_give_the_bits_of_vdpbf16ps(cache_dtype, head_dim, block_size, window, softcap):
    """avx512_fp32 widens the bf16 K/V, q and probabilities to fp32 and adds each pair's odd product
    first, as vdpbf16ps does; bf16 products are exact in fp32, so the two paths agree to the bit and
    the path a host takes changes no token."""
    if _C.isa() != "avx512_bf16":
        pytest.skip("no AVX512-BF16 in this build")
    q, kc, vc, bt, sl, qsl, scales = make_batch(PROMPTS, 9, 3, head_dim, block_size, torch.bfloat16,
                                                cache_dtype=cache_dtype, seed=11)
    ks, vs = scales or (None, None)
    outs = []
    try:
        for p in ("avx512_fp32", "avx512_bf16"):
            _C.set_prefill_attention_path(p)
            assert _C.prefill_attention_path() == p
            outs.append(paged_attention(q * 2, kc, vc, bt, sl, qsl, 0.125, k_scales=ks, v_scales=vs, window=window,
                                        softcap=softcap))
    finally:
        _C.set_prefill_attention_path("amx")
    assert torch.equal(outs[0], outs[1])


def test_best_path_without_amx():
    """Where AMX does not run, builds for AVX512-FP16 CPUs (Intel Sapphire Rapids and later, where
    vdpbf16ps issues at a quarter of the FMA rate) take the fp32 QK and the fp16 PV, other AVX512-BF16
    builds vdpbf16ps."""
    if _C.isa() != "avx512_bf16":
        pytest.skip("no AVX512-BF16 in this build")
    best = _C.prefill_attention_path()
    if best == "amx":
        pytest.skip("AMX runs here")
    fp16_build = _C.decode_attention_path() == "avx512_fp16"  # the best decode path this build has
    assert best == ("avx512_fp16" if fp16_build else "avx512_bf16")


def test_bad_argument_changes_nothing():
    """The step is validated before either kernel runs: a bad block id in a decode leaves the prompt's
    output rows untouched."""
    q, kc, vc, bt, sl, qsl, _ = make_batch([(64, 64), (20, 1)], 4, 2, 64, 16, torch.bfloat16)
    bt[1, 0] = 10**6
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match="block_tables\\[1, 0\\]"):
        paged_attention(q, kc, vc, bt, sl, qsl, 0.125, out=out)
    assert not out.any()


def test_unknown_path_name():
    with pytest.raises(ValueError, match="amx, avx512_fp16, avx512_fp32, avx512_bf16, portable or paged"):
        _C.set_prefill_attention_path("sse")


@pytest.fixture(scope="module")
def fresh_thread_runs() -> tuple[dict, str]:
    """For each path, in one new process (fresh interpreter start-up is most of the cost, so one for all
    paths): a new thread (empty thread_local scratch) runs a 21-token prompt, then a 600-token one,
    against the reference. ({path: "ok", "skip" or the traceback}, the process's stderr)."""
    code = f"""
import json, threading, traceback
import pyengine, torch
from pyengine import _C
from pyengine.ops.attention import paged_attention
from tests.test_attention import make_batch, reference
_C.set_num_threads(1)  # the kernel runs on the calling thread: the new one
results = {{}}
def run(name):
    try:
        _C.set_prefill_attention_path(name)
        if _C.prefill_attention_path() != name:
            results[name] = "skip"
            return
        for specs in ([(21, 21)], [(600, 600)]):
            q, kc, vc, bt, sl, qsl, _ = make_batch(specs, 9, 3, 64, 16, torch.bfloat16)
            out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125)
            torch.testing.assert_close(out.float(), reference(q, kc, vc, bt, sl, qsl, 0.125), atol=2e-2, rtol=2e-2)
        results[name] = "ok"
    except BaseException:
        results[name] = traceback.format_exc()
for name in {PATHS!r}:
    t = threading.Thread(target=run, args=(name,))
    t.start()
    t.join()
print("RESULTS " + json.dumps(results))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULTS ")]
    results = json.loads(lines[-1][len("RESULTS "):]) if r.returncode == 0 and lines else {}
    return results, f"exit status {r.returncode}\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("path_name", PATHS)
def test_a_fresh_threads_first_item_stays_inside_its_scratch(path_name, fresh_thread_runs):
    """A thread sizes its scratch by the first item it runs. 21 queries x 3 heads = 63 rows, which the
    6-row vdpbf16ps kernel pads to 66: the scratch was sized for 64 (whole AMX tiles) whatever the path,
    the padding rows were written past its end, and the next, larger prompt's resize found the heap
    corrupt (a glibc abort that took the server down). On a new thread of a fresh process, whose
    scratch is still empty; in this process earlier tests have grown this thread's."""
    results, stderr = fresh_thread_runs
    assert path_name in results, stderr  # the process died (an abort) before or while running this path
    if results[path_name] == "skip":
        pytest.skip(f"no {path_name} path here")
    assert results[path_name] == "ok", results[path_name]
