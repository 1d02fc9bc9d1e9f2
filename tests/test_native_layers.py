"""decoder_layers (all layers in one native call) against the op-by-op forward: the same bits."""
from __future__ import annotations

import pytest
import torch

from pyengine import _C
from model_helpers import TINY_ARCHS, TINY_NATIVE_ARCHS, SequenceRunner, default_model_path, write_tiny_checkpoint
from pyengine.model.loader import load_model
from pyengine.ops.attention import from_cache_layout


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


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_cache_bit_identical(cache_dtype, tmp_path):
    cfg, model = load_model(write_tiny_checkpoint(str(tmp_path), "llama"), torch.bfloat16, "cpu")
    assert_same(run_both(model, cfg, STEPS, cache_dtype))


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
