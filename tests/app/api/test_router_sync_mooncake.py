"""`engine-registry router-sync --smg` with MooncakeConnector instances (compat
`kv_connector`), a real smg (1.13.0) and a real registry; the instances are stand-ins
(tests/support/pd_stand_in.py). smg gives a Mooncake decode `remote_engine_id` (the worker's
`kv_engine_id`: the registry's engine of the current generation) and a `remote_bootstrap_addr`
built from the prefill's host (which the vLLM plugin's decode replaces with the registry's,
tests/workers/vllm_plugin/test_mooncake_bootstrap.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.server import RegistryProcess
from tests.app.api.conftest import tokened_registry
from tests.app.api.test_router_sync import Fleet, wait_for
from tests.app.conftest import READER
from tests.support.pd_stand_in import StandIns
from workers.tools.routers import RouterSyncProcess, SmgProcess

pytestmark = [pytest.mark.api, pytest.mark.timeout(180)]

MOONCAKE = {"kv_connector": "MooncakeConnector"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-sync-mooncake")


@pytest.fixture(scope="module")
def registry(workdir: Path) -> Iterator[RegistryProcess]:
    with tokened_registry(workdir) as proc:
        yield proc


def test_smg_gets_each_mooncake_generations_engine_id(
    workdir: Path, registry: RegistryProcess
) -> None:
    stand_ins = StandIns()
    fleet = Fleet(registry, stand_ins)
    smg = SmgProcess(workdir).start()
    sync = RouterSyncProcess(workdir, registry.url, [], token=READER, smgs=[smg])
    try:
        p1 = fleet.launch("prefill-m", "prefill", **MOONCAKE)
        d1 = fleet.launch("decode-m", "decode", **MOONCAKE)
        sync.start()

        def workers() -> dict[str, dict[str, object]]:
            return {str(w["url"]): w for w in smg.workers()}

        wait_for(lambda: {p1.url, d1.url} <= workers().keys(), 15, "smg lists both")
        for instance in (p1, d1):
            worker = workers()[instance.url]
            assert worker["kv_connector"] == "MooncakeConnector"
            assert worker["kv_engine_id"] == instance.engine_id
        for round_ in range(2):  # a relaunch: the decode is handed the new generation's id
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
            answer = httpx.post(f"{smg.url}/v1/completions", json=body, timeout=10)
            assert answer.status_code == 200, answer.text
            handed = d1.completions[-1]["kv_transfer_params"]
            assert handed["remote_engine_id"] == p1.engine_id, round_
            assert handed["remote_bootstrap_addr"].startswith("http://127.0.0.1:")
            old = p1
            p1 = fleet.launch("prefill-m", "prefill", **MOONCAKE)
            gone, new = old.url, p1.url
            wait_for(lambda: gone not in workers(), 5, "the superseded prefill leaves smg")  # noqa: B023
            wait_for(lambda: new in workers(), 5, "the relaunched prefill is registered")  # noqa: B023
            assert workers()[p1.url]["kv_engine_id"] == p1.engine_id
            stand_ins.remove(old.name)
    finally:
        sync.stop()
        smg.stop()
        stand_ins.close()
        fleet.http.close()
