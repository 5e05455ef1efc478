"""The operator's status page: a summary, the groups in pages, and the latest events.

The summary comes first (groups and ranks by role and state, over the whole registry); then
one page of groups, the not-ready ones first (then by group id), at most ``limit`` groups and
never more than ``PAGE_BUDGET`` bytes of rows, so a page of a 12,500-group fleet stays well
under 1 MB; a "next page" link carries ``after`` (the last row's place in that order) and the
filters. Pages are a live view, not a snapshot: a group that changes state between two pages
moves in the order. Rendered on the server from the registry's read model (one store-wide
read per page), with inline CSS and a small inline script (allowed by hash in the
Content-Security-Policy) that follows the registry's watch stream
(``GET /tp-groups?watch=true``) and, when a group changes, fetches the same URL and swaps
the page's main part in (at most once a second); it shows a banner when the stream breaks or
goes silent (no bookmark for 20 s), and follows it again every refresh period from its
revision.
Without JavaScript a ``<noscript>`` meta refresh reloads the page. Every value that comes
from a client (group ids, hosts, agent names, details) goes through :func:`html.escape`.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from html import escape
from typing import TYPE_CHECKING

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

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1rem;color:#1a1a1a;background:#fff}
h1{font-size:1.3rem;margin:0 0 .3rem}h2{font-size:1.1rem;margin:1.2rem 0 .4rem}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:.2rem .5rem;
border-bottom:1px solid #ddd;vertical-align:top}th{background:#f2f2f2}
code{font-size:12px}.ok{color:#0a6b2c;font-weight:600}.bad{color:#a40e26;font-weight:600}
.low{color:#a40e26;font-weight:600}.refusal{color:#a40e26}.muted{color:#555}
#lost{background:#a40e26;color:#fff;padding:.4rem .6rem;margin:.4rem 0}
form{margin:.4rem 0}label{margin-right:.8rem}details summary{cursor:pointer}
"""

SCRIPT = """
(function(){
  var lost = document.getElementById("lost");
  var every = Number(document.body.dataset.refresh) || 5;
  var revision = null, pending = false, last = 0;
  function down(why){
    lost.textContent = "Lost the registry at " + new Date().toISOString() + " (" + why +
      "); the page below is from before. Retrying every " + every + " s.";
    lost.hidden = false;
  }
  async function refresh(){
    pending = false; last = Date.now();
    try {
      var r = await fetch(location.href, {credentials: "same-origin", cache: "no-store",
        signal: AbortSignal.timeout(4000)});
      if (!r.ok) throw new Error("the registry answered " + r.status);
      var doc = new DOMParser().parseFromString(await r.text(), "text/html");
      document.querySelector("main").replaceWith(doc.querySelector("main"));
      lost.hidden = true;
    } catch (e) { down(e.message); }
  }
  function changed(){
    if (pending) return;
    pending = true;
    setTimeout(refresh, Math.max(0, 1000 - (Date.now() - last)));
  }
  function silent(ms){
    return new Promise(function(_, no){
      setTimeout(function(){ no(new Error("no word for " + ms / 1000 + " s")); }, ms);
    });
  }
  async function follow(){
    var url = location.origin + "/tp-groups?watch=true" +
      (revision === null ? "" : "&revision=" + revision);
    try {
      var r = await fetch(url, {credentials: "same-origin", cache: "no-store"});
      if (r.status === 410) { revision = null; changed(); throw new Error("history compacted"); }
      if (!r.ok) throw new Error("the registry answered " + r.status);
      if (revision !== null || !lost.hidden) changed();
      var reader = r.body.getReader(), decoder = new TextDecoder(), text = "";
      while (true) {
        var got = await Promise.race([reader.read(), silent(20000)]);
        if (got.done) throw new Error("the registry ended the stream");
        text += decoder.decode(got.value, {stream: true});
        var lines = text.split("\\n");
        text = lines.pop();
        for (var i = 0; i < lines.length; i++) {
          if (!lines[i]) continue;
          var line = JSON.parse(lines[i]);
          if (line.type === "ERROR") throw new Error(line.object.detail);
          revision = line.revision;
          if (line.type !== "BOOKMARK") changed();
        }
      }
    } catch (e) {
      down(e.message);
      setTimeout(follow, every * 1000);
    }
  }
  follow();
})();
"""


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
    return "/status?" + "&amp;".join(f"{k}={escape(v)}" for k, v in parts if v)


