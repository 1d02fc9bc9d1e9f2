"""Speculative decoding with a draft model: a smaller model with the target's vocabulary proposes its greedy
continuation of each request, and the engine verifies those drafts as it does n-gram drafts (spec_decode.py:
the request's last token and its k drafts are rows of the next step; NgramSpeculator.verify keeps them).

The draft model has its own KV cache, block pool (no prefix caching) and ModelRunner: the target's forward
code over other weights. For each request it drafts for, a _DraftSeq holds the tokens the draft has seen and
the blocks of their KV. After each step, propose():
  1. frees the draft blocks of every request that no longer runs (finished, aborted, preempted);
  2. rolls each drafting request's draft cache back to the longest prefix its tokens share with the
     request's (the accepted drafts stay, the rejected ones go) and returns the blocks it no longer needs;
  3. runs the draft model over the tokens it has not computed (the prompt the first time, later what
     verification appended), in chunks of at most max_num_batched_tokens, and takes the argmax at each
     request's last token: its first draft; then k - 1 one-token passes, batched across the requests, each
     computing the previous draft and taking the argmax of the next. So k draft passes a step.

Exactness: a greedy draft x is a point mass q. For it, the verification rule (keep x iff the target's sample at
its position is x; otherwise that sample) is rejection sampling: accept with probability min(1, p(x)/q(x)) =
p(x), and on rejection draw from the residual max(0, p - q) normalised, which is p without x, the target's own
draw given that it is not x. Every output token is therefore distributed as the target's alone; in fact it is
the non-speculative engine's draw at that position (greedy or seeded), so the output is the same token for
token. A sampled (non-greedy) draft would need the full rule with q; greedy drafts do not.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pyengine.config import EngineConfig, ModelConfig
from pyengine.dtypes import cache_dtype_of
from pyengine.engine.block_pool import BlockPool
from pyengine.engine.request import Request, RequestStatus
from pyengine.engine.spec_decode import NgramSpeculator, SpecState, accepted_prefix
from pyengine.model.metadata import allocate_kv_caches

log = logging.getLogger("pyengine.engine")


def check_vocabulary(target_config: ModelConfig, target_tokenizer, draft_config: ModelConfig, draft_tokenizer,
                     draft_path: str) -> None:
    """Raise ValueError unless the draft's token ids mean what the target's do: the same vocabulary size and,
    where both tokenizers list their vocabulary, the same token for every id."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative draft model {draft_path} has a vocabulary of {draft_config.vocab_size} "
                         f"tokens, the target model {target_config.vocab_size}; a draft model must use the "
                         f"target's tokenizer")
    target_vocab = getattr(target_tokenizer, "get_vocab", None)
    draft_vocab = getattr(draft_tokenizer, "get_vocab", None)
    if target_vocab is None or draft_vocab is None:
        return
    t, d = target_vocab(), draft_vocab()
    differ = [tok for tok, i in d.items() if t.get(tok) != i]
    if differ or len(t) != len(d):
        example = f" (token {differ[0]!r}: id {d[differ[0]]} in the draft, {t.get(differ[0])} in the target)" \
            if differ else ""
        raise ValueError(f"speculative draft model {draft_path} has different token ids from the target "
                         f"model{example}; a draft model must use the target's tokenizer")


@dataclass
class _DraftSeq:
    """A request as the draft's runner sees it: the fields prepare_batch reads, and how far it is in step."""

    all_token_ids: list[int]  # the request's tokens as of the last proposal, then the drafts proposed after them
    num_synced: int = 0  # leading tokens known to equal the request's (its length at the last proposal)
    num_computed_tokens: int = 0  # leading tokens whose KV the draft's cache holds
    block_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # always empty: the draft verifies nothing


@dataclass
class _Batch:
    """A draft model step, shaped as the SchedulerOutput fields ModelRunner.logits reads."""

    reqs: list[_DraftSeq]
    num_new: list[int]
    sampling: list[bool]


