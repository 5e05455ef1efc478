"""`engine-registry router-sync` when it cannot see the registry: a real registry, a real
vllm-router (0.1.17) fed only by a real router-sync process, stand-in instances
(tests/support/pd_stand_in.py). Within ``--grace`` the routers keep the last list; blind past
it (the registry gone, or its token refused after a rotation) router-sync offers nothing, so
the router forgets the instances within its own 5 s expiry, ``--alive-file`` is no longer
touched, and one line says so with the cause; the watch coming back ends it."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from harness.server import RegistryProcess
from tests.app.api.test_router_sync import EXPIRY_S, Fleet, complete, wait_for
from tests.app.conftest import READER, WORKER, tokens_file
from tests.support.pd_stand_in import StandIns
from workers.tools.routers import RouterSyncProcess, VllmRouterProcess

pytestmark = [pytest.mark.faults, pytest.mark.timeout(240)]
GRACE_S = 8.0  # above a registry restart here, so the refused token is the cause said
BLIND = "past the 8 s grace"


def age(path: Path) -> float:
    return time.time() - path.stat().st_mtime


def test_blind_past_its_grace_router_sync_offers_nothing_and_says_why_once(
    tmp_path: Path,
) -> None:
    tokens = tokens_file(tmp_path, f"worker:{WORKER}", f"reader:{READER}")
    alive = tmp_path / "router-sync.alive"
    with RegistryProcess(
        f"sqlite:///{tmp_path / 'registry.db'}",
        args=["--tokens-file", str(tokens)],
        env={"REGISTRY_WATCH_BOOKMARK_S": "1"},  # a quiet registry says it is there each 1 s
        log_path=tmp_path / "registry.log",
    ) as registry:
        stand_ins = StandIns()
        fleet = Fleet(registry, stand_ins)
        router = VllmRouterProcess(tmp_path).start()
        sync = RouterSyncProcess(tmp_path, registry.url, [router.discovery], token=READER)
        sync.cmd += ["--alive-file", str(alive), "--grace", str(GRACE_S)]
        try:
            fleet.launch("prefill-a", "prefill")
            fleet.launch("decode-a", "decode")
            sync.start()
            wait_for(lambda: complete(router).status_code == 200, 30, "router serves PD")
            assert age(alive) < 3

            # The registry goes: within the grace the router keeps the instances ...
            registry.stop()
            stopped = time.monotonic()
            time.sleep(EXPIRY_S + 1)
            assert complete(router).status_code == 200
            # ... past it router-sync offers nothing and the router forgets them.
            wait_for(
                lambda: complete(router).status_code != 200,
                GRACE_S + EXPIRY_S + 5,
                "the router forgets what a blind router-sync last saw",
            )
            print(f"router empty {time.monotonic() - stopped:.1f} s after the registry went")
            log = sync.log_text()
            assert log.count(BLIND) == 1, log[-3000:]
            assert "no longer offering the 2 instances it last saw" in log
            line = log.split(BLIND)[1].split("\n")[0]
            assert "Connection refused" in line, line
            assert age(alive) > 3

            # It comes back: offered again, the file touched again.
            registry.start()
            wait_for(lambda: complete(router).status_code == 200, 30, "router serves again")
            assert "the watch is back after" in sync.log_text()
            assert age(alive) < 3

            # The reader token is rotated out while the registry restarts: the watch is
            # refused (401); past the grace, blind again, saying so with that cause.
            registry.stop()
            tokens.write_text(f"worker:{WORKER}\n")
            registry.start()
            wait_for(lambda: sync.log_text().count(BLIND) == 2, GRACE_S + 15, "blind on 401")
            line = sync.log_text().split(BLIND)[2].split("\n")[0]
            assert "401 unauthorized" in line, line
            wait_for(lambda: complete(router).status_code != 200, EXPIRY_S + 5, "forgotten")

            # The token is back (SIGHUP reloads the file): so is the watch.
            tokens.write_text(f"worker:{WORKER}\nreader:{READER}\n")
            assert registry.proc is not None
            registry.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: complete(router).status_code == 200, 30, "router serves again")
            assert sync.log_text().count("the watch is back after") == 2
        finally:
            sync.stop()
            router.stop()
            stand_ins.close()
            fleet.http.close()
