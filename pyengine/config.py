"""Plain dataclasses for configuration; no framework."""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def memory_size(text: str) -> float | int:
    """'0.5' -> fraction 0.5; '2GiB', '512M', '1073741824' -> bytes (an argparse type)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use a fraction like 0.5 or bytes like 2GiB)")
    value = float(m.group(1))
    if not m.group(2) and not m.group(3) and 0 < value <= 1:
        return value
    return int(value * _UNITS[m.group(2)])


@dataclass
class ModelConfig:
    """The architecture of a Llama-family checkpoint, read from config.json or GGUF metadata."""

    architecture: str  # e.g. "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # QKV projection bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Family features; the defaults are plain Llama (model/families.py reads them from checkpoints).
    sliding_window: int | None = None  # attention window of the "sliding_attention" layers (Mistral, Gemma)
    layer_types: list[str] | None = None  # per layer "sliding_attention" | "full_attention" (None: all sliding
    # when sliding_window is set)
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers (unscaled)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # MLP activation: "silu" | "gelu_pytorch_tanh" (Gemma's GeGLU)
    post_norms: bool = False  # Gemma 2/3: the attention and MLP outputs are RMS-normed before the residual add
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    norm_weight_offset: float = 0.0  # Gemma's HF checkpoints store w of the (1 + w) RMSNorm (GGUF stores 1 + w)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma; default head_dim)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits

    def layer_window(self, layer: int) -> int:
        """The attention window of a layer (0: none)."""
        if not self.sliding_window or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return 0
        return self.sliding_window


# Running sequences above which no request speculates (SpeculativeConfig.disable_by_batch_size's default):
# past it a step is no longer bound by reading the weights, so rejected drafts cost real compute.
SPEC_DISABLE_BATCH_SIZE = 4


@dataclass
class SpeculativeConfig:
    """Speculative decoding, vLLM's --speculative-config keys. Method "ngram" (prompt lookup): the last n
    tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked up in the prompt and output so far,
    and the tokens that followed the latest match are proposed as drafts. Method "draft_model" (the default
    when "model" is given): a smaller model with the same vocabulary proposes its greedy continuation."""

    method: str | None = None  # "ngram" or "draft_model"; None: "draft_model" if model is given, else "ngram"
    model: str | None = None  # the draft model (a .gguf file or HF folder), method "draft_model" only
    num_speculative_tokens: int = 5  # most drafts verified per step and request (k)
    prompt_lookup_max: int = 4  # longest suffix matched
    prompt_lookup_min: int = 2  # shortest suffix matched (1 would propose after any repeated token)
    # No request speculates while more sequences than this run (None: SPEC_DISABLE_BATCH_SIZE)
    disable_by_batch_size: int | None = None

    _KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
             "disable_by_batch_size")

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "ngram" if self.model is None else "draft_model"
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft_model', got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative method 'draft_model' needs a 'model' (a .gguf file or HF folder) and "
                             "'ngram' takes none")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is None:
            self.disable_by_batch_size = SPEC_DISABLE_BATCH_SIZE
        v = self.disable_by_batch_size
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"speculative disable_by_batch_size must be an integer >= 1, got {v!r}")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig") -> "SpeculativeConfig":
        """From the JSON text of --speculative-config or a dict (a TOML table); ValueError names what is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls._KEYS))
        if unknown:
            raise ValueError(f"speculative config has unknown keys {unknown}; known: {list(cls._KEYS)}")
        return cls(**value)


