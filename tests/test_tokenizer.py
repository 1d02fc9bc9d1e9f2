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
    from transformers import AutoTokenizer

    folder, name = gguf_folder_and_name()
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


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


def test_gguf_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """A `llama` (SentencePiece BPE with byte fallback) GGUF vocabulary, built by hand."""
    import gguf
    from transformers import AutoTokenizer

    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "s", "▁h", "el", "ll", "lo", "he", "hel", "hell",
             "hello", "▁hello", "▁w", "or", "▁wor", "▁worl", "▁world", "▁t", "es", "st", "▁te", "▁tes", "▁test"]
    merges = ["▁ h", "e l", "l l", "l o", "h e", "he l", "hel l", "hell o", "▁ hello", "▁ w", "o r", "▁w or",
              "▁wor l", "▁worl d", "▁ t", "e s", "s t", "▁t e", "▁te s", "▁tes t"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + words
    w = gguf.GGUFWriter(str(tmp_path / "sp.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(words))
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = Tokenizer.from_model_path(str(tmp_path / "sp.gguf"))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    for text in ["hello world", " hello  world test", "héllo wörld 😀", "test\nhello", "</s>hello<s>"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text) and ids[0] == 1
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.encode("hello world", add_special_tokens=False) == hf.encode("hello world", add_special_tokens=False)
