"""A real vLLM instance served by vLLM's gRPC entrypoint (``vllm serve … --grpc``, the
servicer from ``smg-grpc-servicer``), as smg's vLLM PD mode uses it: `Instance` with
``--grpc``, healthy once the standard gRPC health service answers SERVING."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from workers.tools.vllm_launch import Instance, free_port


def grpc_serving(port: int) -> bool:
    import grpc  # type: ignore[import-untyped]
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, contextlib.suppress(grpc.RpcError):
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=2.0
        )
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)
    return False


@dataclass
class GrpcInstance(Instance):
    # vLLM's gRPC server has no HTTP /metrics: the plugin serves them here
    # (ENGINE_REGISTRY_GRPC_METRICS_PORT).
    metrics_port: int = field(default_factory=free_port)

    @property
    def grpc_url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def _cmd(self, node: int) -> list[str]:
        return [*super()._cmd(node), "--grpc"]

    def _env(self, node: int) -> dict[str, str]:
        return {**super()._env(node), "ENGINE_REGISTRY_GRPC_METRICS_PORT": str(self.metrics_port)}

    def wait_healthy(self, timeout_s: float = 240.0) -> float:
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited early:\n{self.tails()}")
            if grpc_serving(self.port):
                return time.monotonic() - self.started_at
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not serving gRPC within {timeout_s} s:\n{self.tails()}")
