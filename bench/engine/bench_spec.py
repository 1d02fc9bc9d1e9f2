"""Speculative decoding (n-gram drafts, or a draft model with --draft-model) on against off: the default
model, greedy, EOS ignored, rounds of the two engines alternating in one run. Workloads: a code edit (the
prompt holds ~300 tokens of code; the answer rewrites it with one change), quoting a passage, open-ended chat
(drafts rarely match), and 16 concurrent code edits. Prints output tok/s of each, their ratio, and the
drafts' acceptance rate. --draft-model drafts with a model (PATH; the default model itself when none is
named: nearly every draft is accepted, so the figures show what the k draft passes a step cost against
the target steps they save).

--model PATH runs the same rows on another model, e.g. the random-weight GGUF in a 1.7B Llama's shapes that
bench/engine/bench_quant_real.py writes (its model_path(cache, "Q4_K_M", 24) writes it once, to
~/.cache/pyengine-bench/random-1.7b-shapes-24l.Q4_K_M.gguf by default): the cost side at a real size. Its
greedy output soon repeats itself, which n-gram drafts then match, so its acceptance is no guide to a real one.

    python bench/engine/bench_spec.py [--threads 2] [--rounds 2] [--max-tokens 256] [--k 5] [--model PATH]
        [--kv-cache-mib 512] [--disable-by-batch-size N] [--only WORKLOAD ...] [--draft-model [PATH]]
    python bench/engine/bench_spec.py --sweep   # ms per decode step against the batch's tokens
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

import pyengine  # noqa: E402,F401  (before torch: it sets the OpenMP spin policy)

CODE = '''class LRUCache:
    """A fixed-size mapping that forgets the least recently used key first."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.items: dict[str, int] = {}

    def get(self, key: str) -> int | None:
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

    def put(self, key: str, value: int) -> None:
        if key in self.items:
            self.items.pop(key)
        elif len(self.items) >= self.capacity:
            oldest = next(iter(self.items))
            del self.items[oldest]
        self.items[key] = value

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, key: str) -> bool:
        return key in self.items

    def clear(self) -> None:
        self.items.clear()
