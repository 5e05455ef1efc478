"""What the vLLM tier checks around its instances: the router (a real vllm-router, no prefill or
decode URL on its command line, fed only by `engine-registry router-sync` from the tier's
registry with a reader token), and a request naming a superseded prefill engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from registry_client.client import RegistryClient
from registry_client.models import Engine
from tests.workers.vllm_plugin.conftest import FIGURES, MACHINE
from workers.tools.routers import RouterSyncProcess, VllmRouterProcess
from workers.tools.vllm_launch import Instance
from workers.tools.vllm_pd import complete
from workers.vllm_plugin.stale import MARK as STALE_MARK


def within(check: Callable[[], Any], limit_s: float, what: str, on_fail: Callable[[], str]) -> Any:
    """``check()``'s first truthy result, polled; fails naming ``what`` after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"{what}: not within {limit_s} s\n{on_fail()}"
        time.sleep(0.5)


@dataclass
class Routing:
    router: VllmRouterProcess
    sync: RouterSyncProcess

    @classmethod
    def start(cls, workdir: Path, registry_url: str, reader_token: str) -> Routing:
        router = VllmRouterProcess(workdir).start()
        sync = RouterSyncProcess(workdir, registry_url, [router.discovery], token=reader_token)
        return cls(router, sync.start())

    def stop(self) -> None:
        self.sync.stop()
        self.router.stop()

    def tails(self) -> str:
        return (
            f"router-sync:\n{self.sync.log_text()[-3000:]}\n"
            f"vllm-router:\n{self.router.log_text()[-3000:]}"
        )

    def answer(self, body: dict[str, Any], limit_s: float) -> tuple[httpx.Response, float]:
        """The first 200 the router gives for ``body`` (it answers 503 until it has a prefill
        and a decode instance), and the seconds it took."""
        t0 = time.monotonic()

        def ok() -> httpx.Response | None:
            try:
                got = complete(self.router.url, body, timeout_s=60.0)
            except httpx.HTTPError:
                return None
            return got if got.status_code == 200 else None

        got = within(ok, limit_s, "a PD answer through vllm-router", self.tails)
        return got, time.monotonic() - t0

    def said(self, text: str, limit_s: float) -> float:
        """Seconds until router-sync's or vllm-router's log says ``text``."""
        t0 = time.monotonic()
        within(
            lambda: text in self.sync.log_text() + self.router.log_text(),
            limit_s,
            f"the routers' logs say {text!r}",
            self.tails,
        )
        return time.monotonic() - t0


def serving(client: RegistryClient, group: str, url: str, limit_s: float = 60.0) -> Engine:
    """The group's engine once it published that it serves at ``url``."""

    def published() -> Engine | None:
        engine = client.get_engine(group)
        return engine if (engine.raw.get("serving") or {}).get("url") == url else None

    found: Engine = within(
        published, limit_s, f"{group} published {url}", lambda: str(client.get_engine(group).raw)
    )
    return found


def stale_request_fails_at_once(
    decode: Instance, body: dict[str, Any], params: dict[str, Any], old_id: str, old_port: int
) -> None:
    """A request still naming the superseded engine (and its dead side channel) fails at once
    naming the cause (the plugin asks the registry first), instead of vLLM waiting 5 s on the
    side channel."""
    stale = {**params, "remote_engine_id": old_id, "remote_port": old_port}
    t0 = time.monotonic()
    refused = complete(decode.url, {**body, "kv_transfer_params": stale})
    took = FIGURES["request naming the superseded engine failed after"] = time.monotonic() - t0
    said = [line for line in decode.log_text().splitlines() if STALE_MARK in line]
    assert any(f"{old_id}: superseded by generation" in line for line in said), (
        refused.status_code,
        refused.text[:500],
        decode.tails(),
    )
    assert took < 5.0, refused.text[:500]  # not vLLM's 5 s wait on the side channel
    MACHINE["a request naming the superseded engine: decode answered"] = (
        f"{refused.status_code} {refused.text[:120]}"
    )
