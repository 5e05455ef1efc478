"""The workers' client against a real registry process over real HTTP: the whole contract."""

from __future__ import annotations

from dataclasses import replace

import pytest

from registry_client import errors
from registry_client.client import RegistryClient
from registry_client.models import AgentItem, Compat, KvSpec

pytestmark = [pytest.mark.api, pytest.mark.timeout(60)]

KV = KvSpec("DRAM", 0, [1 << 20, 2 << 20], 8, 512, 2)
COMPAT: Compat = {"model": "m", "block_size": 4, "dtype": "float16"}


def register(client: RegistryClient, group: str, rank: int, engine_id: str) -> bool:
    _, created = client.register_agent(
        group,
        rank,
        engine_id=engine_id,
        agent_name=f"{engine_id}-rank{rank}",
        agent_metadata=b"md%d" % rank,
        host="127.0.0.1",
        kv=KV,
        ttl_s=30,
    )
    return created


def test_the_client_walks_the_whole_contract_against_a_real_registry(registry_url: str) -> None:
    with RegistryClient(registry_url, timeout_s=10) as client:
        assert client.healthz()
        assert client.readyz()
        engine, created = client.open_engine(
            "pf", launch_id="l1", tp_size=2, role="prefill", compat=COMPAT
        )
        assert created
        assert engine.generation == 1
        again, created_again = client.open_engine(
            "pf", launch_id="l1", tp_size=2, role="prefill", compat=COMPAT
        )
        assert (again.engine_id, created_again) == (engine.engine_id, False)
        with pytest.raises(errors.GroupConflict):
            client.open_engine("pf", launch_id="l1", tp_size=4, role="prefill")

        assert register(client, "pf", 0, engine.engine_id)
        assert not register(client, "pf", 0, engine.engine_id)
        with pytest.raises(errors.NotReady) as not_ready:
            client.handshake(engine.engine_id, tp_size=1, rank=0, timeout_s=0.5)
        assert not_ready.value.missing_ranks == [1]
        register(client, "pf", 1, engine.engine_id)
        assert client.get_engine("pf", wait_ready_s=1).ready
        assert client.heartbeat("pf", 1, engine_id=engine.engine_id)

        plan = client.handshake(engine.engine_id, tp_size=1, rank=0, compat=COMPAT)
        assert (plan.tp_ratio, [t.rank for t in plan.targets]) == (-2, [0, 1])
        assert plan.targets[1].agent_metadata == b"md1"
        assert plan.targets[1].kv == KV
        wider = client.handshake(engine.engine_id, tp_size=4, rank=3)
        assert (wider.tp_ratio, [t.rank for t in wider.targets]) == (2, [1])
        with pytest.raises(errors.Incompatible) as incompatible:
            client.handshake(engine.engine_id, tp_size=2, rank=0, compat={"block_size": 16})
        assert incompatible.value.mismatches[0]["field"] == "block_size"
        with pytest.raises(errors.InvalidRequest):
            client.handshake(engine.engine_id, tp_size=3, rank=0)

        newer, _ = client.open_engine("pf", launch_id="l2", tp_size=2, role="prefill")
        assert newer.generation == 2
        with pytest.raises(errors.EngineSuperseded) as gone:
            client.resolve_engine(engine.engine_id)
        assert gone.value.current_engine_id == newer.engine_id
        with pytest.raises(errors.EngineIdMismatch) as stale:
            client.heartbeat("pf", 0, engine_id=engine.engine_id)
        assert stale.value.cause == "superseded"
        with pytest.raises(errors.LaunchSuperseded):
            client.open_engine("pf", launch_id="l1", tp_size=2, role="prefill")
        with pytest.raises(errors.NotFound):
            client.heartbeat("pf", 0, engine_id=newer.engine_id)

        register(client, "pf", 0, newer.engine_id)
        client.deregister_agent("pf", 0, engine_id=newer.engine_id)
        assert client.resolve_engine(newer.engine_id).registered_ranks == []
        assert [g.group_id for g in client.list_groups()] == ["pf"]
        client.delete_group("pf")
        with pytest.raises(errors.NotFound):
            client.resolve_engine(newer.engine_id)