BLOCK_SIZES = (8, 16, 32, 64, 128)  # tokens per KV-cache block the kernels and flags take
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_MODES = ("auto", "dequantize")
DEVICES = ("cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
SCHEDULING_POLICIES = ("fcfs", "priority")

# The defaults of the settings whose None means "decided at start-up" (the engine and the memory plan use these).
LONG_PREFILL_TOKENS = {"cpu": 64, "cuda": 512}
# The default chunk of a lone prompt on the CPU (EngineConfig.solo_prefill_tokens): 512 ran lone prompts
# fastest of 64, 256 and 512, in bf16 and in fp32 (docs/performance.md, "prefill chunk size"). A newcomer
# interrupts the chunk before the next layer, so its size costs the newcomer little.
SOLO_PREFILL_TOKENS_CPU = 512
KV_FRACTION_DEFAULT = 0.9  # of the memory left after weights and the activation reserve
CPU_DEFAULT_KV_BYTES = 4 << 30  # like vLLM-CPU's default KV space


@dataclass(frozen=True)
class Setting:
    """What the command line, the server's TOML file and their help say about one EngineConfig field; the
    flags and keys are generated from it (pyengine/engine_args.py), so it is written here once."""

    help: str
    group: str  # the heading it is listed under in --help
    choices: tuple | None = None
    minimum: int | None = None  # the least value allowed (None as a value is always allowed)
    # What a None default means, for --help ("64 on cpu, 512 on cuda"): such defaults are decided at start-up.
    default_text: str | None = None
    parse: Callable[[str], Any] | None = None  # a command-line or TOML string -> the value (else: the field's type)
    cuda_only: bool = False  # a true value needs device="cuda"
    flag: str | None = None  # the command-line flag, where it is not the field's name (vLLM's name)
    example: str | None = None  # a valid command-line value, where a parsed setting takes more than a size


def setting(default: Any, help: str, **details: Any) -> Any:
    """An EngineConfig field: its default and its Setting."""
    return field(default=default, metadata={"setting": Setting(help, **details)})


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Sizes are in tokens unless named otherwise.

    To add a setting, add a field here with setting(default, help, group=..., ...): the server's flag, its
    TOML key and their --help follow from it (and the planner's flag, once named in plan.PLAN_SETTINGS)."""

    model: str | None = setting(None, "HF model folder or .gguf file", group="model",
                                default_text="the bundled default model")
    dtype: str = setting("auto", "weight and activation dtype; auto: bfloat16 on cuda and on CPUs with bf16 dot "
                                 "products (AVX512-BF16 or AMX), else float32", group="model", choices=DTYPES)
    weights: str = setting("auto", "GGUF weights: auto keeps tensors of the types with native CPU kernels "
                                   "(ops/qlinear.py) quantized and dequantizes other types to --dtype; dequantize "
                                   "expands every tensor at load", group="model", choices=WEIGHT_MODES)
    device: str = setting("cpu", "where the model runs", group="model", choices=DEVICES)
    max_model_len: int | None = setting(None, "context window in tokens (prompt + completion)", group="model",
                                        default_text="the model's")
    block_size: int = setting(16, "tokens per KV-cache block: the prefix cache's unit; larger blocks are longer "
                                  "runs for CPU decode attention to stream", group="KV cache", choices=BLOCK_SIZES)
    # bytes (int > 1) or a fraction (0, 1] of the memory left after the weights (plan.plan_memory)
    kv_cache_memory: float | int | None = setting(
        None, "KV-cache budget: a fraction (0,1] of the memory left after the weights, or a size such as 2GiB",
        group="KV cache", parse=memory_size,
        default_text=f"{KV_FRACTION_DEFAULT:.0%} of the memory left after the weights and the activation "
                     f"reserve; on cpu at most {CPU_DEFAULT_KV_BYTES >> 30} GiB and what max_num_seqs "
                     "sequences of max_model_len tokens can use")
    kv_cache_dtype: str = setting("auto", "KV-cache element type (auto: the model's dtype); fp8/int8 halve or "
                                          "quarter its size", group="KV cache", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of identical prompt prefixes", group="KV cache")
    # On the CPU the cache is anonymous memory the OS commits as blocks are first written (model/metadata.py):
    # prefault commits all of it at start-up, as vLLM and llama.cpp do, so first requests do not pay for it and
    # a host short of memory fails at start-up rather than mid-request.
    kv_cache_prefault: bool = setting(False, "commit the whole CPU KV cache at start-up instead of as blocks are "
                                             "first written", group="KV cache")
    # A disk tier under the prefix cache (pyengine/engine/kv_tiers.py): full KV blocks are written through to
    # files in this directory and read back on a pool miss, also after a restart.
    kv_disk_path: str | None = setting(None, "a disk tier under the prefix cache: full KV blocks are written to DIR "
                                             "and read back instead of recomputed, also after a restart (one "
                                             "subfolder per model fingerprint)", group="KV cache",
                                       default_text="off")
    kv_disk_bytes: int = setting(8 * 2**30, "most bytes the disk tier keeps in --kv-disk-path (per model), e.g. "
                                            "20GiB; the least recently used blocks go first", group="KV cache",
                                 parse=memory_size, minimum=1)
    # Host memory as the middle tier (pyengine/engine/kv_host.py): blocks are kept in RAM first, in front of the
    # disk tier when there is one; what RAM evicts goes down to the disk, or is dropped without one.
    kv_host_bytes: int = setting(0, "most bytes of KV blocks kept in host memory under the prefix cache (pinned on "
                                    "a GPU), in front of --kv-disk-path when set, e.g. 16GiB; 0: off",
                                 group="KV cache", parse=memory_size, minimum=0)
    max_num_seqs: int = setting(256, "most sequences decoded together in one step", group="scheduling", minimum=1)
    max_num_batched_tokens: int = setting(2048, "token budget of one engine step (decodes + prompt chunks)",
                                          group="scheduling", minimum=1)
    # Most tokens one sequence computes in a step (0: up to max_num_batched_tokens): a long prompt is prefilled in
    # chunks of this size, and a request arriving meanwhile goes first (the chunk shrinks to make room for its first
    # chunk; scheduler.pyx), so it starts within about one chunk's time. 64 on CPU, 512 on CUDA (where small
    # steps leave the GPU idle). On the CPU the chunk bounds a newcomer's wait (128 would double it), and
    # 64-token chunks cost a long prompt little, since prefill attention reads the KV cache in place and the
    # kernels' thread pool never waits for a helper the OS has not run (native/include/pyengine/parallel.h).
    # Figures: docs/performance.md, "prefill chunk size". While nothing else runs or waits,
    # solo_prefill_tokens applies instead.
    long_prefill_tokens: int | None = setting(
        None, "most tokens one prompt computes in a step while others run or wait (its chunk; 0: up to "
              "--max-num-batched-tokens); a request arriving meanwhile starts within about one chunk",
        group="scheduling", minimum=0,
        default_text=f"{LONG_PREFILL_TOKENS['cpu']} on cpu, {LONG_PREFILL_TOKENS['cuda']} on cuda")
    # The chunk of a prompt that has the engine to itself (the only request running or waiting), never below
    # long_prefill_tokens. It stalls nobody's decodes, and larger chunks run faster (docs/performance.md, "prefill
    # chunk size"). A request that arrives meanwhile (AsyncLLM, the server) interrupts the chunk before the
    # model's next layer (pyengine/interrupt.py), so it waits about one layer of it; the prompt computes that
    # chunk again.
    solo_prefill_tokens: int | None = setting(
        None, "the chunk of a prompt that has the engine to itself: larger runs faster; a request arriving "
              "meanwhile interrupts it and the chunk is computed again", group="scheduling", minimum=0,
        default_text=f"{SOLO_PREFILL_TOKENS_CPU} on cpu, --long-prefill-tokens on cuda")
    scheduling_policy: str = setting("fcfs", "order of waiting requests (priority: the request field 'priority')",
                                     group="scheduling", choices=SCHEDULING_POLICIES)
    num_threads: int | None = setting(None, "CPU threads for torch and the native kernels", group="threads and CUDA",
                                      default_text="torch's and the kernels' own: the CPUs available")
    seed: int = setting(0, "seeds the RNG that draws a seed for each request without one", group="scheduling")
    # CUDA only, both off until measured on a device.
    cuda_graphs: bool = setting(False, "replay decode steps as CUDA graphs, one per batch-size bucket, captured at "
                                       "start-up (model/cuda_graphs.py)", group="threads and CUDA", cuda_only=True)
    tensor_core_prefill: bool = setting(False, "prompt chunks' attention on tensor cores (FlashAttention-2; "
                                               "bf16/fp16, unquantized KV cache)", group="threads and CUDA",
                                        cuda_only=True)
    # Structured output: grammars (JSON schemas, regexes, EBNF) compile in worker processes
    # (pyengine/grammar_pool.py), apart from tokenization and chat templates.
    grammar_compile_workers: int = setting(2, "processes that compile structured-output grammars, apart from "
                                              "tokenization and templates (each holds the tokenizer's vocabulary); "
                                              "started on the first structured request", group="scheduling",
                                           minimum=1)
    grammar_compile_timeout: float = setting(10.0, "seconds a grammar (json_schema, regex, tool schema) may take to "
                                                   "compile; a slower one is stopped and its request gets 400",
                                             group="scheduling")
    # Jump-forward (pyengine/engine/spec_decode.py): where a request's grammar forces the next text, its tokens
    # are the request's drafts for the next step, verified there like n-gram drafts (so the output is what it
    # is without it); with or without --speculative-config.
    jump_forward: bool = setting(True, "structured output: text the grammar forces (a fixed key, a closing "
                                       "bracket) becomes drafts the next step verifies: fewer steps, same output",
                                 group="scheduling")
    # Speculative decoding: a SpeculativeConfig, or its JSON text / dict as
    # --speculative-config takes it.
    speculative: SpeculativeConfig | str | dict | None = setting(
        None, "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 5, "
              "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2, \"disable_by_batch_size\": 4}, or a draft "
              "model with the same tokenizer: {\"model\": PATH, \"num_speculative_tokens\": 4}",
        group="scheduling", parse=SpeculativeConfig.parse, flag="--speculative-config", default_text="off",
        example='{"method": "ngram", "num_speculative_tokens": 3}')

    def __post_init__(self) -> None:
        if self.speculative is not None:
            self.speculative = SpeculativeConfig.parse(self.speculative)
        for name, s in engine_settings().items():
            value = getattr(self, name)
            if s.choices is not None and value not in s.choices:
                raise ValueError(f"{name} must be {_one_of(s.choices)}, got {value!r}")
            if s.minimum is not None and value is not None and value < s.minimum:
                raise ValueError(f"{name} must be >= {s.minimum}, got {value}")
            if s.cuda_only and value and self.device != "cuda":
                raise ValueError(f"{name} needs device='cuda', got device={self.device!r}")
        if self.kv_disk_path is not None and not self.enable_prefix_caching:
            raise ValueError("kv_disk_path needs enable_prefix_caching (the disk tier lies under the prefix cache)")
        for name in ("kv_disk_bytes", "kv_host_bytes"):  # memory_size reads "0.5" as a fraction: not a size here
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be a number of bytes such as 4GiB, got {getattr(self, name)}")
        if self.kv_host_bytes and not self.enable_prefix_caching:
            raise ValueError("kv_host_bytes needs enable_prefix_caching (the host tier lies under the prefix cache)")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout}")


def engine_settings() -> dict[str, Setting]:
    """EngineConfig's fields and their Settings, in declaration order."""
    return {f.name: f.metadata["setting"] for f in fields(EngineConfig)}


def _one_of(choices: tuple) -> str:
    """(8, 16, 32) -> "8, 16 or 32"."""
    names = [str(c) for c in choices]
    return ", ".join(names[:-1]) + f" or {names[-1]}"