def _summary(states: list[GroupState]) -> str:
    """Groups and ranks by role and state, the whole registry: what an operator reads first."""
    rows = []
    for role in ("prefill", "decode", "both", ""):
        mine = [s for s in states if not role or s.engine.role == role]
        if role and not mine:
            continue
        ready = sum(not s.missing for s in mine)
        live = sum(sum(r < s.engine.tp_size for r in s.agents) for s in mine)
        missing = sum(len(s.missing) for s in mine)
        bad = ' class="bad"' if len(mine) - ready else ""
        rows.append(
            f'<tr><th scope="row">{role or "all"}</th><td>{len(mine)}</td><td>{ready}</td>'
            f"<td{bad}>{len(mine) - ready}</td><td>{live}</td><td{bad}>{missing}</td></tr>"
        )
    return (
        '<section aria-labelledby="summary-h"><h2 id="summary-h">Summary</h2>'
        '<table id="summary"><thead><tr><th scope="col">Role</th><th scope="col">Groups</th>'
        '<th scope="col">Ready</th><th scope="col">Not ready</th>'
        '<th scope="col">Ranks live</th><th scope="col">Ranks missing</th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></section>"
    )


def _page(
    shown: list[GroupState], filters: Filters, observer: Observer, now: float
) -> tuple[str, str]:
    """One page of rows (at most ``limit``, at most ``PAGE_BUDGET`` bytes) and its links."""
    keys = [order_key(s) for s in shown]
    start = bisect.bisect_right(keys, filters.after) if filters.after else 0
    rows: list[str] = []
    size = 0
    for s in shown[start : start + filters.limit]:
        row = _group_row(s, observer, now)
        if rows and size + len(row) > PAGE_BUDGET:
            break
        rows.append(row)
        size += len(row)
    end = start + len(rows)
    links = []
    if filters.after:
        links.append(f'<a href="{_query(filters, "")}">First page</a>')
    if end < len(shown):
        links.append(f'<a rel="next" href="{_query(filters, keys[end - 1])}">Next page</a>')
    where = f"Groups {start + 1} to {end} of {len(shown)}" if rows else f"None of {len(shown)}"
    nav = f'<nav aria-label="Pages" id="pages"><p>{where}. {" ".join(links)}</p></nav>'
    body = "".join(rows) or '<tr><td colspan="9">No group matches.</td></tr>'
    return body, nav


def _left(seconds: float, ttl_s: int) -> str:
    text = f"{max(0.0, seconds):.0f}s of {ttl_s}s"
    if seconds < ttl_s / 3:
        return f'<span class="low">{text} (low)</span>'
    return text


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:32])) + (
        f" … ({len(ranks)} in all)" if len(ranks) > 32 else ""
    )


def _group_row(state: GroupState, observer: Observer, now: float) -> str:
    e = state.engine
    gid = escape(e.group_id)
    live = [r for r in sorted(state.agents) if r < e.tp_size]
    missing = state.missing
    if missing:
        ready = f'<span class="bad">{len(live)}/{e.tp_size} not ready</span>'
        parts = []
        for r in missing[:32]:
            host = observer.last_host(e.group_id, e.engine_id, r)
            where = f"last on {escape(host)}" if host else "never seen by this replica"
            parts.append(f"missing rank {r} ({where})")
        if len(missing) > 32:
            parts.append(f"… {len(missing)} missing in all")
        missing_html = "<br>".join(parts)
    else:
        ready = f'<span class="ok">{len(live)}/{e.tp_size} ready</span>'
        missing_html = '<span class="muted">none</span>'
    if state.agents:
        worst = min(state.agents, key=lambda r: state.expires_at[r] - now)
        lease = _left(state.expires_at[worst] - now, state.agents[worst].ttl_s)
    else:
        lease = '<span class="muted">no live agent</span>'
    by_host: dict[str, list[int]] = {}
    for r in live:
        by_host.setdefault(state.agents[r].host, []).append(r)
    hosts = "; ".join(f"{escape(h)}: {_ranks(rs)}" for h, rs in sorted(by_host.items()))
    if live:
        items = "".join(
            f"<li>rank {r} on {escape(a.host)} ({escape(a.agent_name)}), lease "
            f"{_left(state.expires_at[r] - now, a.ttl_s)}</li>"
            for r, a in ((r, state.agents[r]) for r in live[:256])
        )
        hosts_html = f"<details><summary>{hosts}</summary><ul>{items}</ul></details>"
    else:
        hosts_html = '<span class="muted">none</span>'
    return (
        f'<tr id="g-{gid}"><th scope="row">{gid}</th><td>{e.role}</td>'
        f"<td>{e.generation}</td><td>{escape(e.created_at)}</td>"
        f"<td><code>{escape(e.engine_id)}</code></td><td>{ready}</td><td>{missing_html}</td>"
        f"<td>{lease}</td><td>{hosts_html}</td></tr>"
    )


