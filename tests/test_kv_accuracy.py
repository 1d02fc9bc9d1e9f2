"""Teacher-forced top-1 agreement on a fixed natural text (tests/model_helpers.py: natural_text_ids):
the bf16 engine against the fp32 one, fp8/int8 KV caches against an fp32 cache (fp32 model: only the
cache's rounding differs) and against the bf16 cache (bf16 model, the kernels bf16 models run), through
`LLM` and through the server. Each position's argmax (prompt_logprobs / echo+logprobs top 1) is
compared; agreement is what greedy decoding would see, position by position, without drifting apart.

Thresholds sit a little below what was measured on this text (2,047 positions, AVX512-BF16 CPU):
bf16 vs fp32 99.1%; against an fp32 cache int8 99.1%, fp8 98.0% (mean |logprob change| 0.013 and
0.034); against a bf16 cache int8 98.7%, fp8 97.8%. They depend on the text: on a code-heavy one our bf16 got 98.6% where transformers' own
bf16 forward got 97.1% (both against fp32, before our residual stream was fp32), so bf16 itself, not
our kernels, sets that ceiling.
Where it went: bf16 rounding injected one place at a time into the fp32 op-by-op path (the first 384
tokens) moved the text tokens' logprobs by a mean of 0.018 when it rounded the residual stream, 0.008
the norm outputs (the projections' inputs), 0.006 the K/V cache, 0.005 attention's q and output, 0.003
the MLP activation; 0.022 all at once. So the residual stream is kept in fp32 in every model (native
decoder layers and op by op, CPU and CUDA): bf16 vs fp32 rose from 98.7% to 99.1%. Next on the list:
the norm outputs.

What held int8 and fp8 at 98.6% / 96.5% against an fp32 cache: K, not V, nor the kernels' arithmetic
(the fp32 path dequantizes exactly). Rounding only K or only V of transformers' fp32 forward (the
same per (token, kv head) scales) gives int8 98.7% / 99.9% and fp8 96.2% / 98.9%. K has a few large
channels, so a per-token scale leaves the others few levels (int8), and q.k's rounding error is that
of the one or two terms that dominate it (fp8). So q, k and v are rotated per head after RoPE by a
normalised Walsh-Hadamard transform (ops/layers.py: hadamard_heads; the attention output is rotated
back), which spreads those channels over all of them: int8 99.1%, fp8 96.8%. (int8 K is rounded for the
queries too, as fp8's below: on an AMD Zen 2, 98.97% -> 99.61%, mean |logprob change| 0.0136 -> 0.0082.)

fp8 after the rotation, simulated on transformers' fp32 forward with a fake-quantized cache (mean
|logprob change| of the text tokens, this text; agreement moves by +-0.4% with no change in it): the
encoder was already torch's round-to-nearest-even of x / (absmax / 448). K alone costs 0.056, V alone
0.018; K and V 0.056. Not the cause, or no help: attention sinks (the first 1-64 tokens exact: 0.053-
0.057), finer scales (per 32 or 16 values: 0.056), rotating V or not, balancing q against k per RoPE
pair (0.054), subtracting a per-(layer, head) mean from K (exact for softmax; 0.051, and it needs
calibration data). e4m3's error is relative, so its energy is about |k|^2 / 1000 whatever the
rotation; what counts is its projection on the queries, and queries share a large common direction
(40-70% of their energy), along which a token's own q points. Two write-side changes (kv_quant.h,
native/cpu/kv_cache.cpp): each fp8 row takes the best of 16 scales absmax / 448 * (16 + j) / 16 (least
squared error; 0.056 -> 0.049 for K alone), and K's values are rounded to the nearest or the other
neighbouring code so as to cut the error along the token's own q heads (round_k_for_queries; 0.039). Both: 0.035, agreement 98.2% in the simulation; on a second text (the
GPL) 0.082 -> 0.042, 95.1% -> 97.3%. Measured through the engine on this text: fp8 96.8% -> 98.0%,
mean |logprob change| 0.058 -> 0.034 (int8 unchanged: 99.1%, 0.013); on the GPL 95.4% -> 97.1%,
0.080 -> 0.043; on other Python docs (import, objects, customization, ...) 97.6% -> 97.5%, 0.067 ->
0.036: the logprob change halves on every text, the agreement moves within its noise there.
"""
from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from model_helpers import natural_text_ids, real_engine
from pyengine import _C
from pyengine.output_types import TokenLogprob
from pyengine.llm import LLM
from pyengine.sampling_params import SamplingParams
from test_server_e2e import ServerProcess

