"""fp32 prompts over an fp32 cache (native/cpu/attention/prefill_fp32.cpp, the "avx2_fp32" prefill path) against
the fp32 torch reference, and against the decode kernel the same steps ran on before ("paged")."""
from __future__ import annotations

import math

import pytest
import torch

from pyengine import _C
from pyengine.ops.attention import paged_attention
from tests.test_attention import make_batch, poison_unowned_slots, reference
from tests.test_prefill_attention import PROMPTS, rising_score_batch

TOL = dict(atol=2e-5, rtol=1e-4)  # fp32 throughout: only the summation order differs


@pytest.fixture(params=["avx2_fp32", "paged"])
def path(request):
    """Runs the test with fp32 prompts on one path; skips avx2_fp32 where the build lacks AVX2 + FMA."""
    threads = _C.num_threads()
    _C.set_prefill_attention_path("amx" if request.param == "avx2_fp32" else "paged")
    _C.set_num_threads(2)  # items run in parallel
    try:
        if _C.prefill_attention_path("float32") != request.param:
            pytest.skip(f"no {request.param} path here")
        yield request.param
    finally:
        _C.set_prefill_attention_path("amx")
        _C.set_num_threads(threads)


def test_fp32_prompts_take_the_avx2_kernel():
    """Where the build has AVX2 and FMA, fp32 prompts run prefill_fp32 (until this kernel they ran on
    the decode kernel, a pass over K/V per query token); capped to "paged", they go back there."""
    flags = open("/proc/cpuinfo").read().split()
    if "avx2" not in flags or "fma" not in flags:
        pytest.skip("no AVX2 + FMA on this CPU")
    assert _C.prefill_attention_path("float32") == "avx2_fp32"
    _C.set_prefill_attention_path("paged")
    try:
        assert _C.prefill_attention_path("float32") == "paged"
    finally:
        _C.set_prefill_attention_path("amx")
    with pytest.raises(ValueError, match="q_dtype"):
        _C.prefill_attention_path("float16")


@pytest.mark.parametrize("gqa,kv_heads,head_dim,block_size", [
    (3, 3, 64, 16),   # the default model's shape (GQA 3:1)
    (4, 2, 64, 8),    # GQA 4:1, blocks of 8
    (4, 2, 128, 32),  # head_dim 128
    (3, 1, 128, 16),
    (1, 2, 64, 24),   # no GQA; blocks that hold no whole number of 8-token groups past the first
    (2, 2, 32, 6),    # blocks of 6: every group gathered; head_dim 32
    (3, 3, 64, 128),  # the largest blocks
    (5, 1, 80, 16),   # head_dim 80 (a multiple of 8, not of 16); G = 5
])
def test_prompts_match_reference(path, gqa, kv_heads, head_dim, block_size):
    q, kc, vc, bt, sl, qsl, _ = make_batch(PROMPTS, gqa * kv_heads, kv_heads, head_dim, block_size, torch.float32)
    scale = 1.0 / math.sqrt(head_dim)
    out = paged_attention(q, kc, vc, bt, sl, qsl, scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(q, kc, vc, bt, sl, qsl, scale), **TOL)


@pytest.mark.parametrize("window,softcap", [(1, 0.0), (7, 0.0), (40, 0.0), (64, 0.0), (100, 0.0), (0, 5.0), (33, 2.0)])
def test_window_and_softcap(path, window, softcap):
    """Sliding windows (Mistral, Gemma's local layers) on the kernel; a soft-cap (Gemma 2) sends the
    step to the decode kernel, still right."""
    q, kc, vc, bt, sl, qsl, _ = make_batch(PROMPTS, 6, 2, 64, 16, torch.float32, seed=3)
    out = paged_attention(q, kc, vc, bt, sl, qsl, 0.2, window=window, softcap=softcap)
    ref = reference(q, kc, vc, bt, sl, qsl, 0.2, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("block_size", [16, 10])
def test_long_prompt_and_nan_in_unowned_slots(path, block_size):
    """A 2k-token prompt (many kv chunks per item, items of unequal causal work) beside shorter chunks;
    NaN in every slot no sequence owns must not leak (the cache is read in place, and the block holding
    a sequence's last position also holds slots past its end)."""
    specs = [(2048, 2048), (1100, 100), (70, 37)]
    q, kc, vc, bt, sl, qsl, _ = make_batch(specs, 9, 3, 64, block_size, torch.float32, seed=4)
    kc, vc = poison_unowned_slots(kc, vc, bt, specs, block_size)
    out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125)
    torch.testing.assert_close(out, reference(q, kc.nan_to_num(), vc.nan_to_num(), bt, sl, qsl, 0.125), **TOL)


def test_scores_rising_through_the_prompt(path):
    """Scores that grow with the position by ~1.3 log2 units a token: the running max rises in every
    chunk, and each row's sum is rescaled again and again."""
    q, kc, vc, bt, sl, qsl = rising_score_batch(torch.float32)
    out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125)
    # scores reach ~200: an fp32 rounding of one (~1e-5) moves its probability as much, on both paths
    torch.testing.assert_close(out, reference(q, kc, vc, bt, sl, qsl, 0.125), atol=2e-4, rtol=1e-3)


def test_strided_q_in_a_mixed_step(path):
    """q as a view of a fused QKV output, prompts beside decodes (whose rows the step gathers); out
    rows the step does not own stay as they were."""
    q, kc, vc, bt, sl, qsl, _ = make_batch([(40, 1), (90, 33), (9, 1), (300, 64)], 4, 2, 64, 8, torch.float32, seed=5)
    T = q.shape[0]
    qkv = torch.cat([q.reshape(T, -1), torch.randn(T, 2 * 2 * 64)], dim=1)
    out = torch.full_like(q, float("nan"))
    paged_attention(qkv[:, : 4 * 64].view(T, 4, 64), kc, vc, bt, sl, qsl, 0.3, out=out)
    torch.testing.assert_close(out, reference(q, kc, vc, bt, sl, qsl, 0.3), **TOL)
