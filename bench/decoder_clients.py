"""The stream client processes of ``bench/decoders.py`` (``bench/decoder_streams.py``),
driven from the benchmark: started with their share of the streams, asked, dumped, closed."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT
from bench.storm_core import COMPAT


class Clients:
    """``bench.decoder_streams`` processes sharing ``streams`` among them."""

    def __init__(
        self,
        urls: list[str],
        revision: int,
        streams: int,
        procs: int,
        tmp: Path,
        prefix: str,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        for k in range(procs):
            n = streams // procs + (k < streams % procs)
            cmd = [
                sys.executable,
                "-m",
                "bench.decoder_streams",
                "--urls",
                ",".join(urls),
                "--model",
                str(COMPAT["model"]),
                "--revision",
                str(revision),
                "--streams",
                str(n),
                "--prefix",
                prefix,
                *extra,
            ]
            err = open(tmp / f"clients-{k}.log", "ab")  # noqa: SIM115
            self.procs.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err
                )
            )
        ready = self.read(330)  # each waits --ready-timeout (300 s) for its streams
        if sum(r["ready"] for r in ready) < streams:
            raise RuntimeError(f"streams open: {ready} (of {streams})")

    def read(self, timeout_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        out = []
        for p in self.procs:
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], max(0, deadline - time.monotonic()))
            line = p.stdout.readline() if ready else b""
            if not line:
                raise RuntimeError(f"stream client {p.pid} gave no answer (exit {p.poll()})")
            out.append(json.loads(line))
        return out

    def ask(self, command: str, timeout_s: float = 60) -> list[dict[str, Any]]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(command.encode() + b"\n")
            p.stdin.flush()
        return self.read(timeout_s)

    def dump(self) -> dict[str, Any]:
        paths = [self.tmp / f"dump-{k}.json" for k in range(len(self.procs))]
        for p, path in zip(self.procs, paths, strict=True):
            assert p.stdin is not None
            p.stdin.write(f"dump {path}\n".encode())
            p.stdin.flush()
        self.read(120)
        parts = [json.loads(path.read_text()) for path in paths]
        return {
            "records": [r for d in parts for r in d["records"]],
            "opens": [b for d in parts for b in d["opens"]],
            "attempts": [a for d in parts for a in d["attempts"]],
            "ends": {k: sum(d["ends"].get(k, 0) for d in parts) for d in parts for k in d["ends"]},
            **{k: sum(d[k] for d in parts) for k in ("duplicates", "relists", "lines")},
        }

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
