"""Fixtures shared by several test modules: the default model loaded once per session, as our fp32
model, as our bf16 model on its quantized weights, and as the independent transformers reference on
the same weights. And the Hypothesis profile: no example database, so no test writes into the checkout."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
from hypothesis import settings

from tests.model_helpers import gguf_folder_and_name

# Hypothesis keeps failing examples (and a cache of the source's constants) in .hypothesis/ under the
# working directory, the checkout, by default: the database is off (a failure still prints its example
# and a @reproduce_failure blob) and its other files go to a folder in the system's tmp directory.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "pyengine-hypothesis"))
settings.register_profile("pyengine", database=None, print_blob=True)
settings.load_profile("pyengine")


@pytest.fixture(scope="session", autouse=True)
def _data_dir(tmp_path_factory):
    """`python -m server` keeps its conversation store under the user's data directory: the tests'
    servers get a throwaway one instead of the home directory's."""
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def hf_model():
    """transformers' Llama on the default GGUF's weights (dequantized to fp32): the reference."""
    from transformers import AutoModelForCausalLM

    folder, name = gguf_folder_and_name()
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def real_parts():
    """(model config, our fp32 model with its weights dequantized, tokenizer, name): Engine(parts=...)
    builds engines on it without loading the weights again."""
    from pyengine.model.loader import load_model, resolve_model_path
    from pyengine.tokenizer import Tokenizer

    path = resolve_model_path(None)
    cfg, model = load_model(path, torch.float32, torch.device("cpu"), weights="dequantize")
    return cfg, model, Tokenizer.from_model_path(path), "smollm2-135m"


@pytest.fixture(scope="session")
def bf16_parts():
    """(model config, our bf16 model on the GGUF's quantized weights, tokenizer, name): what the server
    runs by default (steps in decoder_layers). Shared, like real_parts: tests build engines on it and
    must not change the model."""
    from pyengine.model.loader import load_model, resolve_model_path
    from pyengine.tokenizer import Tokenizer

    path = resolve_model_path(None)
    cfg, model = load_model(path, torch.bfloat16, torch.device("cpu"))
    return cfg, model, Tokenizer.from_model_path(path), "smollm2-135m"
