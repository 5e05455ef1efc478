"""Watch (``GET /tp-groups?watch=true``) and paged lists, measured:

- **fan-out**: 1,000 watchers (aiohttp, one process) on one replica; one change at a time
  (an engine opened), from the write's send to each watcher's receipt of its line: p50/p99,
  on SQLite and on etcd; the server's CPU per delivered line (the write included) and the
  client's. The client's own ceiling: the same client against ``python -m bench.watch
  ceiling PORT``, a raw asyncio server that writes one line to every stream per PUT and
  does nothing else.
- **storm with watchers**: the request-path launch storm (``bench/storm_lean.py``) against a
  fresh registry with no watcher and with 100 watchers connected (in another process,
  ``python -m bench.watch watchers URL N``, reading every line), interleaved rounds: ranks/s.
- **paged list**: 12,500 TP 8 groups (every rank registered, batched), then
  ``GET /tp-groups?limit=500`` page by page: time and bytes per page, the whole walk, the
  unpaged list once, and the server's RSS.
"""

from __future__ import annotations

import asyncio
import base64
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import HOST, cpu_seconds, pct, process, registry_server, say
from bench.storm_lean import lean_http
from workers.tools.procs import free_port

TP = 8
LINE_OBJECT = {
    "group_id": "fan-0",
    "engine_id": str(uuid.uuid4()),
    "generation": 1,
    "launch_id": "x",
    "tp_size": 8,
    "role": "prefill",
    "compat": {},
    "created_at": "2026-12-01T00:00:00.000Z",
    "ready": False,
    "registered_ranks": [],
    "missing_ranks": list(range(8)),
    "agents": [],
}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


# -- fan-out ---------------------------------------------------------------------------------


async def _fanout(url: str, watchers: int, changes: int, pid: int | None) -> dict[str, Any]:
    import aiohttp

    arrivals: dict[int, list[float]] = defaultdict(list)
    opened = 0
    all_open = asyncio.Event()

    async def one(session: Any) -> None:
        nonlocal opened
        async with session.get(url + "/tp-groups", params={"watch": "true"}) as r:
            opened += 1
            if opened == watchers:
                all_open.set()
            async for line in r.content:
                if line.startswith(b'{"type":"B'):
                    continue
                arrivals[int(json.loads(line)["revision"])].append(time.perf_counter())

    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s,
        aiohttp.ClientSession() as writer,
    ):
        tasks = [asyncio.create_task(one(s)) for _ in range(watchers)]
        await asyncio.wait_for(all_open.wait(), 120)
        await asyncio.sleep(1.0)
        latencies: list[float] = []
        server0 = cpu_seconds(pid) if pid else 0.0
        client0 = time.process_time()
        seen: set[int] = set(arrivals)
        for i in range(changes):
            body = {"launch_id": uuid.uuid4().hex, "tp_size": TP, "role": "prefill"}
            sent = time.perf_counter()
            async with writer.put(
                f"{url}/tp-groups/fan-{i}-{uuid.uuid4().hex[:6]}/engine", json=body
            ) as r:
                await r.read()
            deadline = time.monotonic() + 30
            while True:
                done = [
                    rev for rev, got in arrivals.items() if rev not in seen and len(got) >= watchers
                ]
                if done:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"change {i} did not reach all {watchers} watchers")
                await asyncio.sleep(0.005)
            seen.update(done)
            latencies += [t - sent for t in arrivals[done[0]]]
            await asyncio.sleep(0.2)
        server = (cpu_seconds(pid) - server0) if pid else 0.0
        client = time.process_time() - client0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    delivered = changes * watchers
    return {
        "watchers": watchers,
        "changes": changes,
        "p50_ms": round(pct(latencies, 50) * 1000, 1),
        "p99_ms": round(pct(latencies, 99) * 1000, 1),
        "max_ms": round(max(latencies) * 1000, 1),
        "server_cpu_us_per_line": round(server / delivered * 1e6, 1) if pid else None,
        "client_cpu_us_per_line": round(client / delivered * 1e6, 1),
    }


