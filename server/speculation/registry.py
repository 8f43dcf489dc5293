"""The one list of proposers. Adding a proposer = its own file + one line in `BUILTIN`.

The registry feeds everything that names a method: the CLI's choices, settings validation, the API's
check of `speculation.method`, the engine's proposers and the metrics' label values. Entries name
their class as "module:Class" and are imported only when an engine is built, so this module stays
importable from the CLI and the API without torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

PLAIN = "none"  # plain decoding: no proposer
AUTO = "auto"  # the planner picks a proposer (or none) and K per sequence and step


@dataclass(frozen=True)
class Entry:
    """A proposer's method name and its class (a `Proposer` subclass with `build(ctx)`), or
    "module:Class" to import it lazily."""

    name: str
    proposer: str | type
    summary: str = ""

    def build(self, ctx: Any) -> Any:
        """The `Proposer` for this server built from `ctx` (a `BuildContext`), or None when it cannot run
        here (e.g. no draft model). Typed loosely: this module names proposers and imports none of them,
        so the settings and the CLI can read `BUILTIN.methods` without importing torch."""
        cls = self.proposer
        if isinstance(cls, str):
            module, _, attr = cls.partition(":")
            cls = getattr(importlib.import_module(module), attr)
        return cls.build(ctx)


@dataclass(frozen=True)
class Registry:
    """An immutable, ordered set of proposer entries (order = `auto`'s tie-break preference)."""

    entries: tuple[Entry, ...]

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        if len(set(names)) != len(names) or {PLAIN, AUTO} & set(names):
            raise ValueError(f"proposer names must be unique and not {PLAIN!r}/{AUTO!r}: {names}")

    @property
    def proposers(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    @property
    def methods(self) -> tuple[str, ...]:
        """Every method a request or the settings may name."""
        return (PLAIN, *self.proposers, AUTO)

    def with_entry(self, entry: Entry) -> Registry:
        return Registry((*self.entries, entry))


BUILTIN = Registry((
    Entry("ngram", "server.speculation.ngram:NgramProposer", "prompt lookup: copies what followed the latest match"),
    Entry("suffix", "server.speculation.suffix:SuffixProposer", "suffix trees over this request and earlier outputs"),
    Entry("draft", "server.speculation.draft_model:DraftModelProposer", "a smaller causal LM with its own KV cache"),
    Entry("eagle", "server.speculation.eagle:EagleProposer", "a one-layer head drafting from the target's features"),
))
