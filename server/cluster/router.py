"""The cache-aware request router: a request goes to the replica that holds the longest prefix of its prompt.

A replica's prefix cache keeps the keys and values of prompts it prefilled, and its suffix pool drafts from the
text it has seen: a conversation's next turn, or an agent's next call sharing its system prompt and tools, runs
fastest where the earlier ones ran. The router keeps, per replica, what it sent there (`PrefixIndex`: chained
hashes of the prompt text in blocks of `block_chars`, per `cache_salt`, least recently used out past
`max_blocks`) and ranks the replicas for each request (`rank`):

1. a replica the request is pinned to (it stored the response the request continues), alone, first;
2. else the replica with the longest prefix match (ties: the least loaded), unless its load exceeds the least
   loaded replica's by more than `imbalance`: then
3. the least loaded (ties: the one holding the least, so new conversations spread out).

Every replica follows in order of load, so a full replica (Ray's `max_ongoing_requests`) passes the request on
to the next. Ray gives the router only replicas that are running: a replica that is draining (scale-down,
shutdown) or dead is not among the candidates, and its entries are dropped.

The index is the router's own (one per ingress replica); it is what was sent, not what each replica still
caches, which is what vLLM's and SGLang's cache-aware routers and Ray's `PrefixCacheAffinityRouter` keep too.

>>> index = PrefixIndex(block_chars=4)
>>> index.insert("a", "", "You are terse. Hello")
>>> index.match("", "You are terse. Goodbye", ["a", "b"])
{'a': 12, 'b': 0}
>>> rank(["a", "b"], loads={"a": 1, "b": 0}, matches={"a": 12, "b": 0}, sizes={}, imbalance=2)
['a', 'b']
>>> rank(["a", "b"], loads={"a": 4, "b": 0}, matches={"a": 12, "b": 0}, sizes={}, imbalance=2)
['b', 'a']
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from server.cluster.forwarding import ForwardedRequest, RoutingKey

log = logging.getLogger(__name__)


class PrefixIndex:
    """Which prompt prefixes were sent to which replica, in blocks of `block_chars` characters.

    Block i of a text is identified by a hash chained over the salt and blocks 0..i, so a match of n blocks
    means the first n * block_chars characters are equal (up to hash collisions, which cost one routing choice,
    never correctness). Each replica keeps at most `max_blocks` blocks, least recently used out first.
    """

    def __init__(self, block_chars: int = 32, max_blocks: int = 16384) -> None:
        if block_chars < 1 or max_blocks < 1:
            raise ValueError("block_chars and max_blocks must be positive")
        self.block_chars, self.max_blocks = block_chars, max_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def _chain(self, salt: str, text: str) -> list[int]:
        h, out = hash(("specula", salt)), []
        for start in range(0, len(text) - self.block_chars + 1, self.block_chars):
            h = hash((h, text[start:start + self.block_chars]))
            out.append(h)
        return out

    def insert(self, replica: str, salt: str, text: str) -> None:
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in self._chain(salt, text):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def match(self, salt: str, text: str, replicas: Iterable[str]) -> dict[str, int]:
        """Characters of `text`'s prefix each of `replicas` holds (a multiple of `block_chars`)."""
        chain = self._chain(salt, text)
        out = {}
        for replica in replicas:
            blocks = self._blocks.get(replica, {})
            n = 0
            while n < len(chain) and chain[n] in blocks:
                n += 1
            out[replica] = n * self.block_chars
        return out

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget every replica not in `replicas` (stopped, draining or dead)."""
        keep = set(replicas)
        for replica in [r for r in self._blocks if r not in keep]:
            del self._blocks[replica]


def rank(
    replicas: list[str],
    *,
    loads: Mapping[str, float | None],
    matches: Mapping[str, int],
    sizes: Mapping[str, int],
    imbalance: float,
    pin: str | None = None,
) -> list[str]:
    """`replicas` in the order to try them (see the module doc). A load of None (unknown) counts as infinite."""
    load = {r: math.inf if loads.get(r) is None else float(loads[r]) for r in replicas}
    by_load = sorted(replicas, key=lambda r: (load[r], sizes.get(r, 0), r))
    if pin is not None and pin in load:
        return [pin] + [r for r in by_load if r != pin]
    if not by_load:
        return []
    best = max(replicas, key=lambda r: (matches.get(r, 0), -load[r]))
    if matches.get(best, 0) > 0 and load[best] - load[by_load[0]] <= imbalance:
        return [best] + [r for r in by_load if r != best]
    return by_load


def routing_key_of(pending: PendingRequest | None) -> RoutingKey | None:
    """The routing key of a request the ingress forwarded; None for any other call (broadcasts, probes)."""
    if pending is None:
        return None
    for arg in pending.args:
        if isinstance(arg, ForwardedRequest):
            return arg.routing
    return None


class CacheAwareRouter(RequestRouter):
    """Ray Serve's request router for the engine replicas (`RequestRouterConfig.request_router_class`)."""

    def initialize_state(self, block_chars: int = 32, max_blocks: int = 16384, imbalance: float = 2) -> None:
        """Called by Ray with `request_router_kwargs`: the index's block size and capacity, and by how many
        ongoing requests the best-matching replica may exceed the least loaded one before load wins."""
        self.index = PrefixIndex(block_chars, max_blocks)
        self.imbalance = imbalance

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Once every rank was full, back off before trying again (Ray's loop spins otherwise).
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        key = routing_key_of(pending_request) or RoutingKey()
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        names = list(by_name)
        loads = await self._loads(candidate_replicas)
        order = rank(
            names,
            loads=loads,
            matches=self.index.match(key.salt, key.text, names) if key.text else {},
            sizes={n: self.index.size(n) for n in names},
            imbalance=self.imbalance,
            pin=key.pin,
        )
        return [[by_name[n]] for n in order]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int | None]:
        """Each replica's ongoing requests: Ray's cached figure, or asked of the replica when it has none."""
        loads: dict[str, int | None] = {}
        unknown = []
        for r in replicas:
            cached = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if cached is None:
                unknown.append(r)
            else:
                loads[r.replica_id.unique_id] = cached
        if unknown:
            for r, queue_len in await self._probe_queue_lens(unknown, 0):
                loads[r.replica_id.unique_id] = queue_len
        return loads

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        key = routing_key_of(pending_request)
        if key is not None and key.text:
            self.index.insert(replica_id.unique_id, key.salt, key.text)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.retain(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.retain(r.replica_id.unique_id for r in self._replicas.values())
