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

from app.store import Entry

Group = Mapping[str, Entry]  # a group's stored entries: its engine key and its agents' keys


class GroupEvent:
    """One change of one group. Its wire ``line`` (the engine's view, encoded) is made on
    first use, by a watcher or the byte count of the watchers' budgets: a replica nobody
    watches makes none (a fleet's launch is two changes a group). What makes it is kept as
    plain fields (the callable and its arguments), not a closure: a launch's events would
    otherwise be some 6 more objects each for the garbage collector to traverse."""

    __slots__ = ("_args", "_line", "_make", "before", "gid", "kind", "revision", "role")

    def __init__(
        self,
        revision: int,
        gid: str,
        kind: str,  # ADDED, MODIFIED, DELETED
        role: str,
        line: bytes | Callable[..., bytes],
        before: Group | None,  # the group's entries before this change (None: it did not exist)
        *args: object,  # what ``line`` (a callable) is called with
    ) -> None:
        self.revision, self.gid, self.kind, self.role, self.before = (
            revision, gid, kind, role, before
        )  # fmt: skip
        self._line: bytes | None = line if isinstance(line, bytes) else None
        self._make: Callable[..., bytes] | None = None if isinstance(line, bytes) else line
        self._args: tuple[object, ...] | None = args or None

    @property
    def line(self) -> bytes:
        if self._line is None:
            assert self._make is not None
            self._line = self._make(*(self._args or ()))
            self._make = self._args = None
        return self._line


class EventLog:
    def __init__(self, keep: int) -> None:
        self.keep = max(1, keep)
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

    @property
    def end(self) -> int:
        """The position after the newest event."""
        return self.offset + len(self.events)

    def append(self, event: GroupEvent) -> None:
        self.events.append(event)
        self._revisions.append(event.revision)
        if len(self.events) > self.keep + self.keep // 4:  # trim in steps, whole revisions
            cut = len(self.events) - self.keep
            while cut < len(self.events) and self._revisions[cut] == self._revisions[cut - 1]:
                cut += 1
            self.oldest = self._revisions[cut - 1]
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
