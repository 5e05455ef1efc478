"""Every group's state for an operator's read, each made once per version of the group.

A status page or a scrape of ``/metrics`` reads every group (``RegistryBase.group_states``): at
100,000 ranks that made 12,500 ``GroupState`` objects from their entries each time, and the
observer compared each rank with its last sight, 0.7-1.8 s of the registry's CPU a read on the
2-core machine (``docs/benchmarks.md``), though heartbeats change no key between two reads.

What a state holds apart from its read's instant is a function of the group's entries: so
each group's state is kept with the group's version (its entries' keys and modification
revisions, as ``app/watch/rendered.py`` keys a list page's JSON), and a read whose entries are
of the same version takes the kept state with only what moves filled in afresh: each agent's
expiry (the read's instant plus its lease's time left, a full ``ttl_s`` for a lease the store
does not know, as ``GroupState.read`` computes it) and the read's revision. The kept state's
engine, agents and revisions are shared, never changed (no code changes a ``GroupState``);
sharing the agents is also how the observer tells a group that did not change
(``app/registry/observer.py``). ``tests/app/registry/test_kept_states.py`` checks the kept
states equal
fresh reads through a group's changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.registry import keys
from app.registry.records import Decoded
from app.registry.state import GroupState
from app.store import Entry, Snapshot

Version = tuple[tuple[str, ...], tuple[int, ...]]


@dataclass(slots=True)
class _Kept:
    version: Version
    state: GroupState
    leases: list[tuple[int, int, float]]  # each agent entry's rank, lease and ttl, in order


def version_of(entries: Sequence[Entry]) -> Version:
    """The entries' keys and modification revisions (two tuples: a pair for each entry cost
    more than the rest of a kept state's read)."""
    return tuple([e.key for e in entries]), tuple([e.mod_revision for e in entries])


class KeptStates:
    """Groups' states kept per version (see the module doc); what one read of every group
    did not show is dropped at the next (``keep_only``)."""

    def __init__(self) -> None:
        self._kept: dict[str, _Kept] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def state(
        self,
        gid: str,
        entries: Sequence[Entry],
        revision: int,
        remaining: dict[int, float],
        read_at: float,
        decoded: Decoded,
    ) -> GroupState | None:
        """The group's state as ``GroupState.read(..., brief=True)`` reads these entries."""
        version = version_of(entries)
        kept = self._kept.get(gid)
        if kept is None or kept.version != version:
            snap = Snapshot(list(entries), revision, remaining, read_at)
            state = GroupState.read(snap, gid, decoded, brief=True)
            if state is None:
                self._kept.pop(gid, None)
                return None
            prefix = keys.agent_prefix(gid)
            briefs = [decoded.brief(e) for e in entries if e.key.startswith(prefix)]
            leases = [(a.rank, a.lease, float(a.ttl_s)) for a in briefs]
            self._kept[gid] = _Kept(version, state, leases)
            return state
        was = kept.state
        expires = {rank: read_at + remaining.get(lease, ttl) for rank, lease, ttl in kept.leases}
        state = GroupState(
            was.engine,
            was.engine_revision,
            was.agents,
            was.agent_revisions,
            expires,
            revision,
            was.serving,
            was.serving_revision,
        )
        state.__dict__["missing"] = was.missing  # the cached property, made once
        return state

    def keep_only(self, gids: set[str]) -> None:
        """Drop the groups not in ``gids`` (deleted since)."""
        if self._kept.keys() - gids:
            self._kept = {g: k for g, k in self._kept.items() if g in gids}
