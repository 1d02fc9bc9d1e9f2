"""Stand-ins that drive the real Engine without a real model (fast plumbing tests).

PagedEchoModel writes each (token id, position) into its K and V cache slots (through the real
reshape_and_cache) and predicts the next token from the whole context read back through the block
tables: any error in slot mapping, block tables, prefix-cache reuse or preemption changes the output.
"""
from __future__ import annotations

import torch

from pyengine.config import EngineConfig, ModelConfig
from pyengine.engine.engine import Engine
from pyengine.ops.attention import from_cache_layout
from pyengine.ops.cache import reshape_and_cache

VOCAB = 500
EOS = 2


def next_token(ctx: list[int]) -> int:
    h = sum((i + 1) * t for i, t in enumerate(ctx)) * 31 + len(ctx)
    return 3 + h % (VOCAB - 3)


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks))
    return toks[len(prompt):]


class PagedEchoModel(torch.nn.Module):
    def weight_bytes(self) -> int:
        return 0

    def forward(self, input_ids, positions, kv_caches, meta, logits_indices, interrupt=None):
        kv = kv_caches[0]
        rows = torch.stack([input_ids.float(), positions.float()], -1).view(-1, 1, 2)  # (token id, position)
        reshape_and_cache(rows, rows, kv.k, kv.v, meta.slot_mapping)
        if interrupt is not None:  # as a real model may stop: after some of the step's KV writes
            interrupt.check()
        k, v = from_cache_layout(kv.k, kv.v)
        bs = k.shape[2]
        qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        assert len(seq_lens) == meta.block_tables.shape[0] and max(seq_lens) == meta.max_seq_len
        seq_of = [s for s in range(len(seq_lens)) for _ in range(qsl[s + 1] - qsl[s])]
        rows = range(len(input_ids)) if logits_indices is None else logits_indices.tolist()  # None: every row
        logits = torch.full((len(rows), VOCAB), -30.0)
        for i, idx in enumerate(rows):  # causal: a row sees its sequence's positions up to its own
            s = seq_of[idx]
            n = seq_lens[s] - (qsl[s + 1] - 1 - idx)
            blocks = meta.block_tables[s, : -(-n // bs)].long()
            ctx = k[blocks, 0].reshape(-1, 2)[:n]
            assert ctx[:, 1].long().tolist() == list(range(n)), "positions/slots mismatch"
            assert torch.equal(v[blocks, 0].reshape(-1, 2)[:n], ctx), "K and V caches disagree"
            nxt = next_token(ctx[:, 0].long().tolist())
            logits[i] = -0.5 * (torch.arange(VOCAB) - nxt).abs().float()
            logits[i, nxt] = 5.0
        return logits


class FakeTokenizer:
    eos_token_ids = [EOS]
    bos_token_id = 1
    vocab_size = VOCAB
    all_special_ids = {0, 1, 2}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [3 + ord(c) % (VOCAB - 3) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i % 26) if i > 2 else ("" if skip_special_tokens else "<s>") for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "|".join(m["content"] for m in messages) + (">" if add_generation_prompt else "")


def fake_engine(kv_tokens: int = 4096, **config) -> Engine:
    cfg = ModelConfig(architecture="PagedEcho", vocab_size=VOCAB, hidden_size=1, intermediate_size=1,
                      num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=2,
                      max_position_embeddings=8192, eos_token_ids=[EOS])
    block_size = config.get("block_size", 16)
    config.setdefault("kv_cache_memory", kv_tokens * 16 + block_size * 16 - 1)  # 16 bytes per token
    config.setdefault("max_model_len", min(kv_tokens, cfg.max_position_embeddings))
    config.setdefault("dtype", "float32")
    return Engine(EngineConfig(**config), parts=(cfg, PagedEchoModel(), FakeTokenizer(), "paged-echo"))


def abort_while_speculating(engine) -> tuple[str, list[str]]:
    """Aborts a running request whose drafts wait for their step (queued, as a client that left), and makes
    the next forward pass abort another speculating one while that step runs. Returns the first's id and
    the list the second's id lands in."""
    queued = next(r.parent_id for r in engine.scheduler.running if r.spec_token_ids)
    engine.queue_abort(queued)
    model = engine.runner.model
    aborted: list[str] = []

    def forward_then_abort(*args, **kwargs):
        out = model(*args, **kwargs)
        for r in list(engine.scheduler.running):
            if r.spec_token_ids and not aborted:
                aborted.append(r.parent_id)
                engine.abort_request(r.parent_id)
        return out

    engine.runner.model = forward_then_abort
    return queued, aborted
