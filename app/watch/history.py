"""The bounded log of group changes a replica keeps for its watchers and its list pages.

Each entry is one change of one group at one store revision, with its wire line encoded once
when first read (every watcher sends the same bytes), and the group's stored entries as they
were before it (so a list page can be read as of an earlier revision: ``as_of``). Entries are
addressed by a position that only grows (``offset`` counts the ones dropped), and the log
keeps running byte counts over the events watchers are behind on, so a watcher's lag in bytes
is one subtraction.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from app.store import Entry

Group = Mapping[str, Entry]  # a group's stored entries: its engine key and its agents' keys
# An event's weight in the log's byte bound: a fixed part, and per stored entry of the group
# the event holds (its entries before the change, and the line's share per agent: an agent's
# view is ~150 bytes plus its name and host, each at most 256 characters).
EVENT_BASE_BYTES = 512
ENTRY_BYTES = 256


@dataclass(frozen=True, slots=True)
class Selector:
    """A watch's or a list's filter: the engine's role and ``compat["model"]`` (None: any).
    A watcher sees a group that enters its filter as ADDED, one that leaves it as DELETED
    (with the group as it was before the change), as Kubernetes' watch cache does."""

    role: str | None = None
    model: str | None = None

    def passes(self, role: str | None, model: str | None) -> bool:
        return (self.role is None or role == self.role) and (
            self.model is None or model == self.model
        )

    @property
    def empty(self) -> bool:
        return self.role is None and self.model is None


ANY = Selector()


class GroupEvent:
    """One change of one group. Its wire ``line`` (the engine's view, encoded) is made on
    first use, by a watcher or the byte count of the watchers' budgets: a replica nobody
    watches makes none (a fleet's launch is two changes a group). What makes it is kept as
    plain fields (the callable and its arguments), not a closure: a launch's events would
    otherwise be some 6 more objects each for the garbage collector to traverse.

    ``role`` and ``model`` are the shown engine's (after the change; before it for DELETED);
    ``prior`` the engine's (role, model) before a MODIFIED change, which decides what a
    filtered watcher sees (`line_for`)."""

    __slots__ = (
        "_args",
        "_deleted",
        "_line",
        "_make",
        "before",
        "gid",
        "kind",
        "model",
        "prior",
        "revision",
        "role",
        "weight",
    )

    def __init__(
        self,
        revision: int,
        gid: str,
        kind: str,  # ADDED, MODIFIED, DELETED
        role: str,
        line: bytes | Callable[..., bytes],
        before: Group | None,  # the group's entries before this change (None: it did not exist)
        *args: object,  # what ``line`` (a callable) is called with: kind, revision, gid, ...
        model: str | None = None,
        prior: tuple[str, str | None] | None = None,
        weight: int = EVENT_BASE_BYTES,
    ) -> None:
        self.revision = revision
        self.gid = gid
        self.kind = kind
        self.role = role
        self.model = model
        self.prior = prior
        self.before = before
        self.weight = weight
        self._line: bytes | None = line if isinstance(line, bytes) else None
        self._make: Callable[..., bytes] | None = None if isinstance(line, bytes) else line
        self._args: tuple[object, ...] | None = args or None
        self._deleted: bytes | None = None

    @property
    def line(self) -> bytes:
        if self._line is None:
            assert self._make is not None
            self._line = self._make(*(self._args or ()))
        return self._line

    def line_for(self, selector: Selector) -> bytes | None:
        """The line a watcher filtered by ``selector`` gets for this change (None: none)."""
        now = selector.passes(self.role, self.model)
        if self.kind != "MODIFIED" or self.prior is None or selector.empty:
            return self.line if now else None
        was = selector.passes(*self.prior)
        if now and was:
            return self.line
        if now:  # entered the filter
            return b'{"type":"ADDED"' + self.line[len(b'{"type":"MODIFIED"') :]
        if was:  # left it: the group as the watcher last saw it
            return self.deleted_line()
        return None

    def deleted_line(self) -> bytes:
        """A MODIFIED change as a DELETED line carrying the group before it."""
        if self._deleted is None:
            if self._make is None or self._args is None or self.before is None:
                raise ValueError("a DELETED line needs the group before the change")
            _, revision, gid, _, *rest = self._args
            self._deleted = self._make("DELETED", revision, gid, self.before, *rest)
        return self._deleted


