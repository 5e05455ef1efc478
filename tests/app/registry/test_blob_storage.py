"""Metadata blobs stored deflated (``app/registry/blobs.py``), served exactly as sent.

The codec alone, on every kind of blob (one that deflates, random bytes, one that begins with
the envelope's magic, one an earlier version stored), and refusing what it cannot read back;
then real registry processes over HTTP on a real SQLite file and a real etcd, whose stored
bytes are read from the store itself: smaller than sent with ``deflate`` (the default), the
bytes as sent with ``none``, and every handshake answering the blob as it was sent."""

from __future__ import annotations

import asyncio
import base64
import os
import sqlite3
import struct
import threading
import zlib
from pathlib import Path

import httpx
import pytest

from app.registry import blobs
from app.registry.blobs import MAGIC, CorruptBlob, sent, stored
from app.store.etcd.store import EtcdStore
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.server import RegistryProcess
from tests.support.faults import agent_body, open_body

pytestmark = [pytest.mark.store, pytest.mark.timeout(180)]

TP = 8


def nixl_like(rank: int, regions: int = 80) -> bytes:
    """Bytes shaped as NIXL's agent metadata: a header, then per region its address, length
    and a remote key that repeats the backend's fields (the real one: bench/blob_size.py)."""
    head = b"nixlSerDes|Agent|" + f"prefill-rank{rank}".encode() + b"|Conns|UCX|" + os.urandom(96)
    rkeys = b"".join(
        struct.pack("<QQI", 0x7F0000000000 + (rank << 28) + (r << 20), 1 << 20, r)
        + b"|posix|sysv|cma|tcp|"
        + os.urandom(4)
        for r in range(regions)
    )
    return head + rkeys


