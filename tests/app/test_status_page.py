"""The status page as a person sees it: headless Chromium against a real registry process.

One registry (SQLite, tokens) and one browser serve the module. The registry holds a ready
prefill group, a prefill group whose rank 3 on node-b.example let its lease expire, a decode
group that planned a handshake, and a refusal (a rank of the decode group sent the prefill
group's engine_id: cause other_group). The page is checked in the browser (after its script
ran), by axe-core inside the page (accessibility) and by the Nu HTML Checker (validity), and
its screenshot is saved under the test's tmp_path.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from tests.app.api.conftest import agent_body, launch
from tests.support.chromium import CHROMIUM, Chromium
from tests.support.chromium import SKIP_REASON as NO_CHROMIUM

pytestmark = pytest.mark.ui

READER = "reader-token-0123456789abcdef"
WORKER = "worker-token-0123456789abcdef"
HOSTILE = "<img/src=x/onerror=document.title='pwned'>"
NODE_MODULES = Path("/usr/lib/node_modules")


def _npm_root() -> Path:
    npm = shutil.which("npm")
    if npm is None:
        return NODE_MODULES
    done = subprocess.run([npm, "root", "-g"], capture_output=True, text=True, timeout=30)
    return Path(done.stdout.strip() or NODE_MODULES)


def _tool(relative: str) -> Path:
    path = _npm_root() / relative
    if not path.is_file():
        pytest.skip(f"{path} is missing: scripts/system-deps.sh installs it with npm")
    return path


def _register(c: httpx.Client, gid: str, eid: str, rank: int, host: str, ttl_s: int = 60) -> None:
    body = agent_body(eid, rank, host=host, ttl_s=ttl_s)
    r = c.put(f"/tp-groups/{gid}/engine/agents/{rank}", json=body)
    assert r.status_code == 201, r.text


def _open(c: httpx.Client, gid: str, tp: int, role: str) -> str:
    r = c.put(
        f"/tp-groups/{gid}/engine",
        json={"launch_id": launch(), "tp_size": tp, "role": role, "compat": {"model": "m"}},
    )
    assert r.status_code == 201, r.text
    return str(r.json()["engine_id"])


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    d = tmp_path_factory.mktemp("status-registry")
    (d / "tokens").write_text(f"reader:{READER}\nworker:{WORKER}\n")
    with RegistryProcess(
        f"sqlite:///{d / 'registry.db'}",
        args=["--tokens-file", str(d / "tokens"), "--sweep-interval-s", "0.2"],
        log_path=d / "registry.log",
    ) as proc:
        worker = {"Authorization": f"Bearer {WORKER}"}
        reader = {"Authorization": f"Bearer {READER}"}
        with httpx.Client(base_url=proc.url, headers=worker, timeout=30) as c:
            ready = _open(c, "prefill-ready", 2, "prefill")
            for r in range(2):
                _register(c, "prefill-ready", ready, r, "node-a.example")
            partial = _open(c, "prefill-partial", 4, "prefill")
            for r in range(3):
                _register(c, "prefill-partial", partial, r, "node-a.example")
            _register(c, "prefill-partial", partial, 3, "node-b.example", ttl_s=5)
            # The registry sees rank 3 alive once (as a scrape would), then its lease lapses.
            assert c.get("/status", headers=reader).status_code == 200
            decode = _open(c, "decode-0", 2, "decode")
            for r in range(2):
                _register(c, "decode-0", decode, r, "node-c.example")
            hs = c.post(f"/engines/{ready}/handshake", json={"tp_size": 2, "rank": 0})
            assert hs.status_code == 200, hs.text
            wrong = c.put("/tp-groups/decode-0/engine/agents/1", json=agent_body(ready, 1))
            assert wrong.json()["cause"] == "other_group", wrong.text
            # Client input that is markup must show as text, never become elements.
            hostile = c.put("/tp-groups/decode-0/engine/agents/1", json=agent_body(HOSTILE, 1))
            assert hostile.json()["cause"] == "unknown", hostile.text
            deadline = time.monotonic() + 20
            while c.get("/tp-groups/prefill-partial/engine").json()["ready"]:
                assert time.monotonic() < deadline, "rank 3's 5 s lease never expired"
                time.sleep(0.25)
        with httpx.Client(base_url=proc.url, headers=reader, timeout=30) as c:
            for _ in range(3):  # more reads after the expiry: counted once all the same
                assert c.get("/status").status_code == 200
            # Recorded when the sweep ends the lease (reads hide it from its expiry on).
            deadline = time.monotonic() + 5
            while True:
                events = c.get("/events").json()["events"]
                expired = [e for e in events if e["kind"] == "lease_expired"]
                if expired or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert [(e["group_id"], e["fields"]["rank"]) for e in expired] == [
                ("prefill-partial", 3)
            ]
        yield proc


def _page_url(registry: RegistryProcess, query: str = "") -> str:
    # A person types the reader token into the browser's credentials prompt; the URL's
    # user-info is the same HTTP Basic answer, given up front.
    return f"http://status:{READER}@{registry.host}:{registry.port}/status{query}"


def _rows(browser: Chromium) -> dict[str, str]:
    text = browser.evaluate(
        "JSON.stringify(Object.fromEntries([...document.querySelectorAll('#groups-h ~ table "
        "tbody tr')].map(r => [r.querySelector('th') ? r.querySelector('th').innerText : '', "
        "r.innerText])))"
    )
    rows: dict[str, str] = json.loads(text)
    return rows


def test_the_page_shows_groups_missing_ranks_hosts_and_refusals(
    registry: RegistryProcess, browser: Chromium, tmp_path: Path
) -> None:
    browser.navigate(_page_url(registry))
    rows = _rows(browser)
    assert set(rows) == {"prefill-ready", "prefill-partial", "decode-0"}
    assert "2/2 ready" in rows["prefill-ready"]
    assert "3/4 not ready" in rows["prefill-partial"]
    assert "missing rank 3 (last on node-b.example)" in rows["prefill-partial"]
    assert "node-a.example: 0, 1, 2" in rows["prefill-partial"]
    events = browser.evaluate("document.querySelector('#events-h ~ table').innerText")
    assert "engine_id_mismatch (cause other_group)" in events
    assert "lease_expired" in events
    assert "node-b.example" in events
    assert "decode TP 2 ranks 0 planned against prefill engine" in events
    assert HOSTILE in events
    assert browser.evaluate("document.querySelectorAll('img').length") == 0
    assert browser.evaluate("document.title") == "Engine registry status"
    shot = browser.screenshot(tmp_path / "status.png")
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
    html = browser.evaluate("document.documentElement.outerHTML")
    assert READER not in html
    assert WORKER not in html


def test_filters_work_without_script(registry: RegistryProcess, browser: Chromium) -> None:
    browser.navigate(_page_url(registry, "?role=prefill&state=not_ready"))
    assert set(_rows(browser)) == {"prefill-partial"}
    browser.navigate(_page_url(registry, "?role=decode"))
    assert set(_rows(browser)) == {"decode-0"}


def test_the_page_passes_axe_core(registry: RegistryProcess, browser: Chromium) -> None:
    axe = _tool("axe-core/axe.min.js")
    browser.navigate(_page_url(registry))
    browser.evaluate(axe.read_text())
    result: dict[str, Any] = browser.evaluate(
        "axe.run(document, {resultTypes: ['violations']}).then(r => ({violations: "
        "r.violations.map(v => ({id: v.id, help: v.help, nodes: v.nodes.map(n => n.html)}))}))",
        await_promise=True,
    )
    assert result["violations"] == [], json.dumps(result["violations"], indent=1)


def test_the_page_is_valid_html(registry: RegistryProcess, tmp_path: Path) -> None:
    vnu = _tool("vnu-jar/build/dist/vnu.jar")
    java = shutil.which("java")
    if java is None:
        pytest.skip("java is missing: scripts/system-deps.sh installs default-jre-headless")
    page = httpx.get(
        f"{registry.url}/status", headers={"Authorization": f"Bearer {READER}"}, timeout=30
    )
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    (tmp_path / "status.html").write_text(page.text)
    done = subprocess.run(
        [
            java,
            "-jar",
            str(vnu),
            "--format",
            "json",
            "--exit-zero-always",
            str(tmp_path / "status.html"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    messages = json.loads(done.stderr or done.stdout)["messages"]
    errors = [m for m in messages if m.get("type") in {"error", "non-document-error"}]
    assert errors == [], json.dumps(errors, indent=1)


def _status_reads(registry: RegistryProcess) -> int:
    """Answered ``GET /status`` requests in the registry's access log so far."""
    assert registry.log_path is not None
    log = registry.log_path.read_text()
    return log.count('"path": "/status", "route": "/status", "status": 200')


