"""The KV budget (`kv_cache_memory`): caches sized once, requests wait for room, one that could never fit
is a 400 naming its field, `kv_cache_usage` is the fraction of the budget held, and text is unchanged."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.config import Settings, parse_memory
from server.engine.admission import ROW_SLACK
from server.engine.engine import Engine
from server.model.runner import ModelRunner
from server.scheduler import Scheduler
from tests.engine_helpers import request, run
from tests.live_server import live_server

SLOTS = 400


def budget(tiny_target, tiny_draft, slots: int = SLOTS) -> str:
    """`kv_cache_memory` that buys `slots` tokens in the target's and the draft's caches together."""
    per_token = sum(ModelRunner.kv_shape(m.model).bytes_per_token for m in (tiny_target, tiny_draft))
    return str(slots * per_token)


def settings(memory: str, step_tokens: int = ROW_SLACK, **overrides) -> Settings:
    """A KV budget, and a step token budget whose widest row needs no more than one step's drafts (a row's
    reservation counts the step's widest row: `max_num_batched_tokens` columns, at least `ROW_SLACK`)."""
    return Settings.load(kv_cache_memory=memory, max_num_batched_tokens=step_tokens, **overrides)


@pytest.mark.parametrize(("text", "value"), [("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("0.25", 0.25),
                                             ("1073741824", 2**30), ("1.0", 1.0)])
def test_memory_values(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("text", ["-1GB", "1.5", "12 parsecs", "GiB", "0.0"])
def test_bad_memory_values_fail_at_start_up(text):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        Settings.load(kv_cache_memory=text)


def test_the_budget_sizes_the_caches_once_and_bounds_the_context(tiny_target, tiny_draft):
    engine = Engine(tiny_target, tiny_draft, settings(budget(tiny_target, tiny_draft)))
    assert engine.kv_slots == SLOTS
    assert engine.limits.max_context == SLOTS - ROW_SLACK  # one row alone, with a step's columns to spare
    assert engine.runner.allocated_slots == SLOTS  # allocated up front
    assert Engine(tiny_target, tiny_draft, Settings.load()).kv_slots is None
    wide = Engine(tiny_target, tiny_draft, settings(budget(tiny_target, tiny_draft), 100))
    assert wide.limits.max_context == SLOTS - 100  # a step's widest row may be a prompt chunk of 100 tokens


def test_greedy_text_is_the_same_within_a_budget(tiny_target, tiny_draft, prompt_ids, greedy_reference):
    """Five rows with every method, in a budget that holds them all: joins, leaves and capacity changes move
    rows inside the one buffer, and the text equals plain greedy decoding."""
    slots = 5 * (max(len(p) for p in prompt_ids) + 16 + ROW_SLACK)  # exactly enough for all five
    engine = Engine(tiny_target, tiny_draft, settings(budget(tiny_target, tiny_draft, slots)))
    methods = ["none", "ngram", "draft", "suffix", "auto"]
    reqs = [request(f"r{i}", p, m, 3) for i, (p, m) in enumerate(zip(prompt_ids, methods, strict=True))]
    assert engine.fits(reqs)
    assert run(engine, reqs) == greedy_reference


@pytest.mark.slow
def test_admission_waits_for_room_and_usage_is_the_budget_held(tiny_target, tiny_draft, prompt_ids):
    engine = Engine(tiny_target, tiny_draft, settings(budget(tiny_target, tiny_draft)))
    # Each row reserves prompt + max_tokens + ROW_SLACK columns: two of 150 fit 400 slots, three do not.
    reqs = [request(f"r{i}", p, "ngram", 3, max_tokens=150 - ROW_SLACK - len(p)) for i, p in enumerate(prompt_ids)]
    assert engine.fits(reqs[:2]) and not engine.fits(reqs[:3])
    engine.add_requests(reqs[:2])
    assert engine.kv_cache_usage() == pytest.approx(2 * 150 / SLOTS)
    assert not engine.fits(reqs[2:3])
    for rid in ("r0", "r1"):
        engine.abort_request(rid)
    assert engine.kv_cache_usage() == 0 and engine.fits(reqs[2:4])

    batches: list[int] = []
    real_step = engine.step

    def step():
        batches.append(len(engine.running))
        return real_step()

    engine.step = step

    async def serve() -> dict[str, list[int]]:
        sched = Scheduler(engine, max_batch_size=8, max_waiting=8)
        sched.start()
        streams = {r.request_id: sched.submit([r]) for r in reqs}
        tokens: dict[str, list[int]] = {}
        for rid, stream in streams.items():
            async for _, out in stream.events():
                tokens.setdefault(rid, []).extend(out.token_ids)
        await sched.shutdown(0)
        return tokens

    tokens = asyncio.run(serve())
    assert max(batches) == 2  # the budget, not max_batch_size, bounded the batch
    assert tokens == run(Engine(tiny_target, tiny_draft, Settings.load()), reqs)  # all served, text unchanged


@pytest.mark.slow
def test_a_request_that_could_never_fit_is_a_400_naming_the_field(tiny_target, tiny_draft):
    memory = budget(tiny_target, tiny_draft)
    with live_server(tiny_target, tiny_draft, served_model_name="tiny", kv_cache_memory=memory,
                     max_num_batched_tokens=ROW_SLACK) as (url, _):
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": SLOTS, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt" and str(SLOTS - ROW_SLACK) in error["message"]
        del body["max_tokens"]  # unset: the server's default, clipped to what fits
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