# teacher-forced runs over 2,048 tokens, several on the fp32 model: up to minutes each on a slow 2-core machine
pytestmark = [pytest.mark.accuracy, pytest.mark.timeout(600)]
N = 2048
# bf16 vs fp32, fp8/int8 vs a bf16 cache. fp8 vs a bf16 cache measured 97.8% on an AVX512-BF16 CPU and
# 97.3% on an AVX2 one (the bf16 model's portable kernels; within the +-0.4% that agreement moves with no
# change in the cache). The bar, fp8 >= 97.5% against an fp32 cache, is MIN_VS_FP32_CACHE's.
MIN_AGREEMENT = {"bf16": 0.99, "fp8": 0.97, "int8": 0.98}
# The bars. int8 with K rounded to nearest measured 98.97% and a mean |logprob difference| of 0.0136
# on the Zen 2 host (fp32 model, AVX2 kernels); with K rounded for the step's q, as fp8's is, 99.61% and 0.0082.
MIN_VS_FP32_CACHE = {"fp8": 0.975, "int8": 0.99}
MAX_LOGPROB_SHIFT = {"fp8": 0.04, "int8": 0.01}  # against the fp32 cache
MAX_DECODE_KERNEL_SHIFT = {"fp8": 0.045, "int8": 0.03}  # against the bf16 cache
CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


@pytest.fixture(scope="module")
def text(real_parts) -> list[int]:
    return natural_text_ids(real_parts[2], N)


def prompt_logprobs(engine, text: list[int]) -> list[TokenLogprob]:
    """The engine's logprob of each token of `text` after its prefix, with the argmax (top 1)."""
    llm = LLM.from_engine(engine)
    out = llm.generate([text], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)[0]
    return out.prompt_logprobs[1:]


def top1(lps: list[TokenLogprob]) -> list[int]:
    return [lp.top[0][0] for lp in lps]


def agreement(a: list, b: list) -> float:
    assert len(a) == len(b) == N - 1
    rate = sum(x == y for x, y in zip(a, b)) / len(a)
    print(f"top-1 agreement {rate:.4f} over {len(a)} positions")  # shown with -s or on failure
    return rate


def logprob_shift(a: list[TokenLogprob], b: list[TokenLogprob]) -> float:
    """Mean |difference| of the text tokens' logprobs: a smoother measure than agreement, which counts
    only the positions whose top two were close enough to swap."""
    assert [x.token_id for x in a] == [y.token_id for y in b]
    shift = sum(abs(x.logprob - y.logprob) for x, y in zip(a, b)) / len(a)
    print(f"mean |logprob difference| {shift:.4f}")
    return shift


@pytest.fixture(scope="module")
def bf16_lps(bf16_parts, text) -> list[TokenLogprob]:
    return prompt_logprobs(real_engine(bf16_parts, N + 16, dtype="bfloat16"), text)


@pytest.fixture(scope="module")
def bf16_top1(bf16_lps) -> list[int]:
    return top1(bf16_lps)


@pytest.fixture(scope="module")
def fp32_lps(real_parts, text) -> list[TokenLogprob]:
    return prompt_logprobs(real_engine(real_parts, N + 16), text)


def test_bf16_engine_agrees_with_fp32(fp32_lps, bf16_top1):
    assert agreement(bf16_top1, top1(fp32_lps)) >= MIN_AGREEMENT["bf16"]


def test_prefill_kernels_fp16_path_costs_little_accuracy(bf16_parts, text, fp32_lps):
    """The prefill kernel's avx512_fp16 path (fp16 sums of q.k over 16 dims pairs and of p.v within each
    64-token chunk, fp16 probabilities) and its avx512_fp32 path (fp32 sums, bf16 probabilities: the bits
    of vdpbf16ps), each on the bf16 model, against the fp32 engine. Measured: top-1 99.27% and 99.22%,
    mean |logprob change| 0.0142 and 0.0139 (q.k in fp32: 99.41%, 0.0142; bf16 probabilities: 99.12%,
    0.0149)."""
    lps = {}
    try:
        for path in ("avx512_fp16", "avx512_fp32"):
            _C.set_prefill_attention_path(path)
            if _C.prefill_attention_path() != path:
                pytest.skip(f"no {path} prefill path here (the best is {_C.prefill_attention_path()})")
            lps[path] = prompt_logprobs(real_engine(bf16_parts, N + 16, dtype="bfloat16"), text)
    finally:
        _C.set_prefill_attention_path("amx")
    assert agreement(top1(lps["avx512_fp16"]), top1(fp32_lps)) >= MIN_AGREEMENT["bf16"]
    assert logprob_shift(lps["avx512_fp16"], fp32_lps) <= 1.1 * logprob_shift(lps["avx512_fp32"], fp32_lps)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_against_an_fp32_cache(kv, real_parts, text, fp32_lps):
    """The fp32 model with a quantized cache against its fp32 cache: the cache's rounding alone."""
    engine = real_engine(real_parts, N + 16, kv_cache_dtype=kv)
    assert engine.runner.kv_caches[0].k.dtype == CACHE_DTYPES[kv]
    lps = prompt_logprobs(engine, text)
    assert agreement(top1(lps), top1(fp32_lps)) >= MIN_VS_FP32_CACHE[kv]
    assert logprob_shift(lps, fp32_lps) <= MAX_LOGPROB_SHIFT[kv]


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_through_llm(kv, bf16_parts, text, bf16_top1):
    engine = real_engine(bf16_parts, N + 16, dtype="bfloat16", kv_cache_dtype=kv)
    assert engine.runner.kv_caches[0].k.dtype == CACHE_DTYPES[kv]
    assert agreement(top1(prompt_logprobs(engine, text)), bf16_top1) >= MIN_AGREEMENT[kv]


