"""``python -m bench.wire_cost [--groups N] [--connections C] [--evict BYTES] [--profile OUT]
[--profile-launch OUT]``: the CPU a node heartbeat and a group's launch cost on the registry's
whole server path, in this process, without sockets.

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
round and the median. Nothing is asserted; ``--profile`` writes a cProfile of one more round.

The launch (each group's open, then its node's registration, one group at a time) is counted
as CPU while the registry answers (the client's bodies are made outside those spans): per
group, the event loop's thread (and of it, the open's and the registration's) and the whole
process (the SQLite file's thread beside it); ``--profile-launch`` writes a cProfile of those
spans.

``--evict BYTES`` writes over a buffer of that size between two heartbeats (not timed), as the
rest of a live machine does between two heartbeats 0.8 ms apart (the client, the kernel's
network stack, other processes sharing the L3 cache): each heartbeat then starts with its code
and data out of the caches. This machine's L2 is 1 MiB a core and its L3 32 MiB, shared.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.fleet import BLOB_BYTES, REGIONS
from bench.fleet_load import TP, Fleet
from bench.raw_client import RawPool
from bench.storm_core import COMPAT

ROUNDS, PER_ROUND = 7, 5000
ANSWER_S = 30.0  # an answer not written by then fails the run


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


async def measure(
    groups: int,
    connections: int,
    profile: Path | None,
    evict: int = 0,
    launch_profile: Path | None = None,
) -> dict[str, Any]:
    from uvicorn.lifespan.on import LifespanOn
    from uvicorn.server import ServerState

    from app.main import create_app
    from app.server.serve import RegistryConfig, uvicorn_options
    from app.server.settings import Settings

    with tempfile.TemporaryDirectory(prefix="wire-cost-") as tmp:
        settings = Settings(store=f"sqlite:///{Path(tmp) / 'registry.db'}")
        app = create_app(settings)
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
        conns = []
        for _ in range(connections):
            transport = KeptTransport()
            protocol = config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=state, app_state=lifespan.state
            )
            protocol.connection_made(transport)
            conns.append((protocol, transport))
        turn = 0

        async def request(data: bytes) -> bytes:
            nonlocal turn
            protocol, transport = conns[turn % connections]
            turn += 1
            protocol.data_received(data)
            await asyncio.wait_for(transport.written.wait(), ANSWER_S)
            transport.written.clear()
            answer = transport.out.pop()
            transport.out.clear()
            return answer

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

        for i, gid in enumerate(fleet.groups):
            role = "prefill" if gid.startswith("prefill") else "decode"
            body = {"launch_id": uuid.uuid4().hex, "tp_size": TP, "role": role, "compat": COMPAT}
            answer = await timed(RawPool.prepare("PUT", f"/tp-groups/{gid}/engine", body), "open")
            eid = json.loads(answer.partition(b"\r\n\r\n")[2])["engine_id"]
            agents = {"agents": fleet.agents(i, eid)}
            answer = await timed(
                RawPool.prepare("PUT", f"/tp-groups/{gid}/engine/agents", agents), "register"
            )
            if not answer.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"registration refused: {answer[:300]!r}")
            engines[gid] = eid
        if launch_prof is not None and launch_profile is not None:
            launch_prof.dump_stats(launch_profile)
        rng = random.Random(1)
        beats = [
            RawPool.prepare(
                "POST",
                f"/tp-groups/{g}/engine/agents/heartbeat",
                {"engine_id": engines[g], "ranks": list(range(TP))},
            )
            for g in (rng.choice(list(engines)) for _ in range(PER_ROUND))
        ]
        for beat in beats[:1000]:  # warm up
            await request(beat)
        rounds = []
        buffer, fill = bytearray(evict), bytes(range(256)) * (evict // 256)
        for _ in range(ROUNDS):
            spent = 0.0
            for beat in beats:
                if evict:
                    buffer[: len(fill)] = fill
                started = time.process_time()
                answer = await request(beat)
                spent += time.process_time() - started
            rounds.append(spent / PER_ROUND * 1e6)
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"heartbeat refused: {answer[:300]!r}")
        if profile is not None:
            prof = cProfile.Profile()
            prof.enable()
            for beat in beats:
                await request(beat)
            prof.disable()
            prof.dump_stats(profile)
        await lifespan.shutdown()
    rounds.sort()
    return {
        "groups": groups,
        "connections": connections,
        "evict_bytes": evict,
        "heartbeat_cpu_us": {"best": round(rounds[0], 1), "median": round(rounds[ROUNDS // 2], 1)},
        "launch_cpu_ms_a_group": {
            "loop_thread": round((launch["open"] + launch["register"]) / groups * 1e3, 3),
            "loop_thread_open": round(launch["open"] / groups * 1e3, 3),
            "loop_thread_register": round(launch["register"] / groups * 1e3, 3),
            "process": round(launch["process"] / groups * 1e3, 3),
        },
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
    args = parser.parse_args(argv)
    import uvloop

    os.environ.setdefault("REGISTRY_LOG_LEVEL", "warning")
    out = uvloop.run(
        measure(args.groups, args.connections, args.profile, args.evict, args.profile_launch)
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
