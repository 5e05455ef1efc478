"""``python -m bench.wire_cost [--groups N] [--connections C] [--evict BYTES] [--profile OUT]
[--profile-launch OUT] [--in-flight K] [--store sqlite|etcd] [--etcd-members M]
[--renew-window W]``: the CPU a node heartbeat and a group's launch cost on the registry's
whole server path, in this process, without sockets (to the clients; etcd's are real).

The registry's own app and server pieces (``create_app``, ``RegistryConfig``: uvicorn's
protocol class with the wire path of app/server/bypass/wire.py, the lifespan with a real SQLite
store in
a temporary directory), N TP 8 groups opened and registered through the protocol as the fleet
benchmark does (``bench/fleet_load.py``'s bodies, 3,928-byte blobs of 80 regions), then 7
rounds of 5,000 node heartbeats of random groups, each fed to a connection's protocol as the
bytes a client sends, its answer awaited in what the transport was given to write. The
transport keeps what is written: no syscall, no other process; so this is the Python work of
a heartbeat (parsing, the wire path, the handler, the answer, the bookkeeping) with the SQLite
file's thread beside it. Process CPU per heartbeat (the heartbeats' own, summed): the best
round and the median, and of it the event loop's thread; the registry's CPU share while idle
3 s before the rounds (its timers and watches, counted in the heartbeats' CPU as they run);
and a round's heartbeats a second. Nothing is asserted; ``--profile`` writes a cProfile of
one more round.
``--in-flight K``: the heartbeats go K at a time, each on its own connection, the CPU counted
per wave (on etcd with W > 0 an answer waits for the journal's tick, 20-50 ms: one at a time
would measure the waits).

The launch (each group's open, then its node's registration, one group at a time) is counted
as CPU while the registry answers (the client's bodies are made outside those spans): per
group, the event loop's thread (and of it, the open's and the registration's) and the whole
process (the SQLite file's thread beside it); ``--profile-launch`` writes a cProfile of those
spans. Every 10 s of the launch the groups registered so far renew once, not counted (as the
fleet's nodes do; on etcd a launch of 2,000 groups outlasts their 30 s lease).

``--evict BYTES`` writes over a buffer of that size between two heartbeats (not timed), as the
rest of a live machine does between two heartbeats 0.8 ms apart (the client, the kernel's
network stack, other processes sharing the L3 cache): each heartbeat then starts with its code
and data out of the caches. This machine's L2 is 1 MiB a core and its L3 32 MiB, shared.

``--store etcd``: the same on a real etcd of ``--etcd-members`` (3) local members, started here
with the fleet benchmark's settings, the registry's ``etcd_renew_window_s``
(``REGISTRY_ETCD_RENEW_WINDOW_S``) set to ``--renew-window`` (0: every renewal reaches etcd).
The process's CPU then includes its gRPC client's; etcd's own CPU is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.fleet import BLOB_BYTES, REGIONS
from bench.fleet_load import TP, Fleet
from bench.raw_client import RawPool
from bench.storm_core import COMPAT

ROUNDS, PER_ROUND = 7, 5000
IDLE_S = 3.0  # the registry left idle this long before the rounds: its CPU then
ANSWER_S = 30.0  # an answer not written by then fails the run
RENEW_S = 10.0  # the launch's registered groups renew this often (the library's pace, TTL 30 s)
RENEW_WAVE = 64  # renewals in flight at once then


def _ok(answer: bytes) -> bool:
    """Whether the server's answer is a 200."""
    return answer.startswith(b"HTTP/1.1 200")


