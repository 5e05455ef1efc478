"""The domain rules: engines per launch, agents with leases, resolution and handshakes.

Keys in the store (``gid`` a group id, ``eid`` an engine id):

    groups/{gid}/engine           the current engine of the group (JSON EngineRecord)
    groups/{gid}/agents/{rank}    a live agent of the current engine, without its blob (lease)
    blobs/{gid}/{rank}            that agent's metadata blob, on the same lease
    mooncake/{gid}/{eid}/{dp}/{tp}/{pp}  a MooncakeConnector prefill worker of engine eid
    launches/{gid}/{launch_id}    {engine_id, generation} of every launch the group has seen
    engines/{eid}                 {group_id, generation}: who was issued this engine_id
    groups/{gid}/serving          where the current engine's instance serves (no lease: it
                                  goes with its engine; liveness is the engine's readiness)

Every state change is one store transaction guarded by the engine key's mod_revision, so an
open, a registration and a deletion racing each other serialize; losers re-read and retry.
"""

from __future__ import annotations

from app.registry.agents import AgentsMixin, _check_reachable
from app.registry.base import RegistryBase
from app.registry.batches import BatchesMixin
from app.registry.engines import EnginesMixin
from app.registry.handshakes import HandshakesMixin
from app.registry.mooncake import MooncakeMixin
from app.registry.races import MAX_ATTEMPTS
from app.registry.records import (
    AgentRecord,
    Decoded,
    EngineRecord,
    IndexRecord,
)
from app.registry.serving import ServingMixin
from app.registry.state import GroupState


class Registry(
    MooncakeMixin,
    EnginesMixin,
    BatchesMixin,
    HandshakesMixin,
    AgentsMixin,
    ServingMixin,
    RegistryBase,
):
    """The domain rules over a :class:`app.store.Store` (see the module doc)."""


__all__ = [
    "MAX_ATTEMPTS",
    "AgentRecord",
    "Decoded",
    "EngineRecord",
    "GroupState",
    "IndexRecord",
    "Registry",
    "RegistryBase",
    "_check_reachable",
]
