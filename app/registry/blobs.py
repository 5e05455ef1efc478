"""How a rank's metadata blob is stored, and read back exactly as it was sent.

NIXL's agent metadata repeats a few structures per registered region (a descriptor and the
backend's remote key): 80 DRAM regions make 3,933 bytes, stored in 691 (zlib at level 1, about
15 µs; inflating, 6 µs; ``python -m bench.blob_size``). The blob is most of what a
registration writes, and on etcd every byte of it goes to each member's log and database and
from the leader to each follower: deflated, the fleet's etcd works less and holds less
(docs/operations.md, "What etcd holds").

A stored blob is one of:

- the bytes as sent: with ``REGISTRY_BLOB_CODEC=none``, when deflating saves less than an
  eighth (random bytes, a tiny blob), and every blob an earlier version stored;
- an envelope: ``MAGIC``, a codec byte, the length as sent (4 bytes, big-endian), the
  payload. Codec ``DEFLATE``: zlib's stream of the bytes; codec ``PLAIN``: the bytes as
  sent, for a blob that itself begins with ``MAGIC`` and does not deflate, so that no blob
  this version stores is ever read back as anything but itself.

Reading inflates at most the length the envelope names, and a payload that does not give
exactly that length is refused (:class:`CorruptBlob`), never served.
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from typing import Literal

from app.core.errors import RegistryError

Codec = Literal["deflate", "none"]

# PNG's trick: a byte with the high bit set, then a name, then a line end: no NIXL metadata
# begins so (NIXL's begins "nixlSerDes"), and a blob mangled as text would not keep it.
MAGIC = b"\x89ERblob\n"
PLAIN = 0
DEFLATE = 1
_HEAD = struct.Struct(">BI")  # codec, the length as sent
_HEADER_BYTES = len(MAGIC) + _HEAD.size
LEVEL = 1  # level 6 saves 1-2% more of NIXL's metadata in 1.6 times the time
MAX_BYTES = 0xFFFFFFFF  # the envelope's length field
# A request's blobs deflate on a worker thread when together they pass this (zlib lets go of
# the GIL): a request body's 4 MiB of random bytes take about 90 ms, which the event loop's
# heartbeats must not wait out, whether in one blob or in a batch's eight; a node's NIXL
# metadata (eight ranks of 80 regions) takes about 120 µs, less than the hop.
OFF_LOOP_BYTES = 64 * 1024


class CorruptBlob(RegistryError):
    """A stored blob's envelope does not hold what it says it holds: never served."""

    title = "A stored metadata blob cannot be read back"


def stored(raw: bytes, codec: Codec) -> bytes:
    """What the store keeps for ``raw``."""
    if codec == "deflate" and _HEADER_BYTES < len(raw) <= MAX_BYTES:
        packed = zlib.compress(raw, LEVEL)
        if _HEADER_BYTES + len(packed) <= len(raw) - len(raw) // 8:
            return MAGIC + _HEAD.pack(DEFLATE, len(raw)) + packed
    if raw.startswith(MAGIC):
        return MAGIC + _HEAD.pack(PLAIN, len(raw)) + raw
    return raw


async def stored_off_loop(raws: list[bytes], codec: Codec) -> list[bytes]:
    """``stored`` of each of one request's blobs: on one worker thread when together they are
    over ``OFF_LOOP_BYTES``, else here."""
    if codec == "deflate" and sum(map(len, raws)) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(_each_stored, raws, codec)
    return _each_stored(raws, codec)


def _each_stored(raws: list[bytes], codec: Codec) -> list[bytes]:
    return [stored(raw, codec) for raw in raws]


def sent(value: bytes, key: str = "") -> bytes:
    """The bytes as they were sent, from what the store keeps (``stored``'s inverse)."""
    if not value.startswith(MAGIC):
        return value
    if len(value) < _HEADER_BYTES:
        raise CorruptBlob(_corrupt(key, f"its envelope is cut short ({len(value)} bytes)"))
    codec, length = _HEAD.unpack_from(value, len(MAGIC))
    payload = memoryview(value)[_HEADER_BYTES:]
    if codec == PLAIN:
        raw = bytes(payload)
    elif codec == DEFLATE:
        inflate = zlib.decompressobj()
        try:
            raw = inflate.decompress(payload, length)
        except zlib.error as exc:
            raise CorruptBlob(_corrupt(key, f"its deflated bytes do not inflate ({exc})")) from None
        if not inflate.eof or inflate.unconsumed_tail or inflate.unused_data:
            raise CorruptBlob(_corrupt(key, "its deflated bytes run past the length it names"))
    else:
        raise CorruptBlob(_corrupt(key, f"its codec byte is {codec}, not one this version reads"))
    if len(raw) != length:
        raise CorruptBlob(_corrupt(key, f"it holds {len(raw)} bytes, not the {length} it names"))
    return raw


def _corrupt(key: str, why: str) -> str:
    return (
        f"The stored metadata blob {key or '(unnamed)'} cannot be read back: {why}. The store "
        "was changed outside the registry, or a newer registry version wrote it. The rank "
        "registering again (its agent's next registration) replaces it."
    )
