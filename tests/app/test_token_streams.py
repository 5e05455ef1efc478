"""A token's change reaches the streams it holds open: a real registry process, a real tokens
file, on the fast path and without it (``REGISTRY_FAST_PATH=false``).

A token a reload drops ends its keep-alive streams (a last ``401 unauthorized`` answer, close
1008) and its watch streams (a last ``ERROR`` line) within a second of the reload, whatever
streams of that token ended before; the tokens file is still watched afterwards. A worker
token demoted to reader ends its keep-alive streams (a last ``403 forbidden`` answer, close
1008: the upgrade needs a worker token) and keeps its watches (a reader reads everything); a
narrowed ``groups=`` is applied from the stream's next renewal (``403 out_of_scope`` per
message, as REST answers), and a widened one too.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from harness.server import RegistryProcess
from tests.app.api.conftest import agent_body, sqlite_url
from tests.support.watch import WatchLines

pytestmark = [pytest.mark.faults, pytest.mark.timeout(240)]

ADMIN = "ts-admin-" + uuid.uuid4().hex
WORKER = "ts-worker-" + uuid.uuid4().hex  # in force throughout: the control
GONE = "ts-gone-" + uuid.uuid4().hex  # dropped by the reload
LATER = "ts-later-" + uuid.uuid4().hex  # added by a later change of the file (no signal)
DEMOTED = "ts-demoted-" + uuid.uuid4().hex
SCOPED = "ts-scoped-" + uuid.uuid4().hex
BASE = {
    "admin": f"admin:{ADMIN}",
    "worker": f"worker:{WORKER}",
    "gone": f"worker:{GONE}:name=gone",
    "demoted": f"worker:{DEMOTED}:name=demoted",
    "scoped": f"worker:{SCOPED}:name=scoped:groups=tsa-*,tsb-*",
}
BOUND_S = 1.0  # the contract: within a second of the reload


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def write_tokens(path: Path, lines: dict[str, str]) -> None:
    path.write_text("".join(f"{line}\n" for line in lines.values()))
    settled = time.time() - 5  # SIGHUP reads a file that held still for a second
    os.utime(path, (settled, settled))


@pytest.fixture(scope="module", params=[True, False], ids=["fast-path", "no-fast-path"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RegistryProcess]:
    directory = tmp_path_factory.mktemp("token-streams")
    write_tokens(directory / "tokens", BASE)
    with RegistryProcess(
        sqlite_url(directory),
        args=["--tokens-file", str(directory / "tokens"), "--watch-bookmark-s", "0.3"],
        env={"REGISTRY_FAST_PATH": "true" if request.param else "false"},
        log_path=directory / "registry.log",
    ) as proc:
        yield proc


def tokens_path(server: RegistryProcess) -> Path:
    return Path(server.args[server.args.index("--tokens-file") + 1])


def generation(api: httpx.Client) -> int:
    answer = api.get("/admin/tokens", headers=bearer(ADMIN))
    assert answer.status_code == 200, answer.text
    number: int = answer.json()["generation"]
    return number


def reload(server: RegistryProcess, api: httpx.Client, lines: dict[str, str], how: str) -> float:
    """Write ``lines``, reload (SIGHUP, or the file's own check): a time before the reload."""
    before = generation(api)
    write_tokens(tokens_path(server), lines)
    assert server.proc is not None
    reloaded = time.monotonic()
    if how == "SIGHUP":
        server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if how != "SIGHUP":
            reloaded = time.monotonic()  # the last check that saw the old generation
        if generation(api) != before:
            return reloaded
        time.sleep(0.02)
    raise AssertionError(f"the tokens file ({how}) not reloaded within 10 s")


def restore(server: RegistryProcess, api: httpx.Client) -> None:
    """The module's tokens file as at the start (another test may have changed it)."""
    if tokens_path(server).read_text() != "".join(f"{line}\n" for line in BASE.values()):
        reload(server, api, BASE, "SIGHUP")


def until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return done()


class Renewing:
    """A keep-alive stream read in a thread: its answers queued, its end stamped."""

    def __init__(self, server: RegistryProcess, token: str) -> None:
        url = server.url.replace("http://", "ws://") + "/keepalive"
        self.ws = connect(  # as the lease keeper: no compression (else the route's loop only)
            url,
            additional_headers=bearer(token),
            open_timeout=5,
            proxy=None,
            legacy=True,
            compression=None,
        )
        self.answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self.ended_at: float | None = None
        self.close_code: int | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while True:
                self.answers.put(json.loads(self.ws.recv()))
        except ConnectionClosed as closed:
            self.close_code = closed.rcvd.code if closed.rcvd is not None else None
        finally:
            self.ended_at = time.monotonic()

    def renew(self, group: str, engine_id: str) -> dict[str, Any]:
        self.ws.send(json.dumps([group, engine_id, [0]]))
        return self.answers.get(timeout=10)

    def last(self) -> dict[str, Any]:
        answers = [self.answers.get_nowait() for _ in range(self.answers.qsize())]
        assert answers, "the stream ended without a last answer"
        return answers[-1]

    def close(self) -> None:
        self.ws.close()
        self._thread.join(timeout=5)


class StampedWatch(WatchLines):
    """A watch stream whose end is stamped."""

    ended_at: float | None = None

    def _read(self) -> None:
        super()._read()
        self.ended_at = time.monotonic()

    def rest(self) -> list[dict[str, Any]]:
        lines: list[dict[str, Any]] = []
        while not self.lines.empty():
            item = self.lines.get_nowait()
            if isinstance(item, dict):
                lines.append(item)
        return lines


def launch(api: httpx.Client, prefix: str) -> tuple[str, str]:
    group = f"{prefix}-{uuid.uuid4().hex[:8]}"
    opened = api.put(
        f"/tp-groups/{group}/engine",
        json={"launch_id": uuid.uuid4().hex, "tp_size": 1, "role": "prefill"},
        headers=bearer(WORKER),
    )
    assert opened.status_code == 201, opened.text
    engine_id: str = opened.json()["engine_id"]
    put = api.put(
        f"/tp-groups/{group}/engine/agents/0",
        json=agent_body(engine_id, 0, ttl_s=600),
        headers=bearer(WORKER),
    )
    assert put.status_code == 201, put.text
    return group, engine_id


def rest_heartbeat(api: httpx.Client, group: str, engine_id: str, token: str) -> httpx.Response:
    return api.post(
        f"/tp-groups/{group}/engine/agents/heartbeat",
        json={"engine_id": engine_id, "ranks": [0]},
        headers=bearer(token),
    )


def ended_by(stream: Renewing | StampedWatch, reloaded: float, what: str) -> float:
    """How long after the reload ``stream`` ended (fails past a generous deadline)."""
    assert until(lambda: stream.ended_at is not None, BOUND_S + 4), f"{what} still open"
    assert stream.ended_at is not None
    return stream.ended_at - reloaded


@pytest.mark.parametrize("how", ["SIGHUP", "file changed"])
def test_a_dropped_token_ends_its_streams_whatever_ended_before_and_the_file_stays_watched(
    server: RegistryProcess, how: str
) -> None:
    with httpx.Client(base_url=server.url, timeout=30.0) as api:
        restore(server, api)
        group, engine_id = launch(api, "ts")
        # A stream of the token that ended normally (its client closed it) before the reload.
        earlier = Renewing(server, GONE)
        assert earlier.renew(group, engine_id)["agents"]
        earlier.close()
        time.sleep(0.3)  # the server has seen it go
        live, kept = Renewing(server, GONE), Renewing(server, WORKER)
        watch = StampedWatch(api, {}, headers=bearer(GONE))
        kept_watch = StampedWatch(api, {}, headers=bearer(WORKER))
        try:
            assert live.renew(group, engine_id)["agents"]
            assert kept.renew(group, engine_id)["agents"]
            reloaded = reload(server, api, {k: v for k, v in BASE.items() if k != "gone"}, how)
            took = ended_by(live, reloaded, "the dropped token's keep-alive stream")
            last = live.last()
            assert (last["status"], last["code"]) == (401, "unauthorized"), last
            assert live.close_code == 1008
            assert took < BOUND_S, (how, took)
            took = ended_by(watch, reloaded, "the dropped token's watch stream")
            final = watch.rest()[-1]
            assert (final["type"], final["object"]["code"]) == ("ERROR", "unauthorized"), final
            assert took < BOUND_S, (how, took)
            assert rest_heartbeat(api, group, engine_id, GONE).status_code == 401
            # The tokens in force keep their streams.
            assert kept.renew(group, engine_id)["agents"]
            launch(api, "ts")
            assert kept_watch.changes(1)[0]["type"] == "ADDED"
            # A later change of the file, without a signal, is still applied.
            reload(server, api, {**BASE, "later": f"worker:{LATER}"}, "file changed")
            assert rest_heartbeat(api, group, engine_id, LATER).status_code == 200
        finally:
            for stream in (live, kept):
                stream.close()
            for lines in (watch, kept_watch):
                lines.close()
    log = Path(server.log_path).read_text() if server.log_path else ""
    assert "Traceback" not in log, log[-3000:]


def test_a_demoted_token_ends_its_keepalive_streams_and_a_scope_applies_from_the_next_renewal(
    server: RegistryProcess,
) -> None:
    with httpx.Client(base_url=server.url, timeout=30.0) as api:
        restore(server, api)
        own, inside, narrowed = launch(api, "ts"), launch(api, "tsa"), launch(api, "tsb")
        demoted, scoped = Renewing(server, DEMOTED), Renewing(server, SCOPED)
        watch = StampedWatch(api, {}, headers=bearer(DEMOTED))
        try:
            assert demoted.renew(*own)["agents"]
            assert scoped.renew(*inside)["agents"]
            assert scoped.renew(*narrowed)["agents"]
            changed = {
                **BASE,
                "demoted": f"reader:{DEMOTED}:name=demoted",
                "scoped": f"worker:{SCOPED}:name=scoped:groups=tsa-*",
            }
            reloaded = reload(server, api, changed, "SIGHUP")
            # Demoted to reader: its keep-alive stream ends (it could not be opened now).
            took = ended_by(demoted, reloaded, "the demoted token's keep-alive stream")
            last = demoted.last()
            assert (last["status"], last["code"]) == (403, "forbidden"), last
            assert demoted.close_code == 1008
            assert took < BOUND_S, took
            assert rest_heartbeat(api, *own, DEMOTED).status_code == 403
            # Narrowed: the next renewal outside the new scope is refused, as REST refuses it.
            answer = scoped.renew(*narrowed)
            assert (answer["status"], answer["code"]) == (403, "out_of_scope"), answer
            assert rest_heartbeat(api, *narrowed, SCOPED).status_code == 403
            assert scoped.renew(*inside)["agents"]  # the stream goes on for its groups
            # A reader reads every group: the demoted token's watch streams on.
            launch(api, "ts")
            assert watch.changes(1)[0]["type"] == "ADDED"
            assert watch.ended_at is None
            # Widened again: the same stream renews the group once more.
            reload(server, api, BASE, "SIGHUP")
            assert scoped.renew(*narrowed)["agents"]
        finally:
            for stream in (demoted, scoped):
                stream.close()
            watch.close()
