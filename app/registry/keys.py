"""The store's layout: the key of each record of a group (its engine, its serving URL, each
rank's agent and blob), and a record's stored bytes. Every package that reads the store names
keys through here."""

from __future__ import annotations

from pydantic import BaseModel

GROUPS = "groups"  # the top segment of every key of a group's state (not its blobs)


def engine(gid: str) -> str:
    return f"groups/{gid}/engine"


def group_prefix(gid: str) -> str:
    return f"groups/{gid}/"


def serving(gid: str) -> str:
    return f"groups/{gid}/serving"


def agent_prefix(gid: str) -> str:
    return f"groups/{gid}/agents/"


def agent(gid: str, rank: int) -> str:
    return f"groups/{gid}/agents/{rank:05d}"


def blob(gid: str, rank: int) -> str:
    return f"blobs/{gid}/{rank:05d}"


def mooncake_prefix(gid: str, engine_id: str = "") -> str:
    """A group's Mooncake workers, or one engine's (by engine: an open deletes the old
    engine's in the transaction that may write the new one's, and etcd refuses a
    transaction whose deletion and write overlap)."""
    return f"mooncake/{gid}/{engine_id}/" if engine_id else f"mooncake/{gid}/"


def mooncake(gid: str, engine_id: str, dp_rank: int, tp_rank: int, pp_rank: int) -> str:
    return f"{mooncake_prefix(gid, engine_id)}{dp_rank:05d}/{tp_rank:05d}/{pp_rank:05d}"


def dump(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()
