"""A real registry process on loopback, for tests: ``python -m app serve`` in a subprocess.

The launcher itself is the project's one (`workers.tools.procs`), shared with the benchmarks,
the demo and the vLLM launcher; this module keeps the tests' names for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from workers.tools import procs
from workers.tools.procs import ROOT, free_port

__all__ = ["ROOT", "RegistryProcess", "free_port"]


class RegistryProcess(procs.RegistryProcess):
    """Starts, stops, kills and restarts one ``engine-registry serve`` on a fixed port."""

    def __init__(
        self,
        store: str,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        """``prefix``: a command that runs the server (``prlimit --nofile=1024:1024``, say)."""
        super().__init__(
            store, host=host, port=port, args=args, env=env, log_path=log_path, prefix=prefix
        )
