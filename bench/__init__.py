"""Benchmarks of the engine registry against what users would pick instead.

One module per measured question, each with ``run(quick) -> dict``:

- :mod:`bench.storm`: launch storm over real HTTP (SQLite, etcd when ``app.store.etcd.store``
  imports), beside the etcd-direct baseline and the framework/client ceilings;
- :mod:`bench.handshake`: a decode rank resolving a prefill engine and loading its NIXL agents;
- :mod:`bench.transfer`: NIXL READ bandwidth over DRAM between processes against a memcpy.

``python -m bench.run [--quick] [--only storm,handshake,transfer]`` runs them, writes
``bench/results/<name>.json`` and ``bench/results/latest.md``. Nothing here is a test: no
figure is ever asserted. Everything listens on 127.0.0.1 only, and every loop is bounded in
count and time.
"""
