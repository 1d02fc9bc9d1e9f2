"""The prefix-aware replica router (server/replica_router.py): plain Python, no Ray needed (but the Serve
config file's test)."""
import os

import pytest

from server.replica_router import PrefixRouter, Replica, RouterConfig


def router(n: int = 2, **kw) -> PrefixRouter:
    return PrefixRouter([Replica(f"engine-{i}") for i in range(n)], RouterConfig(block_size=4, **kw))


def send(r: PrefixRouter, ids: list[int], session: str | None = None):
    d = r.choose(ids, session)
    r.record(d.index, ids, session)
    return d


def test_block_hashes_cover_full_blocks_and_depend_on_everything_before():
    r = router()
    assert len(r.block_hashes(list(range(11)))) == 2  # the partial third block is not hashed
    a, b = r.block_hashes([1, 2, 3, 4, 5, 6, 7, 8]), r.block_hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same second block, different first block: a different prefix


def test_shared_leading_blocks_go_to_the_replica_that_holds_them():
    r = router()
    first = send(r, list(range(100, 112)))  # 3 blocks
    other = send(r, list(range(200, 212)))
    assert (first.reason, other.reason) == ("least_loaded", "least_loaded")
    assert first.index != other.index  # idle replicas take turns
    follow = send(r, list(range(100, 108)) + [7, 7, 7, 7, 7])  # shares 2 of the first prompt's blocks
    assert (follow.index, follow.reason, follow.matched_blocks) == (first.index, "prefix", 2)


def test_conversation_sticks_to_its_replica_by_session_or_by_prefix():
    r = router(3)
    prompt = list(range(50, 58))
    turn1 = send(r, prompt, "conv-1")
    for turn in range(2, 6):
        prompt = prompt + [turn] * 6  # the next turn's prompt extends the last one
        d = send(r, prompt, "conv-1")
        assert (d.index, d.reason) == (turn1.index, "session")
        assert d.matched_blocks >= 2
        d = send(r, prompt, None)  # no session id: the prompt's blocks lead to the same replica
        assert (d.index, d.reason) == (turn1.index, "prefix")


def test_a_busy_prefix_holder_is_passed_over_for_the_least_loaded():
    r = router(max_imbalance=2)
    hot = list(range(8))
    holder = send(r, hot).index
    r.replicas[holder].in_flight = 3  # more than max_imbalance above the idle replica
    d = r.choose(hot)
    assert (d.index, d.reason) == (1 - holder, "least_loaded")
    r.replicas[holder].in_flight = 2
    assert r.choose(hot).index == holder


def test_unhealthy_and_forgotten_replicas_are_not_chosen():
    r = router()
    ids = list(range(8))
    holder = send(r, ids, "s").index
    r.replicas[holder].healthy = False
    r.forget(holder)
    d = r.choose(ids, "s")
    assert (d.index, d.reason) == (1 - holder, "least_loaded")
    r.replicas[holder].healthy = True
    assert r.choose(ids, "s").reason == "least_loaded"  # its cache was lost: no affinity left
    r.replicas[0].healthy = r.replicas[1].healthy = False
    assert r.choose(ids) is None


def test_tables_are_bounded():
    r = router(max_entries=3)
    for i in range(10):
        send(r, [i] * 4, f"s{i}")
    assert len(r._blocks) == 3 and len(r._sessions) == 3
    assert r.choose([9] * 4, "s9").reason == "session"
    assert r.choose([0] * 4, "s0").reason == "least_loaded"


def test_serve_config_file_builds_the_application():
    """deploy/ray_serve.yaml is a valid Serve config whose args build_app accepts."""
    pytest.importorskip("ray.serve")
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from server.ray import _as_argv, build_app

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy",
                           "ray_serve.yaml")) as f:
        config = yaml.safe_load(f)
    schema = ServeDeploySchema.model_validate(config)
    app = schema.applications[0]
    assert app.import_path == "server.ray:build_app" and app.route_prefix is None
    build_app(app.args)
    assert _as_argv({"replicas": 2, "enable_prefix_caching": False, "api_key": ["a", "b"], "model": None}) == \
        ["--replicas", "2", "--no-enable-prefix-caching", "--api-key", "a", "--api-key", "b"]
    with pytest.raises(ValueError, match="replicas must be at least 1"):
        build_app({"replicas": 0})


def test_without_affinity_every_request_goes_to_the_least_loaded():
    r = router(affinity=False)
    ids = list(range(8))
    first = send(r, ids, "s")
    r.replicas[first.index].in_flight = 1
    d = r.choose(ids, "s")
    assert (d.index, d.reason) == (1 - first.index, "least_loaded")
