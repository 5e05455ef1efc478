"""Keys in the store, the records stored under them, and their decoding."""

from __future__ import annotations

import base64
from typing import Any, TypeVar

from pydantic import BaseModel

from app.schemas import (
    Role,
)
from app.store import Entry

# Optimistic transactions retry this often before giving up with 503 (never reached in
# practice: each retry means another writer made progress).
MAX_ATTEMPTS = 200

R = TypeVar("R", bound=BaseModel)


class EngineRecord(BaseModel):
    group_id: str
    engine_id: str
    generation: int
    launch_id: str
    tp_size: int
    role: Role
    compat: dict[str, Any]
    created_at: str


class AgentRecord(BaseModel):
    rank: int
    engine_id: str
    generation: int
    agent_name: str
    host: str
    kv: dict[str, Any]
    ttl_s: int
    registered_at: str
    lease: int


class IndexRecord(BaseModel):
    group_id: str
    generation: int
    engine_id: str = ""


def _engine_key(gid: str) -> str:
    return f"groups/{gid}/engine"


def _group_prefix(gid: str) -> str:
    return f"groups/{gid}/"


def _agent_prefix(gid: str) -> str:
    return f"groups/{gid}/agents/"


def _agent_key(gid: str, rank: int) -> str:
    return f"groups/{gid}/agents/{rank:05d}"


def _blob_key(gid: str, rank: int) -> str:
    return f"blobs/{gid}/{rank:05d}"


def _dump(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


class Decoded:
    """Stored records parsed once per version: reads re-parse nothing that did not change."""

    LIMIT = 200_000

    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, BaseModel]] = {}
        self._texts: dict[str, tuple[int, str]] = {}

    def base64(self, entry: Entry) -> str:
        """A blob's base64 text, encoded once per version (every handshake sends it)."""
        hit = self._texts.get(entry.key)
        if hit is not None and hit[0] == entry.mod_revision:
            return hit[1]
        text = base64.b64encode(entry.value).decode("ascii")
        if len(self._texts) >= self.LIMIT:
            self._texts.clear()
        self._texts[entry.key] = (entry.mod_revision, text)
        return text

    def remember(self, key: str, revision: int, record: BaseModel) -> None:
        """``record`` was just written under ``key`` at ``revision``: the next read of that
        version takes it as is (it is what parsing its stored JSON would give)."""
        if len(self._cache) >= self.LIMIT:
            self._cache.clear()
        self._cache[key] = (revision, record)

    def record(self, entry: Entry, kind: type[R]) -> R:
        hit = self._cache.get(entry.key)
        if hit is not None and hit[0] == entry.mod_revision and type(hit[1]) is kind:
            return hit[1]
        value = kind.model_validate_json(entry.value)
        self.remember(entry.key, entry.mod_revision, value)
        return value


_UNCACHED = Decoded()