# int8 runs the same integer kernel under either cap: capped to avx512_bf16 it runs on every AVX512-BF16
# CPU, where asking for avx512_fp16 skipped it on all but Intel's newest.
@pytest.mark.parametrize("kv,decode_path", [("fp8", "avx512_fp16"), ("fp8", "avx512_bf16"), ("int8", "avx512_bf16"),
                                            ("fp8", "avx2"), ("int8", "avx2")])
def test_quantized_kv_through_the_decode_kernel(kv, decode_path, bf16_parts, text, bf16_lps):
    """The prompt run by the decode kernel (the prefill kernel capped to "paged"), whose fp8 and int8
    paths compute on the codes in their own way (fp16 or bf16 FMAs for fp8, integer dot products for
    int8): against the bf16 cache through the default kernels. Measured on an AVX512-FP16 CPU: fp8
    98.2% (both paths), mean |logprob change| 0.039; int8 98.7%, 0.023. On an AMD Zen 4 (AVX512-BF16,
    no FP16): fp8 98.4%, 0.038; int8 98.7%, 0.023. On an AMD Zen 2 (avx2): fp8 97.3%, 0.040; int8 98.5%,
    0.023, and 98.9%, 0.0205 since its K is rounded for q."""
    _C.set_decode_attention_path(decode_path)
    _C.set_prefill_attention_path("paged")
    try:
        if _C.decode_attention_path() != decode_path:
            pytest.skip(f"no {decode_path} decode path here (the best is {_C.decode_attention_path()})")
        lps = prompt_logprobs(real_engine(bf16_parts, N + 16, dtype="bfloat16", kv_cache_dtype=kv), text)
    finally:
        _C.set_decode_attention_path("avx512_fp16")
        _C.set_prefill_attention_path("amx")
    assert agreement(top1(lps), top1(bf16_lps)) >= MIN_AGREEMENT[kv]
    assert logprob_shift(lps, bf16_lps) <= MAX_DECODE_KERNEL_SHIFT[kv]


@pytest.fixture(scope="module")
def quantized_servers():
    servers = {kv: ServerProcess("k", "--dtype", "bfloat16", "--kv-cache-dtype", kv, "--max-model-len", "4096",
                                 "--kv-cache-memory", "64MiB") for kv in ("fp8", "int8")}
    try:
        yield {kv: s.wait_ready() for kv, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()


@pytest.mark.e2e
@pytest.mark.timeout(900)  # with the two servers' start-up: a 2,048-token prefill on a slow machine
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_through_the_server(kv, quantized_servers, real_parts, text, bf16_top1):
    """echo + logprobs=1: the server's top-1 token (as text) at each prompt position."""
    from pyengine.model.metadata import kv_bytes_per_token

    server = quantized_servers[kv]
    per_block = 16 * kv_bytes_per_token(real_parts[0], CACHE_DTYPES[kv])
    assert f"KV cache: {(64 << 20) // per_block} blocks" in "".join(server.lines)  # the flag took effect
    body = {"prompt": text, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"})
    with urllib.request.urlopen(req, timeout=600) as r:  # a 2,048-token prefill on a slow CI machine
        tops = json.loads(r.read())["choices"][0]["logprobs"]["top_logprobs"][1:N]
    got = [max(t, key=t.get) for t in tops]
    tok = real_parts[2]
    want = [tok.decode([i]) for i in bf16_top1]
    assert agreement(got, want) >= MIN_AGREEMENT[kv]