class KeptTransport(asyncio.Transport):
    """A transport that keeps what the protocol writes."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []
        self.closed = False
        self.written = asyncio.Event()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out.append(bytes(data))
        self.written.set()

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@contextlib.contextmanager
def _store_url(tmp: Path, store: str, members: int) -> Iterator[str]:
    """The store's URL: a SQLite file under ``tmp``, or a prefix on ``members`` real etcd
    members started there (the fleet benchmark's settings)."""
    if store == "sqlite":
        yield f"sqlite:///{tmp / 'registry.db'}"
        return
    from bench.fleet import _etcd
    from harness.etcd import etcd_available

    if not etcd_available():
        raise SystemExit("--store etcd needs etcd (make system-deps: Debian's etcd-server)")
    with _etcd(tmp, members) as cluster:
        yield cluster.url("wire-cost")


async def measure(
    groups: int,
    connections: int,
    profile: Path | None,
    evict: int = 0,
    launch_profile: Path | None = None,
    store: str = "sqlite",
    members: int = 3,
    renew_window_s: float = 0.0,
    in_flight: int = 1,
) -> dict[str, Any]:
    from uvicorn.lifespan.on import LifespanOn
    from uvicorn.server import ServerState

    from app.main import create_app
    from app.server.serve import GC_THRESHOLD, RegistryConfig, uvicorn_options
    from app.server.settings import Settings
    from app.server.shedding import install

    with (
        tempfile.TemporaryDirectory(prefix="wire-cost-") as tmp,
        _store_url(Path(tmp), store, members) as url,
    ):
        settings = Settings(store=url, etcd_renew_window_s=renew_window_s)
        app = create_app(settings)
        gc.set_threshold(*GC_THRESHOLD)  # as ``serve`` does
        install(app, settings)  # the lease clock (the etcd window) and shedding, as ``serve``
        config = RegistryConfig(
            app,
            tls=None,
            handshake_timeout_s=settings.header_timeout_s,
            hot_path=True,
            **uvicorn_options(settings),
        )
        config.load()
        lifespan = LifespanOn(config)
        await lifespan.startup()
        state = ServerState()
        conns: list[tuple[Any, KeptTransport]] = []

        def connect(count: int) -> None:
            """``count`` fresh connections: the server closes one idle past its keep-alive
            (5 s), so the heartbeats' are opened after the launch."""
            conns.clear()
            for _ in range(count):
                transport = KeptTransport()
                protocol = config.http_protocol_class(  # type: ignore[call-arg]
                    config=config, server_state=state, app_state=lifespan.state
                )
                protocol.connection_made(transport)
                conns.append((protocol, transport))

        connect(1)
        turn = 0

        async def request(data: bytes, on: int | None = None) -> bytes:
            """``data``'s answer, on connection ``on`` (else the next in turn)."""
            nonlocal turn
            if on is None:
                on, turn = turn % len(conns), turn + 1
            protocol, transport = conns[on]
            if transport.closed:
                raise RuntimeError(f"the server closed connection {on}")
            protocol.data_received(data)
            await asyncio.wait_for(transport.written.wait(), ANSWER_S)
            transport.written.clear()
            answer = transport.out.pop()
            transport.out.clear()
            return answer

        async def wave(data: list[bytes]) -> list[bytes]:
            """Each of ``data`` on its own connection, at once (``in_flight`` at most)."""
            if len(data) == 1:
                return [await request(data[0])]
            return list(await asyncio.gather(*(request(d, i) for i, d in enumerate(data))))

        fleet = Fleet(groups * TP, BLOB_BYTES, REGIONS)
        engines: dict[str, str] = {}
        # The launch, one group at a time: CPU counted only while the registry answers (the
        # bodies are made outside), for the loop's thread and the whole process.
        launch = {"open": 0.0, "register": 0.0, "process": 0.0}  # the thread's: open + register
        launch_prof = cProfile.Profile() if launch_profile is not None else None

        async def timed(data: bytes, step: str) -> bytes:
            thread, process = time.thread_time(), time.process_time()
            if launch_prof is not None:
                launch_prof.enable()
            answer = await request(data)
            if launch_prof is not None:
                launch_prof.disable()
            launch[step] += time.thread_time() - thread
            launch["process"] += time.process_time() - process
            return answer

        def beat(gid: str, eid: str) -> bytes:
            body = {"engine_id": eid, "ranks": list(range(TP))}
            return RawPool.prepare("POST", f"/tp-groups/{gid}/engine/agents/heartbeat", body)

        async def renew_all() -> None:
            """Every group registered so far renews once, ``RENEW_WAVE`` at a time on fresh
            connections (on etcd a renewal's answer waits for the journal's tick), as the
            fleet's nodes do every ``RENEW_S``: a launch longer than their lease (etcd's, of
            2,000 groups) keeps them."""
            connect(RENEW_WAVE)
            up = [beat(g, e) for g, e in engines.items()]
            for k in range(0, len(up), RENEW_WAVE):
                refused = [a for a in await wave(up[k : k + RENEW_WAVE]) if not _ok(a)]
                if refused:
                    raise RuntimeError(f"heartbeat refused in the launch: {refused[0][:300]!r}")
            connect(1)

        beaten = time.monotonic()
        for i, gid in enumerate(fleet.groups):
            role = "prefill" if gid.startswith("prefill") else "decode"
            body = {"launch_id": uuid.uuid4().hex, "tp_size": TP, "role": role, "compat": COMPAT}
            answer = await timed(RawPool.prepare("PUT", f"/tp-groups/{gid}/engine", body), "open")
            eid = json.loads(answer.partition(b"\r\n\r\n")[2])["engine_id"]
            agents = {"agents": fleet.agents(i, eid)}
            answer = await timed(
                RawPool.prepare("PUT", f"/tp-groups/{gid}/engine/agents", agents), "register"
            )
            if not _ok(answer):
                raise RuntimeError(f"registration refused: {answer[:300]!r}")
            engines[gid] = eid
            if time.monotonic() - beaten > RENEW_S:  # the groups up so far renew (not timed)
                await renew_all()
                beaten = time.monotonic()
        if launch_prof is not None and launch_profile is not None:
            launch_prof.dump_stats(launch_profile)
        connect(max(connections, in_flight))
        rng = random.Random(1)
        beats = [beat(g, engines[g]) for g in (rng.choice(list(engines)) for _ in range(PER_ROUND))]
        waves = [beats[i : i + in_flight] for i in range(0, PER_ROUND, in_flight)]
        for w in waves[: max(1, len(waves) // 5)]:  # warm up
            await wave(w)
        # The registry's own work with no request (its store's timers and watches): counted in
        # each heartbeat's CPU for as long as the heartbeats run.
        idle_process, idle_loop, idle_at = time.process_time(), time.thread_time(), time.monotonic()
        await asyncio.sleep(IDLE_S)
        idle_s = time.monotonic() - idle_at
        idle_share = {
            "process": round((time.process_time() - idle_process) / idle_s, 4),
            "loop_thread": round((time.thread_time() - idle_loop) / idle_s, 4),
        }
        rounds, loop_rounds, walls = [], [], []
        buffer, fill = bytearray(evict), bytes(range(256)) * (evict // 256)
        for _ in range(ROUNDS):
            spent = on_loop = 0.0
            began = time.monotonic()
            for w in waves:
                if evict:
                    buffer[: len(fill)] = fill
                started, thread = time.process_time(), time.thread_time()
                answers = await wave(w)
                spent += time.process_time() - started
                on_loop += time.thread_time() - thread
            walls.append(time.monotonic() - began)
            rounds.append(spent / PER_ROUND * 1e6)
            loop_rounds.append(on_loop / PER_ROUND * 1e6)
        refused = [a for a in answers if not _ok(a)]
        if refused:
            raise RuntimeError(f"heartbeat refused: {refused[0][:300]!r}")
        if profile is not None:
            prof = cProfile.Profile()
            prof.enable()
            for w in waves:
                await wave(w)
            prof.disable()
            prof.dump_stats(profile)
        await lifespan.shutdown()
    rounds.sort()
    loop_rounds.sort()
    return {
        "store": store if store == "sqlite" else f"etcd, {members} members, W {renew_window_s} s",
        "groups": groups,
        "connections": connections,
        "in_flight": in_flight,
        "evict_bytes": evict,
        "heartbeat_cpu_us": {"best": round(rounds[0], 1), "median": round(rounds[ROUNDS // 2], 1)},
        "heartbeat_loop_thread_us": {
            "best": round(loop_rounds[0], 1),
            "median": round(loop_rounds[ROUNDS // 2], 1),
        },
        "launch_cpu_ms_a_group": {
            "loop_thread": round((launch["open"] + launch["register"]) / groups * 1e3, 3),
            "loop_thread_open": round(launch["open"] / groups * 1e3, 3),
            "loop_thread_register": round(launch["register"] / groups * 1e3, 3),
            "process": round(launch["process"] / groups * 1e3, 3),
        },
        "idle_cpu_share": idle_share,
        "heartbeats_a_second": round(PER_ROUND / sorted(walls)[ROUNDS // 2]),
        "rounds": ROUNDS,
        "per_round": PER_ROUND,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--evict", type=int, default=0, help="bytes written between heartbeats")
    parser.add_argument("--profile", type=Path, help="a cProfile of one more heartbeat round")
    parser.add_argument("--profile-launch", type=Path, help="a cProfile of the launch's answers")
    parser.add_argument(
        "--in-flight", type=int, default=1, help="heartbeats sent at once, each on a connection"
    )
    parser.add_argument("--store", choices=["sqlite", "etcd"], default="sqlite")
    parser.add_argument("--etcd-members", type=int, default=3, help="etcd: its members")
    parser.add_argument(
        "--renew-window", type=float, default=0.0, help="etcd: REGISTRY_ETCD_RENEW_WINDOW_S"
    )
    args = parser.parse_args(argv)
    if args.in_flight < 1 or args.connections < 1 or args.etcd_members < 1:
        parser.error("--in-flight, --connections and --etcd-members are at least 1")
    import uvloop

    os.environ.setdefault("REGISTRY_LOG_LEVEL", "warning")
    out = uvloop.run(
        measure(
            args.groups,
            args.connections,
            args.profile,
            args.evict,
            args.profile_launch,
            args.store,
            args.etcd_members,
            args.renew_window,
            args.in_flight,
        )
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
