"""Engine Prometheus metrics over the PagedEcho stand-in: vLLM names, a model_name label on every
series, one inter-token observation per gap, requests (not sequences) in the gauges and prompt
counters."""
from prometheus_client import generate_latest

from pyengine.sampling_params import SamplingParams

from engine_fakes import fake_engine

GREEDY = dict(temperature=0.0, ignore_eos=True)


def sample(engine, name: str, **labels) -> float:
    v = engine.metrics.registry.get_sample_value(name, {"model_name": "paged-echo", **labels})
    assert v is not None, f"{name} {labels} not exported"
    return v


def run(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_every_series_has_model_name():
    engine = fake_engine()
    engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=3, **GREEDY))
    run(engine)
    samples = [s for m in engine.metrics.registry.collect() for s in m.samples]
    assert samples
    assert all(s.labels.get("model_name") == "paged-echo" for s in samples), \
        [s.name for s in samples if "model_name" not in s.labels]
    text = generate_latest(engine.metrics.registry).decode()
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits",
                 "num_preemptions"):
        assert f"pyengine:{name}" in text, name


def test_inter_token_latency_one_observation_per_gap():
    engine = fake_engine()
    engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=7, **GREEDY))
    engine.add_request("b", [6, 7], SamplingParams(max_tokens=4, **GREEDY))
    run(engine)
    assert sample(engine, "pyengine:inter_token_latency_seconds_count") == (7 - 1) + (4 - 1)
    assert sample(engine, "pyengine:time_to_first_token_seconds_count") == 2
    assert sample(engine, "pyengine:request_time_per_output_token_seconds_count") == 2
    assert sample(engine, "pyengine:request_decode_time_seconds_count") == 2
    assert sample(engine, "pyengine:generation_tokens_total") == 11


def test_n_gt_1_counts_prompt_once_and_requests_not_sequences():
    engine = fake_engine()
    prompt = list(range(3, 3 + 40))
    engine.add_request("a", prompt, SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True))
    assert sample(engine, "pyengine:prompt_tokens_total") == 40
    assert sample(engine, "pyengine:request_prompt_tokens_sum") == 40
    running = set()
    while engine.has_unfinished():
        engine.step()
        running.add((sample(engine, "pyengine:num_requests_running"), sample(engine, "pyengine:num_requests_waiting")))
    assert (1.0, 0.0) in running
    assert all(r + w <= 1 for r, w in running), running
    assert sample(engine, "pyengine:request_generation_tokens_sum") == 4 * 5
    assert sample(engine, "pyengine:request_generation_tokens_count") == 1
    assert sample(engine, "pyengine:request_success_total", finished_reason="length") == 4


def test_waiting_counts_requests():
    engine = fake_engine(max_num_seqs=1)
    for i in range(3):
        engine.add_request(f"r{i}", [3 + i, 4], SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    assert sample(engine, "pyengine:num_requests_running") == 1
    assert sample(engine, "pyengine:num_requests_waiting") == 2
