"""kv_cache_prefault: the CPU KV cache is committed at start-up instead of block by block on first write."""
import pytest
import torch

from pyengine.config import ModelConfig
from pyengine.model.metadata import allocate_kv_caches
from tests.model_helpers import real_engine, smaps_field

BLOCKS = 2048
KV_BYTES = 2 * 2 * BLOCKS * 16 * 4 * 64 * 2  # layers x (k, v) x blocks x block_size x heads x head_dim x bf16: 64 MiB


def resident_bytes(addr: int) -> int:
    """Rss of the memory map holding addr."""
    return int(smaps_field(addr, "Rss:")) * 1024


def config() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=64)


@pytest.mark.parametrize("prefault", [False, True])
def test_prefault_commits_the_whole_cache_at_allocation(prefault):
    caches = allocate_kv_caches(config(), BLOCKS, 16, torch.bfloat16, "cpu", prefault=prefault)
    assert sum(c.k.nbytes + c.v.nbytes for c in caches) == KV_BYTES
    resident = resident_bytes(caches[0].k.data_ptr())  # all layers share one arena chunk
    if prefault:
        assert resident >= KV_BYTES
    else:
        assert resident < KV_BYTES // 4
    assert all(not c.k.any() and not c.v.any() for c in caches)  # zeros either way


def test_the_engine_setting_reaches_the_cache(real_parts):
    engine = real_engine(real_parts, kv_tokens=2048, kv_cache_prefault=True)  # one arena chunk
    caches = engine.runner.kv_caches
    assert resident_bytes(caches[0].k.data_ptr()) >= sum(c.k.nbytes + c.v.nbytes for c in caches)
