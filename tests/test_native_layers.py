"""decoder_layers (all layers in one native call) against the op-by-op forward (the same bits), and
with a quantized KV cache against transformers with K/V quantized in torch (independent of our kernels)."""
from __future__ import annotations

import pytest
import torch

from pyengine import _C
from model_helpers import (TINY_ARCHS, TINY_NATIVE_ARCHS, SequenceRunner, default_model_path, step_metadata,
                           write_tiny_checkpoint)
from pyengine.model.loader import load_model
from pyengine.ops.attention import from_cache_layout
from test_cache_ops import QMAX, ref_kv_quantize
from test_layer_ops import ref_hadamard


# decoder_layers needs the packed bf16 linears, built only with AVX512-BF16 (like `cuda` tests, a
# hardware requirement: elsewhere the model runs op by op, which the other tests cover)
pytestmark = pytest.mark.skipif(_C.isa() != "avx512_bf16", reason="needs a CPU build with AVX512-BF16")


def run_both(model, cfg, steps, cache_dtype=None):
    """Logits and final caches of the same steps, native layers vs op by op (native_layer_rows = 0)."""
    rows = model.native_layer_rows
    assert rows > 0, "bf16 CPU models take the native path"
    results = []
    try:
        for native in (True, False):
            model.native_layer_rows = rows if native else 0
            runner = SequenceRunner(model, cfg, 400, cache_dtype=cache_dtype)
            logits = [runner.step(ids, all_logits=True) for ids in steps]
            results.append((logits, runner.caches))
    finally:
        model.native_layer_rows = rows
    return results


