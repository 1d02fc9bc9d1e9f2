"""`python -m server`: an OpenAI-compatible HTTP server over pyengine's AsyncLLM."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from pyengine.config import BLOCK_SIZES, SpeculativeConfig, memory_size
from pyengine.request_log import RequestLog
from server import config_file, store
from server.app import MODELS, ServerConfig, create_app, listen
from server.config_file import ModelSpec, ServeFile
from server.connections import ConnectionLimits
from server.gateway import GatewayConfig
from server.models import ConfigError, ModelEntry, check_config
from server.routing import RoutingConfig
from server.tools import PARSERS

class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows '(default: X)' except where there is no default value to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m server",
        description="Serve a model over an OpenAI-compatible HTTP API (chat, completions, streaming).",
        formatter_class=_HelpFormatter)
    m = p.add_argument_group("model and engine")
    m.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH",
                   help="HF model folder or .gguf file; omitted: the bundled default model. Repeat to serve "
                        "several models, each with its own engine and KV budget (named NAME, or the file's "
                        "name); model \"auto\" then means the first one")
    m.add_argument("--config", default=None, metavar="TOML",
                   help="serve the models, API key tiers and routing rules of a TOML file instead of --model "
                        "(engine flags below are the defaults of its models); see README")
    m.add_argument("--served-model-name", default=None,
                   help="model name clients send and see in responses; default: the model's name")
    m.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype")
    m.add_argument("--weights", default="auto", choices=["auto", "dequantize"],
                   help="GGUF weights: auto keeps Q8_0/Q4_0/Q4_1 quantized on the CPU (int8 kernels) and "
                        "dequantizes other types to --dtype; dequantize expands every tensor at load")
    m.add_argument("--max-model-len", type=int, default=None,
                   help="context window in tokens (prompt + completion); default: the model's")
    m.add_argument("--kv-cache-memory", type=memory_size, default=None,
                   help="KV-cache budget: a fraction (0,1] of the memory left after the weights, "
                        "or a size such as 2GiB")
    m.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"],
                   help="KV-cache element type; fp8/int8 halve or quarter its size")
    m.add_argument("--block-size", type=int, default=16, choices=BLOCK_SIZES,
                   help="tokens per KV-cache block: the prefix cache's unit; larger blocks are longer runs "
                        "for CPU decode attention to stream")
    m.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences decoded together in one step")
    m.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step (decodes + prompt chunks)")
    m.add_argument("--long-prefill-tokens", type=int, default=None,
                   help="most tokens one prompt computes in a step while others run or wait (its chunk); a "
                        "request arriving meanwhile starts within about one chunk (default: 64 on cpu, 512 on cuda)")
    m.add_argument("--solo-prefill-tokens", type=int, default=None,
                   help="the chunk of a prompt that has the engine to itself: larger runs faster; a request "
                        "arriving meanwhile interrupts it and the chunk is computed again (default: 256 on cpu, "
                        "--long-prefill-tokens on cuda)")
    m.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of identical prompt prefixes")
    m.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="order of waiting requests (priority: the request field 'priority')")
    m.add_argument("--num-threads", type=int, default=None, help="CPU threads for the model")
    m.add_argument("--seed", type=int, default=0, help="seed for requests that do not set one")
    m.add_argument("--cuda-graphs", action="store_true",
                   help="cuda: replay decode steps as CUDA graphs (one per batch-size bucket, captured at start)")
    m.add_argument("--tensor-core-prefill", action="store_true",
                   help="cuda: prompt chunks' attention on tensor cores (FlashAttention-2; bf16/fp16, unquantized KV)")
    m.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help="speculative decoding (requests without a grammar), vLLM's keys: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                        "(and \"disable_by_batch_size\": no speculation above that many running sequences)")

    s = p.add_argument_group("HTTP and gateway")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    s.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' (repeat for several keys; "
                        "also read from PYENGINE_API_KEY); /health stays open")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait for their first token; more get 503 at once")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take; then it is aborted (504); 0: no limit")
    s.add_argument("--max-body-bytes", type=int, default=4 * 2**20,
                   help="largest request body; larger ones get 413")
    s.add_argument("--max-n", type=int, default=16, help="largest 'n' (choices per request)")
    s.add_argument("--tool-call-parser", default=None, choices=list(PARSERS),
                   help="how tool calls are read from output under tool_choice auto (default: by the model's "
                        "chat template: llama3_json for Llama-3 templates, else hermes)")
    s.add_argument("--rate-limit-rpm", type=int, default=0,
                   help="requests per minute per API key (or client address); 0: no limit")
    s.add_argument("--rate-limit-tpm", type=int, default=0,
                   help="prompt + completion tokens per minute per API key; 0: no limit")
    s.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client gets to send a request's headers (from its first byte), and "
                        "as long again for its body; slower clients get 408 and are disconnected")
    s.add_argument("--keepalive-timeout", type=float, default=15.0,
                   help="seconds an idle connection (no request in progress) stays open")
    s.add_argument("--max-connections", type=int, default=512,
                   help="open connections at most; more are answered 503 and closed")
    s.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests get to finish")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="info: one access-log line per request and a periodic stats line")
    s.add_argument("--request-log", default=None, metavar="PATH",
                   help="write one row per generation request to PATH (.csv, or .jsonl for JSON Lines); "
                        "read it with `python -m pyengine.report PATH`")
    s.add_argument("--request-log-max-bytes", type=memory_size, default=100 * 2**20,
                   help="rotate the request log at this size (PATH.1, PATH.2, ... 5 kept)")
    s.add_argument("--stats-interval", type=float, default=10.0,
                   help="seconds between console stats lines (tokens/s, running/waiting, KV, prefix hits); 0: off")
    s.add_argument("--store", default=None, metavar="PATH",
                   help="SQLite file for stored responses and conversations (/v1/responses, /v1/conversations); "
                        f"':memory:' keeps them until the server stops (default: {store.default_path()})")
    return p


def engine_config(args: argparse.Namespace, model: str | None = None, **overrides):
    """The engine flags, with `overrides` (a config file's per-model settings) on top."""
    from pyengine import EngineConfig

    flags = dict(dtype=args.dtype, weights=args.weights, device=args.device, max_model_len=args.max_model_len,
                 block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                 kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching,
                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 long_prefill_tokens=args.long_prefill_tokens, solo_prefill_tokens=args.solo_prefill_tokens,
                 scheduling_policy=args.scheduling_policy, num_threads=args.num_threads, seed=args.seed,
                 cuda_graphs=args.cuda_graphs, tensor_core_prefill=args.tensor_core_prefill,
                 speculative=args.speculative_config)
    return EngineConfig(model=model, **(flags | overrides))


def speculative_config(text: str):
    """--speculative-config's JSON, checked while the arguments are parsed (an argparse type)."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None




def model_specs(args: argparse.Namespace, serve_file: ServeFile | None) -> list[ModelSpec] | None:
    """The models of the --config file or of several --model flags; None for one model."""
    if serve_file is not None:
        if args.model or args.served_model_name:
            raise ConfigError("--config names the models: leave out --model and --served-model-name")
        return serve_file.models
    if not args.model or len(args.model) == 1 and "=" not in args.model[0]:
        return None
    if args.served_model_name:
        raise ConfigError("--served-model-name names one model; name several with --model NAME=PATH")
    specs = []
    for value in args.model:
        name, sep, path = value.partition("=")
        if not sep or os.sep in name or os.path.exists(value):  # a path that happens to hold "="
            name, path = os.path.splitext(os.path.basename(value.rstrip(os.sep)))[0], value
        specs.append(ModelSpec(name, path or None))
    check_config([(m.name, m.aliases, m.tier) for m in specs], RoutingConfig(), {})
    return specs


def server_config(args: argparse.Namespace, request_log: RequestLog | None = None,
                  serve_file: ServeFile | None = None,
                  conversations: store.ConversationStore | None = None) -> ServerConfig:
    keys = list(args.api_key or [])
    if not keys and os.environ.get("PYENGINE_API_KEY"):
        keys = [os.environ["PYENGINE_API_KEY"]]
    routing, key_tiers = (serve_file.routing, serve_file.key_tiers) if serve_file else (RoutingConfig(), {})
    return ServerConfig(served_model_name=args.served_model_name, max_n=args.max_n, request_log=request_log,
                        routing=routing, key_tiers=key_tiers, store=conversations,
                        stats_interval=args.stats_interval, tool_call_parser=args.tool_call_parser,
                        gateway=GatewayConfig(
        api_keys=keys, max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
        request_timeout=args.request_timeout or None, rate_limit_rpm=args.rate_limit_rpm,
        rate_limit_tpm=args.rate_limit_tpm), connections=ConnectionLimits(
        read_timeout=args.read_timeout, keepalive_timeout=args.keepalive_timeout,
        max_connections=args.max_connections))


async def serve(app: web.Application, host: str, port: int, grace: float) -> None:
    """Run until SIGTERM/SIGINT; then stop accepting, drain up to `grace` seconds, shut down."""
    runner = await listen(app, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    models = app[MODELS]
    bound = runner.addresses[0]
    lines = [f"pyengine server listening on http://{bound[0]}:{bound[1]}"]
    for m in models:
        lines.append(f"  model: {m.name} (context {m.engine.max_model_len} tokens)")
        plan = getattr(m.engine, "plan", None)  # a stand-in engine may have none
        if plan is not None:
            lines.append(f"  KV cache: {plan.num_blocks} blocks x {plan.block_size} tokens = {plan.kv_tokens} tokens")
    if len(models.models) > 1:
        lines.append(f"  router: {models.router.name} (default {models.router.default}, "
                     f"{len(models.router.rules)} rules)")
    print("\n".join(lines), flush=True)
    await stop.wait()
    print("shutting down: draining in-flight requests", flush=True)
    for site in runner.sites:
        await site.stop()  # no new connections
    await asyncio.gather(*(m.serving.drain(grace) for m in models))
    await runner.cleanup()  # closes idle connections, stops the engines
    print("stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pyengine import AsyncLLM

    request_log = None
    if args.request_log:
        try:  # before the model loads: a bad path fails at once
            request_log = RequestLog(args.request_log, max_bytes=int(args.request_log_max_bytes))
        except OSError as e:
            print(f"error: cannot write the request log: {e}", file=sys.stderr)
            return 2
    try:  # also before the model loads: a corrupt or unreadable file fails at once, named
        conversations = store.SQLiteStore(args.store or store.default_path())
    except store.StoreOpenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        serve_file = config_file.load(args.config) if args.config else None
        config = server_config(args, request_log, serve_file, conversations)
        specs = model_specs(args, serve_file)
        if specs is None:
            engines = AsyncLLM(engine_config(args, args.model[0] if args.model else None))
        else:
            engines = []
            for m in specs:
                try:
                    engines.append(ModelEntry(AsyncLLM(engine_config(args, m.path, **m.engine)), m.name,
                                              m.aliases, m.tier))
                except (ValueError, FileNotFoundError) as e:  # e.g. a KV budget too small for the context
                    raise ConfigError(f"model {m.name!r}: {e}") from None
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(engines, config)
    try:
        asyncio.run(serve(app, args.host, args.port, args.shutdown_grace))
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
