"""The etcd store: the storage interface on an etcd v3 cluster, one gRPC channel per endpoint
(``aetcd``'s stubs, asyncio; TLS and auth in ``etcd_conn``), one RPC per call:

- a transaction is one Txn (``mod_revision == r``, or ``version == 0`` for "absent"); its
  header's revision answers, won or lost; a prefix delete is a DeleteRange;
- leases are etcd leases, granted for their ttl plus a headroom that the replica serving
  their renewals ends at their ttl, crediting its own stalls (``etcd_reaper``: a heartbeat
  that waited in a stalled replica still finds its lease); what one has left is known when
  this store granted or renewed it, else asked once per ``lease_cache_s`` (default: a third
  of its TTL) however many readers want it. A lease only gains time (renewed through another
  replica): the figure is a lower bound, asked again when it runs out. Renewals go through a
  few long-lived keep-alive streams a member (``etcd_keepalive``), each answer with the
  revision it was applied at. With ``REGISTRY_ETCD_RENEW_WINDOW_S`` > 0 most renewals stay in
  memory, shared through the renewal journal (``etcd_journal``), which readers answer from: a
  lease no entry was seen for reads as etcd's TTL less the headroom (never short of its time,
  at most the window long);
- ``range`` is one linearizable Range (never stale), a prefix in pages (``etcd_range``);
- ``wait``: every waiter under a top-level segment (``groups/``) shares one watch, and the
  store probes etcd once per ``probe_interval_s`` while anyone waits: a failed probe fails
  every waiter, an answer from another member than a watch's makes its waiters re-read.

Every call has one deadline, ``timeout_s``, shared among the endpoints (the preferred first, a
fair share of the time left each); at most ``max_in_flight`` calls in flight, the rest queue
(``etcd_cluster``). Any failure is :class:`Unavailable`, never a hang. Keys: ``/{prefix}/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import weakref
from collections.abc import AsyncIterator, Awaitable, Sequence
from functools import partial
from typing import Any

import aetcd
from aetcd import rpc
from aetcd.utils import prefix_range_end

from app.store.base import (
    ChangeBatch,
    Compare,
    Delete,
    Entry,
    Lease,
    Op,
    Put,
    Snapshot,
    Store,
    TxnResult,
    Unavailable,
)
from app.store.etcd import ranges as etcd_range
from app.store.etcd import txns as etcd_txns
from app.store.etcd import watch as etcd_watch
from app.store.etcd.cluster import Cluster
from app.store.etcd.config import EtcdAccess, EtcdUrl, parse_url
from app.store.etcd.journal import SLACK_S, Journal, in_journal, journal_key
from app.store.etcd.keepalive import KeepAlives, Renewed
from app.store.etcd.reaper import Reaper, headroom, headroom_s, logical
from app.store.etcd.state import LeaseBook, WatchHub
from app.store.lease_clock import ARRIVED, CLOCK, now
from app.store.tasks import stop

log = logging.getLogger("app.store")

# The least headroom (``REGISTRY_LEASE_GRACE_S``) lazy renewals run with: the journal's
# presence lease is granted for the headroom, and etcd grants none much shorter.
MIN_HEADROOM_S = 5


class EtcdStore(Store):
    renewal_revisions = True
    remote_reads = True

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        prefix: str = "engine-registry",
        *,
        tls: bool = False,
        access: EtcdAccess | None = None,
        timeout_s: float = 10.0,
        probe_interval_s: float = 1.0,
        lease_cache_s: float | None = None,
        # A bound against floods, not a throttle: a slot stays held until this process reads
        # the answer, so under a storm a small bound starves calls etcd would answer at once.
        max_in_flight: int = 2048,
        renew_window_s: float | None = None,  # None: REGISTRY_ETCD_RENEW_WINDOW_S (``CLOCK``)
    ) -> None:
        if not endpoints:
            raise ValueError("EtcdStore needs at least one endpoint")
        self.endpoints = list(endpoints)
        self._root = f"/{prefix.strip('/')}/".encode()
        # Never any credentials: they come from files, not from the URL.
        self.description = EtcdUrl(self.endpoints, prefix.strip("/"), tls).describe()
        self._cluster = Cluster(
            self.endpoints,
            tls=tls,
            access=access or EtcdAccess(),
            timeout_s=timeout_s,
            max_in_flight=max_in_flight,
        )
        self._call = self._cluster.call
        self._txns = etcd_txns.TxnBatcher(self._call, self._txn_alone, timeout_s)
        self._timeout_s = timeout_s
        self._window_given = renew_window_s
        self._window: int | None = None  # fixed at the first lease call
        self._journal: Journal | None = None
        self._journal_starting: asyncio.Future[Journal] | None = None
        self._probe_interval_s = probe_interval_s
        self._leases = LeaseBook(lease_cache_s)
        self._asking: dict[int, asyncio.Task[tuple[float, int, int, int]]] = {}
        self.reaper = Reaper(self._lease_figures, self._expire)
        self._reads: dict[tuple[bytes, bytes], asyncio.Future[Any]] = {}
        self._keepalives: weakref.WeakKeyDictionary[Any, KeepAlives] = weakref.WeakKeyDictionary()
        self._hubs: dict[str, WatchHub] = {}
        self._waiters = 0
        self._prober: asyncio.Task[None] | None = None
        self._trouble: asyncio.Future[Unavailable] | None = None
        self._closed = False

    @classmethod
    def from_url(
        cls, url: str, *, timeout_s: float = 10.0, access: EtcdAccess | None = None
    ) -> EtcdStore:
        """``etcd[s]://h:p[,h:p…]/prefix``; ``access``: TLS files and credentials."""
        parsed = parse_url(url)
        access = access or EtcdAccess()
        access.check(url)
        return cls(
            parsed.endpoints, parsed.prefix, tls=parsed.tls, access=access, timeout_s=timeout_s
        )

    # -- plumbing ------------------------------------------------------------------------

    def _key(self, key: str) -> bytes:
        return self._root + key.encode()

    def _unkey(self, key: bytes) -> str:
        return bytes(key)[len(self._root) :].decode()

    def _entry(self, kv: Any) -> Entry:
        return Entry(self._unkey(kv.key), bytes(kv.value), int(kv.mod_revision), kv.lease or None)

    async def _head(self, client: aetcd.Client, seconds: float) -> int:
        """The store's revision, by a linearizable read of one (absent) key."""
        reply = await client.kvstub.Range(rpc.RangeRequest(key=self._root), timeout=seconds)
        return int(reply.header.revision)

    # -- reads -----------------------------------------------------------------------------

    async def _read(self, key: bytes, end: bytes = b"") -> Any:
        """One linearizable Range, shared by every identical read that comes before it is
        sent (while it waits for a slot, say): each of them began before the read did, so
        the answer is linearizable for all. A storm's reads come in such bursts (the ranks
        of a group fetching its engine at once, the waiters on it waking at once)."""
        pending = self._reads.get((key, end)) or self._send_read(key, end)
        try:
            return await asyncio.shield(pending)
        except Unavailable as exc:
            raise Unavailable(exc.detail) from exc  # each reader its own

    def _send_read(self, key: bytes, end: bytes) -> asyncio.Future[Any]:
        request = etcd_range.first_page(key, end)  # a prefix's first page (_read_prefix)

        def send(client: aetcd.Client, seconds: float) -> Awaitable[Any]:
            settle(read)  # sent: later readers need a read of their own
            reply: Awaitable[Any] = client.kvstub.Range(request, timeout=seconds)
            return reply

        def settle(done: asyncio.Future[Any]) -> None:
            if self._reads.get((key, end)) is done:
                del self._reads[(key, end)]
            if done.done() and not done.cancelled():
                done.exception()  # retrieved: its readers raise their own

        read = self._reads[(key, end)] = asyncio.ensure_future(self._call("read", send))
        read.add_done_callback(settle)
        return read

    async def get(self, key: str, *, settled: bool = True) -> Entry | None:
        reply = await self._read(self._key(key))
        return self._entry(reply.kvs[0]) if reply.kvs else None

    async def range(self, prefix: str, *, settled: bool = True) -> Snapshot:
        kvs, revision = await self._read_prefix(prefix)
        entries = [self._entry(kv) for kv in kvs]  # etcd answers in key order
        if in_journal(prefix):  # the renewal journal's keys are not the store's
            entries = [e for e in entries if not journal_key(e.key)]
        leases = {e.lease for e in entries if e.lease is not None}
        remaining = await self._remaining(leases) if leases else {}
        # A key whose lease's time is out (etcd keeps it for the headroom) is not shown, as
        # the SQLite store shows none past its lease's expiry.
        entries = [e for e in entries if e.lease is None or remaining.get(e.lease, 1.0) > 0]
        return Snapshot(entries, revision, remaining)

    async def _read_prefix(self, prefix: str) -> tuple[list[Any], int]:
        """Every key under ``prefix`` at one revision, in pages; the first is linearizable."""
        start, end = self._key(prefix), prefix_range_end(self._key(prefix))
        return await etcd_range.rest(self._call, await self._read(start, end), end)

    async def _remaining(self, leases: set[int]) -> dict[int, float]:
        journal = self._journal
        known = {
            lease: (journal.book.remaining(lease) if journal is not None else None)
            for lease in leases
        }
        known = {k: self._leases.remaining(k) if v is None else v for k, v in known.items()}
        out = {lease: left for lease, left in known.items() if left is not None}
        ask = [lease for lease, left in known.items() if left is None]
        found = await asyncio.gather(*(self._lease_figures(k) for k in ask))
        out |= {k: logical(f[0], f[1]) for k, f in zip(ask, found, strict=True)}
        if self.reaper.graced:  # this replica's stalls, credited to the leases it follows
            out = {k: left + self.reaper.grace(k) for k, left in out.items()}
        return out

    async def _lease_figures(self, lease: int) -> tuple[float, int, int, int]:
        """etcd's (TTL left, granted TTL, raft term, revision) of the lease, asked once
        however many want it."""
        if lease not in self._asking:  # one question per lease however many ask at once
            self._asking[lease] = asyncio.create_task(self._ask_lease(lease))
        return await asyncio.shield(self._asking[lease])

    async def _ask_lease(self, lease: int) -> tuple[float, int, int, int]:
        request = rpc.LeaseTimeToLiveRequest(ID=lease)
        try:
            info = await self._call(
                "lease read", lambda c, t: c.leasestub.LeaseTimeToLive(request, timeout=t)
            )
        finally:
            self._asking.pop(lease, None)
        header = info.header
        figures = (
            max(0.0, float(info.TTL)),
            int(info.grantedTTL),
            int(header.raft_term),
            int(header.revision),
        )
        self._leases.asked(lease, logical(figures[0], figures[1]), self._ttl_of(figures[1]))
        return figures

    # -- writes ----------------------------------------------------------------------------

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        checks = [
            rpc.Compare(key=self._key(c.key), target=rpc.Compare.VERSION, version=0)
            if c.mod_revision == 0
            else rpc.Compare(
                key=self._key(c.key), target=rpc.Compare.MOD, mod_revision=c.mod_revision
            )
            for c in compares
        ]  # result EQUAL is the default
        requests = []
        keys = [c.key for c in compares]  # what the transaction touches (``etcd_txns.scopes``)
        prefixes: list[str] = []
        for op in ops:
            key = self._key(op.key)
            if isinstance(op, Put):
                put = rpc.PutRequest(key=key, value=op.value, lease=op.lease or 0)
                requests.append(rpc.RequestOp(request_put=put))
            else:
                end = prefix_range_end(key) if op.prefix else b""
                delete = rpc.DeleteRangeRequest(key=key, range_end=end)
                requests.append(rpc.RequestOp(request_delete_range=delete))
            (prefixes if isinstance(op, Delete) and op.prefix else keys).append(op.key)
        request = rpc.TxnRequest(compare=checks, success=requests)
        return await self._txns.submit(request, etcd_txns.scopes(keys, prefixes))

    async def _txn_alone(self, request: rpc.TxnRequest) -> TxnResult:
        async def fn(client: aetcd.Client, seconds: float) -> TxnResult:
            try:
                reply = await client.kvstub.Txn(request, timeout=seconds)
            except rpc.AioRpcError as exc:
                if exc.code() != rpc.StatusCode.NOT_FOUND:  # a Put named a lease that is gone
                    raise
                return TxnResult(False, await self._head(client, seconds))
            # Won: the Txn's own revision; lost: the store's revision at the compare.
            return TxnResult(bool(reply.succeeded), int(reply.header.revision))

        return await self._call("transaction", fn)

    async def grant_lease(self, ttl_s: int) -> Lease:
        journal = await self._journal_up()
        request = rpc.LeaseGrantRequest(TTL=ttl_s + headroom_s() + self._window_s())
        at = now()
        granted = await self._call(
            "lease grant", lambda c, t: c.leasestub.LeaseGrant(request, timeout=t)
        )
        lease = self._followed(int(granted.ID), int(granted.TTL), int(granted.header.raft_term))
        if journal is not None:
            journal.renewed(lease.id, lease.ttl_s, at + int(granted.TTL))
        return lease

    def _window_s(self) -> int:
        """W (``etcd_journal``), fixed at its first use: 0 with a headroom under
        ``MIN_HEADROOM_S``."""
        if self._window is None:
            given = CLOCK.etcd_window_s if self._window_given is None else self._window_given
            self._window = math.ceil(given) if headroom_s() >= MIN_HEADROOM_S else 0
        return self._window

    def _ttl_of(self, granted_ttl: int) -> int:
        """The ttl of a lease etcd granted for ``granted_ttl`` seconds."""
        room, window = headroom_s(), self._window_s()
        if window and granted_ttl > room + window:
            return granted_ttl - room - window
        return granted_ttl - headroom(granted_ttl)

    def _followed(
        self, lease_id: int, granted_ttl: int, term: int, revision: int | None = None
    ) -> Lease:
        """A lease this replica granted or renewed (at raft ``term``), now at its full
        ``granted_ttl``: its logical time, known to readers and followed by the reaper."""
        ttl = self._ttl_of(granted_ttl)
        self._leases.granted(lease_id, float(ttl))
        if not self._closed:
            self.reaper.noted(lease_id, ttl, float(ttl), term)
            self.reaper.start()
        return Lease(lease_id, ttl, float(ttl), revision)

    async def refresh_lease(self, lease_id: int) -> Lease | None:
        journal = await self._journal_up()
        arrived = ARRIVED.get()
        arrived = now() if arrived is None else arrived
        if self.reaper.overdue(lease_id) and await self.reaper.settle(lease_id):
            return None  # its time ran out before this renewal arrived: judged as SQLite does
        if journal is not None:
            known = journal.book.known.get(lease_id)
            at = now()
            if known is not None and known.etcd_at >= at + known.ttl_s + headroom_s() + SLACK_S:
                # In memory: etcd keeps it past this renewal's logical time + headroom.
                journal.renewed(lease_id, known.ttl_s, known.etcd_at)
                self.reaper.noted(lease_id, known.ttl_s, float(known.ttl_s), 0)
                self.reaper.start()
                revision = await journal.revision_after(arrived, self._timeout_s)
                return Lease(lease_id, known.ttl_s, float(known.ttl_s), revision, watched=True)
        at = now()
        renewed = await self._call("lease refresh", partial(self._keep_alive, lease_id))
        if renewed.ttl <= 0:  # etcd answers TTL 0 for a lease it no longer has
            self._leases.granted(lease_id, None)
            self.reaper.forget(lease_id)
            if journal is not None:
                journal.book.forget(lease_id)
            return None
        lease = self._followed(lease_id, renewed.ttl, renewed.term, renewed.revision)
        if journal is not None:
            journal.renewed(lease_id, lease.ttl_s, at + renewed.ttl)
        return lease

    async def _keep_alive(self, lease_id: int, client: aetcd.Client, seconds: float) -> Renewed:
        streams = self._keepalives.get(client)
        if streams is None:
            streams = self._keepalives[client] = KeepAlives(client)
        return await streams.renew(lease_id, seconds)

    async def _journal_up(self) -> Journal | None:
        """The renewal journal (``etcd_journal``), started on the first lease call; None
        when renewals are not lazy (``REGISTRY_ETCD_RENEW_WINDOW_S`` 0)."""
        if not self._window_s() or self._closed:
            return None
        if self._journal is not None:
            return self._journal
        if self._journal_starting is None:
            self._journal_starting = asyncio.ensure_future(self._start_journal())
        starting = self._journal_starting
        try:
            return await asyncio.shield(starting)
        except BaseException:
            if self._journal_starting is starting and starting.done():
                self._journal_starting = None  # the next call tries again
            raise

    async def _start_journal(self) -> Journal:
        room = headroom_s()
        journal = Journal(
            self._call,
            self._root,
            room,
            room + self._window_s() + 60.0,
            moved=self._moved,
            adopt=self._adopt,
            lost=self._lost,
        )
        await journal.start()
        self._journal = self.reaper.journal = journal
        return journal

    def _moved(self, leases: list[int]) -> None:
        """Renewed last through another replica: that replica ends them (``etcd_journal``)."""
        for lease_id in leases:
            self.reaper.forget(lease_id)

    def _adopt(self, leases: list[int]) -> None:
        """Their replica is gone: ended here at their logical expiry + headroom."""
        if self._journal is None or self._closed:
            return
        for lease_id in leases:
            known = self._journal.book.known[lease_id]
            self.reaper.adopt(lease_id, known.ttl_s, known.logical_at + headroom_s())
        self.reaper.start()

    def _lost(self) -> None:
        """The journal lost history: what is followed here is left to etcd's own expiry."""
        for lease_id in list(self.reaper.leases):
            self.reaper.forget(lease_id)

    async def revoke_lease(self, lease_id: int) -> None:
        request = rpc.LeaseRevokeRequest(ID=lease_id)

        async def fn(client: aetcd.Client, seconds: float) -> None:
            try:
                await client.leasestub.LeaseRevoke(request, timeout=seconds)
            except rpc.AioRpcError as exc:
                if exc.code() != rpc.StatusCode.NOT_FOUND:
                    raise

        await self._call("lease revoke", fn)
        self._leases.granted(lease_id, None)
        self.reaper.forget(lease_id)
        if self._journal is not None:
            self._journal.ended(lease_id)

    async def _expire(self, lease_id: int) -> None:
        """The reaper ends a lease whose time ran out: ``on_expired`` is told its entries."""
        tell = self.on_expired
        gone = await self._lease_entries(lease_id) if tell is not None else []
        await self.revoke_lease(lease_id)
        if tell is not None and gone:
            try:
                tell(gone)
            except Exception:  # the reaper must go on
                log.exception("lease expiries not told")

    async def _lease_entries(self, lease_id: int) -> list[Entry]:
        """The entries on the lease now: its keys (etcd's), then each of them."""
        request = rpc.LeaseTimeToLiveRequest(ID=lease_id, keys=True)
        try:
            info = await self._call(
                "lease read", lambda c, t: c.leasestub.LeaseTimeToLive(request, timeout=t)
            )
            replies = await asyncio.gather(*(self._read(bytes(key)) for key in info.keys))
        except Unavailable:
            return []  # the lease still ends; only its event is lost
        return [self._entry(kv) for reply in replies for kv in reply.kvs if kv.lease == lease_id]

    # -- waiting ---------------------------------------------------------------------------

    async def wait(self, prefix: str, after_revision: int, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        hub = await self._hub(prefix[: prefix.find("/") + 1], after_revision + 1)
        # History gone, or the hub may have missed a change: the caller re-reads.
        if hub is None or hub.track(prefix) > after_revision + 1:
            return True
        trouble = self._watch_health()
        self._waiters += 1
        try:
            while hub.latest.get(prefix, 0) <= after_revision:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                either: list[asyncio.Future[Any]] = [hub.next_change(prefix), trouble, hub.dead]
                await asyncio.wait(either, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                if trouble.done():
                    raise Unavailable(trouble.result().detail)
                if hub.dead.done():  # the stream broke (a member died): re-read via failover
                    await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))
                    return True
            return True
        finally:
            self._waiters -= 1

    async def _hub(self, segment: str, start: int) -> WatchHub | None:
        hub = self._hubs.get(segment)
        if hub is not None:
            await asyncio.shield(hub.opened)
            return hub
        hub = self._hubs[segment] = WatchHub(start, self._cluster.preferred)
        key = self._key(segment)

        async def open_watch(client: aetcd.Client, seconds: float) -> Any:
            hub.index = self._cluster.index(client)
            try:
                async with asyncio.timeout(seconds):
                    end = prefix_range_end(key)
                    return await client.watch(key, range_end=end, start_revision=start)
            except aetcd.RevisionCompactedError:
                return None  # history is gone: report a change, the caller re-reads

        try:
            watch = await self._call("watch", open_watch)
        except BaseException as exc:
            self._bury(segment, hub)
            hub.opened.set_exception(exc)
            hub.opened.exception()  # retrieved; the waiters sharing this opening get it too
            raise
        hub.opened.set_result(None)
        if watch is None:
            self._bury(segment, hub)
            return None
        hub.task = asyncio.create_task(self._follow(segment, hub, watch))
        return hub

    async def _follow(self, segment: str, hub: WatchHub, watch: Any) -> None:
        try:
            async for event in watch:
                hub.dispatch(self._unkey(event.kv.key), int(event.kv.mod_revision))
        except Exception:  # a broken stream wakes its waiters, who re-read
            pass
        finally:
            self._bury(segment, hub)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(watch.cancel(), 1.0)  # else etcd streams on to nobody

    def _bury(self, segment: str, hub: WatchHub) -> None:
        if self._hubs.get(segment) is hub:
            del self._hubs[segment]
        hub.end()

    def changes(
        self,
        prefix: str,
        start_revision: int,
        progress_s: float,
        nudge: asyncio.Event | None = None,
    ) -> AsyncIterator[ChangeBatch]:
        """etcd's own watch and revisions (``etcd_watch``)."""
        return etcd_watch.follow(self._call, self._root, prefix, start_revision, progress_s, nudge)

    async def entries(self, prefix: str) -> Snapshot:
        kvs, revision = await self._read_prefix(prefix)
        entries = [self._entry(kv) for kv in kvs]
        if in_journal(prefix):  # the renewal journal's keys are not the store's
            entries = [e for e in entries if not journal_key(e.key)]
        return Snapshot(entries, revision, {})

    async def lease_remaining(self, leases: set[int]) -> dict[int, float]:
        return await self._remaining(leases) if leases else {}

    async def revision(self) -> int:
        return await self._call("read", self._head)

    def _watch_health(self) -> asyncio.Future[Unavailable]:
        """The future a failed probe resolves, with a prober running to resolve it."""
        if self._trouble is None or self._trouble.done():
            self._trouble = asyncio.get_running_loop().create_future()
        if self._prober is None or self._prober.done():
            self._prober = asyncio.create_task(self._probe())
        return self._trouble

    async def _probe(self) -> None:
        """While anyone waits: one linearizable read per interval for the whole store. A
        failure fails every waiter; an answer from another member than a watch's ends that
        watch (the member may be cut off, its watch silent) and its waiters re-read."""
        while self._waiters:
            await asyncio.sleep(self._probe_interval_s)
            try:
                await self._call("read", self._head, slots=0)
            except Unavailable as exc:
                if self._trouble is not None and not self._trouble.done():
                    self._trouble.set_result(exc)
                return
            for segment, hub in list(self._hubs.items()):
                if hub.index != self._cluster.preferred and hub.opened.done():
                    self._bury(segment, hub)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self._cluster.start(self._root)

    async def ping(self) -> None:
        await self._call("read", self._head)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [self._prober, *(h.task for h in self._hubs.values())]
        await asyncio.gather(
            self.reaper.close(),
            *([self._journal.close()] if self._journal is not None else []),
            *(stop(task) for task in tasks if task is not None),
        )
        self._hubs.clear()
        for streams in list(self._keepalives.values()):
            streams.close()
        await self._cluster.close()
