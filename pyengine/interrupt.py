"""StepInterrupt: a flag that stops the model run in flight before its next layer.

A prompt that has the engine to itself is prefilled in large chunks (solo_prefill_tokens): they stall
nobody's decodes and cost less per token. A request that arrived during such a chunk would wait for all
of it. Instead the thread that queues the request (AsyncLLM) sets this flag; the model checks it before
each layer (decoder_layers reads it natively) and stops by raising StepInterrupted. The engine then
commits nothing of the step (a model run writes only KV slots that the rerun overwrites) and schedules
again, the newcomer now with it: the newcomer waits about one layer of the chunk, and the long prompt
computes that chunk again. The solo step right after an interrupted one is not interrupted, so arrivals
that leave the prompt alone again (a request aborted as soon as it came) cannot starve it.
"""
from __future__ import annotations

import numpy as np


class StepInterrupted(Exception):
    """The model run stopped on its StepInterrupt; nothing it computed is to be used."""


class StepInterrupt:
    def __init__(self) -> None:
        self._flag = np.zeros(1, dtype=np.int32)  # an int32 at a fixed address, read by native code

    @property
    def address(self) -> int:
        return self._flag.ctypes.data

    def set(self) -> None:
        """Thread-safe: the run in flight (if it was given this interrupt) stops before its next layer."""
        self._flag[0] = 1

    def clear(self) -> None:
        self._flag[0] = 0

    def check(self) -> None:
        if self._flag[0]:
            raise StepInterrupted
