"""The CPU kernels' thread pool (native/include/pyengine/parallel.h): every item runs once whatever the
thread count, concurrent callers, and a process forked after the pool has run."""
import pathlib
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from pyengine import _C
from pyengine.ops.layers import rms_norm

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def restore_threads():
    before = _C.num_threads()
    yield
    _C.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_a_loop_gives_the_one_thread_result_at_every_size(restore_threads, threads):
    g = torch.Generator().manual_seed(0)
    w = torch.rand(576, generator=g) + 0.5
    for rows in (57, 64, 130, 1000):  # 1 to 20 items (layers.cpp: for_units), fewer and more than the threads
        x = torch.randn(rows, 576, generator=g)
        _C.set_num_threads(1)
        ref = rms_norm(x, w, 1e-5)
        _C.set_num_threads(threads)
        for _ in range(20):
            assert torch.equal(rms_norm(x, w, 1e-5), ref)


def test_concurrent_callers_each_get_their_own_result(restore_threads):
    """Kernels release the GIL: a second thread's loop runs (inline) while the first one's is in flight."""
    _C.set_num_threads(2)
    g = torch.Generator().manual_seed(1)
    w = torch.ones(576)
    xs = [torch.randn(512, 576, generator=g) for _ in range(2)]
    refs = [rms_norm(x, w, 1e-5) for x in xs]
    bad = []

    def run(i):
        for _ in range(200):
            if not torch.equal(rms_norm(xs[i], w, 1e-5), refs[i]):
                bad.append(i)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not bad


def test_a_forked_child_runs_the_kernels():
    """libgomp's team (the previous pool) hung the first parallel loop of a child forked after the
    parent had used it; the child now starts helpers of its own."""
    code = textwrap.dedent("""
        import os
        import pyengine, torch
        from pyengine import _C
        from pyengine.ops.layers import rms_norm
        _C.set_num_threads(2)
        x, w = torch.randn(256, 576), torch.ones(576)
        ref = rms_norm(x, w, 1e-5)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if torch.equal(rms_norm(x, w, 1e-5), ref) else 3)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    try:
        res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the forked child hung in its first parallel loop")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-1] == "0"