async def _ceiling_server(port: int) -> None:
    """A raw server: ndjson streams on GET, one line to every stream per PUT."""
    streams: set[asyncio.StreamWriter] = set()
    revision = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal revision
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            method = head.split(b" ", 1)[0]
            length = 0
            for field in head.split(b"\r\n"):
                if field.lower().startswith(b"content-length:"):
                    length = int(field.split(b":")[1])
            if length:
                await reader.readexactly(length)
            if method == b"GET":
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                streams.add(writer)
                return
            revision += 1
            line = json.dumps({"type": "ADDED", "revision": revision, "object": LINE_OBJECT})
            data = line.encode() + b"\n"
            chunk = b"%x\r\n%s\r\n" % (len(data), data)
            for stream in list(streams):
                stream.write(chunk)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")

    server = await asyncio.start_server(handle, HOST, port, backlog=4096)
    async with server:
        await server.serve_forever()


def fanout(watchers: int, changes: int) -> dict[str, Any]:
    from harness.etcd import EtcdCluster, etcd_available

    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-watch-") as tmp:
        with registry_server(f"sqlite:///{tmp}/fan.db", log=Path(tmp) / "sqlite.log") as url:
            rows["sqlite"] = asyncio.run(_fanout(url, watchers, changes, url.pid))
            say(f"watch fan-out sqlite: {rows['sqlite']}")
        if etcd_available():
            with EtcdCluster(Path(tmp) / "etcd", size=1) as cluster:
                store = cluster.url(f"fan-{uuid.uuid4().hex[:6]}")
                with registry_server(store, log=Path(tmp) / "etcd.log") as url:
                    rows["etcd"] = asyncio.run(_fanout(url, watchers, changes, url.pid))
                    say(f"watch fan-out etcd: {rows['etcd']}")
        port = free_port()
        cmd = [sys.executable, "-m", "bench.watch", "ceiling", str(port)]
        with process(cmd, log=Path(tmp) / "ceiling.log"):
            wait_http_tcp(HOST, port, 30)
            ceiling = f"http://{HOST}:{port}"
            rows["client_ceiling"] = asyncio.run(_fanout(ceiling, watchers, changes, None))
            say(f"watch fan-out client ceiling: {rows['client_ceiling']}")
    return rows


def wait_http_tcp(host: str, port: int, timeout_s: float) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{host}:{port} did not accept within {timeout_s} s")


# -- a launch storm with watchers ----------------------------------------------------------


async def _watch_until_stdin_closes(url: str, n: int) -> None:
    import aiohttp

    lines = 0

    async def one(session: Any) -> None:
        nonlocal lines
        async with session.get(url + "/tp-groups", params={"watch": "true"}) as r:
            async for _ in r.content:
                lines += 1

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        tasks = [asyncio.create_task(one(s)) for _ in range(n)]
        await asyncio.sleep(1.0)
        print("BENCH-READY", flush=True)
        await asyncio.to_thread(sys.stdin.read)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps({"lines": lines}), flush=True)


def storm_with_watchers(ranks: int, watchers: int, rounds: int) -> dict[str, Any]:
    import subprocess

    out: dict[str, list[float]] = {"none": [], "watched": []}
    cpu: dict[str, list[float]] = {"none": [], "watched": []}
    lines: list[int] = []
    with tempfile.TemporaryDirectory(prefix="bench-watch-storm-") as tmp:
        for r in range(rounds):
            for case in ("none", "watched") if r % 2 == 0 else ("watched", "none"):
                store = f"sqlite:///{tmp}/{case}-{r}.db"
                with registry_server(store, log=Path(tmp) / f"{case}-{r}.log") as url:
                    peer = None
                    if case == "watched":
                        peer = subprocess.Popen(
                            [sys.executable, "-m", "bench.watch", "watchers", url, str(watchers)],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                        )
                        assert peer.stdout is not None
                        assert peer.stdout.readline().strip() == b"BENCH-READY"
                    row = lean_http(url, ranks)
                    out[case].append(row["ranks_per_s"])
                    cpu[case].append(row.get("server_cpu_s", 0.0))
                    if peer is not None:
                        got, _ = peer.communicate(b"", timeout=60)
                        lines.append(json.loads(got.splitlines()[-1])["lines"])
                say(f"watch storm {case} round {r}: {row['ranks_per_s']} ranks/s")
    none, watched = statistics.median(out["none"]), statistics.median(out["watched"])
    return {
        "ranks": ranks,
        "watchers": watchers,
        "rounds": rounds,
        "none_ranks_per_s": round(none, 1),
        "watched_ranks_per_s": round(watched, 1),
        "ratio": round(watched / none, 3),
        "none_server_cpu_s": round(statistics.median(cpu["none"]), 3),
        "watched_server_cpu_s": round(statistics.median(cpu["watched"]), 3),
        "all_rounds": out,
        "lines_per_watched_storm": lines,
    }


