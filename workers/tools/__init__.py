"""Tools around the worker library, never imported by it: the demo, the real-vLLM launcher
and its pieces (processes, the PD proxy, the tiny model, vLLM's CLI shim, the AMX check),
and the process helpers that tests, benchmarks, the demo and the launcher share
(`workers.tools.procs`: one `free_port`, one registry launcher)."""