class ChangeLog:
    """``keep``: events kept (trimmed past a quarter more); ``max_bytes``: the events' weight
    kept (their estimated memory, `GroupEvent.weight`; trimmed to three quarters of it), so
    that one writer changing a very large group often cannot grow the log past it."""

    def __init__(self, keep: int, max_bytes: int | None = None) -> None:
        self.keep = max(1, keep)
        self.max_bytes = max_bytes
        self.weight = 0  # of the events kept
        self.events: list[GroupEvent] = []
        self._revisions: list[int] = []
        self.offset = 0  # position of events[0]
        self.oldest = 0  # a watch or a page may be at this revision or later
        # The counted window, events[_first:] (to the newest, once counted): _starts[j] is a
        # running count of line bytes before events[_first + j], from any base (only
        # differences are read), _total the count after the last counted event. A window is
        # started where a watcher first needs it: lines before it are never made for a count.
        self._first = 0
        self._starts: list[int] = []
        self._total = 0

    def reset(self, revision: int) -> None:
        self.offset += len(self.events)
        self.events, self._revisions, self._starts, self._first = [], [], [], 0
        self.oldest = revision
        self.weight = 0

    @property
    def end(self) -> int:
        """The position after the newest event."""
        return self.offset + len(self.events)

    def append(self, event: GroupEvent) -> None:
        self.events.append(event)
        self._revisions.append(event.revision)
        self.weight += event.weight
        cut = 0
        if len(self.events) > self.keep + self.keep // 4:  # trim in steps, whole revisions
            cut = len(self.events) - self.keep
        if self.max_bytes is not None and self.weight > self.max_bytes:
            target, dropped = self.weight - self.max_bytes * 3 // 4, 0
            while cut < len(self.events) - 1 and dropped < target:
                dropped += self.events[cut].weight
                cut += 1
            cut = max(cut, 1)
        if cut:
            self._trim(cut)

    def _trim(self, cut: int) -> None:
        """Drop the first ``cut`` events and the rest of the last one's revision, keeping the
        newest revision whole."""
        while cut < len(self.events) and self._revisions[cut] == self._revisions[cut - 1]:
            cut += 1
        if cut >= len(self.events):  # the newest revision stays
            last = self._revisions[-1]
            cut = bisect.bisect_left(self._revisions, last)
            if cut == 0:
                return
        self.oldest = self._revisions[cut - 1]
        self.weight -= sum(e.weight for e in self.events[:cut])
        del self.events[:cut], self._revisions[:cut]
        if cut > self._first:
            del self._starts[: cut - self._first]
        self._first = max(self._first - cut, 0)
        self.offset += cut

    def after(self, revision: int) -> int:
        """The position of the first event after ``revision`` (which must be kept)."""
        return self.offset + bisect.bisect_right(self._revisions, revision)

    def at(self, position: int) -> GroupEvent | None:
        """The event at ``position``; None past the newest, or when it was dropped."""
        i = position - self.offset
        return self.events[i] if 0 <= i < len(self.events) else None

    def bytes_after(self, position: int) -> int:
        """Bytes of the lines from ``position`` (or the oldest kept) to the newest event:
        a watcher's lag. Makes the lines of those events not made yet, and of no other."""
        i = max(position - self.offset, 0)
        if i >= len(self.events):
            return 0
        if not self._starts or i > self._first + len(self._starts):
            self._first, self._starts, self._total = i, [], 0  # a window of its own
        elif i < self._first:  # the window grows back to i
            at, back = self._starts[0], []
            for event in reversed(self.events[i : self._first]):
                at -= len(event.line)
                back.append(at)
            self._starts[:0] = back[::-1]
            self._first = i
        for event in self.events[self._first + len(self._starts) :]:
            self._starts.append(self._total)
            self._total += len(event.line)
        return self._total - self._starts[i - self._first]

    def as_of(self, revision: int, groups: Mapping[str, Group]) -> dict[str, Group]:
        """Every group's entries as they were at ``revision`` (at or after ``oldest``), from
        ``groups`` (as they are now) and the changes since."""
        state: dict[str, Group] = dict(groups)
        undone: set[str] = set()
        for event in self.events[self.after(revision) - self.offset :]:
            if event.gid in undone:
                continue
            undone.add(event.gid)
            if event.before is None:
                state.pop(event.gid, None)
            else:
                state[event.gid] = event.before
        return state
