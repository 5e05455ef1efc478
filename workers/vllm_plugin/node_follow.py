"""One registry watch a node: the decode workers of an instance on one node share it.

A decode worker releases the prefill engines it loaded on the registry's word
(`workers.vllm_plugin.release`). Each of a node's workers needs the same word, so one of them
(the node's leader) holds the watch and hands every event to the others over a Unix domain
socket, one JSON object a line:

- **Election.** The first worker to take an exclusive ``flock`` on
  ``<runtime dir>/follow-<key>.lock`` leads; ``<key>`` hashes the registry URLs, the
  instance's group (``ENGINE_REGISTRY_GROUP``), the node (`common.node_name`) and the model.
  The runtime dir is ``$XDG_RUNTIME_DIR/engine-registry``, else
  ``/run/user/<uid>/engine-registry`` when that is the user's, else
  ``<tmp>/engine-registry-<uid>``: private to the user (0700, not a link). The kernel drops the
  lock when its holder dies, however it dies.
- **Alone.** When that directory is not private (another user made the ``<tmp>`` one first), the
  worker says so in one line and holds its own watch: the node loses the sharing, never a
  handshake.
- **Leader.** Binds ``follow-<key>.sock``, watches the registry (`registry_client.watch.GroupWatch`,
  filtered on the server by ``model``: the instance's ``compat["model"]``) and writes each
  event to every connected worker: a worker that connects first gets a ``SYNC`` of the groups
  the leader holds, then each change; a ``PING`` line every ``PING_S`` when nothing
  happens. A worker that does not read for ``SEND_TIMEOUT_S`` is dropped (it connects again
  and gets a new ``SYNC``).
- **Followers.** Connect and apply what the leader sends. At EOF, or ``SILENT_S`` without a
  line (the leader died, or hangs), they race for the lock again: the winner binds the socket
  and starts a fresh watch (its first event is a ``SYNC``, which every worker applies as a
  whole, so nothing that changed in between is missed), the others connect to it.
- **Pauses.** The leader's watch reconnects after a jittered pause
(`registry_client.backoff.Backoff`,
  the first one drawn from ``[0, WATCH_BASE_S)``), so a replica restart does not bring every
  node's leader back in the same second; a lost registry (`WatchLost`) or a refusal (a rotated
  token) is logged and the watch starts over after a capped, jittered pause too.

Each worker still decides and releases its own vLLM state from the events it receives.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from registry_client.backoff import Backoff
from registry_client.errors import RegistryUnavailable
from registry_client.models import Engine
from registry_client.watch import WatchEvent
from workers.vllm_plugin import common
from workers.vllm_plugin.settings import PluginSettings

# (kind, engines, deleted): a SYNC's groups, or one group's change.
OnEvent = Callable[[str, list[Engine], bool], None]

PING_S = 5.0  # the leader's keep-alive line when nothing happens
SILENT_S = 3 * PING_S  # a follower that hears nothing this long takes its leader for gone
SEND_TIMEOUT_S = 5.0  # a follower that reads nothing this long is dropped (it reconnects)
CONNECT_TIMEOUT_S = 2.0
WATCH_BASE_S, WATCH_CAP_S = 2.0, 16.0  # the watch's reconnects: first pause in [0, 2 s)
RESTART_BASE_S, RESTART_CAP_S = 2.0, 30.0  # a watch that failed (lost, refused) starts over
ELECT_BASE_S, ELECT_CAP_S = 0.05, 1.0  # a follower that found no leader tries again
IDLE_TIMEOUT_S, LOST_AFTER_S = 20.0, 30.0  # the watch's (docs/workers.md "Watching")
USER_RUN = Path("/run/user")  # systemd-logind's per-user runtime directories


class NodeFollowError(RuntimeError):
    """The node's runtime directory is not usable (another user's, or open to others)."""


def runtime_dir() -> Path:
    """The node's shared directory for this user: ``$XDG_RUNTIME_DIR/engine-registry``, else
    under ``/run/user/<uid>`` when that is this user's, else ``<tmp>/engine-registry-<uid>``;
    made 0700. NodeFollowError when it is not this user's private directory (a name in a
    shared ``<tmp>`` that another user took first, a link, or open to others)."""
    uid = os.getuid()
    base = os.environ.get("XDG_RUNTIME_DIR")
    user_run = USER_RUN / str(uid)
    if base:
        path = Path(base) / "engine-registry"
    elif _private(user_run, uid):
        path = user_run / "engine-registry"
    else:
        path = Path(tempfile.gettempdir()) / f"engine-registry-{uid}"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise NodeFollowError(f"cannot make {path}: {exc.strerror}") from None
    if not _private(path, uid):
        info = path.lstat()
        raise NodeFollowError(
            f"{path} is not this user's private directory (owner uid {info.st_uid}, mode "
            f"{info.st_mode & 0o777:o}{', a link' if stat.S_ISLNK(info.st_mode) else ''}): "
            "remove it, or set XDG_RUNTIME_DIR to a directory of this user"
        )
    return path


def _private(path: Path, uid: int) -> bool:
    """A directory itself (not a link to one), owned by ``uid``, closed to everyone else."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid and not info.st_mode & 0o077


