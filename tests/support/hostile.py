"""Helpers of the hostile-input, disk-fault and connection tiers (issue #15).

Real filesystems (a loop-mounted ext4 image, a small tmpfs), ``fsfreeze``, read-only
remounts, raw sockets and a real ``engine-registry serve`` process. Whatever mounts or
freezes is a context manager whose ``finally`` thaws and unmounts, even when the test fails
(a filesystem left frozen hangs every later process that writes to it); a last-chance
``atexit`` hook thaws whatever is still registered as frozen.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from harness.server import RegistryProcess

T = TypeVar("T")

PROBLEM = "application/problem+json"
STORE_TIMEOUT_S = 3.0

ROOT_REASON = (
    "needs root: the disk-fault tests mount a loop ext4 image and a tmpfs, freeze them with "
    "fsfreeze and remount them read-only (CI runs as root)"
)


def require_root(*tools: str) -> None:
    """Skip when not root (or a tool is missing) on a developer's machine; fail under CI
    (``CI`` set), where a skipped fault test would hide a regression."""
    if os.geteuid() != 0:
        _unable(ROOT_REASON)
    require_tools(*tools)


def require_tools(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        _unable(f"needs {', '.join(missing)} (util-linux, e2fsprogs) on PATH")


def _unable(reason: str) -> None:
    if os.environ.get("CI", "").lower() not in {"", "0", "false"}:
        pytest.fail(f"{reason}; CI is set, so this is a failure, not a skip", pytrace=False)
    pytest.skip(reason)


def _sh(*cmd: str | Path, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    argv = [str(c) for c in cmd]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip() or done.stdout}"
        )
    return done


# -- filesystems ---------------------------------------------------------------------------

_FROZEN: set[Path] = set()


def thaw(mountpoint: Path) -> None:
    """``fsfreeze -u``; quiet when the filesystem is not frozen (or not mounted)."""
    subprocess.run(["fsfreeze", "-u", str(mountpoint)], capture_output=True, timeout=30)
    _FROZEN.discard(mountpoint)


@atexit.register
def _thaw_everything() -> None:
    for mountpoint in list(_FROZEN):
        thaw(mountpoint)


def unmount(mountpoint: Path) -> None:
    """Unmount, lazily when something still holds it (never leave a mount behind)."""
    done = subprocess.run(["umount", str(mountpoint)], capture_output=True, timeout=30)
    if done.returncode != 0 and os.path.ismount(mountpoint):
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=30)


@contextlib.contextmanager
def loop_ext4(where: Path, size_mib: int = 32) -> Iterator[Path]:
    """A fresh ext4 filesystem in an image file, loop-mounted at ``where/mnt``."""
    require_root("mkfs.ext4", "mount", "umount", "fsfreeze")
    image, mountpoint = where / "disk.img", where / "mnt"
    mountpoint.mkdir(parents=True)
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    _sh("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", image)
    _sh("mount", "-o", "loop", image, mountpoint)
    try:
        yield mountpoint
    finally:
        thaw(mountpoint)
        unmount(mountpoint)
        image.unlink(missing_ok=True)


@contextlib.contextmanager
def frozen(mountpoint: Path) -> Iterator[None]:
    """``fsfreeze -f`` for the block; always thawed on the way out."""
    _FROZEN.add(mountpoint)
    try:
        _sh("fsfreeze", "-f", mountpoint)
        yield
    finally:
        thaw(mountpoint)


def remount(mountpoint: Path, mode: str) -> None:
    """``mount -o remount,ro`` or ``…,rw``."""
    assert mode in {"ro", "rw"}
    _sh("mount", "-o", f"remount,{mode}", mountpoint)


@contextlib.contextmanager
def small_tmpfs(where: Path, size_kib: int) -> Iterator[Path]:
    require_root("mount", "umount")
    where.mkdir(parents=True)
    _sh("mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0755", "tmpfs", where)
    try:
        yield where
    finally:
        unmount(where)


def fill_up(path: Path, chunk: int = 64 * 1024, limit: int = 1 << 30) -> int:
    """Write ``path`` until the filesystem says it is full (ENOSPC); returns the bytes."""
    written = 0
    with open(path, "wb", buffering=0) as f:
        block = b"\0" * chunk
        while written < limit:
            try:
                written += f.write(block) or 0
            except OSError:
                break
            if chunk > 4096 and shutil.disk_usage(path.parent).free < chunk:
                chunk, block = 4096, b"\0" * 4096
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())
    return written


# -- the server ----------------------------------------------------------------------------


def serve(
    tmp_path: Path,
    db: Path,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    prefix: Sequence[str] = (),
    store_timeout_s: float = STORE_TIMEOUT_S,
) -> RegistryProcess:
    """A started ``engine-registry serve`` over ``db``; its log (stderr) is ``log_of(proc)``."""
    return RegistryProcess(
        f"sqlite:///{db}",
        args=["--store-timeout", f"{store_timeout_s:g}", *args],
        env=env,
        prefix=prefix,
        log_path=tmp_path / "registry.log",
    ).start(timeout_s=60.0)


def log_of(proc: RegistryProcess) -> str:
    assert proc.log_path is not None
    return proc.log_path.read_text(errors="replace") if proc.log_path.exists() else ""


def json_log_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict):
                lines.append(entry)
    return lines


def socket_fds(pid: int) -> int:
    """How many sockets process ``pid`` holds open (its listener and connections)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


def vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


# -- HTTP ----------------------------------------------------------------------------------


def assert_problem(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """An RFC 9457 answer with the contract's members and ``code``; returns its body."""
    assert resp.status_code == status, (
        f"want {status} {code}, got {resp.status_code}: {resp.text[:300]}"
    )
    ctype = resp.headers.get("content-type", "").split(";")[0]
    assert ctype == PROBLEM, f"content-type {ctype!r}: {resp.text[:300]}"
    body: dict[str, Any] = resp.json()
    for member in ("type", "title", "status", "detail", "code"):
        assert member in body, body
    assert body["code"] == code, body
    assert body["status"] == status, body
    return body


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    t0 = time.monotonic()
    result = fn()
    return result, time.monotonic() - t0


def poll(fn: Callable[[], T], ok: Callable[[T], bool], timeout_s: float) -> tuple[T, float]:
    """Call ``fn`` until ``ok`` accepts its result or ``timeout_s`` passes; returns the last
    result and the seconds it took (a transport error counts as not ok)."""
    t0 = time.monotonic()
    last: Any = None
    while True:
        try:
            last = fn()
            if ok(last):
                return last, time.monotonic() - t0
        except httpx.HTTPError as exc:
            last = exc
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not ok within {timeout_s} s; last: {_show(last)}")
        time.sleep(0.1)


def _show(value: Any) -> str:
    if isinstance(value, httpx.Response):
        return f"{value.status_code} {value.text[:300]}"
    return repr(value)


@dataclass
class RawAnswer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None


def raw_exchange(port: int, request: bytes, timeout_s: float = 5.0) -> RawAnswer:
    """Send ``request`` as given (bytes on the wire) and read one HTTP/1.1 answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(request)
        data = b""
        deadline = time.monotonic() + timeout_s
        while b"\r\n\r\n" not in data:
            assert time.monotonic() < deadline, f"no answer head within {timeout_s} s: {data!r}"
            chunk = sock.recv(65536)
            assert chunk, f"connection closed before an answer: {data!r}"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = [
            (k.strip(), v.strip()) for k, _, v in (line.partition(b":") for line in lines[1:])
        ]
        answer = RawAnswer(status, headers, body)
        length = int(answer.header(b"content-length") or b"0")
        while len(answer.body) < length:
            assert time.monotonic() < deadline, "answer body incomplete"
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer.body += chunk
        return answer


def open_engine(
    http: httpx.Client,
    gid: str,
    *,
    tp_size: int = 1,
    role: str = "prefill",
    compat: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"launch_id": os.urandom(8).hex(), "tp_size": tp_size, "role": role}
    if compat is not None:
        body["compat"] = dict(compat)
    resp = http.put(f"/tp-groups/{gid}/engine", json=body)
    assert resp.status_code == 201, resp.text
    engine: dict[str, Any] = resp.json()
    return engine


# -- both paths, raw WebSocket -------------------------------------------------------------

FAST_PATHS = ("fast", "full")  # REGISTRY_FAST_PATH on, and off (the control): same answers


def path_env(mode: str, **more: str) -> dict[str, str]:
    """The environment of a registry serving on ``mode`` (one of :data:`FAST_PATHS`)."""
    return {"REGISTRY_FAST_PATH": "true" if mode == "fast" else "false", **more}


def ws_frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """A client's final frame, masked with a zero key (the payload as it is on the wire)."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 65_536:
        head = bytes((0x80 | opcode, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + n.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


class RawStream:
    """A WebSocket upgrade to ``/keepalive`` over a plain socket: the frames sent as given,
    read only when asked (``rcvbuf``: a small receive buffer, for a client that stops reading)."""

    def __init__(self, port: int, *, rcvbuf: int | None = None, timeout_s: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout_s)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16))
        self.sock.sendall(
            b"GET /keepalive HTTP/1.1\r\nHost: registry\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: "
            + key
            + b"\r\n\r\n"
        )
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, self.rest = data.partition(b"\r\n\r\n")
        self.status = int(head.split(b" ", 2)[1]) if head else 0

    def _exactly(self, n: int) -> bytes:
        while len(self.rest) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the stream")
            self.rest += chunk
        got, self.rest = self.rest[:n], self.rest[n:]
        return got

    def frame(self) -> tuple[int, bytes]:
        """The next frame from the server (unmasked): its opcode and payload."""
        b0, b1 = self._exactly(2)
        n = b1 & 0x7F
        if n >= 126:
            n = int.from_bytes(self._exactly(2 if n == 126 else 8), "big")
        return b0 & 0x0F, self._exactly(n)

    def close_code(self) -> int:
        """Frames read until the server's close: its code (answers before it skipped)."""
        for _ in range(1000):
            opcode, payload = self.frame()
            if opcode == 0x8:
                return int.from_bytes(payload[:2], "big")
        raise AssertionError("no close within 1000 frames")

    def close(self) -> None:
        self.sock.close()


def drain(sock: socket.socket, stop: threading.Event) -> threading.Thread:
    """A thread reading (and dropping) what ``sock`` receives until ``stop`` or its end (the
    socket's timeout, set before, is both threads': a sender's too)."""

    def run() -> None:
        while not stop.is_set():
            try:
                if not sock.recv(1 << 20):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
