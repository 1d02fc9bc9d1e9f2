"""Token sampling (temperature, top-k, top-p, min-p, seeded Philox draws, logprobs) and penalties.

The filtering and drawing rules are documented at the top of native/cpu/sampling.cpp. In short:
min-p and top-k are logit thresholds on the temperature-scaled distribution, top-p is applied to
what they leave (renormalized), and the token is drawn by inverse CDF over the kept tokens with one
uniform from Philox4x32-10 keyed by (seed, step) — so a row's token depends only on its own logits,
parameters, seed and step, never on the batch around it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pyengine.ops._common import check_tensor, cuda_stream, native


@dataclass
class SampleResult:
    token_ids: torch.Tensor  # [B] int32
    logprobs: torch.Tensor | None  # [B] fp32, logprob of the sampled token (num_logprobs is not None)
    top_ids: torch.Tensor | None  # [B, N] int32, the N most likely tokens, best first (num_logprobs = N > 0)
    top_logprobs: torch.Tensor | None  # [B, N] fp32


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, *,
           num_logprobs: int | None = None, bitmask: torch.Tensor | None = None) -> SampleResult:
    """Sample one token per row of logits [B, V] fp32.

    temperature/top_p/min_p [B] fp32, top_k [B] int32 (<= 0: off), seeds/steps [B] int64.
    temperature 0 is exact argmax (ties to the lowest id); top_p in (0, 1] (1: off); min_p in [0, 1]
    (0: off); out-of-range values raise ValueError naming the row (checked natively on CPU).
    num_logprobs: None -> no logprobs; 0 -> the sampled token's; N > 0 -> also the top-N, where
    logprobs are log_softmax of the input logits (before temperature and filters).
    bitmask: None, or [B, ceil(V/32)] int32 on logits' device (bit j of word i set: token 32*i + j
    allowed; xgrammar's layout). Disallowed logits are set to -inf in place first, so the draw and
    the logprobs see the constrained distribution. Without a bitmask the logits are not modified.
    """
    check_tensor("logits", logits, dtypes=(torch.float32,), ndim=2)
    batch, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    dev = logits.device
    for name, t, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                           ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
                           ("seeds", seeds, torch.int64), ("steps", steps, torch.int64)):
        check_tensor(name, t, dtypes=(dtype,), shape=(batch,), device=dev)
    if num_logprobs is not None and (isinstance(num_logprobs, bool) or not isinstance(num_logprobs, int)
                                     or not 0 <= num_logprobs <= vocab):
        raise ValueError(f"num_logprobs must be None or an int in [0, {vocab}], got {num_logprobs!r}")
    if bitmask is not None:
        check_tensor("bitmask", bitmask, dtypes=(torch.int32,), shape=(batch, -(-vocab // 32)), device=dev)
    token_ids = torch.empty(batch, dtype=torch.int32, device=dev)
    logprobs = top_ids = top_logprobs = None
    num_top = 0
    if num_logprobs is not None:
        logprobs = torch.empty(batch, dtype=torch.float32, device=dev)
        if num_logprobs > 0:
            num_top = num_logprobs
            top_ids = torch.empty(batch, num_top, dtype=torch.int32, device=dev)
            top_logprobs = torch.empty(batch, num_top, dtype=torch.float32, device=dev)
    if batch:
        native(dev).sample(
            logits.data_ptr(), batch, vocab, temperature.data_ptr(), top_k.data_ptr(), top_p.data_ptr(),
            min_p.data_ptr(), seeds.data_ptr(), steps.data_ptr(), token_ids.data_ptr(),
            0 if logprobs is None else logprobs.data_ptr(), num_top,
            0 if top_ids is None else top_ids.data_ptr(), 0 if top_logprobs is None else top_logprobs.data_ptr(),
            0 if bitmask is None else bitmask.data_ptr(), cuda_stream(dev))
    return SampleResult(token_ids, logprobs, top_ids, top_logprobs)


def apply_penalties(logits: torch.Tensor, prompt_ids: torch.Tensor, prompt_offsets: torch.Tensor,
                    output_ids: torch.Tensor, output_offsets: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> None:
    """vLLM-style penalties, in place on logits [B, V] fp32.

    Row b's prompt tokens are prompt_ids[prompt_offsets[b]:prompt_offsets[b+1]] (int32 CSR, offsets
    [B+1] int32), likewise its output tokens. repetition [B] (> 0; 1 = off) divides positive and
    multiplies non-positive logits of tokens seen in the prompt or the output; then
    frequency * count + presence * (count > 0) is subtracted over output tokens only.
    Bad offsets/ids/penalty values raise ValueError (checked natively on CPU).
    """
    check_tensor("logits", logits, dtypes=(torch.float32,), ndim=2)
    batch, vocab = logits.shape
    dev = logits.device
    for name, ids, offsets in (("prompt", prompt_ids, prompt_offsets), ("output", output_ids, output_offsets)):
        check_tensor(f"{name}_ids", ids, dtypes=(torch.int32,), ndim=1, device=dev)
        check_tensor(f"{name}_offsets", offsets, dtypes=(torch.int32,), shape=(batch + 1,), device=dev)
    for name, t in (("presence", presence), ("frequency", frequency), ("repetition", repetition)):
        check_tensor(name, t, dtypes=(torch.float32,), shape=(batch,), device=dev)
    if batch:
        native(dev).apply_penalties(
            logits.data_ptr(), batch, vocab, prompt_ids.data_ptr(), prompt_ids.numel(), prompt_offsets.data_ptr(),
            output_ids.data_ptr(), output_ids.numel(), output_offsets.data_ptr(), presence.data_ptr(),
            frequency.data_ptr(), repetition.data_ptr(), cuda_stream(dev))
