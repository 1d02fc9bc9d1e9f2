"""Does an evaluation harness get the model's answers through the server? A hand-made multiple-choice
set scored the way lm-eval's `local-completions` scores loglikelihood tasks, against a running server,
using only the server's tokenizer (exported with `python -m pyengine.tokenizer export DIR`); the picks
are compared with transformers' on the same GGUF.

    python -m server --max-model-len 2048 &
    python bench/serve/lm_eval_check.py --url http://127.0.0.1:8000 [--lm-eval]

Scoring (what lm-eval does with --tokenizer DIR): encode context and context + continuation with the
tokenizer, POST the ids to /v1/completions with echo, max_tokens 1 and logprobs 1, and sum the
continuation tokens' logprobs; the choice with the largest sum is the pick. With --lm-eval the
requests go through lm-eval's own LocalCompletionsAPI instead (pip install lm-eval[api]).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MULTIPLE_CHOICE = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid", " Rome"]),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"]),
    ("One, two, three, four,", [" five", " seven", " ten"]),
    ("The sun rises in the", [" east", " west", " north", " south"]),
    ("Cats and dogs are", [" animals", " vegetables", " minerals"]),
    ("Monday, Tuesday,", [" Wednesday", " Friday", " Sunday"]),
    ("The opposite of hot is", [" cold", " warm", " loud"]),
    ("Grass is usually", [" green", " purple", " orange"]),
]


def request(url: str, key: str | None, body: dict | None = None) -> dict:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=600) as r:
        return json.loads(r.read())


def served_scores(args: argparse.Namespace, tok, model: str) -> list[list[float]]:
    """Per question, per choice: the continuation's summed logprob, as local-completions computes it."""
    scores = []
    for context, choices in MULTIPLE_CHOICE:
        row = []
        for cont in choices:
            ctx = tok(context, add_special_tokens=False)["input_ids"]
            whole = tok(context + cont, add_special_tokens=False)["input_ids"]
            r = request(args.url.rstrip("/") + "/v1/completions", args.api_key,
                        {"model": model, "prompt": whole, "max_tokens": 1, "echo": True, "logprobs": 1,
                         "temperature": 0})
            row.append(sum(r["choices"][0]["logprobs"]["token_logprobs"][len(ctx):len(whole)]))
        scores.append(row)
    return scores


def lm_eval_scores(args: argparse.Namespace, folder: str, model: str) -> list[list[float]]:
    """The same through lm-eval's LocalCompletionsAPI (its request building and response parsing)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=args.url.rstrip("/") + "/v1/completions", model=model, tokenizer=folder,
                             tokenizer_backend="huggingface", max_length=args.max_length)
    reqs = [Instance("loglikelihood", {}, (ctx, cont), i) for i, (ctx, choices) in enumerate(MULTIPLE_CHOICE)
            for cont in choices]
    out = iter(lp for lp, _ in lm.loglikelihood(reqs))
    return [[next(out) for _ in choices] for _, choices in MULTIPLE_CHOICE]


def reference_scores(tok) -> list[list[float]]:
    """transformers' model on the same GGUF (fp32), the same sums."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.model_helpers import gguf_folder_and_name

    folder, name = gguf_folder_and_name()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    scores = []
    for context, choices in MULTIPLE_CHOICE:
        row = []
        for cont in choices:
            n_ctx = len(tok(context, add_special_tokens=False)["input_ids"])
            whole = tok(context + cont, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
            row.append(sum(logp[i - 1, whole[i]].item() for i in range(n_ctx, len(whole))))
        scores.append(row)
    return scores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("PYENGINE_API_KEY"))
    p.add_argument("--lm-eval", action="store_true", help="score through lm-eval's LocalCompletionsAPI")
    p.add_argument("--max-length", type=int, default=2048)
    args = p.parse_args()
    from transformers import AutoTokenizer

    from pyengine.tokenizer import main as export

    base = args.url.rstrip("/")
    model = request(base + "/v1/models", args.api_key)["data"][0]["id"]
    info = request(base + "/tokenizer_info", args.api_key)  # what lm-eval's remote tokenizer reads
    print(f"/tokenizer_info: eos_token={info['eos_token']!r} chat_template={'yes' if info['chat_template'] else 'no'}")
    with tempfile.TemporaryDirectory() as folder:
        export(["export", folder])
        tok = AutoTokenizer.from_pretrained(folder)
        served = lm_eval_scores(args, folder, model) if args.lm_eval else served_scores(args, tok, model)
        reference = reference_scores(tok)
    picks = [max(range(len(r)), key=r.__getitem__) for r in served]
    want = [max(range(len(r)), key=r.__getitem__) for r in reference]
    for (context, choices), a, b in zip(MULTIPLE_CHOICE, picks, want):
        print(f"{context!r}: server {choices[a]!r}, transformers {choices[b]!r}")
    print(json.dumps({"same_picks": picks == want, "agree": sum(a == b for a, b in zip(picks, want)),
                      "questions": len(picks)}))
    sys.exit(0 if picks == want else 1)


if __name__ == "__main__":
    main()
