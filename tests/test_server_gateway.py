"""Pure unit tests of the gateway pieces, request validation and the CLI (no HTTP, no engine)."""
import subprocess
import sys

import pytest

from server.cli import build_parser, memory_size, server_config
from server.gateway import AdmissionControl, RateLimiter, TokenBucket, authenticate, check_context
from server.protocol import APIError, parse_chat, parse_completion, parse_json


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_token_bucket_refills_over_time():
    clock = Clock()
    b = TokenBucket(60, period=60, clock=clock)  # 1 token per second
    assert b.wait_time(60) == 0
    b.take(60)
    assert b.wait_time(1) == pytest.approx(1.0)
    clock.t = 0.5
    assert b.wait_time(1) == pytest.approx(0.5)
    clock.t = 1000  # never above capacity
    assert b.wait_time(60) == 0 and b.wait_time(61) == 0
    b.take(60)
    b.give_back(100)
    assert b.level == 60


def test_rate_limiter_requests_per_key_with_retry_after():
    clock = Clock()
    rl = RateLimiter(rpm=2, tpm=0, clock=clock)
    rl.check_request("a")
    rl.check_request("a")
    with pytest.raises(APIError) as e:
        rl.check_request("a")
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "30"
    rl.check_request("b")  # other keys have their own bucket
    clock.t = 30
    rl.check_request("a")


def test_rate_limiter_tokens_and_refund():
    clock = Clock()
    rl = RateLimiter(rpm=0, tpm=100, clock=clock)
    rl.check_tokens("k", 80)
    with pytest.raises(APIError) as e:
        rl.check_tokens("k", 30)
    assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
    assert int(e.value.headers["Retry-After"]) >= 1
    rl.refund_tokens("k", 50)  # the request used fewer tokens than it reserved
    rl.check_tokens("k", 30)


def test_rate_limiter_forgets_idle_clients():
    """Buckets of clients idle for a period are dropped once the table doubles: memory stays bounded
    by the clients active within a minute, and a returning client still starts with a full bucket."""
    clock = Clock()
    rl = RateLimiter(rpm=5, tpm=0, clock=clock)
    for i in range(1024):
        rl.check_request(f"10.0.{i // 256}.{i % 256}")
    rl.check_request("busy")
    for _ in range(4):
        rl.check_request("busy")  # empty now
    clock.t = 61  # a full period: every other bucket has refilled
    for i in range(1100):
        rl.check_request(f"new-{i}")
    assert len(rl.requests) < 1200  # the 1024 idle ones are gone, new and refilling ones stay
    rl.check_request("10.0.0.1")  # a forgotten client gets a fresh, full bucket
    for _ in range(4):
        rl.check_request("10.0.0.1")
    with pytest.raises(APIError):
        rl.check_request("10.0.0.1")


def test_authenticate():
    assert authenticate(None, []) == ""
    assert authenticate("Bearer k2", ["k1", "k2"]) == "k2"
    for header in (None, "", "Bearer", "Bearer k3", "Basic k1", "Bearer k1x", "k1"):
        with pytest.raises(APIError) as e:
            authenticate(header, ["k1", "k2"])
        assert e.value.status == 401


def test_admission_control_bounds_waiting_requests():
    a = AdmissionControl(max_queue=2)
    a.admit()
    a.admit()
    with pytest.raises(APIError) as e:
        a.admit()
    assert e.value.status == 503 and "Retry-After" in e.value.headers
    a.started()
    a.admit()
    assert (a.waiting, a.in_flight) == (2, 3)
    a.draining = True
    a.started()
    with pytest.raises(APIError) as e:
        a.admit()
    assert e.value.status == 503 and e.value.code == "server_shutting_down"


def test_context_check():
    assert check_context(10, None, 100) == 90
    assert check_context(10, 90, 100) == 90
    with pytest.raises(APIError) as e:
        check_context(10, 91, 100)
    assert e.value.message == ("This model's maximum context length is 100 tokens. However, you "
                               "requested 101 tokens (10 in the messages, 91 in the completion).")
    with pytest.raises(APIError):
        check_context(100, None, 100)


def test_parse_json_errors():
    assert parse_json(b'{"a": 1}') == {"a": 1}
    for raw in (b"{", b"[1]", b"\xff", b'"x"'):
        with pytest.raises(APIError) as e:
            parse_json(raw)
        assert e.value.status == 400


def test_parse_chat_normalises_messages():
    req = parse_chat({"messages": [{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                {"type": "text", "text": "there"}]},
                                   {"role": "assistant", "content": None}],
                      "top_k": -1, "stop": "x", "max_completion_tokens": 5, "max_tokens": 9,
                      "logprobs": True, "top_logprobs": 3, "stream": True,
                      "stream_options": {"include_usage": True}, "unknown_field": {"ignored": 1}}, 4)
    assert req.messages == [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hi there"},
                            {"role": "assistant", "content": ""}]
    assert req.sampling["top_k"] == 0 and req.sampling["stop"] == ["x"]
    assert req.max_tokens == 5 and req.num_logprobs == 3 and req.include_usage


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 5}, "n"),
    ({"n": True}, "n"),
    ({"stop": [1]}, "stop"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 4, "max_tokens": 3}, "min_tokens"),
    ({"stream": "yes"}, "stream"),
])
def test_parse_chat_rejects_with_param(body, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(APIError) as e:
        parse_chat(body, 4)
    assert e.value.status == 400 and e.value.param == param and param.split(".")[0] in e.value.message


def test_parse_completion_prompts():
    assert parse_completion({"prompt": "a"}, 1, 100).prompts == ["a"]
    assert parse_completion({"prompt": ["a", "b"]}, 1, 100).prompts == ["a", "b"]
    assert parse_completion({"prompt": [1, 2]}, 1, 100).prompts == [[1, 2]]
    assert parse_completion({"prompt": [[1], [2, 3]], "logprobs": 2}, 1, 100).num_logprobs == 2
    for bad in (None, [], [100], [[1], []], ["a", 1], 5):
        with pytest.raises(APIError) as e:
            parse_completion({"prompt": bad}, 1, 100)
        assert e.value.param == "prompt"


def test_memory_size():
    assert memory_size("0.5") == 0.5
    assert memory_size("2GiB") == 2 * 2**30
    assert memory_size("512M") == 512 * 2**20
    assert memory_size("1000") == 1000


def test_cli_config(monkeypatch):
    monkeypatch.setenv("PYENGINE_API_KEY", "env-key")
    args = build_parser().parse_args(["--port", "0", "--no-enable-prefix-caching", "--request-timeout", "0"])
    assert args.enable_prefix_caching is False
    cfg = server_config(args)
    assert cfg.gateway.api_keys == ["env-key"] and cfg.gateway.request_timeout is None
    cfg = server_config(build_parser().parse_args(["--api-key", "a", "--api-key", "b"]))
    assert cfg.gateway.api_keys == ["a", "b"]


def test_cli_help_lists_options():
    out = subprocess.run([sys.executable, "-m", "server", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for opt in ("--model", "--served-model-name", "--api-key", "--max-queue", "--request-timeout",
                "--kv-cache-memory", "--kv-cache-dtype", "--enable-prefix-caching", "--max-num-seqs",
                "--max-num-batched-tokens", "--max-model-len", "--dtype", "--rate-limit-rpm"):
        assert opt in out