def node_key(settings: PluginSettings, node: str, model: str | None) -> str:
    """What the workers that share one watch have in common, hashed into a file name."""
    text = "\n".join((settings.urls, settings.group, node, model or ""))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def this_node() -> str:
    """The node the plugin named at start (`common.set_node`), else the host's."""
    return common._node or common.node_name()


def encode(line: dict[str, Any]) -> bytes:
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"


class NodeFeed:
    """One worker's share of its node's watch (a daemon thread): ``on_event`` gets every
    event, whether this worker leads or follows."""

    def __init__(
        self,
        settings: PluginSettings,
        on_event: OnEvent,
        *,
        model: str | None,
        node: str | None = None,
        directory: Path | None = None,
        log: logging.Logger = common.log,
    ) -> None:
        self._settings = settings
        self._on_event = on_event
        self.model = model
        self.node = node or this_node()
        self._log = log
        self.role = ""  # "leader", "follower" or "alone" once it has one
        if directory is None:
            try:
                directory = runtime_dir()
            except NodeFollowError as exc:  # said once; this worker watches for itself
                log.warning(
                    "engine-registry: node follow: %s; worker %d holds its own registry watch "
                    "(not shared with the node's other decode workers)",
                    exc,
                    os.getpid(),
                )
        self.shared = directory is not None
        key = node_key(settings, self.node, model)
        where = directory or Path(os.devnull)  # unused alone: no lock, no socket
        self.lock_path = where / f"follow-{key}.lock"
        self.socket_path = where / f"follow-{key}.sock"
        self._stop = threading.Event()
        self._lock_fd: int | None = None
        self._server: socket.socket | None = None
        self._fan = threading.Lock()  # the leader's followers and what they were sent
        self._conns: list[socket.socket] = []
        self._groups: dict[str, Engine] = {}
        self._revision = -1  # -1: no SYNC yet
        self._last_sent = 0.0
        self._thread = threading.Thread(target=self._run, name="engine-registry-node", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop: a leader's followers see EOF and elect another."""
        self._stop.set()
        with self._fan:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        if self._server is not None:
            self._server.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # drops the lock
            self._lock_fd = None

    def _run(self) -> None:
        if not self.shared:
            self.role = "alone"
            self._watch()
            return
        election = Backoff(base_s=ELECT_BASE_S, cap_s=ELECT_CAP_S)
        while not self._stop.is_set():
            try:
                if self._try_lock():
                    self._lead()
                    return
                if self._follow():
                    election.reset()
                    continue  # the leader is gone: race for the lock at once
            except Exception as exc:  # said, and tried again: never a dead thread
                self._log.error("engine-registry: node follow failed (%r); retrying", exc)
            self._stop.wait(election.next())

    def _try_lock(self) -> bool:
        if self._lock_fd is None:
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW  # never a planted link
            self._lock_fd = os.open(self.lock_path, flags, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    # -- the leader ----------------------------------------------------------------------

    def _lead(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        server = self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self.socket_path))
        server.listen(64)
        server.settimeout(1.0)
        self.role = "leader"
        self._log.info(
            "engine-registry: worker %d leads node %s's registry watch (model %r): the node's "
            "other decode workers get its events over %s",
            os.getpid(),
            self.node,
            self.model,
            self.socket_path,
        )
        threading.Thread(
            target=self._accept, name="engine-registry-node-accept", daemon=True
        ).start()
        self._watch()

    def _watch(self) -> None:
        """The registry's watch, each event published, until closed; started over after a
        lost registry or a refusal."""
        restart = Backoff(base_s=RESTART_BASE_S, cap_s=RESTART_CAP_S)
        while not self._stop.is_set():
            try:
                with common.client(self._settings) as client:
                    watch = client.watch(
                        model=self.model,
                        idle_timeout_s=IDLE_TIMEOUT_S,
                        lost_after_s=LOST_AFTER_S,
                        backoff=Backoff(base_s=WATCH_BASE_S, cap_s=WATCH_CAP_S),
                    )
                    for event in watch:
                        self._publish(event)
                        restart.reset()
                        if self._stop.is_set():
                            return
            except RegistryUnavailable as exc:
                self._log.warning("engine-registry: release watch lost (%s); retrying", exc)
            except Exception as exc:  # a refusal (a token rotated) or a bad answer
                self._log.error("engine-registry: release watch failed (%r); retrying", exc)
            self._stop.wait(restart.next())

    def _publish(self, event: WatchEvent) -> None:
        """One event of the watch: to the node's other workers, then to this one."""
        if event.type == "SYNC":
            engines, deleted = event.groups, False
            line = {"type": "SYNC", "revision": event.revision, "groups": [g.raw for g in engines]}
        elif event.engine is not None:
            engines, deleted = [event.engine], event.type == "DELETED"
            line = {"type": event.type, "revision": event.revision, "object": event.engine.raw}
        else:
            return
        data = encode(line)
        with self._fan:
            if event.type == "SYNC":
                self._groups = {g.group_id: g for g in engines}
            elif deleted:
                self._groups.pop(engines[0].group_id, None)
            else:
                self._groups[engines[0].group_id] = engines[0]
            self._revision = event.revision
            self._send_all(data)
        self._on_event(event.type, engines, deleted)

    def _send_all(self, data: bytes) -> None:
        """Under ``_fan``: ``data`` to every follower; one that does not take it is dropped."""
        self._last_sent = time.monotonic()
        for conn in list(self._conns):
            try:
                conn.sendall(data)
            except OSError as exc:
                self._log.info("engine-registry: a node follower was dropped (%r)", exc)
                self._conns.remove(conn)
                conn.close()

    def _accept(self) -> None:
        server = self._server
        assert server is not None
        while not self._stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                with self._fan:
                    if self._conns and time.monotonic() - self._last_sent >= PING_S:
                        self._send_all(b'{"type":"PING"}\n')
                continue
            except OSError:  # closed
                return
            conn.settimeout(SEND_TIMEOUT_S)
            with self._fan:
                if self._revision >= 0:  # what it missed: the groups as they stand
                    groups = [g.raw for g in self._groups.values()]
                    snapshot = {"type": "SYNC", "revision": self._revision, "groups": groups}
                    try:
                        conn.sendall(encode(snapshot))
                    except OSError:
                        conn.close()
                        continue
                self._conns.append(conn)

    # -- a follower ----------------------------------------------------------------------

    def _follow(self) -> bool:
        """Apply the leader's lines until it goes; False when no leader answered."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(CONNECT_TIMEOUT_S)
        try:
            conn.connect(str(self.socket_path))
        except OSError:  # not bound yet (a leader starting), or a dead leader's file
            conn.close()
            return False
        self.role = "follower"
        conn.settimeout(SILENT_S)
        with conn, conn.makefile("rb") as lines:
            try:
                for raw in lines:
                    self._apply(json.loads(raw))
                    if self._stop.is_set():
                        break
            except (OSError, ValueError) as exc:  # silent past SILENT_S, or a torn line
                self._log.info("engine-registry: node leader silent or gone (%r)", exc)
        return True

    def _apply(self, line: dict[str, Any]) -> None:
        kind = str(line["type"])
        if kind == "SYNC":
            self._on_event("SYNC", [Engine.from_json(g) for g in line["groups"]], False)
        elif kind != "PING":
            self._on_event(kind, [Engine.from_json(line["object"])], kind == "DELETED")
