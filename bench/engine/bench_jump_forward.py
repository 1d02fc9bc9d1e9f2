"""Jump-forward (grammar-forced text as drafts, EngineConfig.jump_forward) on against off: the default model,
greedy, batch 1, rounds of the engines alternating in one run. Workloads: a json_schema with fixed keys (a
person record) and a tool call under tool_choice "required" (the schema the server builds for it). Prints,
per workload, the forward passes (engine steps) and output tok/s of each engine, their ratios, and how many
of the forced drafts verification accepted. Outputs are checked equal (jump-forward never changes them).

    python bench/engine/bench_jump_forward.py [--threads 2] [--rounds 3] [--ngram]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

import pyengine  # noqa: E402,F401  (before torch: it sets the OpenMP spin policy)

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]},
                                           "email": {"type": "string", "maxLength": 40},
                                           "member": {"type": "boolean"}},
          "required": ["name", "age", "city", "email", "member"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}


def chat(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def workloads(tok):
    """name -> (prompt token lists, the JSON schema constraining each output)."""
    from server.tools import ToolSpec

    people = [chat(tok, f"Give {who} as a JSON record with name, age, city, email and member.")
              for who in ("Alice Martin, 31, of Paris, alice@example.com, a member",
                          "Kenji Sato, 45, of Tokyo, kenji@example.jp, not a member")]
    calls = [chat(tok, f"What is the weather in {city}? Use the tool.") for city in ("Tokyo", "Lima")]
    return {"fixed keys": (people, PERSON), "tool call": (calls, ToolSpec([WEATHER], "required").schema())}


def run_round(llm, prompts, schema) -> tuple[list[list[int]], int, float, int]:
    """(outputs, forward passes, output tok/s, output tokens) of the prompts one after another (batch 1)."""
    from pyengine import SamplingParams
    from pyengine.sampling_params import StructuredOutputsParams

    params = SamplingParams(max_tokens=128, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    steps0, t = llm.engine.num_steps, time.perf_counter()
    outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    dt = time.perf_counter() - t
    n = sum(len(o) for o in outs)
    return outs, llm.engine.num_steps - steps0, n / dt, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ngram", action="store_true", help="n-gram speculation on in both engines")
    args = ap.parse_args()

    from pyengine import LLM

    common = dict(num_threads=args.threads, kv_cache_memory=256 << 20, max_model_len=2048, max_num_seqs=8)
    if args.ngram:
        common["speculative"] = {"method": "ngram", "num_speculative_tokens": 5}
    engines = {"off": LLM(jump_forward=False, **common), "on": LLM(jump_forward=True, **common)}
    tok = engines["off"].engine.tokenizer
    loads = workloads(tok)
    for llm in engines.values():  # warm-up, and the grammars compiled before timing
        for prompts, schema in loads.values():
            run_round(llm, prompts[:1], schema)
    print(f"{'workload':>11} {'tokens':>7} {'passes off':>11} {'passes on':>10} {'off/on':>7} {'off tok/s':>10} "
          f"{'on tok/s':>9} {'on/off':>7} {'forced accepted':>16}")
    for name, (prompts, schema) in loads.items():
        rates = {"off": [], "on": []}
        passes, outputs = {}, {}
        sp = engines["on"].engine.speculator
        f0, a0 = sp.num_forced_tokens, sp.num_forced_accepted
        for _ in range(args.rounds):
            for key, llm in engines.items():  # alternating, so both see the same load on a shared machine
                outputs[key], passes[key], rate, n = run_round(llm, prompts, schema)
                rates[key].append(rate)
        assert outputs["on"] == outputs["off"], "jump-forward changed the output"
        forced, accepted = sp.num_forced_tokens - f0, sp.num_forced_accepted - a0
        off, on = max(rates["off"]), max(rates["on"])
        print(f"{name:>11} {n:7d} {passes['off']:11d} {passes['on']:10d} {passes['off'] / passes['on']:6.2f}x "
              f"{off:10.1f} {on:9.1f} {on / off:6.2f}x {accepted:>7d}/{forced:<8d}")


if __name__ == "__main__":
    main()
