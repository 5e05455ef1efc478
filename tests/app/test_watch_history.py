"""The watch log (app/watch/history.py): trimmed by whole revisions, positions that only grow,
bytes behind a position, and a list page's view of the groups as of an earlier revision."""

from __future__ import annotations

import pytest

from app.store import Entry
from app.watch.history import ChangeLog, Group, GroupEvent, Selector
from app.watch.pages import decode_token, encode_token

pytestmark = pytest.mark.unit

ENTRY = Entry("groups/g/engine", b"{}", 1, None)


def event(revision: int, gid: str, before: Group | None = None, size: int = 10) -> GroupEvent:
    return GroupEvent(revision, gid, "MODIFIED", "prefill", b"x" * size, before)


def test_the_log_trims_whole_revisions_and_keeps_positions_growing() -> None:
    log = ChangeLog(keep=4)
    for revision, gid in [(1, "a"), (2, "a"), (3, "a"), (3, "b"), (3, "c"), (4, "a")]:
        log.append(event(revision, gid))
    # Past keep + keep // 4 (5) the oldest go, never half a revision: revision 3 stays whole.
    assert [e.revision for e in log.events] == [3, 3, 3, 4]
    assert log.oldest == 2
    assert log.offset == 2
    assert log.end == 6
    assert log.at(1) is None  # dropped
    at = log.at(2)
    assert at is not None
    assert at.gid == "a"
    assert log.after(3) == 5  # the first event after revision 3
    assert log.after(2) == 2


def test_bytes_after_a_position_measure_a_watchers_lag() -> None:
    log = ChangeLog(keep=100)
    for revision in range(1, 6):
        log.append(event(revision, "g", size=revision))
    assert log.bytes_after(0) == 1 + 2 + 3 + 4 + 5
    assert log.bytes_after(3) == 4 + 5
    assert log.bytes_after(log.end) == 0
    log.append(event(6, "g", size=6))
    assert log.bytes_after(3) == 4 + 5 + 6


def test_lines_are_made_only_for_what_a_watcher_is_behind_on() -> None:
    made: list[int] = []

    def lazy(revision: int, size: int) -> GroupEvent:
        def line() -> bytes:
            made.append(revision)
            return b"y" * size

        return GroupEvent(revision, "g", "MODIFIED", "prefill", line, None)

    log = ChangeLog(keep=4)
    for revision in range(1, 7):  # past keep + keep // 4: the first two go, never made
        log.append(lazy(revision, revision))
    assert made == []
    assert log.offset == 2
    first = log.at(2)
    assert first is not None
    assert first.line == b"yyy"
    assert made == [3]
    # A watcher behind from position 4 (revision 5): those lines only, each made once.
    assert log.bytes_after(4) == 5 + 6
    assert made == [3, 5, 6]
    # One further behind: the count grows back to it.
    assert log.bytes_after(2) == 3 + 4 + 5 + 6
    assert made == [3, 5, 6, 4]
    assert log.bytes_after(4) == 5 + 6
    log.append(lazy(7, 7))
    log.append(lazy(8, 8))  # trims revisions 3 and 4 (counted) from the front
    assert log.offset == 4
    assert log.bytes_after(log.end - 1) == 8
    assert log.bytes_after(0) == 5 + 6 + 7 + 8  # from the oldest kept
    assert made == [3, 5, 6, 4, 8, 7]


def test_as_of_undoes_the_changes_after_a_revision() -> None:
    old_a = {"groups/a/engine": Entry("groups/a/engine", b"1", 1)}
    new_a = {"groups/a/engine": Entry("groups/a/engine", b"2", 5)}
    b = {"groups/b/engine": Entry("groups/b/engine", b"1", 2)}
    c = {"groups/c/engine": Entry("groups/c/engine", b"1", 6)}
    log = ChangeLog(keep=100)
    log.reset(2)  # the groups were read at revision 2: a (old) and b
    log.append(event(5, "a", before=old_a))  # a relaunched
    log.append(event(6, "c", before=None))  # c added
    log.append(event(7, "b", before=b))  # b deleted
    now: dict[str, Group] = {"a": new_a, "c": c}
    assert log.as_of(2, now) == {"a": old_a, "b": b}
    assert log.as_of(5, now) == {"a": new_a, "b": b}
    assert log.as_of(7, now) == now


def test_continue_tokens_round_trip_and_refuse_what_the_registry_did_not_give() -> None:
    token = encode_token(41, "prefill-0007", "decode")
    assert decode_token(token) == (41, "prefill-0007", "decode")
    for bad in ("", "not-a-token", encode_token(1, "a", None)[:-3] + "!!!"):
        with pytest.raises(Exception, match="continue token"):
            decode_token(bad)


def weighed(revision: int, weight: int) -> GroupEvent:
    return GroupEvent(revision, "g", "MODIFIED", "prefill", b"z", None, weight=weight)


def test_the_log_is_bounded_by_its_events_weight_keeping_the_newest_revision_whole() -> None:
    log = ChangeLog(keep=1_000, max_bytes=10_000)
    for revision in range(1, 101):  # 100 changes of 1,000 bytes: ten times the bound
        log.append(weighed(revision, 1_000))
        assert log.weight <= 10_000
    assert log.weight == sum(e.weight for e in log.events)
    assert log.oldest == log.events[0].revision - 1
    assert log.events[-1].revision == 100
    # One change heavier than the whole bound stays (a watcher must still get it), alone.
    log.append(weighed(101, 50_000))
    assert [e.revision for e in log.events] == [101]
    assert log.oldest == 100


def modified(role: str, model: str | None, prior: tuple[str, str | None]) -> GroupEvent:
    def line(kind: str, revision: int, gid: str, group: object) -> bytes:
        return b'{"type":"%s","revision":%d,"object":"%s"}' % (
            kind.encode(),
            revision,
            str(sorted(group)).encode(),  # type: ignore[call-overload]
        )

    after, before = {"now": ENTRY}, {"then": ENTRY}
    return GroupEvent(
        7, "g", "MODIFIED", role, line, before, "MODIFIED", 7, "g", after, model=model, prior=prior
    )


def test_a_filtered_watcher_sees_a_group_enter_as_added_and_leave_as_deleted() -> None:
    moved = modified("decode", "m", prior=("prefill", "m"))
    assert (
        moved.line_for(Selector(role="decode"))
        == b'{"type":"ADDED","revision":7,"object":"[\'now\']"}'
    )
    assert moved.line_for(Selector(role="prefill")) == (
        b'{"type":"DELETED","revision":7,"object":"[\'then\']"}'
    )
    assert moved.line_for(Selector(role="both")) is None
    assert moved.line_for(Selector(model="m")) == moved.line  # in before and after
    assert moved.line_for(Selector()) == moved.line
    assert moved.line.startswith(b'{"type":"MODIFIED"')
