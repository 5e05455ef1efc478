"""The bounded log of group changes a replica keeps for its watchers and its list pages.

Each entry is one change of one group at one store revision, with its wire line encoded once
(every watcher sends the same bytes) and the group's stored entries as they were before it
(so a list page can be read as of an earlier revision: ``as_of``). Entries are addressed by
a position that only grows (``offset`` counts the ones dropped), and the log keeps the bytes
written before each position, so a watcher's lag in bytes is one subtraction.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

from app.store import Entry

Group = Mapping[str, Entry]  # a group's stored entries: its engine key and its agents' keys


@dataclass(frozen=True, slots=True)
class GroupEvent:
    revision: int
    gid: str
    kind: str  # ADDED, MODIFIED, DELETED
    role: str
    line: bytes
    before: Group | None  # the group's entries before this change (None: it did not exist)


class EventLog:
    def __init__(self, keep: int) -> None:
        self.keep = max(1, keep)
        self.events: list[GroupEvent] = []
        self._revisions: list[int] = []
        self._starts: list[int] = []  # bytes of every line before each event
        self.offset = 0  # position of events[0]
        self.oldest = 0  # a watch or a page may be at this revision or later
        self.total = 0  # bytes of every line ever appended

    def reset(self, revision: int) -> None:
        self.offset += len(self.events)
        self.events, self._revisions, self._starts = [], [], []
        self.oldest = revision

    @property
    def end(self) -> int:
        """The position after the newest event."""
        return self.offset + len(self.events)

    def append(self, event: GroupEvent) -> None:
        self.events.append(event)
        self._revisions.append(event.revision)
        self._starts.append(self.total)
        self.total += len(event.line)
        if len(self.events) > self.keep + self.keep // 4:  # trim in steps, whole revisions
            cut = len(self.events) - self.keep
            while cut < len(self.events) and self._revisions[cut] == self._revisions[cut - 1]:
                cut += 1
            self.oldest = self._revisions[cut - 1]
            del self.events[:cut], self._revisions[:cut], self._starts[:cut]
            self.offset += cut

    def after(self, revision: int) -> int:
        """The position of the first event after ``revision`` (which must be kept)."""
        return self.offset + bisect.bisect_right(self._revisions, revision)

    def at(self, position: int) -> GroupEvent | None:
        """The event at ``position``; None past the newest, or when it was dropped."""
        i = position - self.offset
        return self.events[i] if 0 <= i < len(self.events) else None

    def bytes_before(self, position: int) -> int:
        """Bytes of every line before ``position``."""
        i = position - self.offset
        if i >= len(self._starts):
            return self.total
        return self._starts[max(i, 0)]

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
