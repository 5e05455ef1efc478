"""The operator's status page: a summary, the groups in pages, and the latest events.

The summary comes first (groups and ranks by role and state, over the whole registry); then
one page of groups, the not-ready ones first (then by group id), at most ``limit`` groups and
never more than ``PAGE_BUDGET`` bytes of rows, so a page of a 12,500-group fleet stays well
under 1 MB; a "next page" link carries ``after`` (the last row's place in that order) and the
filters. Pages are a live view, not a snapshot: a group that changes state between two pages
moves in the order. Rendered on the server from the registry's read model (one store-wide
read per page) with the Jinja2 templates beside this module (``templates/``: the page, its
rows, its CSS and script inline, allowed by hash in the Content-Security-Policy). The script
(``status.js``) follows the registry's watch stream (``GET /tp-groups?watch=true``) and, when
a group changes, fetches the same URL and swaps the page's main part in (at most once a
second); it shows a banner when the stream breaks or goes silent (no bookmark for 20 s), and
follows it again every refresh period from its revision. Without JavaScript a ``<noscript>``
meta refresh reloads the page. Every value that comes from a client (group ids, hosts, agent
names, details) is escaped by the templates' autoescape.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jinja2
from fastapi.templating import Jinja2Templates
from markupsafe import Markup

from app.registry.events import REFUSALS, Event
from app.registry.observer import Observer

if TYPE_CHECKING:
    from app.registry.state import GroupState

REFRESH_S = 5  # up to 200 groups; one second more for each further 100 (at most 30 s)
PAGE_GROUPS = 100  # groups on a page unless ``limit`` says otherwise
MAX_PAGE_GROUPS = 500
PAGE_BUDGET = 768 * 1024  # bytes of group rows on one page: the page stays under 1 MB
AFTER_PATTERN = r"^[01]:[a-z0-9]([a-z0-9._-]{0,62}[a-z0-9])?$"  # a row's place in the order
STATES = ("", "ready", "not_ready")
ROLES = ("", "prefill", "decode", "both")

TEMPLATES_DIR = Path(__file__).parent / "templates"
STYLE = (TEMPLATES_DIR / "status.css").read_text()
SCRIPT = (TEMPLATES_DIR / "status.js").read_text()
TEMPLATES = Jinja2Templates(
    env=jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
)


def refresh_s(groups: int) -> int:
    """Seconds between polls: a large registry's page is larger and costs more to build."""
    return min(30, REFRESH_S + max(0, groups - 200) // 100)


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


CSP = (
    f"default-src 'none'; style-src {_csp_hash(STYLE)}; script-src {_csp_hash(SCRIPT)}; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)


@dataclass(frozen=True, slots=True)
class Filters:
    role: str = ""
    state: str = ""
    limit: int = PAGE_GROUPS
    after: str = ""  # the order key of the previous page's last row; "" for the first page

    def keep(self, state: GroupState) -> bool:
        if self.role and state.engine.role != self.role:
            return False
        ready = not state.missing
        return not self.state or (self.state == "ready") == ready


def order_key(state: GroupState) -> str:
    """Not-ready groups first, then by group id (the ``after`` of the next page)."""
    return ("0:" if state.missing else "1:") + state.engine.group_id


def _query(filters: Filters, after: str) -> str:
    parts = [("role", filters.role), ("state", filters.state)]
    if filters.limit != PAGE_GROUPS:
        parts.append(("limit", str(filters.limit)))
    parts.append(("after", after))
    return "/status?" + "&".join(f"{k}={v}" for k, v in parts if v)  # escaped by the template


class Lease(NamedTuple):
    text: str
    low: bool


class AgentView(NamedTuple):
    rank: int
    host: str
    name: str
    lease: Lease


class GroupView(NamedTuple):
    """One row of the groups' table, as ``status_rows.html``'s ``group_row`` shows it."""

    gid: str
    role: str
    generation: int
    created_at: str
    engine_id: str
    live: int
    tp_size: int
    missing: list[tuple[int, str | None]]  # the first 32, with the host last seen
    missing_total: int
    lease: Lease | None  # the rank whose lease ends first
    hosts: str
    agents: list[AgentView]  # the first 256 live ranks


class SummaryRow(NamedTuple):
    role: str
    groups: int
    ready: int
    not_ready: int
    live: int
    missing: int


class EventView(NamedTuple):
    at: str
    kind: str
    cause: str
    refusal: bool
    times: int
    group_id: str
    detail: str


def _summary(states: list[GroupState]) -> list[SummaryRow]:
    """Groups and ranks by role and state, the whole registry: what an operator reads first."""
    rows = []
    for role in ("prefill", "decode", "both", ""):
        mine = [s for s in states if not role or s.engine.role == role]
        if role and not mine:
            continue
        ready = sum(not s.missing for s in mine)
        live = sum(sum(r < s.engine.tp_size for r in s.agents) for s in mine)
        missing = sum(len(s.missing) for s in mine)
        rows.append(SummaryRow(role, len(mine), ready, len(mine) - ready, live, missing))
    return rows


def _page(
    shown: list[GroupState], filters: Filters, observer: Observer, now: float
) -> tuple[list[str], str, list[tuple[str, str, str]]]:
    """One page of rows (at most ``limit``, at most ``PAGE_BUDGET`` bytes), what it shows of
    the whole, and its links (text, rel, href)."""
    keys = [order_key(s) for s in shown]
    start = bisect.bisect_right(keys, filters.after) if filters.after else 0
    group_row = TEMPLATES.get_template("status_rows.html").module.group_row  # type: ignore[attr-defined]
    rows: list[str] = []
    size = 0
    for s in shown[start : start + filters.limit]:
        row = group_row(_group_view(s, observer, now))
        if rows and size + len(row) > PAGE_BUDGET:
            break
        rows.append(row)
        size += len(row)
    end = start + len(rows)
    links = []
    if filters.after:
        links.append(("First page", "", _query(filters, "")))
    if end < len(shown):
        links.append(("Next page", "next", _query(filters, keys[end - 1])))
    where = f"Groups {start + 1} to {end} of {len(shown)}" if rows else f"None of {len(shown)}"
    return rows, where, links


def _left(seconds: float, ttl_s: int) -> Lease:
    return Lease(f"{max(0.0, seconds):.0f}s of {ttl_s}s", seconds < ttl_s / 3)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:32])) + (
        f" … ({len(ranks)} in all)" if len(ranks) > 32 else ""
    )