def _event_row(ev: Event) -> str:
    kind = escape(ev.kind)
    cause = ev.fields.get("cause")
    if cause:
        kind += f" (cause {escape(str(cause))})"
    cls = ' class="refusal"' if ev.kind in REFUSALS else ""
    count = f" ({ev.count} times)" if ev.count > 1 else ""
    return (
        f"<tr><td>{escape(ev.at)}</td><td{cls}>{kind}{count}</td>"
        f"<td>{escape(ev.group_id)}</td><td>{escape(ev.detail)}</td></tr>"
    )


def _options(name: str, values: Iterable[str], chosen: str) -> str:
    opts = "".join(
        f'<option value="{v}"{" selected" if v == chosen else ""}>{v or "any"}</option>'
        for v in values
    )
    return f'<label>{name} <select name="{name}">{opts}</select></label>'


def render(
    states: list[GroupState],
    events: list[Event],
    observer: Observer,
    filters: Filters,
    now: float | None = None,
) -> str:
    now = time.time() if now is None else now
    shown = sorted((s for s in states if filters.keep(s)), key=order_key)
    ready = sum(not s.missing for s in states)
    rows, nav = _page(shown, filters, observer, now)
    event_rows = "".join(_event_row(ev) for ev in reversed(events))
    if not event_rows:
        event_rows = '<tr><td colspan="4">No events yet.</td></tr>'
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    every = refresh_s(len(states))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Engine registry status</title>
<noscript><meta http-equiv="refresh" content="{every * 2}"></noscript>
<style>{STYLE}</style></head>
<body data-refresh="{every}"><header><h1>Engine registry status</h1>
<p id="lost" role="alert" hidden></p></header>
<main>
<p id="stamp">Read at {stamp}: {len(states)} groups, {ready} ready, {len(states) - ready} not
ready; {len(shown)} match the filters. Refreshes every {every} s.</p>
{_summary(states)}
<form method="get" action="/status">{_options("role", ROLES, filters.role)}
{_options("state", STATES, filters.state)}<button type="submit">Filter</button></form>
<section aria-labelledby="groups-h"><h2 id="groups-h">Groups</h2>
<p class="muted">Not-ready groups first, then by group id.</p>{nav}
<table><caption class="muted">Lease left: the rank whose lease ends first; marked low under a
third of its ttl. Generation: launches of the group so far.</caption>
<thead><tr><th scope="col">Group</th><th scope="col">Role</th><th scope="col">Generation</th>
<th scope="col">Opened</th><th scope="col">Engine id</th><th scope="col">Ranks</th>
<th scope="col">Missing</th><th scope="col">Lease left</th>
<th scope="col">Hosts (ranks)</th></tr></thead>
<tbody>{rows}</tbody></table></section>
<section aria-labelledby="events-h"><h2 id="events-h">Events (newest first)</h2>
<table><thead><tr><th scope="col">Time</th><th scope="col">Kind</th><th scope="col">Group</th>
<th scope="col">What</th></tr></thead><tbody>{event_rows}</tbody></table></section>
</main>
<script>{SCRIPT}</script>
</body></html>
"""