def test_a_dead_replica_first_in_the_list_costs_one_failed_connect(registry_url: str) -> None:
    from tests.workers.torchrun_support import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    with RegistryClient([dead, registry_url], timeout_s=10) as client:
        engine, _ = client.open_engine("g", launch_id="x", tp_size=1, role="both")
        assert client.url == registry_url
        assert client.resolve_engine(engine.engine_id).group_id == "g"


def test_engine_ids_cause_mismatch_with_the_cause_the_registry_names(
    registry_url: str, other_registry_url: str
) -> None:
    with RegistryClient(registry_url) as here, RegistryClient(other_registry_url) as there:
        mine, _ = here.open_engine("a", launch_id="1", tp_size=1, role="prefill")
        other, _ = here.open_engine("b", launch_id="1", tp_size=1, role="prefill")
        foreign, _ = there.open_engine("a", launch_id="1", tp_size=1, role="prefill")
        with pytest.raises(errors.EngineIdMismatch) as other_group:
            register(here, "a", 0, other.engine_id)
        assert other_group.value.cause == "other_group"
        with pytest.raises(errors.EngineIdMismatch) as unknown:
            register(here, "a", 0, foreign.engine_id)
        assert unknown.value.cause == "unknown"
        assert register(here, "a", 0, mine.engine_id)


def batch(engine_id: str, ranks: list[int]) -> list[AgentItem]:
    return [
        AgentItem(r, engine_id, f"{engine_id}-rank{r}", b"md%d" % r, "127.0.0.1", KV) for r in ranks
    ]


def test_batches_register_all_or_none_and_one_heartbeat_renews_them(registry_url: str) -> None:
    with RegistryClient(registry_url, timeout_s=10) as client:
        engine, _ = client.open_engine("pf", launch_id="l1", tp_size=4, role="prefill")
        eid = engine.engine_id
        first = client.register_agents("pf", batch(eid, [0, 1]), ttl_s=30)
        assert [a.rank for a in first.agents] == [0, 1]
        assert (first.created_ranks, first.replaced_ranks) == ([0, 1], [])
        assert first.agents[1].agent_name == f"{eid}-rank1"
        assert len({a.expires_at for a in first.agents}) == 1, "one shared lease"

        foreign = batch(eid, [2, 3])
        foreign[1] = replace(foreign[1], engine_id="never-issued-here")
        with pytest.raises(errors.EngineIdMismatch) as mismatch:
            client.register_agents("pf", foreign)
        assert (mismatch.value.rank, mismatch.value.cause) == (3, "unknown")
        with pytest.raises(errors.InvalidRequest) as outside:
            client.register_agents("pf", batch(eid, [2, 7]))
        assert outside.value.errors[0]["loc"] == ["body", "agents", 1, "rank"]
        with pytest.raises(errors.NotFound):
            client.register_agents("no-such-group", batch(eid, [0]))
        assert client.get_engine("pf").registered_ranks == [0, 1], "all or none"

        again = client.register_agents("pf", batch(eid, [1, 2, 3]), ttl_s=30)
        assert (again.created_ranks, again.replaced_ranks) == ([2, 3], [1])
        assert client.get_engine("pf").ready
        plan = client.handshake(eid, tp_size=4, rank=3)
        assert [(t.rank, t.agent_metadata) for t in plan.targets] == [(3, b"md3")]

        renewed = client.heartbeat_agents("pf", engine_id=eid, ranks=[0, 1, 2, 3])
        assert [r.rank for r in renewed] == [0, 1, 2, 3]
        assert all(r.expires_at >= first.expires_at for r in renewed)

        client.deregister_agent("pf", 2, engine_id=eid)
        with pytest.raises(errors.NotFound) as absent:
            client.heartbeat_agents("pf", engine_id=eid, ranks=[0, 2])
        assert "rank 2" in absent.value.detail
        newer, _ = client.open_engine("pf", launch_id="l2", tp_size=4, role="prefill")
        with pytest.raises(errors.EngineIdMismatch) as stale:
            client.heartbeat_agents("pf", engine_id=eid, ranks=[0])
        assert stale.value.cause == "superseded"
        with pytest.raises(ValueError, match="at least one"):
            client.heartbeat_agents("pf", engine_id=newer.engine_id, ranks=[])
        with pytest.raises(ValueError, match="at least one"):
            client.register_agents("pf", [])