'''

PASSAGE = (
    "The lighthouse at the end of the harbour was built in 1852 from granite quarried on the island. "
    "For ninety years a keeper climbed its one hundred and twelve steps every evening to light the lamp, "
    "wind the clockwork that turned the lens, and write the weather in a leather-bound log. "
    "In 1941 the lamp was electrified, and in 1978 the last keeper left; since then the light has been "
    "switched on and off by a timer, and the keeper's cottage has become a small museum. "
    "Visitors can climb the tower on summer weekends, read the old logs, and see the original lens, "
    "which weighs more than two tonnes and still floats on a bath of mercury. "
    "The harbour master says the light is rarely needed now that ships carry satellite navigation, "
    "but the town voted to keep it burning, because it has guided fishermen home for as long as anyone remembers.")


def chat(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def workloads(tok) -> dict[str, list[list[int]]]:
    """name -> the prompt token lists of one round. The default model (135M) does not make the asked change
    to the code, but copies it (mostly faithfully) when asked to repeat it with the change; it summarises
    rather than quotes in a chat, so the quoting workload is a completion prompt (a RAG-style answer)."""
    edit = chat(tok, "Repeat this code exactly, but rename `items` to `entries`:\n\n" + CODE)
    quote = tok.encode("Passage:\n" + PASSAGE + "\n\nThe same passage, copied word for word:\n")
    story = chat(tok, "Write a short story about a fox who learns to play the violin.")
    return {"code edit": [edit], "quote": [quote], "chat": [story], "16 x code edit": [edit] * 16}


def run_round(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int, float, float]:
    """(output tok/s, output tokens per CPU second of this process, output tokens, draft tokens, accepted
    tokens) of one generate call. CPU time is the steadier figure on a shared machine."""
    from pyengine import SamplingParams

    m = llm.engine.metrics
    d0, a0 = m.spec_draft_tokens._value.get(), m.spec_accepted_tokens._value.get()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t, c = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / dt, n / dc, n, m.spec_draft_tokens._value.get() - d0, m.spec_accepted_tokens._value.get() - a0


def bench(args) -> None:
    from pyengine import LLM

    if args.draft_model:
        from pyengine.model.loader import default_model_path

        path = default_model_path() if args.draft_model == "default" else args.draft_model
        spec = {"model": path, "num_speculative_tokens": args.k}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if args.disable_by_batch_size:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    common = dict(model=args.model, num_threads=args.threads, kv_cache_memory=args.kv_cache_mib << 20,
                  max_model_len=2048, max_num_seqs=32)
    engines = {"off": LLM(**common), "on": LLM(speculative=spec, **common)}
    tok = engines["off"].engine.tokenizer
    loads = {k: v for k, v in workloads(tok).items() if not args.only or k in args.only}
    print("prompt tokens: " + ", ".join(f"{k} {len(v[0])}" for k, v in loads.items()))
    for llm in engines.values():  # warm-up
        run_round(llm, [tok.encode("Hello")], 8)
    print(f"{'workload':>16} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'cpu on/off':>11} {'acceptance':>11} "
          f"{'tok/step':>9}")
    for name, prompts in loads.items():
        rates = {"off": [], "on": []}
        cpu_rates = {"off": [], "on": []}
        drafts = accepted = 0.0
        outputs = {}
        for _ in range(args.rounds):
            for key, llm in engines.items():  # alternating, so both see the same load on a shared machine
                steps0 = llm.engine.num_steps
                rate, cpu_rate, n, d, a = run_round(llm, prompts, args.max_tokens)
                rates[key].append(rate)
                cpu_rates[key].append(cpu_rate)
                if key == "on":
                    drafts, accepted = drafts + d, accepted + a
                    outputs["steps"] = llm.engine.num_steps - steps0
                    outputs["n"] = n
        off, on = max(rates["off"]), max(rates["on"])
        acc = f"{accepted / drafts:.0%}" if drafts else "-"
        per_step = outputs["n"] / outputs["steps"] / len(prompts) if outputs.get("steps") else 0
        cpu = max(cpu_rates["on"]) / max(cpu_rates["off"])
        print(f"{name:>16} {off:10.1f} {on:10.1f} {on / off:6.2f}x {cpu:10.2f}x {acc:>11} {per_step:9.2f}")


def sweep(args) -> None:
    """ms per decode step of B one-token sequences (speculation off): the step time against its tokens, to see
    where it stops being set by reading the weights (flat) and grows with the tokens."""
    from pyengine import LLM, SamplingParams

    llm = LLM(args.model, num_threads=args.threads, kv_cache_memory=512 << 20, max_model_len=1024, max_num_seqs=64)
    tok = llm.engine.tokenizer
    prompt = tok.encode(PASSAGE)[:64]
    params = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    print(f"{'batch':>6} {'ms/step':>8} {'x batch 1':>10}")
    base = None
    for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48):
        best = float("inf")
        for _ in range(args.rounds):
            outs = llm.generate([prompt] * b, params, use_tqdm=False)
            m = outs[0].metrics
            best = min(best, (m.last_token_time - m.first_token_time) / 32 * 1e3)
        base = base or best
        print(f"{b:6d} {best:8.1f} {best / base:9.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--model", default=None, metavar="PATH", help="the target model (default: the default model)")
    ap.add_argument("--kv-cache-mib", type=int, default=512,
                    help="KV cache per engine; 16 code edits on a 1.7B model need ~1200 MiB to run at once")
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    ap.add_argument("--only", action="append", default=None, metavar="WORKLOAD", help='e.g. "16 x code edit"')
    ap.add_argument("--draft-model", nargs="?", const="default", default=None, metavar="PATH",
                    help="draft with this model (.gguf or HF folder; the default model when no PATH)")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    sweep(args) if args.sweep else bench(args)


if __name__ == "__main__":
    main()
