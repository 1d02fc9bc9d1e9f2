"""Tokenizers (HF tokenizer.json, or rebuilt from GGUF metadata by `gguf_tokenizer`) and chat templates
(jinja2, HF semantics)."""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from pyengine.gguf_tokenizer import gguf_tokenizer


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


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
                tok, config = gguf_tokenizer(gf.meta)
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

    def get_vocab(self) -> dict[str, int]:
        """Every token (added ones included) and its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the model's template (transformers semantics); extra kwargs reach the template."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: this model has no chat template; send a plain prompt instead")
        if self._template is None:
            self._template = _compile(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{**self._special_tokens, **kwargs})


    def info(self, max_model_len: int | None = None) -> dict[str, Any]:
        """The tokenizer's settings as transformers' tokenizer_config.json names them: what the
        server's /tokenizer_info answers (lm-eval's "remote" tokenizer reads eos_token, bos_token and
        chat_template from it) and what save_pretrained writes."""
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self._special_tokens,
                                  "chat_template": self.chat_template, "clean_up_tokenization_spaces": False}
        if max_model_len is not None:
            config["model_max_length"] = max_model_len
        return config

    def save_pretrained(self, folder: str, max_model_len: int | None = None) -> list[str]:
        """Write this tokenizer as a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json,
        special_tokens_map.json, chat_template.jinja), which transformers' AutoTokenizer loads, so that
        tools that want a tokenizer on disk (guidellm, aiperf, lm-eval) encode as the server does.
        Returns the files written."""
        os.makedirs(folder, exist_ok=True)
        config = self.info(max_model_len)
        template = config.pop("chat_template")
        files = {"tokenizer_config.json": config,
                 "special_tokens_map.json": {k: v for k, v in self._special_tokens.items() if v is not None}}
        written = []
        self._tok.save(os.path.join(folder, "tokenizer.json"))
        written.append("tokenizer.json")
        for name, obj in files.items():
            with open(os.path.join(folder, name), "w") as f:
                json.dump(obj, f, indent=2, ensure_ascii=False)
            written.append(name)
        if template:
            with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
                f.write(template)
            written.append("chat_template.jinja")
        return written


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


def main(argv: list[str] | None = None) -> int:
    """`python -m pyengine.tokenizer export OUT_DIR [--model PATH]`: the served model's tokenizer as a
    Hugging Face folder, for clients that need `--tokenizer DIR`."""
    import argparse

    from pyengine.model.loader import resolve_model_path

    p = argparse.ArgumentParser(prog="python -m pyengine.tokenizer",
                                description="Write a model's tokenizer as a Hugging Face tokenizer folder.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write tokenizer.json, tokenizer_config.json and the chat template")
    e.add_argument("out", help="folder to write (created if missing)")
    e.add_argument("--model", default=None, help="HF model folder or .gguf file; omitted: the bundled default model")
    e.add_argument("--max-model-len", type=int, default=None, help="model_max_length to record")
    args = p.parse_args(argv)
    tok = Tokenizer.from_model_path(resolve_model_path(args.model))
    for name in tok.save_pretrained(args.out, args.max_model_len):
        print(os.path.join(args.out, name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