# -- a paged list of a large fleet --------------------------------------------------------


async def _populate(url: str, groups: int) -> None:
    import aiohttp

    blob = base64.b64encode(b"\0" * 4096).decode()
    gate = asyncio.Semaphore(64)

    async def group(i: int, s: Any) -> None:
        gid = f"{'prefill' if i % 2 else 'decode'}-{i:05d}"
        async with gate:
            body = {"launch_id": "l", "tp_size": TP, "role": "prefill" if i % 2 else "decode"}
            async with s.put(f"{url}/tp-groups/{gid}/engine", json=body) as r:
                eid = (await r.json())["engine_id"]
            agents = [
                {
                    "rank": k,
                    "engine_id": eid,
                    "agent_name": f"{eid}-{k}",
                    "agent_metadata": blob,
                    "host": HOST,
                    "ttl_s": 3600,
                    "kv": {
                        "mem_type": "DRAM",
                        "device_id": 0,
                        "base_addrs": [4096],
                        "num_blocks": 1024,
                        "block_len": 65536,
                    },
                }
                for k in range(TP)
            ]
            async with s.put(f"{url}/tp-groups/{gid}/engine/agents", json={"agents": agents}) as r:
                if r.status != 200:
                    raise RuntimeError(f"{gid}: {r.status} {await r.text()}")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as s:
        await asyncio.gather(*(group(i, s) for i in range(groups)))


def paged_list(groups: int, limit: int) -> dict[str, Any]:
    import httpx

    with (
        tempfile.TemporaryDirectory(prefix="bench-watch-list-") as tmp,
        registry_server(f"sqlite:///{tmp}/list.db", log=Path(tmp) / "list.log") as url,
    ):
        rss_empty = rss_mib(url.pid)
        t0 = time.perf_counter()
        asyncio.run(_populate(url, groups))
        populate_s = time.perf_counter() - t0
        rss_full = rss_mib(url.pid)
        with httpx.Client(base_url=url, timeout=120) as c:
            c.get("/tp-groups", params={"limit": 1})  # warm
            times: list[float] = []
            sizes: list[int] = []
            params: dict[str, Any] = {"limit": limit}
            seen = 0
            walk0 = time.perf_counter()
            while True:
                t = time.perf_counter()
                r = c.get("/tp-groups", params=params)
                times.append(time.perf_counter() - t)
                sizes.append(len(r.content))
                body = r.json()
                seen += len(body["groups"])
                if body["continue"] is None:
                    break
                params["continue"] = body["continue"]
            walk_s = time.perf_counter() - walk0
            rss_walk = rss_mib(url.pid)
            t = time.perf_counter()
            whole = c.get("/tp-groups")
            whole_s = time.perf_counter() - t
            rss_whole = rss_mib(url.pid)
    if seen != groups:
        raise RuntimeError(f"the walk saw {seen} groups of {groups}")
    return {
        "groups": groups,
        "tp": TP,
        "limit": limit,
        "pages": len(times),
        "populate_s": round(populate_s, 1),
        "page_p50_ms": round(pct(times, 50) * 1000, 1),
        "page_max_ms": round(max(times) * 1000, 1),
        "page_kib_p50": round(pct([float(s) for s in sizes], 50) / 1024, 1),
        "page_kib_max": round(max(sizes) / 1024, 1),
        "walk_s": round(walk_s, 2),
        "unpaged_s": round(whole_s, 2),
        "unpaged_mib": round(len(whole.content) / 2**20, 1),
        "rss_mib": {
            "empty": rss_empty,
            "populated": rss_full,
            "after_walk": rss_walk,
            "after_unpaged": rss_whole,
        },
    }


def run(quick: bool = False) -> dict[str, Any]:
    watchers = 100 if quick else 1000
    return {
        "fanout": fanout(watchers, 5 if quick else 20),
        "storm": storm_with_watchers(256 if quick else 1024, 100, 1 if quick else 3),
        "list": paged_list(500 if quick else 12_500, 500),
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["ceiling"]:
        asyncio.run(_ceiling_server(int(argv[1])))
    elif argv[:1] == ["watchers"]:
        asyncio.run(_watch_until_stdin_closes(argv[1], int(argv[2])))
    else:
        print(json.dumps(run(quick="--quick" in argv), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
