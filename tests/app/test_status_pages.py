"""The status page in pages, against a real registry process (SQLite) over real HTTP.

One registry serves the module: nine small groups (three of them not ready: rank 1 never
registered) and, for the size bound, twelve groups of TP 256 whose rows are large (long
agent names and hosts: about 80 KB of HTML each). The page is read in headless Chromium (its
links followed as a person would) and with httpx (its bytes).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.api.status_html import PAGE_BUDGET
from harness.server import RegistryProcess
from tests.app.api.conftest import agent_body, launch
from tests.support.chromium import Chromium

pytestmark = pytest.mark.ui

SMALL = [f"{role}-{i}" for role in ("decode", "prefill") for i in range(4)] + ["both-0"]
NOT_READY = {"decode-1", "prefill-2", "both-0"}
BIG = [f"wide-{i:02d}" for i in range(12)]
BIG_TP = 256
HOST_TAIL = f"{'h' * 63}.{'h' * 63}.example"  # names at most 128 characters, hosts long


def _open(c: httpx.Client, gid: str, tp: int, role: str) -> str:
    body = {"launch_id": launch(), "tp_size": tp, "role": role}
    r = c.put(f"/tp-groups/{gid}/engine", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["engine_id"])


def _register(c: httpx.Client, gid: str, agents: list[dict[str, object]]) -> None:
    r = c.put(f"/tp-groups/{gid}/engine/agents", json={"agents": agents})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    d = tmp_path_factory.mktemp("status-pages")
    with (
        RegistryProcess(f"sqlite:///{d / 'registry.db'}", log_path=d / "registry.log") as proc,
        httpx.Client(base_url=proc.url, timeout=60) as c,
    ):
        for gid in SMALL:
            role = gid.split("-")[0]
            eid = _open(c, gid, 2, role)
            ranks = [0] if gid in NOT_READY else [0, 1]
            _register(c, gid, [agent_body(eid, r) | {"rank": r} for r in ranks])
        for gid in BIG:
            eid = _open(c, gid, BIG_TP, "prefill")
            agents = [
                agent_body(eid, r, agent_name=f"{eid}-{'n' * 85}-{r}", host=f"node-{r}.{HOST_TAIL}")
                | {"rank": r}
                for r in range(BIG_TP)
            ]
            _register(c, gid, agents)
        yield proc


def _groups(browser: Chromium) -> list[str]:
    text = browser.evaluate(
        "JSON.stringify([...document.querySelectorAll('#groups-h ~ table tbody tr th')]"
        ".map(th => th.innerText))"
    )
    groups: list[str] = json.loads(text)
    return groups


def _next(browser: Chromium) -> str | None:
    href = browser.evaluate("(document.querySelector('a[rel=next]') || {}).href || null")
    return str(href) if href else None


def _walk(browser: Chromium, url: str) -> list[list[str]]:
    pages: list[list[str]] = []
    next_url: str | None = url
    while next_url is not None:
        assert len(pages) < 50, "the pages never end"
        browser.navigate(next_url)
        pages.append(_groups(browser))
        next_url = _next(browser)
    return pages


def test_the_summary_counts_groups_and_ranks_by_role_and_state(
    registry: RegistryProcess, browser: Chromium
) -> None:
    browser.navigate(f"{registry.url}/status")
    text = browser.evaluate(
        "JSON.stringify([...document.querySelectorAll('#summary tbody tr')].map(r => "
        "[...r.children].map(c => c.innerText)))"
    )
    rows = {r[0]: r[1:] for r in json.loads(text)}
    # groups, ready, not ready, ranks live, ranks missing
    big = len(BIG)
    assert rows["prefill"] == [str(4 + big), str(3 + big), "1", str(big * BIG_TP + 7), "1"]
    assert rows["decode"] == ["4", "3", "1", "7", "1"]
    assert rows["both"] == ["1", "0", "1", "1", "1"]
    assert rows["all"] == [str(9 + big), str(6 + big), "3", str(big * BIG_TP + 15), "3"]
    # The summary comes before the groups: what an operator reads first.
    order = browser.evaluate(
        "document.querySelector('#summary').compareDocumentPosition("
        "document.querySelector('#groups-h')) & Node.DOCUMENT_POSITION_FOLLOWING"
    )
    assert order


def test_pages_list_not_ready_groups_first_and_every_group_once(
    registry: RegistryProcess, browser: Chromium
) -> None:
    pages = _walk(browser, f"{registry.url}/status?limit=3")
    assert [len(p) for p in pages] == [3] * 7
    seen = [g for page in pages for g in page]
    assert seen[:3] == sorted(NOT_READY)
    assert seen[3:] == sorted(set(SMALL + BIG) - NOT_READY)
    nav = browser.evaluate("document.querySelector('#pages').innerText")
    assert "Groups 19 to 21 of 21" in nav
    assert "First page" in nav


def test_filters_carry_over_to_the_next_page(registry: RegistryProcess, browser: Chromium) -> None:
    pages = _walk(browser, f"{registry.url}/status?role=decode&limit=2")
    assert pages == [["decode-1", "decode-0"], ["decode-2", "decode-3"]]
    pages = _walk(browser, f"{registry.url}/status?state=not_ready&limit=1")
    assert pages == [["both-0"], ["decode-1"], ["prefill-2"]]


def test_a_page_stays_under_a_megabyte_however_large_its_rows(
    registry: RegistryProcess, tmp_path: Path
) -> None:
    with httpx.Client(base_url=registry.url, timeout=60) as c:
        pages: list[list[str]] = []
        sizes: list[int] = []
        params: dict[str, str | int] = {"limit": 500}
        while True:
            page = c.get("/status", params=params)
            assert page.status_code == 200
            sizes.append(len(page.content))
            pages.append(re.findall(r'<tr id="g-([^"]+)">', page.text))
            follow = re.search(r'<a rel="next" href="/status\?([^"]+)">', page.text)
            if follow is None:
                break
            assert len(pages) < 20, "the pages never end"
            params = dict(httpx.QueryParams(follow.group(1).replace("&amp;", "&")))
    (tmp_path / "sizes.json").write_text(json.dumps(sizes))
    # Twelve rows of about 80 KB and nine small ones: more than one page's budget, so the
    # registry splits them (500 groups allowed a page); the walk sees each group once.
    assert max(sizes) <= 1_000_000, sizes
    assert sum(sizes) > PAGE_BUDGET, sizes
    assert len(pages) >= 2, sizes
    seen = [g for p in pages for g in p]
    assert sorted(seen) == sorted(SMALL + BIG)


def test_a_made_up_place_in_the_order_is_refused(registry: RegistryProcess) -> None:
    for after in ("2:decode-0", "0:Not A Group", "decode-0"):
        r = httpx.get(f"{registry.url}/status", params={"after": after}, timeout=30)
        assert r.status_code == 422, (after, r.text)
    r = httpx.get(f"{registry.url}/status", params={"limit": 501}, timeout=30)
    assert r.status_code == 422, r.text


def test_the_page_says_how_it_stays_current(registry: RegistryProcess) -> None:
    """The script follows the watch stream (no polling period); without it the page reloads
    at its ``<noscript>`` meta refresh: the text names that period, and no other."""
    page = httpx.get(f"{registry.url}/status", timeout=30).text
    reload = re.search(r'<noscript><meta http-equiv="refresh" content="(\d+)">', page)
    assert reload is not None, page[:600]
    stamp = re.search(r'<p id="stamp">(.*?)</p>', page, re.S)
    assert stamp is not None
    said = " ".join(stamp.group(1).split())
    assert "Follows the registry's changes as they come" in said, said
    assert f"reloads every {reload.group(1)} s" in said, said
    assert "Refreshes every" not in said, said
