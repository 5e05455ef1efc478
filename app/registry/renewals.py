"""A heartbeat's renewals: which leases a heartbeat renews, read as cheaply as is safe.

A heartbeat renews the lease of each of its ranks when that rank is a live agent of the
engine it names, and is refused otherwise (``_leases``: the group's range read). At fleet
scale a node's heartbeat is the registry's commonest request, so two cheaper reads come first,
each answering only when every rank is a live agent of that engine (anything else takes the
range read, which answers or refuses as before):

- the store's memory (``Store.peek``; the SQLite store), read without waiting; a node's last
  answer is kept with the store's ``memory_version`` of ``groups/``, and while that number
  stands (no entry there put or deleted since, none ended; the events the registry appends
  under ``events/`` do not count) the answer stands without the peek: the leases' own
  liveness is what the renewal then judges (``refresh_lease`` refuses an ended one, and the
  heartbeat is refused as a peek would have it refused);
- the replica's watch feed (``seen``), for a store whose renewals say the revision they were
  applied at (``Store.renewal_revisions``; etcd): the leases the feed shows are renewed first,
  then the feed is checked again once it has applied every change up to the latest renewal's
  revision. It must still show the same leases: a state at a revision no older than the
  renewals, so the answer is one a read made after them would give, without the range read
  (on etcd a gRPC call of about 0.5 ms of this process's CPU). Lagging more than
  ``SEEN_WAIT_S``, or showing anything else, the heartbeat takes the range read.
"""

from __future__ import annotations

from typing import TypeVar

from app.core.errors import FieldPath
from app.registry import keys
from app.registry.base import RegistryBase, _no_group, outside_group
from app.registry.records import AgentBrief, EngineRecord
from app.registry.state import GroupState
from app.store import Entry, Lease

# A node's heartbeat's read: its keys, the entries read, the leases they gave, the store's
# memory_version they were read at.
_Kept = tuple[list[str], list[Entry | None], dict[int, int], int | None]

# How long a heartbeat waits for the watch feed to reach its renewals' revision. The leases are
# renewed before the wait, so a feed that lags delays the answer, never the renewal; the range
# read instead costs etcd a linearizable read when a launch's load can least afford it. In a
# launch of 100,000 ranks on etcd the feed lagged 0.5-1.4 s (median) for minutes: with 1 s,
# 15-47% of the heartbeats of each 5 s of the launch's first 80 s took the range read; with 3 s,
# none after its first 25 s, and the launch was ready in 131 s against 168 s (one run each,
# docs/benchmarks.md). The worker library waits for a heartbeat's answer as long as its
# interval (10 s by default).
SEEN_WAIT_S = 3.0


# Nodes whose last answer is kept (``_leases_now``, ``_leases_seen``): past it the memo starts
# over.
MEMO_NODES = 50_000

K = TypeVar("K")
V = TypeVar("V")


def _keep(memo: dict[K, V], asked: K, answer: V) -> None:
    """``answer`` kept for ``asked``, in a memo of at most ``MEMO_NODES`` nodes."""
    if len(memo) >= MEMO_NODES:
        memo.clear()
    memo[asked] = answer


