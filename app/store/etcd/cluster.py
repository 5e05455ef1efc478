"""Calls to an etcd cluster: one deadline per call shared among the members, the preferred
first, failing over round after round; at most ``max_in_flight`` calls in flight. Whatever
goes wrong surfaces as :class:`Unavailable` (:class:`EtcdAccessError` when etcd refuses
this replica: TLS, user, password, permission), never as a hang."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aetcd
from aetcd import rpc

from app.store.base import TooLarge, Unavailable
from app.store.etcd.config import EtcdAccess
from app.store.etcd.conn import EtcdAccessError, EtcdAuthError, Member, Secrets, check_members

T = TypeVar("T")

_MIB = 1024 * 1024
# Agent metadata blobs reach a few MiB (the API's 4 MiB body limit); gRPC's default cap on a
# message is 4 MiB. The etcd side needs --max-request-bytes raised to match (see README).
_GRPC_OPTIONS: dict[str, Any] = {
    "grpc.max_send_message_length": 16 * _MIB,
    "grpc.max_receive_message_length": 16 * _MIB,
    # A restarted member is dialed again within a second, not after gRPC's 2-minute backoff.
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
    # Notice a silently dead peer (a partition, not a refused connection) on idle channels;
    # not below etcd's --grpc-keepalive-min-time (5 s) or it closes the connection.
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}


def _too_large(code: rpc.StatusCode, details: str) -> bool:
    """etcd refuses a request over its ``--max-request-bytes`` ("etcdserver: request is too
    large"), and gRPC one over that plus 512 KiB ("received message larger than max"): the
    same request can never pass, so it is not tried again."""
    text = details.lower()
    if code == rpc.StatusCode.INVALID_ARGUMENT:
        return "too large" in text
    return code == rpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in text


def _too_large_error(what: str, why: str) -> TooLarge:
    return TooLarge(
        f"etcd refused the {what} for its size ({why}): one etcd request holds at most "
        "etcd's --max-request-bytes (1.5 MiB unless its operator raised it), and this one "
        "is larger. Send a smaller metadata blob, or raise --max-request-bytes on every etcd "
        "member (docs/operations.md)."
    )


# Bounds the tries of one call (the deadline bounds its time).
_MAX_TRIES = 64


class Cluster:
    """The members of one etcd cluster as one store reaches them."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        tls: bool,
        access: EtcdAccess,
        timeout_s: float,
        max_in_flight: int,
    ) -> None:
        secrets = Secrets.read(access, tls)
        self.members = [
            Member(
                h,
                p,
                tls=tls,
                access=access,
                secrets=secrets,
                timeout_s=timeout_s,
                options=_GRPC_OPTIONS,
            )
            for h, p in endpoints
        ]
        self.preferred = 0
        self._timeout_s = timeout_s
        self._max_in_flight = max_in_flight
        self._slots = asyncio.Semaphore(max_in_flight)
        self._closed = False

    def index(self, client: aetcd.Client) -> int:
        """The member whose channel ``client`` is."""
        return [m.client for m in self.members].index(client)

    async def call(
        self, what: str, fn: Callable[[aetcd.Client, float], Awaitable[T]], slots: int = 1
    ) -> T:
        """Run ``fn(client, seconds)`` on the preferred endpoint, failing over to the others,
        round after round, all within ``timeout_s`` (a wait for one of the ``max_in_flight``
        slots included). A member that answers at once with an error (no leader yet, leader
        changed, connection refused) costs a try, not the deadline: elections last about a
        second, so rounds go on with a short pause until it passes.

        ``fn`` must be safe to repeat: an attempt that timed out may have been applied (a
        repeated compare-and-set then loses, and its caller re-reads)."""
        if self._closed:
            raise Unavailable("The etcd store is closed (the service is shutting down).")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        n = len(self.members)
        try:
            async with asyncio.timeout_at(deadline):
                if slots:  # the liveness probe takes none: it must not queue behind a storm
                    await self._slots.acquire()
        except TimeoutError:
            busy = f"all {self._max_in_flight} calls this replica may have in flight stayed busy"
            raise self._unavailable(what, [busy]) from None
        failures: list[str] = []
        refused: dict[int, str] = {}  # members that refuse this replica (TLS, auth)
        start = self.preferred
        try:
            for attempt in range(_MAX_TRIES):
                if attempt and attempt % n == 0:  # every endpoint failed this round
                    pause = min(0.05 * (attempt // n), 0.25, deadline - loop.time())
                    await asyncio.sleep(max(0.0, pause))
                # A fair share of the time left for each endpoint not yet tried this round.
                budget = (deadline - loop.time()) / (n - attempt % n)
                if budget <= 0:
                    break
                index = (start + attempt) % n
                where = self.members[index].where
                try:
                    # The deadline travels with the RPC (gRPC's own): it bounds etcd's answer,
                    # not the turns this process takes to read an answer that came in time.
                    # One channel per member for the store's life.
                    return await self.members[index].call(fn, budget)
                except EtcdAuthError:
                    raise  # a wrong password or a missing role: every member says the same
                except EtcdAccessError as exc:
                    refused[index] = exc.detail
                    if len(refused) == n:  # every member refuses: waiting will not help
                        raise EtcdAccessError("; ".join(refused.values())) from None
                    failures.append(exc.detail)
                except TimeoutError:
                    failures.append(f"{where}: no answer within {budget:.1f} s")
                except rpc.AioRpcError as exc:
                    if _too_large(exc.code(), exc.details() or ""):
                        raise _too_large_error(what, exc.details()) from exc
                    if exc.code() == rpc.StatusCode.INVALID_ARGUMENT:
                        raise self._refused(what, exc.details()) from exc
                    if exc.code() == rpc.StatusCode.DEADLINE_EXCEEDED:
                        failures.append(f"{where}: no answer within {budget:.1f} s")
                    else:
                        failures.append(f"{where}: {exc.code().name} {exc.details()}")
                except aetcd.InvalidArgumentError as exc:
                    if _too_large(rpc.StatusCode.INVALID_ARGUMENT, str(exc)):
                        raise _too_large_error(what, str(exc)) from exc
                    raise self._refused(what, str(exc)) from exc
                except (aetcd.ClientError, OSError) as exc:
                    failures.append(f"{where}: {exc!r}")
                if self.preferred == index:
                    self.preferred = (index + 1) % n
        finally:
            if slots:
                self._slots.release()
        raise self._unavailable(what, failures[-n:], len(failures))

    def _unavailable(self, what: str, last: list[str], tries: int = 0) -> Unavailable:
        return Unavailable(
            f"etcd did not answer the {what} within {self._timeout_s:g} s ({tries} tries; "
            f"last: {'; '.join(last) or 'no time left'}). Check that a majority of the etcd "
            "members is up and reachable from this replica, and that etcd keeps up (its disk "
            "and CPU)."
        )

    @staticmethod
    def _refused(what: str, why: str) -> Unavailable:
        return Unavailable(
            f"etcd refused the {what}: {why}. If it says the request is too large, raise "
            "etcd's --max-request-bytes above the largest agent metadata blob."
        )

    async def start(self, key: bytes) -> None:
        """Reach etcd once: a member that refuses this replica (wrong CA, no client
        certificate, wrong password, TLS spoken to a plain etcd or the reverse) stops the
        start with the cause and its fix; etcd merely down does not (calls answer 503)."""
        await check_members(self.members, key, min(self._timeout_s, 5.0))

    async def close(self) -> None:
        self._closed = True
        for member in self.members:
            with contextlib.suppress(Exception):
                await member.close()
