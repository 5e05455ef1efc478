"""``GET /tp-groups``: the groups as of one store revision, in pages.

A list is read from the feed once it has applied every change up to the store's revision at
the request (so it sees every write answered before it). Its pages are one snapshot: the
``continue`` token names the revision and the last group sent, and a later page is the feed's
groups as of that revision (undoing the changes since, from the log), so a fleet of 12,500
groups is walked in pages with nothing missed or seen twice. A token older than the log
answers ``410 revision_compacted``: list again. Leases (``expires_at``) are as of the read.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Iterable, Mapping

from app.core.errors import FieldProblem, InvalidRequest, RevisionAhead, RevisionCompacted
from app.core.schemas import Engine
from app.registry import keys
from app.registry.records import Decoded
from app.store import Entry, Store
from app.watch.feed import Feed, selected, view
from app.watch.history import Group, Selector


def encode_token(revision: int, after: str, role: str | None) -> str:
    raw = json.dumps({"r": revision, "a": after, "role": role}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_token(token: str) -> tuple[int, str, str | None]:
    try:
        raw = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        revision, after, role = raw["r"], raw["a"], raw["role"]
        if not (isinstance(revision, int) and isinstance(after, str)):
            raise ValueError
        if role is not None and not isinstance(role, str):
            raise ValueError
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError):
        raise InvalidRequest(
            "The continue token is not one this registry gave: pass the 'continue' of the "
            "previous page as it was, or list again without it.",
            fields=[FieldProblem(("continue",), "not a continue token", "value_error")],
        ) from None
    return revision, after, role


async def refuse_ahead(store: Store, revision: int, what: str) -> None:
    """Refuse a revision the store has not reached (a store restored from a backup, or a new
    SQLite file under clients of the old one): a watch from it would get bookmarks forever,
    a page would be labelled with it. A replica merely behind the store is not refused (its
    feed catches up): the store's own revision decides."""
    head = await store.revision()
    if revision > head:
        raise RevisionAhead(
            f"The {what}'s revision {revision} is ahead of the store's ({head}): the store was "
            "restored or replaced since that revision was read. List the groups again (GET "
            "/tp-groups) and watch from the list's revision.",
            store_revision=head,
        )


async def snapshot(
    feed: Feed, *, token: str | None, selector: str | None, timeout_s: float
) -> tuple[int, str, Mapping[str, Group]]:
    """The groups a page reads: (revision, the last group the previous page sent, groups as
    of that revision). ``selector``: the filters of the first page, which its token carries.
    The groups are taken before any await of the caller: ``feed.groups`` itself changes."""
    after = ""
    if token is None:
        revision = await feed.caught_up(timeout_s)
    else:
        revision, after, token_selector = decode_token(token)
        if token_selector != selector:
            raise InvalidRequest(
                "A continue token goes with the filters of its first page: pass the same "
                f"filters ({token_selector!r}), or list again.",
                fields=[FieldProblem(("continue",), "differs from the filters", "value_error")],
            )
        if revision > feed.progress:  # a page from a replica ahead of this one
            await refuse_ahead(feed.store, revision, "continue token")
            await feed.caught_up(timeout_s)
    if revision < feed.log.oldest:
        raise RevisionCompacted(
            f"The list's snapshot (revision {revision}) is older than the history this "
            f"replica keeps (from revision {feed.log.oldest}): list again from the first page.",
            oldest_revision=feed.log.oldest,
        )
    groups: Mapping[str, Group] = (
        feed.groups if revision >= feed.progress else feed.log.as_of(revision, feed.groups)
    )
    return revision, after, groups


def live(group: Group, remaining: Mapping[int, float]) -> Group:
    """The group without the entries whose lease ended (expired, its keys not yet deleted)."""
    ended = [k for k, e in group.items() if e.lease is not None and remaining.get(e.lease, 1) <= 0]
    return {k: e for k, e in group.items() if k not in ended} if ended else group


async def leases_left(
    store: Store, groups: Mapping[str, Group], page: list[str]
) -> tuple[dict[int, float], float]:
    """The time left of the page's groups' leases, and when it was read."""
    leases = {e.lease for g in page for e in groups[g].values() if e.lease is not None}
    remaining = await store.lease_remaining(leases) if leases else {}
    return remaining, time.time()


def taken(groups: Mapping[str, Group], page: list[str]) -> dict[str, Group]:
    """The page's groups as they are now, before the page awaits anything: ``groups`` may be
    the feed's own, which a change replaces (or drops) while the page reads its leases."""
    return {gid: groups[gid] for gid in page}


async def views(
    store: Store, decoded: Decoded, groups: Mapping[str, Group], page: list[str], revision: int
) -> list[Engine]:
    """The page's groups as the API shows them, with their leases' time left as of now."""
    mine = taken(groups, page)
    remaining, now = await leases_left(store, mine, page)
    out: list[Engine] = []
    for gid in page:
        engine = view(gid, live(mine[gid], remaining), revision, decoded, remaining, now)
        if engine is not None:
            out.append(engine)
    return out


def _after(feed: Feed, groups: Mapping[str, Group], after: str) -> Iterable[str]:
    """The ids of ``groups`` past ``after``, in order: from the feed's kept order when the page
    reads the feed's groups as they are now, else sorted (a page of an older revision)."""
    if groups is feed.groups:
        return feed.order.irange(minimum=after, inclusive=(False, True))
    return sorted(g for g in groups if g > after)


def token_selector(selector: Selector) -> str | None:
    """The filters a continue token carries (a role alone as before ``model`` existed)."""
    if selector.model is None:
        return selector.role
    return json.dumps([selector.role, selector.model], separators=(",", ":"))


def passes(decoded: Decoded, entry: Entry, selector: Selector) -> bool:
    if selector.empty:
        return True
    return selector.passes(*selected(decoded, entry))


async def read_page(
    feed: Feed,
    store: Store,
    decoded: Decoded,
    *,
    limit: int | None,
    token: str | None,
    selector: Selector,
    timeout_s: float,
) -> bytes:
    """The page as the answer's JSON bytes: ``{"groups": [...], "revision", "continue"}``."""
    carried = token_selector(selector)
    revision, after, groups = await snapshot(
        feed, token=token, selector=carried, timeout_s=timeout_s
    )
    page: list[str] = []
    more = False
    for gid in _after(feed, groups, after):
        engine_entry = groups[gid].get(keys.engine(gid))
        if engine_entry is None or not passes(decoded, engine_entry, selector):
            continue
        if limit is not None and len(page) >= limit:
            more = True
            break
        page.append(gid)
    mine = taken(groups, page)
    remaining, now = await leases_left(store, mine, page)
    parts = []
    for gid in page:
        text = feed.rendered.json(gid, live(mine[gid], remaining), decoded, remaining, now)
        if text is not None:
            parts.append(text)
    feed.rendered.trim(feed.groups)
    follow = json.dumps(encode_token(revision, page[-1], carried)) if more else "null"
    return b'{"groups":[%s],"revision":%d,"continue":%s}' % (
        b",".join(parts),
        revision,
        follow.encode(),
    )
