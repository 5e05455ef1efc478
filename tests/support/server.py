"""A real registry process on loopback, for tests: ``python -m app serve`` in a subprocess.

The launcher is the project's one (`workers.tools.procs`), shared with the benchmarks, the
demo and the vLLM launcher; this module keeps the tests' names for it (``RegistryProcess``:
``store``, ``host``, ``port``, ``args``, ``env``, ``log_path``, ``prefix``, and more).
"""

from __future__ import annotations

from workers.tools.procs import ROOT, RegistryProcess, free_port

__all__ = ["ROOT", "RegistryProcess", "free_port"]
