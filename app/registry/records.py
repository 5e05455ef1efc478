"""Keys in the store, the records stored under them, and their decoding."""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from app.core.schemas import (
    Role,
)
from app.registry import blobs
from app.store import Entry

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
    opened_by: str | None = (
        None  # the name of the token that opened it (app/security/credentials.py)
    )


class AgentBrief(BaseModel):
    """An agent's record without its KV description: what listings, the status page, the
    gauges and heartbeats need. Parsed from the stored record, the ``kv`` is passed over
    (pydantic reads past it without building it); a rank's ``kv`` is most of its record
    (about 1.3 of 1.5 KiB with 80 KV regions)."""

    model_config = ConfigDict(extra="ignore")

    rank: int
    engine_id: str
    generation: int
    agent_name: str
    host: str
    ttl_s: int
    registered_at: str
    lease: int
    registered_by: str | None = None  # the name of the token that registered it


class AgentRecord(AgentBrief):
    kv: dict[str, Any]


class ServingRecord(BaseModel):
    """Where the current engine's instance serves (its OpenAI API), as it published."""

    engine_id: str
    url: str
    model: str
    dp_rank: int | None = None
    bootstrap: str | None = None
    published_at: str
    published_by: str | None = None  # the name of the token that published it


class MooncakeRecord(BaseModel):
    """A MooncakeConnector prefill worker, as it registered (app/registry/mooncake.py)."""

    engine_id: str  # as vLLM sent it: with its ``_dp{rank}`` suffix under data parallel
    dp_rank: int
    tp_rank: int
    pp_rank: int
    addr: str
    registered_at: str


class IndexRecord(BaseModel):
    group_id: str
    generation: int
    engine_id: str = ""


RECORDS_BYTES = 64 * 1024 * 1024  # parsed agent records kept, by the size of their stored JSON
SMALL_BYTES = 128 * 1024 * 1024  # parsed engine, index and serving records; agents' briefs
BRIEF_BYTES = 512  # what an agent's brief (`AgentBrief`) is counted as in SMALL_BYTES
TEXTS_BYTES = 128 * 1024 * 1024  # base64 texts of blobs kept, by their length


class _Cache:
    """Values by key, each with the store revision it is of and its size in bytes; at most
    ``budget`` bytes in all (the oldest insertion goes first), and what a group's keys hold
    can be dropped at once when the group goes (``forget``).

    An ``OrderedDict``: finding the oldest is O(1) however many were dropped before it. In a
    plain dict ``next(iter(d))`` walks past every slot emptied at the front since the dict was
    last resized, so a cache evicting at its budget took time growing with its size on every
    insertion: at 100,000 ranks (records past the budget, evicted on every heartbeat) that
    walk was half of the event loop's time (``docs/benchmarks.md``)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        self._items: OrderedDict[str, tuple[int, object, int]] = OrderedDict()
        self._by_group: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str, revision: int) -> object | None:
        hit = self._items.get(key)
        return hit[1] if hit is not None and hit[0] == revision else None

    def put(self, key: str, revision: int, value: object, size: int, group: str) -> None:
        self._drop(key)
        if size > self.budget:
            return
        while self.bytes + size > self.budget:
            self._drop(next(iter(self._items)))
        self._items[key] = (revision, value, size)
        self.bytes += size
        self._by_group.setdefault(group, set()).add(key)

    def _drop(self, key: str) -> None:
        held = self._items.pop(key, None)
        if held is None:
            return
        self.bytes -= held[2]
        group = _group_of(key, held[1])
        keys = self._by_group.get(group)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_group[group]

    def forget(self, group: str, keep: Callable[[str], bool] | None = None) -> None:
        for key in list(self._by_group.get(group, ())):
            if keep is None or not keep(key):
                self._drop(key)


def _group_of(key: str, value: object) -> str:
    """The group a cached key belongs to: in the key (``groups/g/…``, ``blobs/g/…``), or for
    an engine's index (``engines/{id}``) in its record."""
    if isinstance(value, IndexRecord):
        return value.group_id
    return key.split("/", 2)[1]


