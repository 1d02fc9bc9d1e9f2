"""Model families: which Hugging Face architectures load, and how each one's config.json sets the
family fields of ModelConfig (everything else is read the same for all of them, in loader.py).

  Llama, Mistral, Qwen2   the base model (Mistral: a sliding window on every layer when set)
  Qwen3                   + RMSNorm of each q/k head before RoPE
  Phi-3                   fused qkv_proj / gate_up_proj (loaded as stored), a window when set
  Gemma 2                 GeGLU, embeddings x sqrt(hidden), (1 + w) RMSNorms, norms of the attention
                          and MLP outputs, sliding layers alternating with global ones, soft-capped
                          scores and logits, scale query_pre_attn_scalar^-1/2
  Gemma 3 (text)          Gemma 2 without soft-caps, + q/k norms, 5 sliding layers per global one,
                          the sliding layers with their own (local) RoPE base
"""
from __future__ import annotations

import math
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM",
)
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def rope_parameters(raw: dict[str, Any]) -> tuple[float, dict | None, float | None]:
    """(rope base, scaling dict or None, Gemma 3's local base or None) from config.json, in the
    transformers 5 layout (`rope_parameters`, per layer type for Gemma 3) or the older one
    (`rope_theta`, `rope_scaling`, `rope_local_base_freq`)."""
    rope = dict(raw.get("rope_parameters") or {})
    local = raw.get("rope_local_base_freq")
    if "full_attention" in rope:  # per layer type
        local = rope.get("sliding_attention", {}).get("rope_theta", local)
        rope = dict(rope["full_attention"])
    theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    scaling = raw.get("rope_scaling") or {
        k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    return theta, scaling, None if local is None else float(local)


def scaled_context(scaling: dict | None, max_pos: int) -> tuple[dict | None, int]:
    """YaRN and dynamic scaling stretch the pretrained context by `factor` (Qwen2.5's 128K configs keep
    max_position_embeddings at the original 32K): the scaling with its original length filled in, and
    the context the model serves (as vLLM derives it)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind not in ("yarn", "dynamic"):
        return scaling, max_pos
    scaling = {**scaling, "rope_type": kind}
    old_len = int(scaling.get("original_max_position_embeddings") or max_pos)
    scaling["original_max_position_embeddings"] = old_len
    return scaling, max(max_pos, int(old_len * scaling["factor"]))


def layer_types(arch: str, raw: dict[str, Any], num_layers: int) -> list[str] | None:
    """Which layers are sliding-window ones (None: all of them, when there is a window)."""
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    if arch == "Gemma2ForCausalLM":  # even layers slide
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if arch == "Gemma3ForCausalLM":
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and raw.get("use_sliding_window"):
        first = int(raw.get("max_window_layers", 0))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return None


def family_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig family fields of a supported architecture's config.json."""
    window = raw.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window"):
        window = None
    fields: dict[str, Any] = dict(
        sliding_window=int(window) if window else None,
        layer_types=layer_types(arch, raw, raw["num_hidden_layers"]) if window else None,
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
    )
    if arch in _GEMMA:
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma activation {act!r} is not supported (gelu_pytorch_tanh)")
        fields.update(
            hidden_act="gelu_pytorch_tanh", post_norms=True, embed_scale=math.sqrt(raw["hidden_size"]),
            norm_weight_offset=1.0, query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            attn_logit_softcap=raw.get("attn_logit_softcapping"),
            final_logit_softcap=raw.get("final_logit_softcapping"),
        )
    elif raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"activation {raw['hidden_act']!r} is not supported for {arch} (silu)")
    return fields