class RenewalsMixin(RegistryBase):
    _renewal_memo: dict[tuple[str, str, tuple[int, ...]], _Kept] | None = None
    # A node's last answer from the watch feed, with the group's mapping it was read from (a
    # mapping is replaced on a change, never changed: the same one gives the same answer).
    _seen_memo: dict[tuple[str, str, tuple[int, ...]], tuple[object, dict[int, int]]] | None = None

    async def _renewals(
        self, gid: str, ranks: list[int], engine_id: str, field: FieldPath = ("ranks",)
    ) -> dict[int, Lease]:
        """A heartbeat: each of ``ranks`` with its renewed lease, or the refusal."""
        leases = self._leases_now(gid, ranks, engine_id)
        if leases is None:
            seen = await self._renewed_as_seen(gid, ranks, engine_id)
            if seen is not None:
                return seen
            leases = await self._leases(gid, ranks, engine_id, field)
        renewed, gone = await self._renew(leases)
        if gone is not None:
            raise self._absent(gid, next(r for r in ranks if leases[r] == gone))
        return {r: renewed[leases[r]] for r in ranks}

    async def _renew(self, leases: dict[int, int]) -> tuple[dict[int, Lease], int | None]:
        """Each lease of ``leases`` (rank -> lease) renewed once, in order; stops at the first
        the store no longer has, and says which (None: every one renewed)."""
        renewed: dict[int, Lease] = {}
        for lease_id in dict.fromkeys(leases.values()):
            lease = await self.store.refresh_lease(lease_id)
            if lease is None:
                return renewed, lease_id
            renewed[lease_id] = lease
        return renewed, None

    def _leases_in(
        self, entries: list[Entry | None], ranks: list[int], engine_id: str
    ) -> dict[int, int] | None:
        """Each rank's lease from the engine's entry and the ranks' agent entries, when every
        rank is a live agent of ``engine_id`` (else None)."""
        if entries[0] is None:
            return None
        engine = self.decoded.record(entries[0], EngineRecord)
        if engine.engine_id != engine_id:
            return None
        leases: dict[int, int] = {}
        for rank, entry in zip(ranks, entries[1:], strict=True):
            if entry is None or rank >= engine.tp_size:
                return None
            brief = self.decoded.brief(entry)
            if brief.engine_id != engine_id:
                return None
            leases[rank] = brief.lease
        return leases

    def _leases_now(self, gid: str, ranks: list[int], engine_id: str) -> dict[int, int] | None:
        """From the store's memory without waiting (None where it cannot say). A node's last
        answer is kept with the entries it was read from: the same entries (the same objects:
        entries are immutable, a change is a new one) give the same answer without decoding
        them again (a node's heartbeat repeats the same read every interval), and at the same
        ``memory_version`` without reading them (a lease ended since is then refused by its
        renewal, not here)."""
        if self.store.remote_reads:
            return None  # a store whose reads are round trips has no memory to peek at
        memo = self._renewal_memo
        if memo is None:
            memo = self._renewal_memo = {}
        asked = (gid, engine_id, tuple(ranks))
        kept = memo.get(asked)
        version = self.store.memory_version(keys.GROUPS)
        if kept is not None and version is not None and kept[3] == version:
            # No entry changed since; the renewal judges the agents' leases (the engine's entry
            # has none: engines.py puts it without one).
            return kept[2]
        wanted = kept[0] if kept else [keys.engine(gid), *(keys.agent(gid, r) for r in ranks)]
        entries = self.store.peek(wanted)
        if entries is None:
            return None
        if kept is not None and all(a is b for a, b in zip(entries, kept[1], strict=True)):
            memo[asked] = (wanted, entries, kept[2], version)
            return kept[2]
        leases = self._leases_in(entries, ranks, engine_id)
        if leases is not None:
            _keep(memo, asked, (wanted, entries, leases, version))
        return leases

    def _leases_seen(self, gid: str, ranks: list[int], engine_id: str) -> dict[int, int] | None:
        """From the watch feed as it is now (maybe behind the store); a node's last answer
        kept with the group's mapping it came from (``_seen_memo``)."""
        group = self.seen.groups.get(gid) if self.seen is not None else None
        if group is None:
            return None
        memo = self._seen_memo
        if memo is None:
            memo = self._seen_memo = {}
        asked = (gid, engine_id, tuple(ranks))
        kept = memo.get(asked)
        if kept is not None and kept[0] is group:
            return kept[1]
        entries = [group.get(keys.engine(gid)), *(group.get(keys.agent(gid, r)) for r in ranks)]
        leases = self._leases_in(entries, ranks, engine_id)
        if leases is not None:
            _keep(memo, asked, (group, leases))
        return leases

    async def _renewed_as_seen(
        self, gid: str, ranks: list[int], engine_id: str
    ) -> dict[int, Lease] | None:
        if self.seen is None or not self.store.renewal_revisions:
            return None
        leases = self._leases_seen(gid, ranks, engine_id)
        if leases is None:
            return None
        renewed, gone = await self._renew(leases)
        if gone is not None or any(lease.revision is None for lease in renewed.values()):
            return None  # gone: the range read says why
        after = max(lease.revision or 0 for lease in renewed.values())
        watched = all(lease.watched for lease in renewed.values())
        if not await self.seen.reached(after, SEEN_WAIT_S, nudge=not watched):
            return None
        if self._leases_seen(gid, ranks, engine_id) != leases:
            return None
        return {r: renewed[leases[r]] for r in ranks}

    async def _leases(
        self, gid: str, ranks: list[int], engine_id: str, field: FieldPath = ("ranks",)
    ) -> dict[int, int]:
        """For a heartbeat: the lease of each of ``ranks`` (a live agent of ``engine_id``),
        refused as ``_current`` refuses; read from the agents' briefs, no ``GroupState``
        (a node's heartbeat at fleet scale is the registry's commonest request)."""
        snap = await self.store.range(keys.group_prefix(gid))
        engine_key, agent_prefix = keys.engine(gid), keys.agent_prefix(gid)
        engine: EngineRecord | None = None
        briefs: list[AgentBrief] = []
        for entry in snap.entries:
            if entry.key == engine_key:
                engine = self.decoded.record(entry, EngineRecord)
            elif entry.key.startswith(agent_prefix):
                briefs.append(self.decoded.brief(entry))
        if engine is None:
            raise _no_group(gid)
        for rank in ranks:
            if rank >= engine.tp_size:
                raise outside_group(gid, rank, engine.tp_size, field)
        if engine_id != engine.engine_id:
            state = GroupState.read(snap, gid, self.decoded, brief=True)
            assert state is not None
            raise await self._mismatch(state, ranks[0], engine_id)
        # Agents of an older engine never outlive its supersession (GroupState is as strict).
        live = {b.rank: b.lease for b in briefs if b.engine_id == engine_id}
        absent = [r for r in ranks if r not in live]
        if absent:
            raise self._absent(gid, absent[0])
        return {r: live[r] for r in ranks}
