"""Prompt prefixes the target has computed before: their keys and values, reused instead of prefilled.

Chat clients send the whole conversation every turn, and agents send the same system prompt and tool
list with every call, so most of a prompt has usually been through the model before. A prefill costs
about as much per token as the model's widest passes (on two CPU cores, ~1.3 ms a token: ~0.6 s for an
agent round's 460-token prompt), and nothing speculation does makes it cheaper.

Layout: token ids are cut into blocks of `BLOCK` tokens from position 0; a block is named by a digest
of its tokens chained to its parent's (and, at the root, the request's `cache_salt`), so a name stands
for the whole prefix up to the block's end, as in vLLM's automatic prefix caching. A block holds that
prefix's keys and values for its `BLOCK` positions, every layer ([layers, kv_heads, BLOCK, head_dim]),
and, when a proposer reads the target's hidden states (a draft head), those positions' final-norm
features ([BLOCK, hidden]: the head then drafts from the whole prompt, as if it had been prefilled),
copied out of the batch cache once a request's prompt is prefilled and again when it leaves (its
answer's blocks; `store`), and copied into a joining row's columns (`match`, then
`BatchKV.load_prefixes`). Keys are stored after RoPE: a prefix always starts at position 0,
so its positions are the same wherever it is reused.

A block may also hold what a proposer computed over the same prefix (`Block.states`, by proposer name:
a draft head's own keys and values, which take it ~0.1 ms a prompt token to compute on two CPU cores).
A proposer's state is added to a block when a request that computed it leaves, and a joining request
gets it for the leading blocks that hold it (`leading_states`).

Requests with different `cache_salt`s never share blocks (vLLM's semantics: tenants that must not learn
each other's prompts through timing). Blocks are evicted least recently used first, leaves before their
parents (`match` and `store` touch a chain's blocks from its end back to its root), within a budget in
bytes. Reused keys and values equal a fresh prefill's to float rounding (the same difference there is
between prefilling a prompt alone and in a batch).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

BLOCK = 16  # tokens per block: the granularity of reuse


# What a proposer keeps of one block (its own tensors, in its own layout: `Proposer.prefix_state`).
State = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Block:
    """One block's keys and values: [layers, kv_heads, BLOCK, head_dim] each; its positions' features
    [BLOCK, hidden] when they were stored with them; proposers' states of the prefix, by name."""

    keys: torch.Tensor
    values: torch.Tensor
    features: torch.Tensor | None = None
    states: Mapping[str, State] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = [self.keys, self.values, self.features, *(t for s in self.states.values() for t in s)]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# Reads a row's keys and values for its live token positions [start, end): [layers, kv_heads, n, head_dim] x 2,
# new tensors (the cache keeps them as they are).
Reader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
# Reads a proposer's state of a row's first n blocks: one per block, fewer when it computed fewer.
StateReader = Callable[[int], list[State]]


class PrefixCache:
    """Blocks of computed prefixes, least recently used evicted first, within `budget_bytes`."""

    def __init__(self, budget_bytes: int, block: int = BLOCK, namespace: str = "") -> None:
        """`namespace`: what the keys and values were computed by (the engine's: the target and its weights
        format), the root of every block's name: blocks of another model or format never match."""
        if budget_bytes <= 0 or block <= 0:
            raise ValueError("a prefix cache needs a positive budget and block size")
        self.budget_bytes = budget_bytes
        self.block = block
        self.namespace = namespace
        self.used_bytes = 0
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._blocks)

    def names(self, tokens: Sequence[int], salt: str | None) -> list[bytes]:
        """The name of every full block of `tokens`: a digest of the block's tokens and its parent's name."""
        root = b"salt:" + (salt or "").encode() if not self.namespace else (
            b"model:" + self.namespace.encode() + b"\0salt:" + (salt or "").encode()
        )
        name = hashlib.blake2b(root, digest_size=16).digest()
        out = []
        for start in range(0, len(tokens) - self.block + 1, self.block):
            data = array("q", tokens[start : start + self.block]).tobytes()
            name = hashlib.blake2b(name + data, digest_size=16).digest()
            out.append(name)
        return out

    def match(self, tokens: Sequence[int], salt: str | None, features: bool = False) -> list[Block]:
        """The cached blocks that cover the longest cached prefix of `tokens` (in order; [] for none);
        with `features`, of blocks that hold their features too."""
        found = []
        for name in self.names(tokens, salt):
            block = self._blocks.get(name)
            if block is None or (features and block.features is None):
                break
            found.append((name, block))
        self._touch([name for name, _ in found])
        return [block for _, block in found]

    def store(
        self,
        tokens: Sequence[int],
        salt: str | None,
        read: Reader,
        features: torch.Tensor | None = None,
        states: Mapping[str, StateReader] | None = None,
    ) -> int:
        """Keep the blocks of `tokens` not cached yet, reading their keys and values with `read` (a
        row's live positions), with their positions' rows of `features` ([>= positions, hidden]) where
        it covers them and each proposer's state where its reader (`states`, by name) has one; a cached
        block lacking features or a state gets them. Returns how many blocks were added."""
        names = self.names(tokens, salt)
        covered = features.shape[0] // self.block if features is not None else 0  # blocks with features given
        read_states: dict[str, list[State]] = {}  # each reader called once, when a block lacks its state

        def state(name: str, i: int) -> State | None:
            if name not in read_states:
                read_states[name] = states[name](len(names))  # type: ignore[index]
            got = read_states[name]
            return got[i] if i < len(got) else None

        added = 0
        for i, name in enumerate(names):
            old = self._blocks.get(name)
            feats = old.features if old is not None else None
            if feats is None and i < covered:
                feats = features[i * self.block : (i + 1) * self.block].clone()  # type: ignore[index]
            kept = dict(old.states) if old is not None else {}
            for proposer in states or {}:
                if proposer not in kept and (s := state(proposer, i)) is not None:
                    kept[proposer] = s
            if old is not None and feats is old.features and len(kept) == len(old.states):
                continue  # nothing new for this block
            keys, values = (old.keys, old.values) if old is not None else read(i * self.block, (i + 1) * self.block)
            block = Block(keys, values, feats, kept)
            if block.nbytes > self.budget_bytes:
                break
            if old is not None:
                self.used_bytes -= old.nbytes
            self._blocks[name] = block
            self.used_bytes += block.nbytes
            added += old is None
        self._touch(names)
        self._evict()
        return added

    def _touch(self, names: list[bytes]) -> None:
        """Most recently used: the chain's root last, so a leaf is always evicted before its parent."""
        for name in reversed(names):
            if name in self._blocks:
                self._blocks.move_to_end(name)

    def _evict(self) -> None:
        while self.used_bytes > self.budget_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self.used_bytes -= block.nbytes


def concat(blocks: list[Block]) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of consecutive blocks: [layers, kv_heads, n x BLOCK, head_dim] each."""
    return torch.cat([b.keys for b in blocks], dim=2), torch.cat([b.values for b in blocks], dim=2)


def leading_states(blocks: list[Block], proposer: str) -> list[State]:
    """`proposer`'s states of the leading `blocks` that hold one (a block without it ends them)."""
    out = []
    for block in blocks:
        state = block.states.get(proposer)
        if state is None:
            break
        out.append(state)
    return out


def concat_features(blocks: list[Block]) -> torch.Tensor:
    """The features of consecutive blocks that hold them: [n x BLOCK, hidden]."""
    assert all(b.features is not None for b in blocks), "match(features=True) returns blocks with features"
    return torch.cat([b.features for b in blocks])  # type: ignore[misc]
