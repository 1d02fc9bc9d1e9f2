"""Offline API: LLM(model).generate(prompts, params) -> full outputs, in input order."""
from __future__ import annotations

import itertools
from typing import Sequence

from tqdm.auto import tqdm

from pyengine.config import EngineConfig
from pyengine.engine.engine import Engine
from pyengine.engine.output import CompletionOutput, RequestOutput
from pyengine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **config) -> None:
        self._attach(Engine(EngineConfig(model=model, **config)))

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        self = cls.__new__(cls)
        self._attach(engine)
        return self

    def _attach(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        items = [(p, None) for p in prompts]
        return self._run(items, sampling_params, use_tqdm, priority)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        items = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm, None)

    def _run(self, items, sampling_params, use_tqdm, priority) -> list[RequestOutput]:
        n = len(items)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * n if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {n} prompts but {len(params)} sampling params")
        engine = self.engine
        batch = next(self._ids)
        rids = [f"{batch}-{i}" for i in range(n)]
        results: dict[str, RequestOutput] = {}
        try:
            for i, (rid, (prompt, ids), p) in enumerate(zip(rids, items, params)):
                engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0, prompt_token_ids=ids)
            bar = tqdm(total=n, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
            with bar:
                while engine.has_unfinished():
                    for out in engine.step():
                        _merge(results, out)
                        if out.finished:
                            bar.update(1)
        finally:
            for rid in rids:  # an exception or interrupt must not leave blocks held
                if rid in engine.groups:
                    engine.abort_request(rid)
        return [results[rid] for rid in rids]


def _merge(results: dict[str, RequestOutput], delta: RequestOutput) -> None:
    """Accumulate a delta RequestOutput into the full one."""
    full = results.get(delta.request_id)
    if full is None:
        full = results[delta.request_id] = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids,
                                                         [], False, None)
    by_index = {c.index: c for c in full.outputs}
    for d in delta.outputs:
        c = by_index.get(d.index)
        if c is None:
            c = CompletionOutput(d.index, "", [], logprobs=[] if d.logprobs is not None else None)
            full.outputs.append(c)
            by_index[d.index] = c
        c.text += d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs:
            c.logprobs.extend(d.logprobs)
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        c.cumulative_logprob = d.cumulative_logprob
    full.outputs.sort(key=lambda c: c.index)
    full.finished = delta.finished
    full.metrics = delta.metrics
    full.error = delta.error
    if delta.prompt_logprobs is not None:
        full.prompt_logprobs = delta.prompt_logprobs