def _group_view(state: GroupState, observer: Observer, now: float) -> GroupView:
    e = state.engine
    live = [r for r in sorted(state.agents) if r < e.tp_size]
    missing = [(r, observer.last_host(e.group_id, e.engine_id, r)) for r in state.missing[:32]]
    lease = None
    if state.agents:
        worst = min(state.agents, key=lambda r: state.expires_at[r] - now)
        lease = _left(state.expires_at[worst] - now, state.agents[worst].ttl_s)
    by_host: dict[str, list[int]] = {}
    for r in live:
        by_host.setdefault(state.agents[r].host, []).append(r)
    agents = [
        AgentView(r, a.host, a.agent_name, _left(state.expires_at[r] - now, a.ttl_s))
        for r, a in ((r, state.agents[r]) for r in live[:256])
    ]
    return GroupView(
        gid=e.group_id,
        role=e.role,
        generation=e.generation,
        created_at=e.created_at,
        engine_id=e.engine_id,
        live=len(live),
        tp_size=e.tp_size,
        missing=missing,
        missing_total=len(state.missing),
        lease=lease,
        hosts="; ".join(f"{h}: {_ranks(rs)}" for h, rs in sorted(by_host.items())),
        agents=agents,
    )


def _event_view(ev: Event) -> EventView:
    cause = ev.fields.get("cause")
    return EventView(
        ev.at,
        ev.kind,
        str(cause) if cause else "",
        ev.kind in REFUSALS,
        ev.count,
        ev.group_id,
        ev.detail,
    )


def page_context(
    states: list[GroupState],
    events: list[Event],
    observer: Observer,
    filters: Filters,
    now: float | None = None,
) -> dict[str, Any]:
    """What ``status.html`` shows."""
    now = time.time() if now is None else now
    shown = sorted((s for s in states if filters.keep(s)), key=order_key)
    rows, where, links = _page(shown, filters, observer, now)
    every = refresh_s(len(states))
    return {
        "style": Markup(STYLE),
        "script": Markup(SCRIPT),
        "every": every,
        "reload_s": every * 2,
        "stamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "total": len(states),
        "ready": sum(not s.missing for s in states),
        "matching": len(shown),
        "summary": _summary(states),
        "filters": filters,
        "roles": ROLES,
        "states": STATES,
        "rows": rows,
        "where": where,
        "links": links,
        "events": [_event_view(ev) for ev in reversed(events)],
    }