def test_the_page_follows_the_watch_stream_instead_of_polling(
    registry: RegistryProcess, browser: Chromium
) -> None:
    browser.navigate(_page_url(registry))
    browser.wait_for("document.getElementById('lost').hidden", timeout_s=10)
    quiet = _status_reads(registry)
    time.sleep(7)  # longer than the page's refresh period (5 s): a poll would have come
    assert _status_reads(registry) == quiet, "the page polled with nothing changed"
    with httpx.Client(base_url=registry.url, headers={"Authorization": f"Bearer {WORKER}"}) as c:
        _open(c, "prefill-late", 2, "prefill")
    # The change comes down the stream; the page reads itself once and shows it.
    browser.wait_for(
        "document.querySelector('main').innerText.includes('prefill-late')", timeout_s=10
    )
    assert _status_reads(registry) == quiet + 1


def test_the_page_says_when_it_lost_the_registry(
    registry: RegistryProcess, browser: Chromium, tmp_path: Path
) -> None:
    browser.navigate(_page_url(registry))
    assert browser.evaluate("document.getElementById('lost').hidden") is True
    registry.stop()  # the last test of the module: the registry goes away under the page
    browser.wait_for("!document.getElementById('lost').hidden", timeout_s=20)
    banner = browser.evaluate("document.getElementById('lost').innerText")
    assert banner.startswith("Lost the registry at"), banner
    assert "prefill-ready" in browser.evaluate("document.querySelector('main').innerText")
    browser.screenshot(tmp_path / "status-lost.png")
