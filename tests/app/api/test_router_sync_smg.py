"""`engine-registry router-sync --smg` feeding a real smg (SGLang's model gateway 1.13.0, PD
mode, no worker on its command line, its worker API behind an admin key) from a real registry.
The instances behind smg are stand-ins (tests/support/pd_stand_in.py: HTTP servers answering
as vLLM's OpenAI server does in PD; smg drives vLLM PD over HTTP as over gRPC); real vLLM
instances served over gRPC behind smg run in the vLLM tier (test_vllm_smg.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from tests.app.api.conftest import tokened_registry
from tests.app.api.test_router_sync import Fleet, wait_for
from tests.app.conftest import ADMIN, READER
from tests.support.pd_stand_in import StandIns
from workers.tools.routers import RouterSyncProcess, SmgProcess

pytestmark = [pytest.mark.api, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-sync-smg")


@pytest.fixture(scope="module")
def registry(workdir: Path) -> Iterator[RegistryProcess]:
    with tokened_registry(workdir, f"admin:{ADMIN}") as proc:
        yield proc


def complete(smg: SmgProcess) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    return httpx.post(f"{smg.url}/v1/completions", json=body, timeout=10)


def by_url(smg: SmgProcess) -> dict[str, dict[str, Any]]:
    return {w["url"]: w for w in smg.workers()}


def listed(smg: SmgProcess, url: str, present: bool) -> Callable[[], bool]:
    return lambda: (url in by_url(smg)) == present


def test_smg_fed_only_by_router_sync_registers_withdraws_at_once_and_reconciles(
    workdir: Path, registry: RegistryProcess
) -> None:
    stand_ins = StandIns()
    fleet = Fleet(registry, stand_ins)
    smg = SmgProcess(workdir).start()
    sync = RouterSyncProcess(workdir, registry.url, [], token=READER, smgs=[smg])
    removals: list[float] = []
    try:
        p1 = fleet.launch("prefill-a", "prefill")
        d1 = fleet.launch("decode-a", "decode")
        bad = fleet.launch("prefill-b", "prefill", dtype="float16")  # never to be registered
        # A worker someone else added: router-sync never removes it (it does not own the list).
        foreign = stand_ins.add("foreign", "decode", "foreign-engine")
        added = httpx.post(
            f"{smg.url}/workers",
            headers=smg.headers(),
            timeout=5,
            json={"url": foreign.url, "worker_type": "decode"},
        )
        assert added.status_code == 202, added.text
        sync.start()

        def registered() -> bool:
            workers = by_url(smg)
            return p1.url in workers and d1.url in workers

        wait_for(registered, 15, "smg lists the prefill and the decode")
        workers = by_url(smg)
        assert workers[p1.url]["worker_type"] == "prefill"
        assert workers[p1.url]["kv_engine_id"] == p1.engine_id  # the registry's engine id
        assert workers[p1.url]["labels"]["engine_registry.group"] == "prefill-a"
        assert workers[d1.url]["worker_type"] == "decode"
        assert workers[d1.url]["kv_engine_id"] == d1.engine_id
        # PD through smg: decode got what prefill-a answered.
        httpx.delete(f"{smg.url}/workers/{workers[foreign.url]['id']}", headers=smg.headers())
        wait_for(lambda: foreign.url not in by_url(smg), 10, "the test's own worker left")
        answer = complete(smg)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == f"{d1.name} decoded from {p1.engine_id}"
        assert "not registering prefill-b: incompatible: dtype" in sync.log_text()
        assert bad.url not in by_url(smg)
        assert not bad.completions
        again = httpx.post(
            f"{smg.url}/workers",
            headers=smg.headers(),
            timeout=5,
            json={"url": foreign.url, "worker_type": "decode"},
        )
        assert again.status_code == 202, again.text
        wait_for(lambda: foreign.url in by_url(smg), 10, "the test's own worker is back")

        # The prefill group is relaunched on another port: smg's own list drops the old one
        # within 1 s of the registry's new generation and lists the new engine id.
        for round_ in range(3):
            old = p1
            t0 = time.monotonic()
            p1 = fleet.launch("prefill-a", "prefill")
            wait_for(listed(smg, old.url, False), 5, "the superseded prefill leaves smg")
            removals.append(time.monotonic() - t0)
            wait_for(listed(smg, p1.url, True), 5, "the relaunched prefill is registered")
            assert by_url(smg)[p1.url]["kv_engine_id"] == p1.engine_id
            cut = time.monotonic()
            for _ in range(4):
                assert complete(smg).status_code == 200
            assert old.since(cut) == 0, round_
            assert p1.since(cut) == 4, round_
            stand_ins.remove(old.name)
        print(f"superseded prefill out of smg's list after {[f'{s:.2f}' for s in removals]} s")
        assert max(removals) < 1.0, removals
        assert "withdraw prefill prefill-a (generation 1" in sync.log_text()
        assert "superseded by generation 2" in sync.log_text()

        # Reconcile on start: router-sync stopped, the registry moves on (a relaunch, a
        # deleted decode group); a new router-sync makes smg's list the registry's.
        sync.stop()
        old = p1
        p1 = fleet.launch("prefill-a", "prefill")
        admin = {"Authorization": f"Bearer {ADMIN}"}
        deleted = httpx.delete(f"{registry.url}/tp-groups/decode-a", headers=admin, timeout=10)
        assert deleted.status_code in (200, 204), deleted.text
        assert old.url in by_url(smg)  # nobody told smg
        assert d1.url in by_url(smg)
        sync.start()

        def reconciled() -> bool:
            workers = by_url(smg)
            return old.url not in workers and d1.url not in workers

        wait_for(reconciled, 10, "the new router-sync withdraws what the registry dropped")
        assert foreign.url in by_url(smg)  # never its to remove
        assert p1.url not in by_url(smg)  # no decode: no prefill to pair with
        assert "no decode instance to pair with" in sync.log_text()
    finally:
        sync.stop()
        smg.stop()
        stand_ins.close()
        fleet.http.close()
