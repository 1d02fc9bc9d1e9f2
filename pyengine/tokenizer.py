"""Tokenizers (HF tokenizer.json, or rebuilt from GGUF metadata) and chat templates (jinja2, HF semantics).

The GGUF builder mirrors transformers' GGUF tokenizer conversion (integrations/gguf/gguf_tokenizer_mapping.py)
so both produce the same ids: byte-level BPE for `gpt2` vocabularies, with the split regex the `pre` type
names (ByteLevel's own GPT-2 regex otherwise); SentencePiece-style BPE for `llama` vocabularies.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GGUF `tokenizer.ggml.pre` -> split regex (others, e.g. gpt2/smollm, use ByteLevel's GPT-2 regex).
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _gguf_tokenizer(meta) -> tuple[HFTokenizer, dict[str, Any]]:
    """A `tokenizers.Tokenizer` and tokenizer_config-like dict from GGUF metadata (meta(key) -> value)."""
    kind = meta("tokenizer.ggml.model")
    tokens: list[str] = list(meta("tokenizer.ggml.tokens"))
    types = list(meta("tokenizer.ggml.token_type") or [])
    merges = [tuple(m.split(" ", 1)) for m in (meta("tokenizer.ggml.merges") or [])]
    if kind == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
            for i, t in enumerate(tokens)
        }
        tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False))
        split = PRE_TOKENIZER_SPLITS.get(meta("tokenizer.ggml.pre"))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        tok.decoder = decoders.ByteLevel()
        special_ok = lambda t: set(t) <= alphabet  # noqa: E731  (llama.cpp mislabels some; transformers skips them)
        add_bos_default = False
    elif kind == "llama":
        if not merges:
            raise ValueError("GGUF sentencepiece vocabulary without merges is not supported")
        vocab = {t: i for i, t in enumerate(tokens)}
        unk_id = meta("tokenizer.ggml.unknown_token_id")
        tok = HFTokenizer(models.BPE(vocab, merges, unk_token=tokens[unk_id] if unk_id is not None else None,
                                     fuse_unk=True, byte_fallback=True))
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
        special_ok = lambda t: True  # noqa: E731
        add_bos_default = True
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama)")
    specials = [AddedToken(t, normalized=False, special=True)
                for t, ty in zip(tokens, types) if ty == _CONTROL and special_ok(t)]
    tok.add_special_tokens(specials)
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def name(key: str) -> str | None:
        i = meta(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {
        "bos_token": name("bos"),
        "eos_token": name("eos"),
        "unk_token": name("unknown"),
        "pad_token": name("padding"),
        "add_bos_token": meta("tokenizer.ggml.add_bos_token", add_bos_default),
        "add_eos_token": meta("tokenizer.ggml.add_eos_token", False),
        "chat_template": meta("tokenizer.chat_template"),
    }
    eos_ids = [meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    config["extra_eos_ids"] = [int(i) for i in eos_ids if i is not None]
    _set_post_processor(tok, config)
    return tok, config


def _set_post_processor(tok: HFTokenizer, config: dict[str, Any]) -> None:
    """BOS/EOS added by encode(add_special_tokens=True), as add_bos_token/add_eos_token say."""
    bos = config["bos_token"] if config.get("add_bos_token") else None
    eos = config["eos_token"] if config.get("add_eos_token") else None
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    special = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)


class Tokenizer:
    """encode/decode plus chat templates and the model's stop ids."""

    def __init__(self, tok: HFTokenizer, config: dict[str, Any], eos_ids: list[int], source: str):
        self._tok = tok
        self.source = source
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.bos_token_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        ids = list(eos_ids)
        if self.eos_token and tok.token_to_id(self.eos_token) is not None:
            ids.insert(0, tok.token_to_id(self.eos_token))
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.all_special_ids: set[int] = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self.all_special_ids |= {i for i in (self.bos_token_id, *self.eos_token_ids) if i is not None}
        self._special_tokens = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                                          "pad_token")}
        self._template = None

    @classmethod
    def from_model_path(cls, path: str) -> "Tokenizer":
        """From a .gguf file (its metadata) or a HF folder (tokenizer.json + tokenizer_config.json)."""
        if os.path.isfile(path):
            from pyengine.model.gguf import open_gguf

            gf = open_gguf(path)
            if gf.meta("tokenizer.ggml.tokens") is None:
                raise ValueError(f"{path}: GGUF file has no tokenizer metadata")
            try:
                tok, config = _gguf_tokenizer(gf.meta)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from exc
            return cls(tok, config, config.pop("extra_eos_ids"), path)
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_path):
            raise FileNotFoundError(f"{path}: no tokenizer.json in the model folder")
        tok = HFTokenizer.from_file(tok_path)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        for name in ("chat_template.jinja",):
            if template is None and os.path.exists(os.path.join(path, name)):
                with open(os.path.join(path, name)) as f:
                    template = f.read()
        if template is None:
            template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
        config["chat_template"] = template
        eos: list[int] = []
        for name in ("config.json", "generation_config.json"):
            value = _read_json(os.path.join(path, name)).get("eos_token_id")
            eos += [int(v) for v in (value if isinstance(value, list) else [value] if value is not None else [])]
        return cls(tok, config, eos, path)

    # The *_batch calls release the GIL while they work (encode/decode do not), so a long text
    # tokenized in a worker thread does not stop the other threads (the server's event loop).
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        if len(ids) < 1024:  # the common case, incremental detokenization: the cheaper call
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the model's template (transformers semantics); extra kwargs reach the template."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: this model has no chat template; send a plain prompt instead")
        if self._template is None:
            self._template = _compile(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{**self._special_tokens, **kwargs})


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


class TemplateError(ValueError):
    """raise_exception() inside a chat template."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _compile(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
