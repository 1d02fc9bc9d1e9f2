"""ModelRunner: one flat batch per step -> forward -> penalties -> sample.

The step arrays live in numpy buffers allocated once (sized for max_num_batched_tokens tokens and
max_num_seqs sequences) and are filled by Cython loops (pyengine.model.batch.prepare_batch /
prepare_sampling); torch tensors are zero-copy views of them on CPU, one copy each on CUDA.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pyengine.interrupt import StepInterrupt
from pyengine.model.batch import prepare_batch, prepare_sampling
from pyengine.model.cuda_graphs import DecodeGraphs
from pyengine.model.metadata import AttentionMetadata, KVCache
from pyengine.ops.sampling import apply_penalties, sample
from pyengine.output_types import TokenLogprob


@dataclass
class StepResult:
    token_ids: list[int]  # one per logits row (1 + k for a sequence verifying k drafts), in scheduler order
    logprobs: list[float] | None = None  # sampled token's logprob per row
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # requests that asked for prompt logprobs: (request, TokenLogprobs of its next prompt tokens)
    prompt_logprobs: list[tuple[object, list[TokenLogprob]]] | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], *, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 vocab_size: int, eos_ids: list[int], device: torch.device,
                 cuda_graphs: bool = False, tensor_cores: bool = False) -> None:
        """cuda_graphs: decode-only steps replay captured CUDA graphs (model/cuda_graphs.py; captured here).
        tensor_cores: CUDA steps with prompt chunks run the tensor-core attention kernel."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        T, S = max_num_batched_tokens, max_num_seqs
        R = max(T, S)  # sampled rows: one per sequence, 1 + k for a sequence verifying k drafts
        max_blocks = -(-max_model_len // block_size)
        self.np = {
            "input_ids": np.zeros(T, np.int64), "positions": np.zeros(T, np.int64),
            "slot_mapping": np.zeros(T, np.int64), "seq_lens": np.zeros(S, np.int32),
            "query_start_loc": np.zeros(S + 1, np.int32), "block_tables": np.zeros(S * max_blocks, np.int32),
            "logits_indices": np.zeros(R, np.int64),
            "temperature": np.zeros(R, np.float32), "top_k": np.zeros(R, np.int32),
            "top_p": np.zeros(R, np.float32), "min_p": np.zeros(R, np.float32),
            "seeds": np.zeros(R, np.int64), "steps": np.zeros(R, np.int64),
        }
        self.t = {k: torch.from_numpy(v) for k, v in self.np.items()}
        self.structured = None  # pyengine.structured.StructuredOutputs, set by the engine when first needed
        self._bitmask: torch.Tensor | None = None  # [max_num_seqs, ceil(vocab/32)] int32, CPU
        self.mask_time = 0.0  # seconds spent filling grammar bitmasks (all steps)
        self.tensor_cores = tensor_cores
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(model, kv_caches, max_num_seqs=S, max_model_len=max_model_len,
                                       block_size=block_size, vocab_size=vocab_size, device=device)
            self.graphs.capture()

    def _dev(self, name: str, n: int) -> torch.Tensor:
        t = self.t[name][:n]
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, out, interrupt: StepInterrupt | None = None) -> StepResult | None:
        """Run one SchedulerOutput; returns the sampled tokens (None if no sequence samples). With an
        interrupt, raises StepInterrupted if it is set before the model's last layer."""
        b = self.np
        T, max_blocks, max_seq_len, nl = prepare_batch(
            out, self.block_size, b["input_ids"], b["positions"], b["slot_mapping"], b["seq_lens"],
            b["query_start_loc"], b["block_tables"], b["logits_indices"])
        S = len(out.reqs)
        plan = self._prompt_logprob_plan(out)
        logits = None
        if self.graphs is not None and T == S == nl and not plan:  # decode only: one token per sequence
            logits = self.graphs.run(S, b["input_ids"], b["positions"], b["slot_mapping"], b["seq_lens"],
                                     b["block_tables"][: S * max_blocks].reshape(S, max_blocks))
        if logits is None:
            logits = self._forward(T, S, max_blocks, max_seq_len, nl, plan, interrupt)
        # one per logits row: a sequence verifying k drafts has 1 + k rows; row i samples the token after its
        # first i drafts (offsets[row] = i)
        reqs = [r for r, s in zip(out.reqs, out.sampling) if s for _ in range(1 + len(r.spec_token_ids))]
        offsets = [i for r, s in zip(out.reqs, out.sampling) if s for i in range(1 + len(r.spec_token_ids))]
        # On CUDA the forward pass is still running: the grammar masks are filled meanwhile.
        bitmask = self._fill_bitmask(reqs) if self.structured is not None else None
        prompt = self._prompt_logprobs(logits[nl:], plan) if plan else None
        if nl == 0:
            return StepResult([], prompt_logprobs=prompt) if prompt else None
        result = self.sample(logits[:nl], reqs, bitmask, offsets if any(offsets) else None)
        result.prompt_logprobs = prompt
        return result

    @torch.inference_mode()
    def logits(self, out) -> torch.Tensor:
        """The model's logits at the sampling rows of a SchedulerOutput-like batch (reqs, num_new, sampling),
        nothing sampled: a draft model's step (pyengine/engine/draft_model.py)."""
        b = self.np
        T, max_blocks, max_seq_len, nl = prepare_batch(
            out, self.block_size, b["input_ids"], b["positions"], b["slot_mapping"], b["seq_lens"],
            b["query_start_loc"], b["block_tables"], b["logits_indices"])
        return self._forward(T, len(out.reqs), max_blocks, max_seq_len, nl, None)

    def _forward(self, T: int, S: int, max_blocks: int, max_seq_len: int, nl: int, plan,
                 interrupt: StepInterrupt | None = None) -> torch.Tensor:
        """The model, eagerly, over the step in the host buffers: logits of the nl sampling rows, then of
        the planned prompt-logprob rows. A decode-only step (one token per sequence, each sampled) passes no
        row indices and no query-length reduction: at batch 1 each small host op costs tens of microseconds."""
        bt = self.t["block_tables"][: S * max_blocks].view(S, max_blocks)
        decode = T == S == nl and not plan
        meta = AttentionMetadata(
            slot_mapping=self._dev("slot_mapping", T),
            block_tables=bt if self.device.type == "cpu" else bt.to(self.device, non_blocking=True),
            seq_lens=self._dev("seq_lens", S), query_start_loc=self._dev("query_start_loc", S + 1),
            max_seq_len=max_seq_len,
            max_query_len=1 if T == S else int(np.diff(self.np["query_start_loc"][: S + 1]).max(initial=1)),
            tensor_cores=self.tensor_cores)
        indices = None if decode else self._dev("logits_indices", nl)
        if plan:
            rows = torch.tensor([r for _, rs, _ in plan for r in rs], dtype=torch.int64, device=self.device)
            indices = torch.cat([indices, rows])
        return self.model(self._dev("input_ids", T), self._dev("positions", T), self.kv_caches, meta, indices,
                          interrupt=interrupt)

    def _prompt_logprob_plan(self, out) -> list[tuple[object, list[int], list[int]]]:
        """(request, logits rows, target tokens) for the prompt tokens whose logprobs this step can give:
        token j's comes from the row of position j - 1, for j not yet done (recomputes after a
        preemption skip them)."""
        plan = []
        qsl, seq_lens = self.np["query_start_loc"], self.np["seq_lens"]
        for s, req in enumerate(out.reqs):
            done = req.prompt_logprobs
            if done is None or len(done) >= req.num_prompt_tokens:
                continue
            q0, n = int(qsl[s]), int(qsl[s + 1] - qsl[s])
            start = int(seq_lens[s]) - n
            first, end = max(len(done), start + 1), min(req.num_prompt_tokens, start + n + 1)
            if end > first:
                plan.append((req, [q0 + j - 1 - start for j in range(first, end)], req.all_token_ids[first:end]))
        return plan

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, plan) -> list[tuple[object, list[TokenLogprob]]]:
        """log_softmax of the raw logits (as for sampled tokens) at each planned row: the target's, and the top N."""
        k = max(req.params.prompt_logprobs for req, _, _ in plan)
        targets = torch.tensor([t for _, _, ts in plan for t in ts], dtype=torch.int64, device=logits.device)
        chosen, top_lp, top_ids = [], [], []
        for r0 in range(0, len(targets), 256):  # [rows, vocab] fp32 a slice at a time, not a second full copy
            lp = torch.log_softmax(logits[r0 : r0 + 256].float(), dim=-1)
            chosen += lp.gather(1, targets[r0 : r0 + 256, None])[:, 0].tolist()
            if k:
                values, ids = lp.topk(k, dim=-1)
                top_lp += values.tolist()
                top_ids += ids.tolist()
        result, row = [], 0
        for req, rows, ts in plan:
            n = req.params.prompt_logprobs
            entries = []
            for t in ts:
                top = list(zip(top_ids[row][:n], top_lp[row][:n])) if n else []
                entries.append(TokenLogprob(t, chosen[row], top))
                row += 1
            result.append((req, entries))
        return result

    def _fill_bitmask(self, reqs: list) -> torch.Tensor | None:
        """The sampling rows' grammar bitmask on the logits' device, or None when no row has a grammar."""
        if not reqs:
            return None
        t0 = time.perf_counter()
        if self._bitmask is None:
            self._bitmask = self.structured.new_bitmask(len(self.np["temperature"]))
        mask = self.structured.fill_bitmask(reqs, self._bitmask)
        self.mask_time += time.perf_counter() - t0
        if mask is None or self.device.type == "cpu":
            return mask
        return mask.to(self.device, non_blocking=True)

    def sample(self, logits: torch.Tensor, reqs: list, bitmask: torch.Tensor | None = None,
               offsets: list[int] | None = None) -> StepResult:
        """Penalties, logit_bias and min_tokens in place on logits, then the native sampler (under the
        grammar bitmask, when given). offsets (speculative decoding): per row, how many of its request's
        drafts come before the token it samples; that row is sampled as the request's step that many
        tokens later (its seed's draw, penalties and min_tokens of that output), so a verified draft is kept
        exactly when it is the token the non-speculative engine would have drawn there."""
        b = self.np
        n = len(reqs)
        all_greedy, any_pen, max_lp = prepare_sampling(
            reqs, b["temperature"], b["top_k"], b["top_p"], b["min_p"], b["seeds"], b["steps"])
        if offsets is not None:
            b["steps"][:n] += np.asarray(offsets, np.int64)
        if any_pen:
            self._apply_penalties(logits, reqs, offsets)
        self._apply_logit_bias(logits, reqs)
        self._mask_min_tokens(logits, reqs, offsets)
        if all_greedy and max_lp < 0 and bitmask is None:
            # numpy's argmax (the first maximum, as torch's) takes ~5 us on a CPU row of 49k logits, torch's ~90
            # (the models' logits are fp32)
            ids = logits.numpy().argmax(-1) if self.device.type == "cpu" else logits.argmax(dim=-1)
            return StepResult(ids.tolist())
        res = sample(logits, self._dev("temperature", n), self._dev("top_k", n), self._dev("top_p", n),
                     self._dev("min_p", n), self._dev("seeds", n), self._dev("steps", n),
                     num_logprobs=max_lp if max_lp >= 0 else None, bitmask=bitmask)
        result = StepResult(res.token_ids.tolist())
        if max_lp >= 0:
            result.logprobs = res.logprobs.tolist()
            if max_lp > 0:
                result.top_ids = res.top_ids.tolist()
                result.top_logprobs = res.top_logprobs.tolist()
        return result

    def _apply_penalties(self, logits: torch.Tensor, reqs: list, offsets: list[int] | None = None) -> None:
        prompt_parts, output_parts, pres, freq, rep = [], [], [], [], []
        for i, r in enumerate(reqs):
            p = r.params
            on = p.has_penalties
            prompt_parts.append(r.prompt_token_ids if on and p.repetition_penalty != 1.0 else ())
            drafts = r.spec_token_ids[: offsets[i]] if offsets else []  # the output this row samples after
            output_parts.append(r.output_token_ids + drafts if on else ())
            pres.append(p.presence_penalty)
            freq.append(p.frequency_penalty)
            rep.append(p.repetition_penalty)

        def csr(parts):
            lens = np.fromiter((len(x) for x in parts), np.int32, len(parts))
            offsets = np.zeros(len(parts) + 1, np.int32)
            np.cumsum(lens, out=offsets[1:])
            flat = np.fromiter((t for x in parts for t in x), np.int32, int(offsets[-1]))
            return torch.from_numpy(flat).to(self.device), torch.from_numpy(offsets).to(self.device)

        pi, po = csr(prompt_parts)
        oi, oo = csr(output_parts)
        f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=self.device)  # noqa: E731
        apply_penalties(logits, pi, po, oi, oo, f32(pres), f32(freq), f32(rep))

    def _apply_logit_bias(self, logits: torch.Tensor, reqs: list) -> None:
        """logits[row, id] += bias for each request's logit_bias, in one scatter-add."""
        parts = [(i, r.logit_bias) for i, r in enumerate(reqs) if r.logit_bias is not None]
        if not parts:
            return
        rows = np.concatenate([np.full(len(ids), i, np.int64) for i, (ids, _) in parts])
        cols = np.concatenate([ids for _, (ids, _) in parts])
        vals = np.concatenate([v for _, (_, v) in parts])
        dev = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        logits.index_put_((dev(rows), dev(cols)), dev(vals), accumulate=True)

    def _mask_min_tokens(self, logits: torch.Tensor, reqs: list, offsets: list[int] | None = None) -> None:
        """Below min_tokens, EOS and stop tokens cannot be sampled (vLLM semantics)."""
        for i, r in enumerate(reqs):
            p = r.params
            if p.min_tokens and r.num_output_tokens + (offsets[i] if offsets else 0) < p.min_tokens:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids)
                if ids:
                    logits[i, ids] = float("-inf")
