"""router-sync's sends: every offered instance to every vllm-router, each round.

vllm-router's discovery listener (a ZMQ ROUTER socket) takes one msgpack map per message,
one instance each; it has no batch form. So a round is one message per instance and router.
Sends never drop silently: each router's socket is polled for room and written until the
round's deadline (one ``--interval``), all routers at once. A router that did not take the
whole round in time (not connected, or slower than the round) is said so in one line, and its
next round starts with the instances this one did not reach, so every instance is announced
within a few rounds even then. ``ZMQ_IMMEDIATE``: nothing is queued for a router that is not
connected, so a restarted router never gets a stale list from before its restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("engine_registry.router_sync")

SEND_HWM = 1000  # messages queued a router (ZMQ's default); a round larger waits for room
ROUTER_EXPIRY_S = 5.0  # vllm-router forgets an instance not announced for this long


class VllmRouter:
    """One vllm-router's discovery address, fed over a ZMQ DEALER socket (it reconnects by
    itself when the router restarts)."""

    def __init__(self, address: str, context: Any) -> None:
        import zmq

        self.address = address
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IMMEDIATE, 1)
        self.socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.socket.connect(f"tcp://{address}")
        self.start = 0  # where the next round begins in the list (past a cut round)
        self.sent = 0
        self.cut = False  # the last round did not reach every instance (said once)

    def close(self) -> None:
        self.socket.close(0)


def announce(routers: Sequence[VllmRouter], messages: Sequence[bytes], deadline_s: float) -> None:
    """Send every router every message, all routers at once, for at most ``deadline_s``."""
    import zmq

    total = len(messages)
    poller = zmq.Poller()
    active: list[VllmRouter] = []
    for router in routers:
        router.sent = 0
        if router.start >= total:
            router.start = 0
        if total:
            active.append(router)
            poller.register(router.socket, zmq.POLLOUT)
    end = time.monotonic() + deadline_s
    while active:
        for router in list(active):
            while router.sent < total:
                message = messages[(router.start + router.sent) % total]
                try:
                    router.socket.send(message, zmq.NOBLOCK)
                except zmq.Again:  # its queue is full (or it is not connected): wait for room
                    break
                router.sent += 1
            if router.sent == total:
                active.remove(router)
                poller.unregister(router.socket)
        left = end - time.monotonic()
        if not active or left <= 0:
            break
        poller.poll(max(1, int(left * 1000)))
    for router in routers:
        _said(router, total, deadline_s)


def _said(router: VllmRouter, total: int, deadline_s: float) -> None:
    """One line when a router's rounds start being cut short, one when they are whole again."""
    if router.sent < total:
        router.start = (router.start + router.sent) % total
        if not router.cut:
            why = "not connected" if router.sent == 0 else "slower than the round"
            log.warning(
                "router-sync: vllm-router %s took %d of %d instances within the round's "
                "%.1f s (%s); each next round starts with those not reached, until it "
                "takes a whole round",
                router.address,
                router.sent,
                total,
                deadline_s,
                why,
            )
        router.cut = True
    elif router.cut:
        router.cut = False
        router.start = 0
        log.warning(
            "router-sync: vllm-router %s takes whole rounds again (%d instances)",
            router.address,
            total,
        )


__all__ = ["ROUTER_EXPIRY_S", "SEND_HWM", "VllmRouter", "announce"]
