"""The renewal journal's book (``app.store.etcd.journal.Book``), no I/O: who renewed a lease
last is decided by journal revision, a renewal here not yet written wins over any entry, a
gone replica's leases are adopted by the live replica with the least id only, and a revoked
lease is forgotten everywhere."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit
pytest.importorskip("aetcd", reason="the etcd extra is not installed")

from app.store.etcd.journal import (  # noqa: E402
    MIN_TICK_S,
    PENDING,
    TICK_S,
    Book,
    in_journal,
    journal_key,
    pack,
    tick_at,
    unpack,
)


def entry(*rows: tuple[int, int, float, float]) -> bytes:
    return pack(rows)


def test_entries_round_trip_in_milliseconds() -> None:
    rows = [(1, 30, 29.9995, 170.0), (-5, 2, 0.0, 0.25)]
    assert list(unpack(pack(rows))) == [(1, 30, 30.0, 170.0), (-5, 2, 0.0, 0.25)]
    assert list(unpack(pack(rows) + b"\x00\x01")) == list(unpack(pack(rows)))  # torn tail


def test_the_latest_journal_revision_owns_a_lease() -> None:
    book = Book("a")
    book.renewed_here(7, 30, etcd_at=1e9)
    assert book.known[7].revision == PENDING
    assert book.heard("b", 50, entry((7, 30, 30.0, 100.0))) == []  # pending here: it wins
    leases, _ = book.take()
    book.written(leases, 60)
    assert book.heard("b", 55, entry((7, 30, 30.0, 100.0))) == []  # older than ours
    assert book.known[7].owner == "a"
    assert book.heard("b", 61, entry((7, 30, 30.0, 100.0))) == [7]  # renewed there since
    assert book.known[7].owner == "b"
    assert book.known[7].etcd_at >= 1e9  # etcd's deadline only grows


def test_a_failed_write_is_written_again() -> None:
    book = Book("a")
    book.renewed_here(7, 30, etcd_at=100.0)
    leases, value = book.take()
    assert [row[0] for row in unpack(value)] == [7]
    assert not book.pending
    book.written(leases, None)
    assert book.pending == {7}


def test_a_gone_replica_s_leases_go_to_the_least_live_id() -> None:
    first, second = Book("a"), Book("c")
    for book in (first, second):
        book.heard("b", 10, entry((7, 30, 30.0, 100.0)))
        book.heard("a" if book is second else "c", 11, b"")  # each knows the other alive
    assert first.left("b") == [7]
    assert first.known[7].owner == "a"
    assert first.known[7].adopted
    assert second.left("b") == []  # "a" is alive and its id is less
    assert second.left("a") == [7]  # until "a" goes too


def test_a_revoked_lease_is_forgotten_by_every_replica() -> None:
    here, there = Book("a"), Book("b")
    there.heard("a", 5, entry((7, 30, 30.0, 100.0)))
    here.renewed_here(7, 30, etcd_at=100.0)
    here.ended(7)
    _, value = here.take()
    assert 7 not in here.known
    assert there.heard("a", 6, value) == [7]
    assert 7 not in there.known


def test_only_reads_that_may_reach_the_journal_filter_it() -> None:
    assert in_journal("")
    assert in_journal("groups")
    assert in_journal("groups.")
    assert not in_journal("groups/")
    assert journal_key("groups.\x7frenewed/abc")
    assert not journal_key("groups.")


def test_a_busy_replica_writes_about_forty_leases_a_write() -> None:
    """A write costs the replica about the same whatever it holds: at the fleet's pace (12,500
    nodes a 10 s interval) it writes about 31 times a second, not 49; a quiet replica once a
    ``TICK_S``, a very busy one once a ``MIN_TICK_S``."""
    assert tick_at(1250.0) == pytest.approx(0.032)
    assert 1250.0 * tick_at(1250.0) == pytest.approx(40.0)
    assert tick_at(0.0) == TICK_S
    assert tick_at(100.0) == TICK_S
    assert tick_at(10_000.0) == MIN_TICK_S
