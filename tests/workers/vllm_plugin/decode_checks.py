"""What the real-vLLM tier checks on a decode instance that uses the registry: its log lines,
its ``/metrics`` (the plugin's series and vLLM's NIXL ones), the registry's handshake events."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx

from registry_client.client import RegistryClient
from workers.tools.vllm_launch import Instance

REGISTRY_HANDSHAKE = re.compile(
    r"engine-registry: handshake with engine (\S+) \(group .*loaded from the registry in "
    r"([0-9.]+) s, clock offset (-?[0-9.]+) s"
)
CONNECTOR_ID = re.compile(r"Creating v1 connector with name: \w+ and engine_id: (\S+)")
SIDE_CHANNEL_HANDSHAKE = re.compile(
    r"engine-registry: handshake with engine (\S+) over vLLM's side channel \S+ in ([0-9.]+) s"
)


def metric(url: str, name: str, labels: str = "", timeout_s: float = 60.0) -> float:
    """One series of an instance's ``/metrics`` (0 when absent); ``labels`` as printed,
    e.g. ``path="registry"``."""
    text = httpx.get(f"{url}/metrics", timeout=timeout_s, trust_env=False).text
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def logged(instance: Instance, text: str, limit_s: float, since: int = 0) -> float:
    """Seconds until ``text`` is in the instance's log (after its first ``since`` characters);
    fails with its tail past ``limit_s``."""
    t0 = time.monotonic()
    while text not in instance.log_text()[since:]:
        if time.monotonic() - t0 > limit_s:
            raise AssertionError(f"{text!r} not logged within {limit_s} s:\n{instance.tails()}")
        time.sleep(0.25)
    return time.monotonic() - t0


def handshake_seconds(instance: Instance, engine_id: str) -> tuple[str, float, float | None]:
    """How decode handshaked with ``engine_id``: ("registry" | "side channel", seconds, the
    clock offset it derived or None)."""
    for line in instance.log_text().splitlines():
        found = REGISTRY_HANDSHAKE.search(line)
        if found and found.group(1) == engine_id:
            return "registry", float(found.group(2)), float(found.group(3))
        side = SIDE_CHANNEL_HANDSHAKE.search(line)
        if side and side.group(1) == engine_id:
            return "side channel", float(side.group(2)), None
    raise AssertionError(f"no handshake with {engine_id} logged:\n{instance.tails()}")


def handshake_event(client: RegistryClient, prefill_group: str, engine_id: str) -> dict[str, Any]:
    """The registry's handshake event of ``engine_id`` (events are written about once a
    second: waited for)."""
    deadline = time.monotonic() + 10
    while True:
        events = client.request("GET", "/events", params={"limit": 1000}).json()["events"]
        for event in events:
            fields = event.get("fields") or {}
            if (
                event["kind"] == "handshake"
                and event["group_id"] == prefill_group
                and fields.get("engine_id") == engine_id
            ):
                return dict(event)
        if time.monotonic() > deadline:
            raise AssertionError(f"no handshake event for {engine_id}: {events[-5:]}")
        time.sleep(0.5)


def connector_ids(instance: Instance) -> list[set[str]]:
    """Per node, the engine_ids vLLM's workers/scheduler logged when making a connector."""
    return [set(CONNECTOR_ID.findall(text)) for text in instance.logs()]


def kv_request(line: str) -> str:
    """The request id a KV-pull watch line names."""
    return line.split(" for request ", 1)[1].split(" ", 1)[0]
