"""The gateway: what a request must pass before it reaches the engine.

Authentication (constant-time key compare), per-key rate limits (token buckets for requests and
tokens per minute -> 429 + Retry-After), body size (-> 413), the context budget (-> 400 with the
message OpenAI's server uses), and back-pressure: a bounded number of requests waiting for their
first token (-> 503 at once instead of an ever-growing queue).
"""
from __future__ import annotations

import contextlib
import hmac
import math
import time
from dataclasses import dataclass, field
from typing import Iterator

from server.protocol import APIError


@dataclass
class GatewayConfig:
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    max_body_bytes: int = 4 * 1024 * 1024
    max_queue: int = 256  # requests admitted but still waiting for their first token
    request_timeout: float | None = 600.0  # seconds from admission to the last token
    rate_limit_rpm: int = 0  # requests per minute per key; 0 = off
    rate_limit_tpm: int = 0  # prompt + completion tokens per minute per key; 0 = off


# ---------------------------------------------------------------- authentication
def authenticate(header: str | None, keys: list[str]) -> str:
    """Return the caller's key (or "" when auth is off); 401 otherwise.

    Every configured key is compared, each with hmac.compare_digest, so the time taken does not
    depend on which key (or how much of one) matched.
    """
    if not keys:
        return ""
    scheme, _, given = (header or "").partition(" ")
    given = given.strip()
    ok = scheme.lower() == "bearer" and bool(given)
    matched = False
    given_bytes = given.encode("utf-8", "surrogateescape")  # aiohttp keeps non-UTF-8 header bytes so
    for key in keys:
        matched |= hmac.compare_digest(given_bytes, key.encode())
    if not (ok and matched):
        raise APIError(401, "Incorrect or missing API key. Send 'Authorization: Bearer <key>'.",
                       type="authentication_error", code="invalid_api_key")
    return given


# ---------------------------------------------------------------- rate limits
class TokenBucket:
    """Holds up to `capacity` tokens, refilled continuously at `capacity` per `period` seconds."""

    def __init__(self, capacity: float, period: float = 60.0, clock=time.monotonic) -> None:
        self.capacity = float(capacity)
        self.rate = self.capacity / period
        self.clock = clock
        self.level = self.capacity
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_time(self, amount: float) -> float:
        """Seconds until `amount` tokens are available (0: available now)."""
        self._refill()
        missing = min(amount, self.capacity) - self.level
        return max(0.0, missing / self.rate)

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)

    def is_full(self) -> bool:
        self._refill()
        return self.level >= self.capacity


class BucketTable:
    """Token buckets by key, created full on first use. A full bucket is the same as a new one, so
    each time the table has doubled since its last sweep it forgets the full ones: it holds about
    the keys that made requests within the last period, not every client address ever seen."""

    def __init__(self, capacity: int, clock) -> None:
        self.capacity, self.clock = capacity, clock
        self._buckets: dict[str, TokenBucket] = {}
        self._sweep_at = 1024

    def __len__(self) -> int:
        return len(self._buckets)

    def find(self, key: str) -> TokenBucket | None:
        return self._buckets.get(key)

    def get(self, key: str) -> TokenBucket:
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= self._sweep_at:
                self._buckets = {k: v for k, v in self._buckets.items() if not v.is_full()}
                self._sweep_at = max(1024, 2 * len(self._buckets))
            b = self._buckets[key] = TokenBucket(self.capacity, clock=self.clock)
        return b


class RateLimiter:
    """Per-key buckets for requests/minute and tokens/minute.

    A request is charged its prompt tokens plus its max_tokens up front (so a burst cannot
    overshoot), and the unused part of max_tokens is given back when it finishes; a refused request
    (see `refused`) gets its request and all its tokens back. A request larger than the whole
    bucket passes when the bucket is full (it could never pass otherwise) and leaves the bucket in
    debt, so the key's next requests wait.
    """

    def __init__(self, rpm: int, tpm: int, clock=time.monotonic) -> None:
        self.rpm, self.tpm = rpm, tpm
        self.requests = BucketTable(rpm, clock)
        self.tokens = BucketTable(tpm, clock)

    def check_request(self, key: str) -> None:
        """Charge one request; 429 if the key's request bucket is empty."""
        if self.rpm <= 0:
            return
        b = self.requests.get(key)
        wait = b.wait_time(1)
        if wait > 0:
            raise _too_many(f"Rate limit reached: {self.rpm} requests per minute.", wait, "requests")
        b.take(1)

    @contextlib.contextmanager
    def charged(self, key: str) -> Iterator[None]:
        """Charge `key` one request before any work (429 when its bucket is empty); give it back
        when the request is refused."""
        self.check_request(key)
        try:
            yield
        except APIError as e:
            if refused(e):
                self.refund_request(key)
            raise

    def check_tokens(self, key: str, tokens: int) -> None:
        """Charge `tokens`; 429 if they are not available yet."""
        if self.tpm <= 0:
            return
        b = self.tokens.get(key)
        wait = b.wait_time(tokens)
        if wait > 0:
            raise _too_many(f"Rate limit reached: {self.tpm} tokens per minute; this request needs "
                            f"{tokens}.", wait, "tokens")
        b.take(tokens)

    def refund_request(self, key: str) -> None:
        b = self.requests.find(key) if self.rpm > 0 else None
        if b is not None:
            b.give_back(1)

    def refund_tokens(self, key: str, tokens: int) -> None:
        b = self.tokens.find(key) if self.tpm > 0 and tokens > 0 else None
        if b is not None:
            b.give_back(tokens)


def refused(e: APIError) -> bool:
    """Whether a request that ended in `e` was refused, and so costs nothing from its key's rate
    limits: every error but a timeout (504), which comes after the engine worked on the request."""
    return e.status != 504


def _too_many(message: str, wait: float, kind: str) -> APIError:
    return APIError(429, message, type=kind, code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(wait)))})


# ---------------------------------------------------------------- back-pressure
class AdmissionControl:
    """Counts requests that were admitted but have not produced their first token yet."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.waiting = 0
        self.in_flight = 0
        self.draining = False

    def admit(self) -> None:
        if self.draining:
            raise APIError(503, "The server is shutting down.", type="server_error",
                           code="server_shutting_down", headers={"Retry-After": "5"})
        if self.waiting >= self.max_queue:
            raise APIError(503, f"The server is overloaded: {self.waiting} requests are already "
                           "waiting. Retry later.", type="server_error", code="server_overloaded",
                           headers={"Retry-After": "1"})
        self.waiting += 1
        self.in_flight += 1

    def started(self) -> None:
        """The request produced its first token (or failed): it no longer waits."""
        self.waiting -= 1

    def finished(self) -> None:
        self.in_flight -= 1


# ---------------------------------------------------------------- context budget
def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str = "messages") -> int:
    """Return the completion budget; 400 with OpenAI's message when it does not fit, naming `param`
    (the request's prompt field: messages, prompt or input).

    max_tokens None defaults to what is left of the window (at least one token must fit).
    """
    completion = max_tokens if max_tokens is not None else max(1, max_model_len - prompt_len)
    if prompt_len + completion > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + completion} tokens ({prompt_len} in the messages, {completion} in the "
            "completion).",
            param=param, code="context_length_exceeded")
    return completion


def timeout_error(seconds: float) -> APIError:
    return APIError(504, f"The request did not finish within {seconds:g} seconds and was aborted.",
                    type="timeout", code="request_timeout")
