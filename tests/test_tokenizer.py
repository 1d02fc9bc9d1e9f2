"""Tokenizer and chat templates: equal to transformers' (GGUF and HF-folder tokenizers)."""
import json

import pytest

from pyengine.tokenizer import TemplateError, Tokenizer
from tests.model_helpers import default_model_path, gguf_folder_and_name

CORPUS = [
    "Hello world",
    "",
    " ",
    "  leading spaces\tand\ttabs\n\n\nnewlines   trailing   ",
    "Ünïcödé façade naïve — “quotes” … ¿qué? ß Ωμέγα Ελληνικά Кириллица",
    "emoji 😀🎉 👩‍👩‍👧 family, flags 🇫🇷🇯🇵, skin 👍🏽",
    "中文测试，日本語のテキスト、한국어 텍스트。",
    "def f(x):\n    return x**2  # comment\n\tif a != b: print(f'{a!r}')\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>a<repo_name>b<file_sep>c",
    "numbers 1234567 3.14159 0x1F 1e-5 ١٢٣",
    "\u00a0\u2003x\u200b y\r\nz",
    "i'm you'll they'VE it's DON'T",
    "    \n\n    indented\n" * 3,
]
MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello!"}, {"role": "user", "content": "Tell me a joke 😀"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    """transformers' tokenizer from the GGUF, with the pre-tokenizer of SmolLM2's own tokenizer.json
    (transformers' GGUF loader ignores `tokenizer.ggml.pre = smollm`, which splits digits one by one)."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    folder, name = gguf_folder_and_name()
    hf = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return hf


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.from_model_path(default_model_path())


@pytest.fixture(scope="module")
def hf_folder(hf_tokenizer, tmp_path_factory):
    """The same tokenizer saved as a HF folder (tokenizer.json, tokenizer_config.json, chat template)."""
    folder = tmp_path_factory.mktemp("hf_tok")
    hf_tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    return str(folder)


def _check_parity(tok: Tokenizer, hf) -> None:
    for text in CORPUS:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
        assert tok.decode(ids) == text  # byte-level BPE round-trips exactly


def _check_template(tok: Tokenizer, hf) -> None:
    for messages in MESSAGES:
        for gen in (True, False):
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)


def test_gguf_tokenizer_matches_transformers(ours, hf_tokenizer):
    _check_parity(ours, hf_tokenizer)
    assert ours.vocab_size == len(hf_tokenizer) == 49152
    assert ours.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert ours.eos_token_ids == [2]
    assert set(hf_tokenizer.all_special_ids) <= ours.all_special_ids


def test_gguf_chat_template_matches_transformers(ours, hf_tokenizer):
    _check_template(ours, hf_tokenizer)
    prompt = ours.apply_chat_template(MESSAGES[0])
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = ours.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> / <|im_end|> stay whole


def test_hf_folder_tokenizer(hf_folder, hf_tokenizer):
    tok = Tokenizer.from_model_path(hf_folder)
    _check_parity(tok, hf_tokenizer)
    _check_template(tok, hf_tokenizer)
    assert tok.eos_token_ids == [2, 0, 7]  # tokenizer eos, config.json list, generation_config.json


def test_template_semantics():
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                "{{ raise_exception('bad role ' + m['role']) }}{% endif %}{{ m['content'] | tojson }}{% endfor %}"
                "{% if add_generation_prompt %}>{% endif %}{{ eos_token }}")
    tok = Tokenizer.from_model_path(default_model_path())
    tok.chat_template, tok._template = template, None
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<|im_start|>"é">' + "<|im_end|>"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == (
        '<|im_start|>"x"<|im_end|>')
    with pytest.raises(TemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    tok.chat_template, tok._template = None, None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES[0])


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_model_path(str(tmp_path))

