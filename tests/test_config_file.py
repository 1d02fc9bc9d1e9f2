"""`python -m server --config server.toml` and several `--model` flags: what a good file gives, and
that a mistake stops the start-up with the file, the line and the entry (before any model loads).
Ends with one real server: two configurations of the bundled model, routed by prompt length.
"""
from __future__ import annotations

import re
import textwrap

import openai
import pytest

from server import config_file
from server.cli import build_parser, main, model_specs
from server.models import ConfigError

# The KV sizes hold max_model_len tokens of an fp32 cache too (auto dtype on a CPU without bf16 dot products).
GOOD = """\
[[models]]
name = "small"
max_model_len = 256
kv_cache_memory = "16MiB"
max_num_seqs = 4

[[models]]
name = "large"
aliases = ["big"]
max_model_len = 1024
kv_cache_memory = "48MiB"
max_num_seqs = 4
tier = "pro"

[api_keys]
"pro-key" = "pro"

[routing]
default = "small"

[[routing.rules]]
name = "long-prompts"
min_prompt_tokens = 100
model = "large"

[[routing.rules]]
name = "code"
metadata = { task = "code" }
tier = "pro"
model = "large"

[[routing.canary]]
name = "small-canary"
model = "small"
canary = "large"
weight = 0.0
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "server.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_good_file(tmp_path):
    f = config_file.load(write(tmp_path, GOOD))
    small, large = f.models
    assert (small.name, small.path, small.engine) == ("small", None, {
        "max_model_len": 256, "kv_cache_memory": 16 << 20, "max_num_seqs": 4})
    assert large.aliases == ["big"] and large.tier == "pro"
    assert f.key_tiers == {"pro-key": "pro"}
    assert [r.name for r in f.routing.rules] == ["long-prompts", "code"]
    assert f.routing.rules[0].min_prompt_tokens == 100
    assert f.routing.rules[1].tiers == ["pro"] and f.routing.rules[1].metadata == {"task": "code"}
    assert f.routing.canaries[0].canary == "large" and f.routing.default == "small"


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.mark.parametrize("change, needle, message", [
    (('model = "large"\n\n[[routing.rules]]', 'model = "nope"\n\n[[routing.rules]]'), 'model = "nope"',
     r"routing.rules\[0\].model: unknown model 'nope'"),
    (('aliases = ["big"]', 'aliases = ["small"]'), 'aliases = ["small"]',
     r"models\[1\].aliases: models\[0\] already claims the name 'small'"),
    (('name = "large"', 'name = "small"'), 'name = "small"\naliases',
     r"models\[1\].name: models\[0\] already claims the name 'small'"),
    (('name = "small"\n', 'name = "small"\npath = "missing.gguf"\n'), 'path = "missing.gguf"',
     r"models\[0\].path: model path .*missing.gguf' does not exist"),
    (('max_num_seqs = 4\ntier', 'max_num_seq = 4\ntier'), "max_num_seq = 4\ntier",
     r"models\[1\].max_num_seq: unknown setting 'max_num_seq'"),
    (('weight = 0.0', 'weight = 1.5'), 'weight = 1.5', r"routing.canary\[0\].weight: weight must be in \[0, 1\]"),
    (('"pro-key" = "pro"', '"pro-key" = "team"'), 'tier = "pro"\n\n[api',
     r"models\[1\].tier: no API key has the tier 'pro'"),
    (('max_model_len = 256', 'max_model_len = "256"'), 'max_model_len = "256"',
     r"models\[0\].max_model_len: max_model_len = '256' has the wrong type"),
    (('max_num_seqs = 4\ntier', 'max_num_seqs = 0\ntier'), "max_num_seqs = 0",
     r"models\[1\].max_num_seqs: max_num_seqs must be >= 1, got 0"),
    (('tier = "pro"\nmodel', 'tier = ["pro", 1]\nmodel'), 'tier = ["pro", 1]',
     r"routing.rules\[1\].tier: tier must be a string or a list of strings"),
])
def test_mistakes_name_the_line(tmp_path, change, needle, message):
    text = GOOD.replace(*change)
    assert text != GOOD
    path = write(tmp_path, text)
    line = text[: text.index(needle)].count("\n") + 1  # where the (first line of the) needle is
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}:{line}: {message}"):
        config_file.load(path)


def test_syntax_error_and_unreadable_file(tmp_path):
    path = write(tmp_path, GOOD.replace("[api_keys]", "[api_keys"))
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: .*line {line_of(GOOD, '[api_keys]')},"):
        config_file.load(path)
    with pytest.raises(ConfigError, match="cannot read the config file"):
        config_file.load(str(tmp_path / "nope.toml"))


def test_cli_refuses_before_loading(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace('model = "large"\n\n[[routing.rules]]', 'model = "nope"\n\n[[routing.rules]]'))
    assert main(["--config", path]) == 2
    assert f"{path}:{line_of(GOOD, 'min_prompt_tokens') + 1}: routing.rules[0].model: unknown model 'nope'" \
        in capsys.readouterr().err
    assert main(["--config", write(tmp_path, GOOD), "--model", "x.gguf"]) == 2
    assert "leave out --model" in capsys.readouterr().err


def test_engine_error_names_the_model(tmp_path, capsys):
    path = write(tmp_path, """\
        [[models]]
        name = "tiny-kv"
        max_model_len = 2048
        kv_cache_memory = "1MiB"
        """)
    assert main(["--config", path, "--num-threads", "1"]) == 2
    assert "error: model 'tiny-kv': the KV cache (1048576 bytes" in capsys.readouterr().err


def test_several_model_flags(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"")
    args = build_parser().parse_args(["--model", f"a={gguf}", "--model", str(gguf)])
    specs = model_specs(args, None)
    assert [(s.name, s.path) for s in specs] == [("a", str(gguf)), ("tiny", str(gguf))]
    assert model_specs(build_parser().parse_args(["--model", str(gguf)]), None) is None  # one model: as before
    with pytest.raises(ConfigError, match="already claims the name 'tiny'"):
        model_specs(build_parser().parse_args(["--model", str(gguf), "--model", f"tiny={gguf}"]), None)


@pytest.mark.e2e
def test_two_bundled_models_routed_by_prompt_length(tmp_path):
    """A real server: two configurations of the bundled model, each with its own small KV cache."""
    from test_server_e2e import ServerProcess

    server = ServerProcess("free-key", "--config", write(tmp_path, GOOD), "--num-threads", "1").wait_ready()
    try:
        banner = "".join(server.lines)
        assert "model: small (context 256 tokens)" in banner and "model: large (context 1024 tokens)" in banner
        free = openai.OpenAI(base_url=server.url + "/v1", api_key="free-key")
        pro = openai.OpenAI(base_url=server.url + "/v1", api_key="pro-key")
        short = free.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert short.parse().model == "small" and short.headers["X-Route-Rule"] == "default"
        long_prompt = "Tell me about the sea. " * 30
        for client, want in ((pro, "large"), (free, "small")):  # large is reserved to pro keys
            r = client.completions.with_raw_response.create(model="auto", prompt=long_prompt, max_tokens=2)
            assert r.parse().model == want and r.headers["X-Route-Rule"] == (
                "long-prompts" if want == "large" else "default")
        with pytest.raises(openai.NotFoundError):
            free.completions.create(model="big", prompt="hi", max_tokens=1)
        assert [m.id for m in pro.models.list()] == ["small", "large", "auto"]
        metrics = server.get("/metrics").text
        for name in ("small", "large"):
            assert f'pyengine:kv_cache_usage_perc{{model_name="{name}"}}' in metrics
        assert 'pyengine_server:routed_requests_total{model_name="large",rule="long-prompts"} 1.0' in metrics
    finally:
        assert server.stop() == 0
