"""The Llama family (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, SmolLM, TinyLlama) over the paged KV cache.

Per layer: add_rms_norm -> fused QKV GEMM (+bias) -> RoPE -> cache write -> paged attention ->
O GEMM -> add_rms_norm -> fused gate/up GEMM -> silu_and_mul -> down GEMM. The residual stream is
carried separately, in fp32 whatever the model's dtype, and updated in place by add_rms_norm; the norms
hand the projections their input in the model's dtype. (Rounding the stream to bf16 after every add was
the largest part of a bf16 model's distance from fp32: tests/test_kv_accuracy.py.) Everything derivable
is built at load: fused weights, the fp32 cos/sin caches, the split sizes, the attention scale. GGUF
projections, embedding and lm_head in a type with a native kernel stay quantized (QuantLinear) when the
loader asks for it. With an fp8/int8 KV cache, q, k and v pass through a Hadamard rotation per head after
RoPE (ops/layers.py: hadamard_heads), and the attention output through it again (it is its own inverse):
K and V are cached rotated, and their rounding costs attention less. An fp8 cache also gets the step's q
to round K for (ops/cache.py: reshape_and_cache).

The other families are this model with a few switches (ModelConfig's family fields): Qwen3 and
Gemma 3 RMS-norm each q/k head before RoPE; Gemma norms the attention and MLP outputs before the
residual add, uses GeGLU, scales the embeddings and soft-caps scores and logits (Gemma 2); Mistral,
Phi-3 and Gemma's sliding layers attend over a window, Gemma 3's with their own RoPE base. Llama-shaped
models (one window for all layers or none) run every step in one native call (decoder_layers); the
others op by op.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pyengine.config import ModelConfig
from pyengine.interrupt import StepInterrupt, StepInterrupted
from pyengine.model.metadata import AttentionMetadata, KVCache
from pyengine.ops._common import DTYPE_CODES, check_tensor
from pyengine.ops.attention import check_kv_cache, paged_attention
from pyengine.ops.cache import reshape_and_cache
from pyengine.ops.layers import add_rms_norm, hadamard_heads, rms_norm, rotary_embedding, silu_and_mul
from pyengine.ops.linear import Fp32Linear, PackedLinear
from pyengine.ops.huge_pages import HugePageArena
from pyengine.ops.qlinear import QuantLinear

WeightGetter = Callable[[str], "torch.Tensor | None"]  # HF tensor name -> tensor (None if absent)
# HF tensor names -> (GGML type, uint8 blocks of the row-concatenated tensors) or None (loader.QuantizedGetter)
QuantizedGetter = Callable[[list[str]], "tuple[str, torch.Tensor] | None"]
QUANTIZED_KV = (torch.float8_e4m3fn, torch.int8)  # caches that hold K and V rotated (hadamard_heads)
SCRATCH_KEPT_ROWS = 256  # decoder_layers' scratch is kept between steps of up to this many rows (decode)


class LayerWeights(NamedTuple):
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2*KVH) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # the norm before the MLP (Gemma: pre_feedforward_layernorm)
    gate_up: torch.Tensor  # [2 * I, hidden]
    down: torch.Tensor
    q_norm: torch.Tensor | None = None  # [D] (qk_norm)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # post_norms: of the attention output (Gemma's post_attention_layernorm)
    mlp_out_norm: torch.Tensor | None = None  # post_norms: of the MLP output


class LayerAttention(NamedTuple):
    window: int  # 0: full causal attention
    cos_sin_cache: torch.Tensor


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "freq_factors")


def rope_inv_freq(dim: int, theta: float, scaling: dict | None, max_pos: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin factor) as transformers computes them, for rope types default, linear,
    llama3, yarn, dynamic (NTK base for the whole served context `max_pos`, as vLLM does; transformers
    recomputes it per step from the longest position), and freq_factors (GGUF `rope_freqs`: llama.cpp
    divides each frequency by its factor; how Llama 3 GGUFs carry llama3 scaling)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    if kind == "dynamic":
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        base = theta * ((factor * max_pos / old_len) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, inv_freq)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope scaling type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")


def _yarn(dim: int, theta: float, scaling: dict, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' _compute_yarn_parameters): interpolate the low frequencies, keep the high
    ones, ramp between; cos/sin are scaled by the attention factor."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) if high != low else 0.001)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attention_factor)


def rope_cache(cfg: ModelConfig, theta: float | None = None, scaling: dict | None = None) -> torch.Tensor:
    """[max_pos, head_dim] fp32: cos in the first half of each row, sin in the second (the model's RoPE,
    or unscaled RoPE of base `theta` when given)."""
    if theta is None:
        theta, scaling = cfg.rope_theta, cfg.rope_scaling
    inv_freq, factor = rope_inv_freq(cfg.head_dim, theta, scaling, cfg.max_position_embeddings)
    freqs = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq
    return torch.cat([freqs.cos() * factor, freqs.sin() * factor], dim=1).contiguous()


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:] (Gemma's GeGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


Linear = Callable[[torch.Tensor], torch.Tensor]


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
                arena: HugePageArena | None = None) -> Linear:
    """bf16 weights on the CPU: PackedLinear, whose native kernel streams the weight at memory bandwidth
    for decode-sized batches (ahead of torch's bf16 GEMM, bench/kernels/bench_linear.py) and hands larger
    batches to torch. fp32 weights on AVX2 CPUs without AVX-512: Fp32Linear (ahead of torch's GEMM there).
    Anything else: torch's F.linear. `out_dtype` (fp32 for the lm_head) is the result type; `arena` holds the
    packed copy."""
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        return PackedLinear(weight, bias, out_dtype=out_dtype or torch.bfloat16, arena=arena)
    if (weight.dtype == torch.float32 and weight.device.type == "cpu" and out_dtype in (None, torch.float32)
            and (bias is None or bias.dtype == torch.float32) and Fp32Linear.runs_here()):
        return Fp32Linear(weight, bias, arena=arena)
    if out_dtype is None or out_dtype == weight.dtype:
        return lambda x: F.linear(x, weight, bias)
    return lambda x: F.linear(x, weight, bias).to(out_dtype)


def _holds_weights(linear: Linear) -> bool:
    """A QuantLinear or Fp32Linear, or a PackedLinear with a packed copy of its weight (on the CPU): the
    original need not be kept."""
    return (isinstance(linear, (QuantLinear, Fp32Linear))
            or (isinstance(linear, PackedLinear) and linear.packed is not None))


class LayerLinears(NamedTuple):
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, get: WeightGetter, dtype: torch.dtype, device: torch.device | str,
                 quantized: QuantizedGetter | None = None):
        """quantized: where given, projections, embedding and lm_head whose tensors it returns are kept
        quantized (QuantLinear, CPU, bf16/fp32 activations); the rest is dequantized through `get`."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.eps = cfg.rms_norm_eps
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_sizes = [h * d, kvh * d, kvh * d]
        self.q_shape, self.kv_shape = (h, d), (kvh, d)
        windows = [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]
        if device.type != "cpu" and (cfg.attn_logit_softcap or any(windows)):
            raise ValueError(f"{cfg.architecture}: sliding-window and soft-capped attention run on the CPU only "
                             "(use --device cpu)")

        def w(name: str, required: bool = True) -> torch.Tensor | None:
            t = get(name)
            if t is None:
                if required:
                    raise ValueError(f"checkpoint has no tensor {name!r}")
                return None
            return t.to(device=device, dtype=dtype).contiguous()

        def norm(name: str, required: bool = True) -> torch.Tensor | None:
            """An RMSNorm weight. Gemma's, 1 + w (the 1 folded in here for HF checkpoints), stay fp32 as in
            transformers: near 1, bf16 would keep only 2-3 digits of w."""
            t = get(name)
            if t is None or not cfg.post_norms:
                return w(name, required)
            return (t.float() + cfg.norm_weight_offset).to(device).contiguous()

        def cat(names: list[str], required: bool = True) -> torch.Tensor | None:
            parts = [get(n) for n in names]
            if any(p is None for p in parts):
                if required or any(p is not None for p in parts):
                    missing = [n for n, p in zip(names, parts) if p is None]
                    raise ValueError(f"checkpoint has no tensor {missing[0]!r}")
                return None
            return torch.cat([p.to(dtype=dtype) for p in parts], dim=0).to(device).contiguous()

        arena = HugePageArena()  # the weights the kernels stream (quantized or packed bf16), on huge pages

        def quant(names: list[str], bias: torch.Tensor | None, out_dtype: torch.dtype | None = None):
            """A QuantLinear over the row-concatenated tensors `names`, where they stay quantized."""
            parts = quantized(names) if quantized is not None else None
            if parts is None:
                return None
            return QuantLinear([b for _, b in parts], [t for t, _ in parts], bias, out_dtype=out_dtype or dtype,
                               arena=arena)

        def linear(names: list[str], bias: torch.Tensor | None,
                   fused_name: str | None = None) -> tuple[Linear, torch.Tensor | None]:
            """(the projection over the row-concatenated tensors `names`, its weight where the projection
            does not hold its own copy). fused_name: a fused projection as stored (Phi-3's qkv_proj,
            gate_up_proj), used instead of the parts where the checkpoint has it."""
            if fused_name is not None and get(fused_name) is not None:
                names = [fused_name]
            lin = quant(names, bias)
            if lin is not None:
                return lin, None
            weight = cat(names)
            lin = make_linear(weight, bias, arena=arena)
            return lin, None if _holds_weights(lin) else weight

        embed_q = quant(["model.embed_tokens.weight"], None, torch.float32)
        self.embed_q = embed_q  # the quantized embedding, whose rows are dequantized per lookup
        self.embed = None if embed_q is not None else w("model.embed_tokens.weight")
        self.layers: list[LayerWeights] = []
        self.linears: list[LayerLinears] = []
        for i in tqdm(range(cfg.num_hidden_layers), desc="Loading weights", unit="layer", leave=False):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{x}_proj" for x in "qkv"]
            post = cfg.post_norms  # Gemma: post_attention_layernorm norms the attention output
            qkv_bias = cat([n + ".bias" for n in attn], required=False)
            o_bias = w(p + "self_attn.o_proj.bias", required=False)
            qkv, qkv_w = linear([n + ".weight" for n in attn], qkv_bias, p + "self_attn.qkv_proj.weight")
            o, o_w = linear([p + "self_attn.o_proj.weight"], o_bias)
            gate_up, gate_up_w = linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], None,
                                        p + "mlp.gate_up_proj.weight")
            down, down_w = linear([p + "mlp.down_proj.weight"], None)
            held = _holds_weights(qkv)  # packed copies replace the projections (and biases): one copy in memory
            self.layers.append(LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=qkv_w, qkv_bias=None if held else qkv_bias, o=o_w, o_bias=None if held else o_bias,
                post_norm=norm(p + ("pre_feedforward_layernorm" if post else "post_attention_layernorm") + ".weight"),
                gate_up=gate_up_w, down=down_w,
                q_norm=norm(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
                k_norm=norm(p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
                attn_out_norm=norm(p + "post_attention_layernorm.weight") if post else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if post else None,
            ))
            self.linears.append(LayerLinears(qkv, o, gate_up, down))
        self.norm = norm("model.norm.weight")
        head_q = embed_q if cfg.tie_word_embeddings else quant(["lm_head.weight"], None, torch.float32)
        if head_q is not None:
            self.lm_head_linear, self.lm_head = head_q, None  # fp32 logits (its out dtype)
        else:
            lm_head = None if cfg.tie_word_embeddings else w("lm_head.weight", required=False)
            if lm_head is None:  # tied (or absent): the embedding, dequantized here if it is held quantized
                lm_head = self.embed if self.embed is not None else w("model.embed_tokens.weight")
            self.lm_head_linear = make_linear(lm_head, None, out_dtype=torch.float32, arena=arena)
            # an untied lm_head is kept only if its linear does not hold a copy of its own
            self.lm_head = lm_head if lm_head is self.embed or not _holds_weights(self.lm_head_linear) else None
        self.cos_sin_cache = rope_cache(cfg).to(device)
        local_cache = (self.cos_sin_cache if cfg.rope_local_theta is None
                       else rope_cache(cfg, cfg.rope_local_theta).to(device))
        self.attention = [LayerAttention(win, local_cache if win else self.cos_sin_cache) for win in windows]
        # Steps run all layers in one native call (decoder_layers) on the CPU with bf16 weights, every
        # projection a PackedLinear or QuantLinear with its native kernel (tests set this lower to compare
        # with the op-by-op path), for Llama-shaped models (the family features run op by op). 0: always op
        # by op.
        lins = [x for l in self.linears for x in l]
        llama_shaped = not (cfg.qk_norm or cfg.post_norms or cfg.hidden_act != "silu" or cfg.embed_scale
                            or cfg.attn_logit_softcap or cfg.final_logit_softcap or len(set(windows)) > 1)
        native = llama_shaped and dtype == torch.bfloat16 and all(_holds_weights(x) for x in lins)
        self.native_layer_rows = 1 << 62 if native else 0
        self._layer_table: tuple[torch.Tensor, int, int] | None = None  # for decoder_layers, per KV cache list
        self._layer_table_caches: list[KVCache] | None = None
        self._scratch: list[torch.Tensor] = []  # decoder_layers' scratch of the last decode-sized step

    def weight_bytes(self) -> int:
        tensors = {id(t): t for t in [self.embed, self.norm, self.lm_head, *(x for l in self.layers for x in l)]
                   if t is not None}
        held = {id(x): x for x in [*(x for l in self.linears for x in l), self.lm_head_linear, self.embed_q]
                if x is not None and _holds_weights(x)}
        return sum(t.numel() * t.element_size() for t in tensors.values()) + sum(x.nbytes for x in held.values())

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        interrupt: StepInterrupt | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64; logits_indices [B] int64, or None for every row (B = T) -> logits
        [B, V] fp32. interrupt: checked before each layer; once set, raises StepInterrupted (the KV slots
        of the step's tokens then hold a partial write, which a rerun of the step overwrites)."""
        t = input_ids.shape[0]
        cfg, eps, scale, sizes, d = self.cfg, self.eps, self.scale, self.qkv_sizes, self.cfg.head_dim
        q_shape, kv_shape = (t, *self.q_shape), (t, *self.kv_shape)
        if self.embed_q is not None:
            # rounded to the model's dtype, as the dequantized table (weights="dequantize") holds it
            residual = self.embed_q.embedding(input_ids, self.dtype).float()
        else:
            residual = F.embedding(input_ids, self.embed).float()
        if cfg.embed_scale:  # the scale rounded to the model's dtype, as transformers does
            residual = residual * torch.tensor(cfg.embed_scale, dtype=self.dtype)
        if t <= self.native_layer_rows:
            x = self._native_layers(residual, positions, kv_caches, meta, interrupt)  # the final norm included
            return self.lm_head_linear(x if logits_indices is None else x.index_select(0, logits_indices))
        act_and_mul = gelu_tanh_and_mul if cfg.hidden_act == "gelu_pytorch_tanh" else silu_and_mul
        softcap = cfg.attn_logit_softcap or 0.0
        rotate = kv_caches[0].k.dtype in QUANTIZED_KV
        x = None
        for layer, lin, cache, attention in zip(self.layers, self.linears, kv_caches, self.attention):
            if interrupt is not None:
                interrupt.check()
            if x is None:
                x = rms_norm(residual, layer.input_norm, eps, dtype=self.dtype)
            else:
                add_rms_norm(x, residual, layer.input_norm, eps)
            q, k, v = lin.qkv(x).split(sizes, dim=1)
            if layer.q_norm is not None:  # per head, before RoPE
                q = rms_norm(q.contiguous().view(q_shape), layer.q_norm, eps)
                k = rms_norm(k.contiguous().view(kv_shape), layer.k_norm, eps)
            rotary_embedding(positions, q, k, attention.cos_sin_cache, d)  # in place (strided column slices too)
            if rotate:
                for part in (q, k, v):
                    hadamard_heads(part, d)
            # .contiguous() copies only for T > 1 (a single row is already contiguous)
            q = q.contiguous().view(q_shape)
            reshape_and_cache(k.contiguous().view(kv_shape), v.contiguous().view(kv_shape), cache.k, cache.v,
                              meta.slot_mapping, k_scales=cache.k_scales, v_scales=cache.v_scales,
                              query=q if rotate else None)  # quantized caches round K for q
            attn = paged_attention(q, cache.k, cache.v, meta.block_tables, meta.seq_lens,
                                   meta.query_start_loc, scale, k_scales=cache.k_scales, v_scales=cache.v_scales,
                                   max_seq_len=meta.max_seq_len, window=attention.window, softcap=softcap,
                                   tensor_cores=meta.tensor_cores, max_query_len=meta.max_query_len)
            if rotate:
                hadamard_heads(attn, d)  # back from rotated V
            x = lin.o(attn.view(t, -1))
            if layer.attn_out_norm is not None:
                rms_norm(x, layer.attn_out_norm, eps, out=x)
            add_rms_norm(x, residual, layer.post_norm, eps)
            x = lin.down(act_and_mul(lin.gate_up(x)))
            if layer.mlp_out_norm is not None:
                rms_norm(x, layer.mlp_out_norm, eps, out=x)
        add_rms_norm(x, residual, self.norm, eps)
        logits = self.lm_head_linear(x if logits_indices is None else x.index_select(0, logits_indices))
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits

    def _native_layers(self, residual: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                       meta: AttentionMetadata, interrupt: StepInterrupt | None = None) -> torch.Tensor:
        """All layers of the op-by-op loop above and the final norm in one native call (same kernels, same
        order: the same bits). residual (fp32) is updated in place; returns x, the normed last hidden state
        (bf16). Per-step Python is kept to argument checks: a decode step's tensor ops cost ~20-100 us each
        once the layers' weight stream has evicted the interpreter's data from the caches."""
        from pyengine import _C

        cfg, t = self.cfg, residual.shape[0]
        h, kvh, d, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
        table, nb, bs = self._layer_table_for(kv_caches)
        cache = kv_caches[0]
        check_tensor("positions", positions, dtypes=(torch.int64,), shape=(t,))
        check_tensor("slot_mapping", meta.slot_mapping, dtypes=(torch.int64,), shape=(t,))
        check_tensor("block_tables", meta.block_tables, dtypes=(torch.int32,), ndim=2)
        s, max_blocks = meta.block_tables.shape
        check_tensor("seq_lens", meta.seq_lens, dtypes=(torch.int32,), shape=(s,))
        check_tensor("query_start_loc", meta.query_start_loc, dtypes=(torch.int32,), shape=(s + 1,))
        check_tensor("residual", residual, dtypes=(torch.float32,), shape=(t, cfg.hidden_size))
        qkv, attn, gate_up, act = self._scratch_for(t)
        x = torch.empty(t, cfg.hidden_size, dtype=torch.bfloat16)
        completed = _C.decoder_layers(
            residual.data_ptr(), x.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(), act.data_ptr(),
            table.data_ptr(), len(self.layers), positions.data_ptr(), self.cos_sin_cache.data_ptr(),
            self.cos_sin_cache.shape[0], meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(),
            meta.seq_lens.data_ptr(), meta.query_start_loc.data_ptr(), t, cfg.hidden_size, h, kvh, d, inter, nb, bs,
            s, max_blocks, meta.max_seq_len, self.eps, self.scale, DTYPE_CODES[self.layers[0].input_norm.dtype],
            DTYPE_CODES[cache.k.dtype], self.attention[0].window, self.norm.data_ptr(),
            0 if interrupt is None else interrupt.address)
        if not completed:
            raise StepInterrupted
        return x

    def _scratch_for(self, t: int) -> list[torch.Tensor]:
        """decoder_layers' scratch (qkv, attn, gate_up, act) for t rows. The last one of at most
        SCRATCH_KEPT_ROWS rows is kept for the next step: a batch's decode steps all have its size."""
        if self._scratch and self._scratch[0].shape[0] == t:
            return self._scratch
        cfg = self.cfg
        widths = (sum(self.qkv_sizes), cfg.num_attention_heads * cfg.head_dim, 2 * cfg.intermediate_size,
                  cfg.intermediate_size)
        scratch = [torch.empty(t, n, dtype=torch.bfloat16) for n in widths]
        if t <= SCRATCH_KEPT_ROWS:
            self._scratch = scratch
        return scratch

    def _layer_table_for(self, kv_caches: list[KVCache]) -> tuple[torch.Tensor, int, int]:
        """decoder_layers' table of addresses (native/cpu/decoder.cpp: LayerField) with the caches' num_blocks
        and block_size, built (and the caches checked) once per cache list."""
        if self._layer_table_caches is not kv_caches:
            if len(kv_caches) != len(self.layers):
                raise ValueError(f"{len(kv_caches)} KV caches for a model of {len(self.layers)} layers")
            check_tensor("norm", self.norm, dtypes=(self.layers[0].input_norm.dtype,))  # one norm dtype for all
            ptr = lambda x: 0 if x is None else x.data_ptr()  # noqa: E731
            rows = []
            for layer, lin, c in zip(self.layers, self.linears, kv_caches):
                nb, _, bs, _ = check_kv_cache(c.k, c.v, c.k_scales, c.v_scales, torch.bfloat16, c.k.device,
                                              self.cfg.num_key_value_heads, self.cfg.head_dim)
                rows.append([ptr(layer.input_norm), *lin.qkv.native_pointers(), *lin.o.native_pointers(),
                             ptr(layer.post_norm), lin.gate_up.native_pointers()[0], lin.down.native_pointers()[0],
                             ptr(c.k), ptr(c.v), ptr(c.k_scales), ptr(c.v_scales),
                             *(int(isinstance(x, QuantLinear)) for x in lin)])
            self._layer_table = (torch.tensor(rows, dtype=torch.int64), nb, bs)
            self._layer_table_caches = kv_caches
        return self._layer_table
