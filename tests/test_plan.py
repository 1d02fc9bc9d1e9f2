"""The capacity planner prints the memory plan the engine logs at start-up: same weights, KV bytes
per token (scales counted), blocks, tokens and concurrency, for bf16, fp8 and int8 caches."""
import logging
import re

import pytest

from pyengine import plan
from pyengine.config import EngineConfig
from pyengine.engine import engine as engine_mod

MAX_LEN = 1024  # 24 MiB of bf16 KV (1088 tokens) holds one sequence of it


@pytest.fixture(scope="module")
def parts(bf16_parts):
    """The default model in bf16 on its quantized weights (tests/conftest.py, loaded once a session)."""
    return bf16_parts


def engine_plan_line(parts, caplog, **config) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pyengine.engine"):
        engine_mod.Engine(EngineConfig(dtype="bfloat16", max_model_len=MAX_LEN, max_num_seqs=8, **config), parts=parts)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan:")]
    assert len(lines) == 1
    return lines[0]


def test_planner_equals_engine_log(parts, caplog, capsys):
    want = {kv: engine_plan_line(parts, caplog, kv_cache_dtype=kv, kv_cache_memory=24 << 20)
            for kv in ("auto", "fp8", "int8")}
    assert plan.main(["--dtype", "bfloat16", "--kv-cache-dtype", "all", "--kv-cache-memory", "24MiB",
                      "--max-model-len", str(MAX_LEN), "--max-num-seqs", "8"]) == 0
    out = capsys.readouterr().out
    for kv, line in want.items():
        assert line in out, (kv, line, out)
    # the KV formula with scales: 2 x 30 layers x 3 KV heads x (64 dims x bytes [+ 4 B fp32 scale])
    bpt = {kv: int(re.search(r"(\d+) B/token", line).group(1)) for kv, line in want.items()}
    assert bpt == {"auto": 2 * 30 * 3 * 64 * 2, "fp8": 2 * 30 * 3 * (64 + 4), "int8": 2 * 30 * 3 * (64 + 4)}
    blocks = int(re.search(r"KV cache (\d+) blocks", want["int8"]).group(1))
    assert blocks == (24 << 20) // (bpt["int8"] * 16)
    assert "max concurrent sequences at 512 prompt + 256 output tokens: " \
           f"{blocks // (768 // 16)}" in out.split("KV cache dtype int8")[1]


def test_planner_memory_matches_engine_measuring(parts, caplog, capsys, monkeypatch):
    """--memory M: the planner assumes M bytes in all; the engine measures what is left after the
    weights. Given the same total, they agree (the default budget: 90% of free minus the reserve)."""
    total = 1 << 30
    weights = parts[1].weight_bytes()
    monkeypatch.setattr(engine_mod, "available_memory", lambda device: total - weights)
    line = engine_plan_line(parts, caplog)
    assert plan.main(["--dtype", "bfloat16", "--memory", "1GiB", "--max-model-len", str(MAX_LEN),
                      "--max-num-seqs", "8"]) == 0
    assert line in capsys.readouterr().out
