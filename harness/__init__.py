"""Helpers shared by the tests and the benchmarks: a registry process, an etcd cluster, test PKI."""