def assert_same(results):
    (got, got_caches), (want, want_caches) = results
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for g, w in zip(got_caches, want_caches):
        for a, b in zip(from_cache_layout(g.k, g.v), from_cache_layout(w.k, w.v)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


STEPS = [list(range(3, 43)), [7], [9], list(range(50, 70)), [11]]  # a prompt, decodes, a chunk, a decode


@pytest.mark.parametrize("kind", TINY_NATIVE_ARCHS)
def test_tiny_models_bit_identical(kind, tmp_path):
    cfg, model = load_model(write_tiny_checkpoint(str(tmp_path), kind), torch.bfloat16, "cpu")
    assert_same(run_both(model, cfg, STEPS))


def test_no_logits_indices_means_every_row(tmp_path):
    """forward(..., logits_indices=None), the runner's decode-only steps (the final norm then runs inside
    decoder_layers), gives every row's logits: the same bits as naming each row, native and op by op."""
    cfg, model = load_model(write_tiny_checkpoint(str(tmp_path), "llama"), torch.bfloat16, "cpu")
    rows = model.native_layer_rows
    try:
        for native_rows in (rows, 0):
            model.native_layer_rows = native_rows
            logits = []
            for indices in (torch.arange(5), None):
                runner = SequenceRunner(model, cfg, 400)
                runner.step(list(range(3, 20)))
                meta = step_metadata(runner.block_table, runner.block_size, runner.length, 5)
                logits.append(model(torch.arange(20, 25), torch.arange(17, 22), runner.caches, meta, indices))
            assert logits[1].shape == (5, cfg.vocab_size) and torch.equal(logits[0], logits[1])
    finally:
        model.native_layer_rows = rows


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_cache_bit_identical(cache_dtype, tmp_path):
    cfg, model = load_model(write_tiny_checkpoint(str(tmp_path), "llama"), torch.bfloat16, "cpu")
    assert_same(run_both(model, cfg, STEPS, cache_dtype))


def hf_with_quantized_kv(folder: str, cache_dtype: torch.dtype, captured: dict):
    """transformers' Llama on the checkpoint's weights rounded to bf16, computing in fp32, whose
    attention sees q, K and V rotated (the Hadamard matrix written out; its output rotated back), and K
    and V quantized and dequantized in torch; `captured` gets each layer's fp32 K and V, rotated."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def dequantized(x):
        codes, scale = ref_kv_quantize(x, cache_dtype)
        return codes.float() * scale[..., None]

    def attention(module, q, k, v, mask, scaling, dropout=0.0, **kw):
        q, k, v = (ref_hadamard(x, x.shape[-1]) for x in (q, k, v))  # a quantized cache holds K and V rotated
        captured[module.layer_idx] = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [S, KVH, D]
        out, weights = eager_attention_forward(module, q, dequantized(k), dequantized(v), mask, scaling, dropout, **kw)
        return ref_hadamard(out, out.shape[-1]), weights  # back from rotated V

    name = f"test_quantized_kv_{str(cache_dtype).removeprefix('torch.')}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=name).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    return hf


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_cache_matches_torch_reference(cache_dtype, tmp_path):
    """The native layers with a fp8/int8 cache against an independent reference: transformers with
    q/K/V rotated and K/V quantized in plain torch. The logits follow the quantized reference (for fp8 measurably
    closer than unquantized attention: mean 4.3e-3 of the span), and layer 0's cache holds torch's
    codes and scales for the reference K/V, up to bf16 rounding."""
    folder = write_tiny_checkpoint(str(tmp_path), "llama")
    cfg, model = load_model(folder, torch.bfloat16, "cpu")
    assert model.native_layer_rows > 0
    runner = SequenceRunner(model, cfg, 400, cache_dtype=cache_dtype)
    got = torch.cat([runner.step(ids, all_logits=True) for ids in STEPS])
    captured: dict = {}
    with torch.inference_mode():
        want = hf_with_quantized_kv(folder, cache_dtype, captured)(torch.tensor([sum(STEPS, [])])).logits[0]
    span = float(want.max() - want.min())
    err = (got - want).abs() / span
    assert float(err.mean()) < 3e-3 and float(err.max()) < 3e-2  # measured: fp8 2.4e-3 / 2.5e-2, int8 1.3e-3 / 9.3e-3

    # Layer 0's cache against torch's quantization of the reference K/V (deeper layers' inputs differ by
    # the accumulated bf16 rounding, which the logits check above bounds)
    pos = torch.arange(len(want))
    slots = runner.block_table.long()[pos // runner.block_size] * runner.block_size + pos % runner.block_size
    blocks, offsets = slots // runner.block_size, slots % runner.block_size
    cache = runner.caches[0]
    for ref, stored, scales in zip(captured[0], from_cache_layout(cache.k, cache.v), (cache.k_scales, cache.v_scales)):
        codes, scale = ref_kv_quantize(ref, cache_dtype)
        scale = scale[..., None]
        ours_scale = scales[blocks, :, offsets]
        if cache_dtype == torch.int8:
            torch.testing.assert_close(ours_scale, scale[..., 0], rtol=2e-2, atol=1e-6)
        else:  # one of the candidates absmax / 448 * [1, 2): bf16 rounding may tip the choice to another
            plain = ref.abs().amax(-1) / QMAX[cache_dtype]
            assert ((ours_scale >= plain * (1 - 2e-2) - 1e-6) & (ours_scale <= plain * 2 * (1 + 2e-2) + 1e-6)).all()
        ours = stored[blocks, :, offsets]
        # bf16 activations make K/V differ from the fp32 reference by up to ~2^-7 of the row's absmax,
        # so codes land up to a step away (measured: at most 0.9 of this bound)
        want_deq = codes.float() * scale
        step = scale if cache_dtype == torch.int8 else torch.maximum(want_deq.abs() * 2.0**-3, scale * 2.0**-9)
        bound = step + 2.0**-7 * ref.abs().amax(-1, keepdim=True)
        ratio = (ours.float() * scales[blocks, :, offsets, None] - want_deq).abs() / bound
        assert float(ratio.max()) <= 1.0, float(ratio.max())


def test_default_model_bit_identical():
    cfg, model = load_model(default_model_path(), torch.bfloat16, "cpu")
    assert_same(run_both(model, cfg, [list(range(100, 164)), [5], [6]]))


def test_steps_over_the_row_limit_run_op_by_op(tmp_path):
    cfg, model = load_model(write_tiny_checkpoint(str(tmp_path), "llama"), torch.bfloat16, "cpu")
    model.native_layer_rows = 8
    (got, _), (want, _) = run_both(model, cfg, [list(range(3, 23)), [5]])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_metadata_raises_and_changes_nothing(tmp_path):
    cfg, model = load_model(write_tiny_checkpoint(str(tmp_path), "llama"), torch.bfloat16, "cpu")
    runner = SequenceRunner(model, cfg, 64)
    runner.block_table[0] = 10**6  # a block id outside the cache: slots outside it too
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 16000000 is outside"):
        runner.step([3, 4, 5])
    assert not any(c.k.any() or c.v.any() for c in runner.caches)  # checked before layer 0 wrote anything


@pytest.mark.parametrize("kind", sorted(set(TINY_ARCHS) - set(TINY_NATIVE_ARCHS)))
def test_family_features_run_op_by_op_in_bf16(kind, tmp_path):
    """q/k norms, Gemma's norms and caps, sliding windows (prompts longer than the window): op by op,
    close to fp32."""
    folder = write_tiny_checkpoint(str(tmp_path), kind)
    cfg, model = load_model(folder, torch.bfloat16, "cpu")
    assert model.native_layer_rows == 0
    _, model32 = load_model(folder, torch.float32, "cpu")
    prompt = list(range(3, 103))
    got = SequenceRunner(model, cfg, 128).prefill(prompt, chunk=40)
    want = SequenceRunner(model32, cfg, 128).prefill(prompt)
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.99
    assert int(got.argmax()) == int(want.argmax())


def test_fp32_models_run_op_by_op(tmp_path):
    _, model = load_model(write_tiny_checkpoint(str(tmp_path), "llama"), torch.float32, "cpu")
    assert model.native_layer_rows == 0