class Decoded:
    """Stored records parsed once per version: reads re-parse nothing that did not change.

    Bounded in bytes (``RECORDS_BYTES`` of parsed agent records, by the size of their stored
    JSON; ``SMALL_BYTES`` of the small records and of the agents' briefs; ``TEXTS_BYTES`` of
    blobs' base64 texts), and emptied of a group's entries when the group is deleted or
    relaunched (``forget``): nothing is kept for a group that is gone.

    The agents' records are apart because they are large (a rank's KV regions: about 1.5 KiB
    with 80 of them) and many: past ``RECORDS_BYTES`` (some 40,000 such ranks) they are evicted
    and parsed again, while the engines every request reads and the agents' briefs that
    heartbeats, listings and the status page need (``brief``) stay (a fleet of 100,000 ranks
    holds about 50 MiB of briefs)."""

    def __init__(
        self,
        records_bytes: int = RECORDS_BYTES,
        texts_bytes: int = TEXTS_BYTES,
        small_bytes: int = SMALL_BYTES,
    ) -> None:
        self._cache = _Cache(records_bytes)
        self._small = _Cache(small_bytes)
        self._texts = _Cache(texts_bytes)

    def base64(self, entry: Entry) -> str:
        """A blob's base64 text, encoded once per version (every handshake sends it)."""
        hit = self._texts.get(entry.key, entry.mod_revision)
        if isinstance(hit, str):
            return hit
        text = base64.b64encode(blobs.sent(entry.value, entry.key)).decode("ascii")
        self._texts.put(entry.key, entry.mod_revision, text, len(text), _group_of(entry.key, None))
        return text

    def kept_base64(self, key: str, revision: int) -> str | None:
        """The base64 text of the blob at ``key`` of ``revision``, when kept."""
        hit = self._texts.get(key, revision)
        return hit if isinstance(hit, str) else None

    def remember(self, key: str, revision: int, record: BaseModel, size: int) -> None:
        """``record`` (``size`` bytes of JSON) was just written under ``key`` at ``revision``:
        the next read of that version takes it as is (it is what parsing its JSON would give)."""
        group = _group_of(key, record)
        if isinstance(record, AgentRecord):
            self._cache.put(key, revision, record, size, group)
            self._small.put(key, revision, _brief_of(record), BRIEF_BYTES, group)
        else:
            self._small.put(key, revision, record, size, group)

    def record(self, entry: Entry, kind: type[R]) -> R:
        cache = self._cache if kind is AgentRecord else self._small
        hit = cache.get(entry.key, entry.mod_revision)
        if type(hit) is kind:
            return hit
        value = kind.model_validate_json(entry.value)
        self.remember(entry.key, entry.mod_revision, value, len(entry.value))
        return value

    def brief(self, entry: Entry) -> AgentBrief:
        """An agent's record without its ``kv`` (``AgentBrief``), kept apart from the records."""
        hit = self._small.get(entry.key, entry.mod_revision)
        if type(hit) is AgentBrief:
            return hit
        full = self._cache.get(entry.key, entry.mod_revision)
        if isinstance(full, AgentRecord):
            brief = _brief_of(full)
        else:
            brief = AgentBrief.model_validate_json(entry.value)
        group = _group_of(entry.key, None)
        self._small.put(entry.key, entry.mod_revision, brief, BRIEF_BYTES, group)
        return brief

    def forget(self, gid: str, *, keep_engines: bool = False) -> None:
        """Drop what is kept for group ``gid``: all of it when the group is deleted; its agents
        and blobs only (``keep_engines``) when a new generation replaced them."""
        gone = (f"groups/{gid}/agents/", f"blobs/{gid}/")
        keep = (lambda key: not key.startswith(gone)) if keep_engines else None
        self._cache.forget(gid, keep)
        self._small.forget(gid, keep)
        self._texts.forget(gid)

    def sizes(self) -> tuple[int, int]:
        """Bytes held: parsed records (agents', then the small ones and leases), base64 texts."""
        return self._cache.bytes + self._small.bytes, self._texts.bytes


def _brief_of(record: AgentRecord) -> AgentBrief:
    fields = record.__dict__
    return trusted(AgentBrief, {f: fields[f] for f in _BRIEF_FIELDS})


def trusted(kind: type[R], values: dict[str, Any]) -> R:
    """``kind.model_construct(**values)`` for ``values`` that hold every field of ``kind`` and
    nothing else, already valid: the instance pydantic's ``model_construct`` makes, without its
    walk of each field's aliases and defaults (0.8 µs against 2.8 for a model of ten fields;
    a launch builds about 25 a node: records, briefs and answers). ``kind`` has no alias, no
    ``model_post_init`` and no extra fields (checked once per model); ValueError for values
    that do not name exactly its fields."""
    if kind not in _PLAIN:
        if (
            kind.__pydantic_post_init__
            or kind.model_config.get("extra") == "allow"
            or any(f.alias or f.validation_alias for f in kind.model_fields.values())
        ):
            raise ValueError(f"{kind.__name__} needs model_construct: aliases, extras or hooks")
        _PLAIN.add(kind)
    if values.keys() != kind.__pydantic_fields__.keys():
        raise ValueError(f"{kind.__name__} takes {sorted(kind.__pydantic_fields__)}")
    model = kind.__new__(kind)
    _set(model, "__dict__", values)
    _set(model, "__pydantic_fields_set__", set(values))
    _set(model, "__pydantic_extra__", None)
    _set(model, "__pydantic_private__", None)
    return model


_PLAIN: set[type[BaseModel]] = set()
_set = object.__setattr__


_BRIEF_FIELDS = tuple(AgentBrief.model_fields)
_UNCACHED = Decoded()
