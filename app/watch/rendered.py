"""A group as a list page shows it, its JSON made once per version of the group.

A page of 500 groups at 100,000 ranks cost 44-209 ms (most of it 60-100 ms) on the 2-core
machine, two thirds of it making each group's view again (its state from its entries, an
``Engine`` and eight ``AgentSummary`` models, their JSON), though a fleet's groups do not
change between two pages: heartbeats renew leases, they write no key. What changes is each
agent's ``expires_at`` (its lease's time left, as of the read).

So the JSON of a group's view is kept, cut before each agent's ``expires_at`` value, with the
version of the group it was made from: its entries' keys and modification revisions (a
change to the group replaces, adds or removes one). A page fills in the expiries as
:class:`~app.registry.state.GroupState` computes them (``now`` plus the lease's time left, a
full ``ttl_s`` for a lease the store does not know) and joins the parts: the same bytes as
serializing the view, which ``tests/app/test_rendered_views.py`` checks. A group whose
version changed is made again, from the entries the page shows (live leases only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic_core import to_json

from app.core.timefmt import utc_iso
from app.registry.records import Decoded
from app.registry.state import GroupState
from app.store import Snapshot
from app.watch.history import Group

_AGENTS_TAIL = b'[],"serving":null}'  # an Engine with no agents and no serving ends so
_EXPIRY_TAIL = b'""}'  # an AgentSummary whose expires_at is empty ends so

Version = tuple[tuple[str, int], ...]


@dataclass(slots=True)
class _Made:
    version: Version
    head: bytes  # the Engine's JSON up to its "agents": value
    agents: list[tuple[bytes, int, float]]  # each agent's JSON up to its expiry; lease, ttl
    serving: bytes


def _version(group: Group) -> Version:
    return tuple((key, entry.mod_revision) for key, entry in group.items())


def _made(gid: str, group: Group, version: Version, decoded: Decoded) -> _Made | None:
    entries = [group[k] for k in sorted(group)]
    state = GroupState.read(Snapshot(entries, 0, {}, 0.0), gid, decoded, brief=True)
    if state is None:
        return None
    bare = state.view(bare=True)
    whole = bare.__pydantic_serializer__.to_json(bare)
    assert whole.endswith(_AGENTS_TAIL), whole[-40:]
    agents = []
    for rank, agent in sorted(state.agents.items()):
        # AgentSummary's fields in its order, written by the serializer its model uses (a
        # model built for each would be most of a view's cost)
        summary = {"rank": rank, "agent_name": agent.agent_name, "host": agent.host}
        text = to_json(summary | {"expires_at": ""})
        assert text.endswith(_EXPIRY_TAIL), text[-40:]
        agents.append((text[: -len(_EXPIRY_TAIL)], agent.lease, float(agent.ttl_s)))
    serving = state.serving_view()
    return _Made(
        version,
        whole[: -len(_AGENTS_TAIL)],
        agents,
        b"null" if serving is None else serving.__pydantic_serializer__.to_json(serving),
    )


class Rendered:
    """Each group's view as JSON, kept per version (see the module doc)."""

    def __init__(self) -> None:
        self._made: dict[str, _Made | None] = {}

    def json(
        self,
        gid: str,
        group: Group,
        decoded: Decoded,
        remaining: Mapping[int, float],
        now: float,
    ) -> bytes | None:
        """The group's view as the API shows it (None: the group has no engine), the leases'
        time left ``remaining`` as of ``now``."""
        version = _version(group)
        made = self._made.get(gid)
        if made is None or made.version != version:
            made = _made(gid, group, version, decoded)
            self._made[gid] = made
        if made is None:
            return None
        expiries: dict[int, bytes] = {}  # a node's ranks share one lease
        parts = []
        for prefix, lease, ttl_s in made.agents:
            expiry = expiries.get(lease)
            if expiry is None:
                left = remaining.get(lease, ttl_s)
                expiry = expiries[lease] = b'"%s"}' % utc_iso(now + left).encode()
            parts.append(prefix + expiry)
        return b'%s[%s],"serving":%s}' % (made.head, b",".join(parts), made.serving)

    def trim(self, groups: Mapping[str, Group]) -> None:
        """Forget the groups no longer in ``groups`` once they are as many as the rest (the
        kept views then hold at most twice the fleet's)."""
        if len(self._made) > 2 * len(groups) + 1024:
            for gid in [g for g in self._made if g not in groups]:
                del self._made[gid]
