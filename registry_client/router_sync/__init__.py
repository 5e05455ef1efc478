"""``engine-registry router-sync``: keep running routers (vllm-router, smg) in step with the
registry. Needs the ``router-sync`` extra (pyzmq, msgpack) for vllm-router."""
