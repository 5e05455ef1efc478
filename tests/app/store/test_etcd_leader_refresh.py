"""A lease a new etcd leader refreshed, on a real 3-member etcd whose leader is killed
(``app.store.etcd.reaper``): a new leader gives every lease its full TTL again, which etcd's
figures cannot tell from a renewal through another replica, but etcd's raft term can. The
replica that renewed the lease restarts its clock from etcd's figure and still ends it, as
a dead rank's, long before etcd's own expiry (ttl + grace)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from app.store import Put
from app.store.lease_clock import CLOCK
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

if not etcd_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

from app.store.etcd.store import EtcdStore  # noqa: E402

TTL_S = 2
# ttl, the election, the clock restarted (ttl and etcd's own extension), slack: 5-7 s here
# alone or beside two busy cores, 13.8 s once in a CI run beside the other tiers. Without the
# raft-term check the lease lives to etcd's own expiry, ttl + grace (62 s): far past it.
BOUND_S = 30.0


def test_a_dead_ranks_lease_a_new_leader_refreshed_is_still_ended_by_its_replica(
    etcd_trio: EtcdCluster,
) -> None:
    assert CLOCK.grace_s + TTL_S > BOUND_S  # etcd's own expiry would come after the bound

    async def body() -> None:
        store = EtcdStore.from_url(etcd_trio.url(uuid.uuid4().hex), timeout_s=5.0)
        try:
            lease = await store.grant_lease(TTL_S)
            assert (await store.txn([], [Put("agent", b"x", lease.id)])).succeeded
            granted = time.monotonic()
            await asyncio.sleep(1.2)  # so the new leader's refresh comes well after the grant
            await asyncio.to_thread(etcd_trio.kill, await asyncio.to_thread(etcd_trio.leader_index))
            # No renewal ever comes (a dead rank): ended by this replica, not by etcd at 62 s.
            while store.reaper.ended == 0:
                elapsed = time.monotonic() - granted
                assert elapsed < BOUND_S, (
                    f"a dead rank's lease outlived a leader change {elapsed:.1f} s"
                )
                await asyncio.sleep(0.1)
            assert (await store.entries("agent")).entries == []
            assert await store.refresh_lease(lease.id) is None
        finally:
            await store.close()

    asyncio.run(body())
