"""A conversation that outgrows the context window under `truncation: "auto"`: does the prefix cache
keep serving the kept history?

    python -m server --max-model-len 2048 &
    python bench/serve/bench_truncation.py --url http://127.0.0.1:8000 [--turns 30] [--json out.json]

One conversation of --turns turns through /v1/responses, each chained to the last by
previous_response_id, each a --words-word question with --output-len generated tokens (ignore_eos).
Per turn: items dropped, input tokens, cached input tokens, seconds. Summary over the turns after the
first truncation: the median of cached_tokens / input_tokens, and their total time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.serve.serve_load import WORDS  # noqa: E402


def post(url: str, body: dict, key: str | None) -> dict:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def question(turn: int, words: int) -> str:
    """A distinct question per turn (so no two turns share text by accident)."""
    return f"Question {turn}: " + " ".join(WORDS[(turn * 7 + i) % len(WORDS)] for i in range(words))


def run(args: argparse.Namespace) -> dict:
    url = args.url.rstrip("/") + "/v1/responses"
    model = args.model or json.loads(urllib.request.urlopen(urllib.request.Request(
        args.url.rstrip("/") + "/v1/models",
        headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})).read())["data"][0]["id"]
    rows, previous = [], None
    for t in range(args.turns):
        body = {"model": model, "input": question(t, args.words), "instructions": "Answer briefly.",
                "truncation": "auto", "max_output_tokens": args.output_len, "ignore_eos": True,
                "temperature": 0, "previous_response_id": previous}
        start = time.perf_counter()
        r = post(url, body, args.api_key)
        seconds = time.perf_counter() - start
        previous = r["id"]
        rows.append({"turn": t + 1, "dropped": r["truncation_details"]["dropped_items"],
                     "input": r["usage"]["input_tokens"],
                     "cached": r["usage"]["input_tokens_details"]["cached_tokens"], "seconds": seconds})
        row = rows[-1]
        print(f"turn {row['turn']:>3}  dropped {row['dropped']:>3}  input {row['input']:>5}  "
              f"cached {row['cached']:>5}  {row['seconds']:6.2f} s", flush=True)
    first = next((i for i, r in enumerate(rows) if r["dropped"]), None)
    after = rows[first:] if first is not None else []
    summary = {"turns": args.turns, "first_truncated_turn": first + 1 if first is not None else None,
               "turns_after": len(after),
               "median_cached_ratio": statistics.median(r["cached"] / r["input"] for r in after) if after else None,
               "seconds_after": sum(r["seconds"] for r in after), "distinct_cuts": len({r["dropped"] for r in after})}
    print(json.dumps(summary))
    return {"rows": rows, "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=os.environ.get("PYENGINE_API_KEY"))
    p.add_argument("--turns", type=int, default=30)
    p.add_argument("--words", type=int, default=60, help="words per question")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per turn")
    p.add_argument("--json", default=None, help="write the rows and the summary here")
    args = p.parse_args()
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