KINDS = {
    "deflates": nixl_like(0),
    "random": os.urandom(3928),
    "magic, random": MAGIC + os.urandom(500),
    "magic, deflates": MAGIC + b"a" * 1000,
    "one byte": b"\x89",
    "magic alone": MAGIC,
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("codec", ["deflate", "none"])
def test_every_blob_reads_back_as_sent(kind: str, codec: blobs.Codec) -> None:
    raw = KINDS[kind]
    assert sent(stored(raw, codec), "blobs/g/00000") == raw


def test_a_blob_that_deflates_is_stored_smaller_one_that_does_not_as_is() -> None:
    raw = nixl_like(3)
    kept = stored(raw, "deflate")
    assert kept.startswith(MAGIC)
    assert len(kept) < len(raw) // 2, (len(kept), len(raw))
    noise = KINDS["random"]
    assert stored(noise, "deflate") == noise  # no envelope: what an earlier version stored
    assert stored(raw, "none") == raw


def test_a_blob_beginning_with_the_magic_is_enveloped_never_misread() -> None:
    for raw in (KINDS["magic, random"], KINDS["magic alone"]):
        for codec in ("deflate", "none"):
            kept = stored(raw, codec)  # type: ignore[arg-type]
            assert kept != raw
            assert kept.startswith(MAGIC)
            assert sent(kept) == raw


def test_a_blob_stored_by_an_earlier_version_reads_as_it_is() -> None:
    for raw in (b"nixl-md-0", nixl_like(1), os.urandom(64)):
        assert sent(raw) == raw


def test_a_large_blob_deflates_off_the_event_loops_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request body's worth of blobs is deflated on a worker thread (4 MiB of random bytes
    take about 90 ms), whether one blob or a batch's many; NIXL's few KiB on the loop, where
    the hop would cost more."""
    threads: list[int] = []
    real = blobs.stored

    def counted(raw: bytes, codec: blobs.Codec) -> bytes:
        threads.append(threading.get_ident())
        return real(raw, codec)

    monkeypatch.setattr(blobs, "stored", counted)

    async def main() -> None:
        loop_thread = threading.get_ident()
        large = nixl_like(0) * 64  # 250 KiB, deflates
        assert [sent(b) for b in await blobs.stored_off_loop([large], "deflate")] == [large]
        assert threads.pop() != loop_thread
        small = nixl_like(1)
        assert [sent(b) for b in await blobs.stored_off_loop([small], "deflate")] == [small]
        assert threads.pop() == loop_thread
        assert await blobs.stored_off_loop([large], "none") == [large]  # nothing to deflate
        assert threads.pop() == loop_thread
        # A batch of blobs each under the bar, together over it: one hop for all of them.
        batch = [nixl_like(i) * 3 for i in range(8)]
        assert all(len(b) < blobs.OFF_LOOP_BYTES for b in batch)
        assert sum(map(len, batch)) > blobs.OFF_LOOP_BYTES
        assert [sent(b) for b in await blobs.stored_off_loop(batch, "deflate")] == batch
        assert len(threads) == 8
        assert loop_thread not in threads

    asyncio.run(main())


def envelope(codec: int, length: int, payload: bytes) -> bytes:
    return MAGIC + struct.pack(">BI", codec, length) + payload


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (MAGIC + b"\x01\x00", "cut short"),
        (envelope(1, 5000, b"not zlib at all"), "do not inflate"),
        (envelope(1, 100, zlib.compress(b"x" * 5000)), "run past the length"),
        (envelope(1, 5000, zlib.compress(b"x" * 100)), "holds 100 bytes, not the 5000"),
        (envelope(1, 100, zlib.compress(b"x" * 100) + b"tail"), "run past the length"),
        (envelope(7, 3, b"abc"), "codec byte is 7"),
        (envelope(0, 9, b"abc"), "holds 3 bytes, not the 9"),
    ],
)
def test_an_envelope_that_does_not_hold_what_it_says_is_refused(value: bytes, says: str) -> None:
    with pytest.raises(CorruptBlob) as caught:
        sent(value, "blobs/g/00003")
    assert says in caught.value.detail
    assert "blobs/g/00003" in caught.value.detail
    assert caught.value.status == 500


def batch(http: httpx.Client, gid: str) -> tuple[str, dict[int, bytes]]:
    """Open ``gid`` (TP 8, prefill) and register its 8 ranks, each with its own blob."""
    opened = http.put(f"/tp-groups/{gid}/engine", json=open_body(tp_size=TP))
    assert opened.status_code in (200, 201), opened.text
    eid = str(opened.json()["engine_id"])
    sent_blobs = {r: nixl_like(r) for r in range(TP)}
    agents = [
        {**agent_body(eid, r), "rank": r, "agent_metadata": base64.b64encode(b).decode()}
        for r, b in sent_blobs.items()
    ]
    answer = http.put(f"/tp-groups/{gid}/engine/agents", json={"agents": agents})
    assert answer.status_code == 200, answer.text
    return eid, sent_blobs


def handshaken(http: httpx.Client, eid: str) -> dict[int, bytes]:
    answer = http.post(f"/engines/{eid}/handshake", json={"tp_size": 1, "rank": 0})
    assert answer.status_code == 200, answer.text
    return {t["rank"]: base64.b64decode(t["agent_metadata"]) for t in answer.json()["targets"]}


def sqlite_values(db: Path, gid: str) -> dict[int, bytes]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT key, value FROM kv WHERE key LIKE ?", (f"blobs/{gid}/%",)
        ).fetchall()
    return {int(key.rsplit("/", 1)[1]): bytes(value) for key, value in rows}


@pytest.mark.parametrize("codec", ["deflate", "none", None])
def test_sqlite_keeps_deflated_blobs_and_serves_them_as_sent(
    tmp_path: Path, codec: str | None
) -> None:
    db = tmp_path / "registry.db"
    args = [] if codec is None else ["--blob-codec", codec]
    with (
        RegistryProcess(f"sqlite:///{db}", args=args, log_path=tmp_path / "log") as proc,
        httpx.Client(base_url=proc.url, timeout=10) as http,
    ):
        eid, sent_blobs = batch(http, "p-0")
        assert handshaken(http, eid) == sent_blobs
        kept = sqlite_values(db, "p-0")
    assert kept.keys() == sent_blobs.keys()
    for rank, raw in sent_blobs.items():
        if codec == "none":
            assert kept[rank] == raw
        else:  # the default deflates: each rank's blob on its own
            assert len(kept[rank]) < len(raw) // 2, (rank, len(kept[rank]), len(raw))
            assert sent(kept[rank]) == raw


def test_a_restart_serves_blobs_an_earlier_version_stored(tmp_path: Path) -> None:
    """A file written with ``none`` (as an earlier version wrote every blob), read by a
    registry that deflates: served as stored."""
    db = tmp_path / "registry.db"
    url = f"sqlite:///{db}"
    with (
        RegistryProcess(url, args=["--blob-codec", "none"], log_path=tmp_path / "a") as proc,
        httpx.Client(base_url=proc.url, timeout=10) as http,
    ):
        eid, sent_blobs = batch(http, "p-old")
    with (
        RegistryProcess(url, log_path=tmp_path / "b") as proc,
        httpx.Client(base_url=proc.url, timeout=10) as http,
    ):
        assert handshaken(http, eid) == sent_blobs
        eid_new, new_blobs = batch(http, "p-new")
        assert handshaken(http, eid_new) == new_blobs
    assert sqlite_values(db, "p-old") == sent_blobs


@pytest.mark.skipif(not etcd_available(), reason=SKIP_REASON)
def test_etcd_holds_deflated_blobs_and_every_replica_serves_them_as_sent(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    url = etcd.url("blobs")

    async def read() -> dict[int, bytes]:
        store = EtcdStore.from_url(url, timeout_s=5.0)
        await store.start()
        try:
            found = (await store.range("blobs/p-0/")).entries
            return {int(e.key.rsplit("/", 1)[1]): e.value for e in found}
        finally:
            await store.close()

    with (
        RegistryProcess(url, log_path=tmp_path / "a") as a,
        RegistryProcess(url, log_path=tmp_path / "b") as b,
        httpx.Client(base_url=a.url, timeout=10) as on_a,
        httpx.Client(base_url=b.url, timeout=10) as on_b,
    ):
        eid, sent_blobs = batch(on_a, "p-0")
        assert handshaken(on_a, eid) == sent_blobs
        assert handshaken(on_b, eid) == sent_blobs  # read from etcd, not from a's memory
        kept = asyncio.run(asyncio.wait_for(read(), 30))
    assert kept.keys() == sent_blobs.keys()
    for rank, raw in sent_blobs.items():
        assert len(kept[rank]) < len(raw) // 2
        assert sent(kept[rank]) == raw
