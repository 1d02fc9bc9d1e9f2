"""The KV tiers under the prefix cache (--kv-disk-path, --kv-host-bytes): a long conversation resumed after a
restart, and a working set larger than the pool.

    python bench/engine/bench_kv_tier.py [--dir /var/tmp/kvbench] [--tokens 4000] [--threads 2] [--json out.json]

restart: a process prefills a --tokens conversation turn with the disk tier on and exits (its write queue
flushed); the files are then dropped from the OS page cache (posix_fadvise DONTNEED: our files only). Then
fresh processes, alternating --repeats times, run the next turn (the same context + a short question):
"resume" with the disk tier and an empty pool, "cold" without it. TTFT of each (from add_request, model
load excluded) and their ratio (goal <= 0.25). Also the block files' read bandwidth (read + crc32 on one
thread, as the tier's reader does, page cache dropped) against `dd` reading one file of the same size in the
same directory.

write cost: fresh --tokens prompts prefilled with the disk tier (every block written through) and without,
alternating --repeats times: what copying blocks out costs the step thread.

working set: --users users, each with a --system-tokens system prompt of their own, send --rounds rounds of
short questions to a pool that holds --pool-fraction of their system prompts. The same requests run, in one
process and round by round in turn, on an engine with the pool only (misses recomputed), one with the disk tier
and one with the host-memory tier alone (--host-bytes, by default room for the whole working set): prompt tokens
served from cache (pool, disk, host memory) and the prompt throughput of each.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.serve.serve_load import WORDS  # noqa: E402


def text_ids(tokenizer, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(200)) + ". ", add_special_tokens=False)
    return ids[:n]


def ttft(engine, ids: list[int]) -> float:
    """Seconds from add_request to the first token of a lone greedy request."""
    from pyengine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine.add_request("r", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def drop_page_cache(folder: str) -> None:
    """Evict our own files from the OS page cache, so that the next read comes from the device."""
    for root, _, files in os.walk(folder):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def engine_of(args, kv_tokens: int, disk: str | None, parts=None, **config):
    from pyengine.config import EngineConfig
    from pyengine.engine.engine import Engine

    kv_tokens = -(-kv_tokens // 16) * 16  # whole blocks
    return Engine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads, max_model_len=kv_tokens,
                               kv_cache_memory=kv_tokens * args.kv_bytes_per_token, kv_disk_path=disk,
                               kv_disk_bytes=args.disk_bytes, **config), parts=parts)


def kv_bytes_per_token(args) -> int:
    """KV bytes per token of --model in --dtype (read from the GGUF's metadata, no weights loaded)."""
    import torch

    from pyengine.engine.engine import resolve_dtype
    from pyengine.model.gguf import open_gguf
    from pyengine.model.loader import config_from_hf, resolve_model_path
    from pyengine.model.metadata import kv_bytes_per_token as per_token

    path = resolve_model_path(args.model)
    cfg = open_gguf(path).config() if os.path.isfile(path) else config_from_hf(path)
    return per_token(cfg, resolve_dtype(args.dtype, torch.device("cpu")))


# A Llama-3.2-1B-like shape on the default model's vocabulary and tokenizer: 16 layers of 2048, GQA 32:8, head_dim
# 64, FFN 8192 (about 1.07B parameters, tied embeddings), Q8_0.
SHAPE_1B = {"block_count": 16, "embedding_length": 2048, "feed_forward_length": 8192, "attention.head_count": 32,
            "attention.head_count_kv": 8, "rope.dimension_count": 64}


def write_random_gguf(dst: str, shape: dict) -> str:
    """A random-weight Q8_0 GGUF of `shape` (llama.* metadata keys) with the default model's tokenizer and
    chat template: its outputs are noise, its costs are those of a real model of that shape."""
    import gguf
    import numpy as np

    from pyengine.model.loader import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(dst, arch=None)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.alignment":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        key = field.name.removeprefix("llama.")
        value = shape.get(key, field.contents()) if field.name.startswith("llama.") else field.contents()
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    d, f = shape["embedding_length"], shape["feed_forward_length"]
    kv = d // shape["attention.head_count"] * shape["attention.head_count_kv"]
    vocab = int(reader.fields["llama.vocab_size"].contents())
    rng = np.random.default_rng(0)

    def add(name: str, rows: int, cols: int) -> None:  # torch shape [rows, cols]
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
        q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, q, raw_shape=list(q.shape), raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    add("token_embd.weight", vocab, d)
    ones = np.ones(d, dtype=np.float32)
    writer.add_tensor("output_norm.weight", ones)
    for i in range(shape["block_count"]):
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", ones)
        for name, rows, cols in (("attn_q", d, d), ("attn_k", kv, d), ("attn_v", kv, d), ("attn_output", d, d),
                                 ("ffn_gate", f, d), ("ffn_up", f, d), ("ffn_down", d, f)):
            add(f"blk.{i}.{name}.weight", rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# ---- restart: each role in a process of its own --------------------------------------------------

def run_role(args) -> dict:
    disk = os.path.join(args.dir, "kv") if args.role in ("write", "resume") else None
    engine = engine_of(args, args.tokens + 64, disk)
    first = text_ids(engine.tokenizer, args.tokens, seed=1)
    second = first + engine.tokenizer.encode(" In one sentence, what was this about?", add_special_tokens=False)
    if args.role == "write":
        t = ttft(engine, first)
        engine.close()
        return {"prefill_s": t, "tokens": len(first), "files": len(engine.kv_tier.store),
                "bytes": engine.kv_tier.store.stats.bytes_used}
    t = ttft(engine, second)
    out = {"ttft_s": t, "tokens": len(second), "computed_tokens": engine.num_computed_tokens}
    if engine.kv_tier is not None:
        out.update(disk_tokens=engine.kv_tier.stats.hit_tokens, read_bytes=engine.kv_tier.store.stats.bytes_read)
        engine.close()
    return out


def spawn(args, role: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--dir", args.dir, "--tokens", str(args.tokens),
           "--threads", str(args.threads), "--dtype", args.dtype, "--disk-bytes", str(args.disk_bytes)]
    if args.model:
        cmd += ["--model", args.model]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise RuntimeError(f"{role} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def read_bandwidth(folder: str) -> tuple[float, int]:
    """(bytes/s, bytes) reading every block file once, read + crc32 on one thread, page cache dropped."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(folder) for f in fs if f.endswith(".kv")]
    drop_page_cache(folder)
    n = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        zlib.crc32(data)
        n += len(data)
    return n / (time.perf_counter() - t0), n


def dd_bandwidth(folder: str, nbytes: int) -> float:
    """bytes/s of `dd` reading one file of nbytes in folder (written, synced, dropped from the page cache)."""
    path = os.path.join(folder, "dd.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
    drop_page_cache(folder)
    t0 = time.perf_counter()
    res = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], capture_output=True, text=True, check=True)
    dt = time.perf_counter() - t0
    os.unlink(path)
    m = re.search(r"copied, ([0-9.]+) s", res.stderr)
    return nbytes / (float(m.group(1)) if m else dt)


def bench_restart(args) -> dict:
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    write = spawn(args, "write")
    drop_page_cache(args.dir)
    resume, cold = [], []
    for _ in range(args.repeats):  # alternating, so both see the same host
        drop_page_cache(args.dir)
        resume.append(spawn(args, "resume"))
        cold.append(spawn(args, "cold"))
    bw, nbytes = read_bandwidth(os.path.join(args.dir, "kv"))
    dd = dd_bandwidth(args.dir, nbytes)
    best_resume = min(r["ttft_s"] for r in resume)
    best_cold = min(c["ttft_s"] for c in cold)
    return {"write": write, "resume": resume, "cold": cold, "ttft_ratio": best_resume / best_cold,
            "read_MBps": bw / 1e6, "dd_MBps": dd / 1e6, "read_vs_dd": bw / dd}


# ---- working set larger than the pool ------------------------------------------------------------

def bench_working_set(args) -> dict:
    import torch

    from pyengine.engine.engine import resolve_dtype
    from pyengine.llm import LLM
    from pyengine.model.loader import load_model, resolve_model_path
    from pyengine.sampling_params import SamplingParams
    from pyengine.tokenizer import Tokenizer

    path = resolve_model_path(args.model)
    cfg, model = load_model(path, resolve_dtype(args.dtype, torch.device("cpu")), torch.device("cpu"))
    tok = Tokenizer.from_model_path(path)
    parts = (cfg, model, tok, "bench")
    systems = [text_ids(tok, args.system_tokens, seed=100 + u) for u in range(args.users)]
    rounds = []
    for r in range(args.rounds):
        order = random.Random(r).sample(range(args.users), args.users)
        rounds.append([systems[u] + text_ids(tok, 32, seed=10_000 * r + u) for u in order])
    pool_tokens = max(int(args.users * args.system_tokens * args.pool_fraction), args.system_tokens + 64)
    # As many sequences as the pool holds whole: more would preempt each other, and recomputing preempted
    # prompts is not what this measures.
    max_seqs = max(1, pool_tokens // (args.system_tokens + 32 + 8))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    disk_dir = os.path.join(args.dir, "workset")
    shutil.rmtree(disk_dir, ignore_errors=True)
    host_bytes = args.host_bytes or 2 * args.users * (args.system_tokens + 64) * args.kv_bytes_per_token
    engines = {"pool_only": engine_of(args, pool_tokens, None, parts, max_num_seqs=max_seqs),
               "pool_and_disk": engine_of(args, pool_tokens, disk_dir, parts, max_num_seqs=max_seqs),
               "pool_and_host": engine_of(args, pool_tokens, None, parts, max_num_seqs=max_seqs,
                                          kv_host_bytes=host_bytes)}
    totals = {name: dict.fromkeys(("wall_s", "prompt_tokens", "cached_tokens", "disk_tokens", "host_tokens"), 0)
              for name in engines}
    for prompts in rounds:  # each round on both engines in turn, so that both see the same host
        for name, engine in engines.items():
            t = totals[name]
            t0 = time.perf_counter()
            outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
            t["wall_s"] += time.perf_counter() - t0
            for out in outs:
                t["prompt_tokens"] += out.metrics.num_prompt_tokens
                t["cached_tokens"] += out.metrics.num_cached_tokens
                t["disk_tokens"] += out.metrics.num_disk_cached_tokens
                t["host_tokens"] += out.metrics.num_host_cached_tokens
    results = {}
    for name, engine in engines.items():
        t = totals[name]
        results[name] = {**t, "cached_fraction": t["cached_tokens"] / t["prompt_tokens"],
                         "prompt_tok_per_s": t["prompt_tokens"] / t["wall_s"],
                         "preemptions": engine.stats().num_preemptions,
                         "pool_tokens": engine.pool.num_blocks * engine.pool.block_size, "max_num_seqs": max_seqs}
        engine.close()
    results["pool_tokens"] = results["pool_only"]["pool_tokens"]
    results["working_set_tokens"] = args.users * args.system_tokens
    results["host_bytes"] = host_bytes
    results["speedup"] = results["pool_only"]["wall_s"] / results["pool_and_disk"]["wall_s"]
    results["host_speedup"] = results["pool_only"]["wall_s"] / results["pool_and_host"]["wall_s"]
    return results


# ---- the cost of writing through ---------------------------------------------------------------

def bench_write_cost(args) -> dict:
    """Prefill throughput of fresh --tokens prompts with the disk tier (every block written through) and
    without it, alternating --repeats times on one model: what the step thread pays for copying blocks out."""
    import torch

    from pyengine.engine.engine import resolve_dtype
    from pyengine.model.loader import load_model, resolve_model_path
    from pyengine.tokenizer import Tokenizer

    path = resolve_model_path(args.model)
    cfg, model = load_model(path, resolve_dtype(args.dtype, torch.device("cpu")), torch.device("cpu"))
    tok = Tokenizer.from_model_path(path)
    parts = (cfg, model, tok, "bench")
    disk_dir = os.path.join(args.dir, "write-cost")
    shutil.rmtree(disk_dir, ignore_errors=True)
    engines = {"no_disk": engine_of(args, args.tokens + 64, None, parts),
               "write_through": engine_of(args, args.tokens + 64, disk_dir, parts)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.repeats):
        for name, engine in engines.items():
            times[name].append(ttft(engine, text_ids(tok, args.tokens, seed=1000 + 2 * r + len(times[name]))))
    out = {name: {"best_s": min(t), "tok_per_s": args.tokens / min(t), "runs": t} for name, t in times.items()}
    out["ratio"] = out["write_through"]["best_s"] / out["no_disk"]["best_s"]
    out["blocks_written"] = engines["write_through"].kv_tier.store.stats.blocks_written
    for engine in engines.values():
        engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: the bundled model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default="/var/tmp/pyengine-kvbench", help="scratch folder for the disk tier (wiped)")
    p.add_argument("--disk-bytes", type=int, default=8 * 2**30)
    p.add_argument("--tokens", type=int, default=4000, help="the resumed conversation's context")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pool-fraction", type=float, default=0.1)
    p.add_argument("--host-bytes", type=int, default=0,
                   help="the working set's host-memory tier (0: twice the users' system prompts' KV)")
    p.add_argument("--only", choices=["restart", "working-set", "write-cost"], default=None)
    p.add_argument("--random-1b", action="store_true",
                   help="--model: a 1B-shaped random-weight Q8_0 GGUF, written to --dir (SHAPE_1B)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--role", default=None, choices=["write", "resume", "cold"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.random_1b:
        args.model = os.path.join(os.path.dirname(args.dir.rstrip("/")) or ".", "pyengine-random-1b.gguf")
        if not os.path.exists(args.model):
            os.makedirs(os.path.dirname(args.model) or ".", exist_ok=True)
            write_random_gguf(args.model, SHAPE_1B)
    args.kv_bytes_per_token = kv_bytes_per_token(args)
    if args.role:
        print(json.dumps(run_role(args)))
        return
    out = {"host": os.uname().nodename, "threads": args.threads}
    if args.only in (None, "restart"):
        out["restart"] = r = bench_restart(args)
        print(f"restart, {r['write']['tokens']}-token context: cold prefill {r['write']['prefill_s']:.2f} s; "
              f"next turn resumed from disk {min(x['ttft_s'] for x in r['resume']):.3f} s vs cold "
              f"{min(x['ttft_s'] for x in r['cold']):.2f} s (ratio {r['ttft_ratio']:.3f}); block files read at "
              f"{r['read_MBps']:.0f} MB/s vs dd {r['dd_MBps']:.0f} MB/s", flush=True)
    if args.only in (None, "working-set"):
        out["working_set"] = w = bench_working_set(args)
        for name in ("pool_only", "pool_and_disk", "pool_and_host"):
            x = w[name]
            print(f"working set {w['working_set_tokens']} tokens, pool {w['pool_tokens']}: {name}: cached "
                  f"{100 * x['cached_fraction']:.1f}% of {x['prompt_tokens']} prompt tokens (disk {x['disk_tokens']}, "
                  f"host {x['host_tokens']}), {x['wall_s']:.1f} s, {x['prompt_tok_per_s']:.0f} prompt tok/s",
                  flush=True)
    if args.only in (None, "write-cost"):
        out["write_cost"] = c = bench_write_cost(args)
        print(f"write-through cost, {args.tokens}-token prefills: {c['no_disk']['tok_per_s']:.0f} tok/s without the "
              f"disk tier, {c['write_through']['tok_per_s']:.0f} with it (time ratio {c['ratio']:.3f}, "
              f"{c['blocks_written']} blocks written)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
