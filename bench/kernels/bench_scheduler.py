"""Per-step engine overhead at 256 running sequences: schedule + batch preparation + sampling
arrays + update (no model). Goal: <= 200 us per step.

    python bench/kernels/bench_scheduler.py            # prints us/step
    python -m pytest bench/kernels/bench_scheduler.py  # pytest-benchmark
"""
from __future__ import annotations

import time

import numpy as np

from pyengine.engine.block_pool import BlockPool
from pyengine.engine.request import Request, RequestStatus
from pyengine.engine.scheduler import Scheduler
from pyengine.model.batch import prepare_batch, prepare_sampling
from pyengine.sampling_params import SamplingParams

NUM_SEQS, PROMPT, BS, MAX_LEN = 256, 128, 16, 4096


class Harness:
    def __init__(self, num_seqs: int = NUM_SEQS) -> None:
        self.pool = BlockPool(num_seqs * MAX_LEN // BS, BS)
        self.sched = Scheduler(self.pool, num_seqs, 8192)
        params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_LEN - PROMPT - 1)
        for i in range(num_seqs):
            self.sched.add_request(Request(f"r{i}", None, [(i * 7 + j) % 30000 for j in range(PROMPT)], params))
        T, S, maxb = 8192, num_seqs, MAX_LEN // BS
        self.buf = [np.zeros(T, np.int64), np.zeros(T, np.int64), np.zeros(T, np.int64), np.zeros(S, np.int32),
                    np.zeros(S + 1, np.int32), np.zeros(S * maxb, np.int32), np.zeros(S, np.int64)]
        self.sbuf = [np.zeros(S, np.float32), np.zeros(S, np.int32), np.zeros(S, np.float32),
                     np.zeros(S, np.float32), np.zeros(S, np.int64), np.zeros(S, np.int64)]
        while any(r.num_computed_tokens < PROMPT for r in self.sched.running) or self.sched.num_waiting:
            self.step()  # get every sequence into decode

    def step(self) -> None:
        out = self.sched.schedule()
        prepare_batch(out, BS, *self.buf)
        reqs = [r for r, s in zip(out.reqs, out.sampling) if s]
        prepare_sampling(reqs, *self.sbuf)
        got = self.sched.update_from_output(out, [1] * len(reqs))
        for r in got:  # what Engine._process does per token before detokenization
            if r.num_tokens >= r.max_total_tokens:
                self.sched.finish(r, RequestStatus.FINISHED_LENGTH)


def test_step_overhead_256(benchmark):
    h = Harness()
    benchmark(h.step)
    assert len(h.sched.running) == NUM_SEQS


if __name__ == "__main__":
    h = Harness()
    n = 500
    t0 = time.perf_counter()
    for _ in range(n):
        h.step()
    dt = (time.perf_counter() - t0) / n
    print(f"{NUM_SEQS} running sequences (decode): {dt * 1e6:.1f} us per step "
          f"(schedule + prepare_batch + prepare_sampling + update)")