class DraftModelSpeculator(NgramSpeculator):
    """Proposes each running request's next k tokens by the draft model's argmax; verifies as NgramSpeculator."""

    def __init__(self, config: EngineConfig, target_config: ModelConfig, target_tokenizer, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, max_model_len: int, metrics=None) -> None:
        """Loads config.speculative.model (in the target's dtype and weights mode) and gives it a KV pool of
        num_blocks blocks, as many tokens as the target's pool holds."""
        from pyengine.model.loader import load_model, resolve_model_path
        from pyengine.model.runner import ModelRunner
        from pyengine.tokenizer import Tokenizer

        super().__init__(config.speculative, metrics)
        path = resolve_model_path(config.speculative.model)
        self.model_config, model = load_model(path, dtype, device, config.weights)
        try:
            draft_tokenizer = Tokenizer.from_model_path(path)
        except (FileNotFoundError, ValueError):  # a checkpoint without a tokenizer: only the sizes are compared
            draft_tokenizer = None
        check_vocabulary(target_config, target_tokenizer, self.model_config, draft_tokenizer, path)
        if self.model_config.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative draft model {path} takes {self.model_config.max_position_embeddings} "
                             f"positions, fewer than max_model_len {max_model_len}; lower max_model_len")
        bs = config.block_size
        kv_caches = allocate_kv_caches(self.model_config, num_blocks, bs, cache_dtype_of(config, dtype), device,
                                       config.kv_cache_prefault)
        self.pool = BlockPool(num_blocks, bs, False)
        self.runner = ModelRunner(model, kv_caches, block_size=bs, max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_model_len=max_model_len, vocab_size=self.model_config.vocab_size,
                                  eos_ids=[], device=device)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.seqs: dict[Request, _DraftSeq] = {}
        log.info("speculative draft model %s: %d drafts a step, %d KV blocks", path,
                 config.speculative.num_speculative_tokens, num_blocks)

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids of each running request that decodes next and may speculate (none while more
        than disable_by_batch_size sequences run) to the draft model's greedy next tokens."""
        live = set(running)
        for req in [r for r in self.seqs if r not in live]:
            self.pool.free_blocks(self.seqs.pop(req).block_ids)
        cfg = self.config
        off = len(running) > cfg.disable_by_batch_size
        drafting: list[tuple[Request, _DraftSeq, int]] = []
        for req in running:
            req.spec_token_ids = []
            if off or req.status is not RequestStatus.RUNNING or req.num_computed_tokens != req.num_tokens - 1:
                continue
            # every draft accepted still leaves room for the token sampled after them
            k = min(cfg.num_speculative_tokens, req.max_total_tokens - req.num_tokens - 1)
            if k <= 0:
                continue
            seq = self._sync(req, k)
            if seq is None:  # the draft's pool is full: this request decodes one token
                continue
            if req.spec is None:  # the counters verify() keeps; k stays num_speculative_tokens
                req.spec = SpecState(cfg.num_speculative_tokens)
            drafting.append((req, seq, k))
        if not drafting:
            return
        self._first_drafts([seq for _, seq, _ in drafting])
        for i in range(1, max(k for _, _, k in drafting)):
            batch = [seq for _, seq, k in drafting if k > i]
            self._run(batch, [1] * len(batch))
        for req, seq, k in drafting:
            drafts = seq.all_token_ids[req.num_tokens : req.num_tokens + k]
            # under a grammar, cut at the first draft it refuses (verification masks each row as well)
            req.spec_token_ids = drafts if req.grammar is None else accepted_prefix(req.grammar, drafts)

    def _sync(self, req: Request, k: int) -> _DraftSeq | None:
        """The request's draft state rolled back to what its tokens share with the request's, the request's
        new tokens appended, and blocks for its tokens and k - 1 drafts; None when the pool lacks them."""
        toks, n = req.all_token_ids, req.num_tokens
        seq = self.seqs.get(req)
        if seq is None:
            seq = self.seqs[req] = _DraftSeq(list(toks))
        else:
            # Verification keeps the drafts up to the first rejected one, whose position now holds the request's
            # last token, always computed again (for the logits of the first draft). A request that decoded
            # without drafts since (speculation off, the pool full) may differ from the cached drafts earlier:
            # compare from the last sync.
            end = min(seq.num_computed_tokens, n - 1)
            keep = min(seq.num_synced, end)
            while keep < end and seq.all_token_ids[keep] == toks[keep]:
                keep += 1
            del seq.all_token_ids[keep:]
            seq.all_token_ids += toks[keep:]
            seq.num_computed_tokens = keep
        seq.num_synced = n
        need = -(-(n + k - 1) // self.pool.block_size)  # the last draft is sampled, never computed
        have = len(seq.block_ids)
        if have > need:
            self.pool.free_blocks(seq.block_ids[need:])
            del seq.block_ids[need:]
        elif need > have:
            if need - have > self.pool.num_free:
                return None
            seq.block_ids += self.pool.allocate(need - have)
        return seq

    def _first_drafts(self, seqs: list[_DraftSeq]) -> None:
        """Compute each sequence's tokens not in the draft's cache, at most max_num_batched_tokens a pass, and
        append the argmax after its last."""
        pending = seqs
        while pending:
            batch, num_new, budget = [], [], self.max_num_batched_tokens
            for seq in pending:
                if budget == 0:
                    break
                take = min(len(seq.all_token_ids) - seq.num_computed_tokens, budget)
                batch.append(seq)
                num_new.append(take)
                budget -= take
            self._run(batch, num_new)
            pending = [seq for seq in pending if len(seq.all_token_ids) == seq.num_synced]

    def _run(self, batch: list[_DraftSeq], num_new: list[int]) -> None:
        """One draft model pass computing num_new[i] tokens of batch[i]; each sequence whose tokens are all
        computed then gets the argmax of its last row appended."""
        sampling = [seq.num_computed_tokens + m == len(seq.all_token_ids) for seq, m in zip(batch, num_new)]
        logits = self.runner.logits(_Batch(batch, num_new, sampling))
        # numpy's argmax on a CPU row of logits is much cheaper than torch's (as in ModelRunner.sample)
        ids = (logits.numpy() if logits.device.type == "cpu" else logits).argmax(-1).tolist()
        drafts = iter(ids)
        for seq, m, samples in zip(batch, num_new, sampling):
            seq.num_computed_tokens += m
            if samples:
                seq.all_token_ids.append(next(drafts))
