"""The cluster's parts that need no running Ray: the cache-aware ranking, its prefix index, the routing keys read
from request bodies, and the deployment options built from the settings."""

from __future__ import annotations

import json

import pytest

from server.cluster.application import replica_options
from server.cluster.router import PrefixIndex, rank
from server.cluster.routing_key import request_routing
from server.config import Settings


def chat_body(*contents: str, salt: str | None = None) -> bytes:
    messages = [{"role": "system" if i == 0 else "user", "content": c} for i, c in enumerate(contents)]
    return json.dumps({"model": "m", "messages": messages, **({"cache_salt": salt} if salt else {})}).encode()


def test_a_later_turn_matches_the_replica_that_served_the_earlier_one():
    index = PrefixIndex(block_chars=8)
    first, _ = request_routing("POST", "/v1/chat/completions", chat_body("You are terse.", "What is a monad?"))
    index.insert("a", first.salt, first.text)
    index.insert("b", "", "something else entirely, long enough for blocks")
    later, _ = request_routing("POST", "/v1/chat/completions",
                               chat_body("You are terse.", "What is a monad?", "And a functor?"))
    matches = index.match(later.salt, later.text, ["a", "b"])
    assert matches["a"] >= len(first.text) - 8 and matches["b"] == 0
    assert rank(["a", "b"], loads={"a": 0, "b": 0}, matches=matches, sizes={}, imbalance=2) == ["a", "b"]


def test_prefixes_are_shared_only_within_a_cache_salt():
    index = PrefixIndex(block_chars=4)
    index.insert("a", "alice", "the same long prompt text")
    assert index.match("bob", "the same long prompt text", ["a"]) == {"a": 0}
    assert index.match("alice", "the same long prompt text", ["a"])["a"] == 24


def test_load_wins_once_it_diverges_by_more_than_the_threshold():
    matches = {"a": 64, "b": 0, "c": 0}
    assert rank(["a", "b", "c"], loads={"a": 3, "b": 1, "c": 2}, matches=matches, sizes={}, imbalance=2)[0] == "a"
    assert rank(["a", "b", "c"], loads={"a": 4, "b": 1, "c": 2}, matches=matches, sizes={}, imbalance=2) == \
        ["b", "c", "a"]


def test_without_a_match_the_least_loaded_then_the_least_holding_replica_wins():
    assert rank(["a", "b"], loads={"a": 1, "b": 0}, matches={}, sizes={"b": 99}, imbalance=2) == ["b", "a"]
    assert rank(["a", "b"], loads={"a": 0, "b": 0}, matches={}, sizes={"a": 5, "b": 1}, imbalance=2) == ["b", "a"]
    # a replica whose load is unknown (it did not answer the probe) comes last
    assert rank(["a", "b"], loads={"a": None, "b": 5}, matches={"a": 99}, sizes={}, imbalance=2) == ["b", "a"]


def test_a_pinned_request_goes_to_its_replica_first_and_gone_replicas_are_forgotten():
    assert rank(["a", "b"], loads={"a": 9, "b": 0}, matches={"b": 99}, sizes={}, imbalance=2, pin="a") == ["a", "b"]
    # pinned to a replica that is no longer a candidate (drained, dead): routed as any other request
    assert rank(["b"], loads={"b": 0}, matches={}, sizes={}, imbalance=2, pin="a") == ["b"]
    index = PrefixIndex(block_chars=4)
    index.insert("a", "", "abcdefgh")
    index.retain(["b"])
    assert index.size("a") == 0 and index.match("", "abcdefgh", ["a"]) == {"a": 0}


def test_the_index_keeps_at_most_max_blocks_per_replica():
    index = PrefixIndex(block_chars=2, max_blocks=3)
    index.insert("a", "", "aabbccddee")
    assert index.size("a") == 3
    assert index.match("", "aabb", ["a"]) == {"a": 0}  # the oldest blocks went first


@pytest.mark.parametrize(("method", "path", "body", "text", "pin"), [
    ("POST", "/v1/completions", b'{"prompt": "Once upon", "cache_salt": "s"}', "Once upon", None),
    ("POST", "/v1/completions", b'{"prompt": ["first", "second"]}', "first", None),
    ("POST", "/v1/responses", b'{"input": "hi", "instructions": "be brief", "previous_response_id": "resp_1"}',
     "be brief\x1euser\x1fhi", "resp_1"),
    ("GET", "/v1/responses/resp_2", b"", "", "resp_2"),
    ("POST", "/v1/chat/completions", b"not json", "", None),
    ("POST", "/tokenize", b'{"prompt": "x"}', "", None),
])
def test_routing_keys(method, path, body, text, pin):
    key, pinned = request_routing(method, path, body)
    assert (key.text, pinned) == (text, pin)


def test_deployment_options_follow_the_settings():
    fixed = replica_options(Settings.load(replicas=3, max_batch_size=4, max_waiting=8, replica_num_cpus=2))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == 12 and fixed["max_queued_requests"] == 8
    assert fixed["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0}
    assert fixed["request_router_config"].request_router_kwargs == {"imbalance": 2.0}
    scaled = replica_options(Settings.load(replicas=2, min_replicas=1, max_replicas=6, target_ongoing_requests=3,
                                           request_router="power_of_two"))
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 6, "initial_replicas": 2,
                                            "target_ongoing_requests": 3.0}
    assert "num_replicas" not in scaled and "request_router_config" not in scaled
    with pytest.raises(ValueError, match="min_replicas"):
        Settings.load(replicas=8, max_replicas=4)
