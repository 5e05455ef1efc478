"""A node's lease renewals over one long-lived WebSocket (the registry's ``GET /keepalive``,
etcd's LeaseKeepAlive), with the REST heartbeat as the way back.

``KeepAliveStream.renew`` sends one renewal, ``[group_id, engine_id, [rank, …]]``, and reads
its answer: the ranks' new expiries, or the error the REST heartbeat would raise (the same
``ProblemError`` subclass by ``code``: ``NotFound``, ``EngineIdMismatch``, ``Forbidden``, …).
It returns ``None`` when there is no stream to renew on, and the caller renews over REST:

- the registry refused the upgrade (an older registry: 403 or 404; streams off: 404; its
  limit reached: 503; a token it refuses: 401/403): the stream is tried again after
  ``retry_s`` (at least the answer's ``Retry-After``);
- the stream broke or did not answer within the renewal's deadline (a restart, a network
  cut): it is closed and opened again after a pause of the one back-off policy
  (``registry_client.backoff``: full jitter, doubling from 1 s up to ``cap_s``).

The stream reaches the replica the client last reached (``RegistryClient.url``) with the
client's own headers (its bearer token, its ``User-Agent``) and TLS context. Not thread-safe:
one keeper's heartbeat thread owns it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from registry_client.backoff import Backoff, retry_after
from registry_client.client import RegistryClient
from registry_client.errors import problem_class
from registry_client.models import RankExpiry

log = logging.getLogger(__name__)

PATH = "/keepalive"
RETRY_S = 600.0  # a registry that refused the stream is asked again this much later
CAP_S = 30.0  # a broken stream's back-off cap
# How the stream is opened (the fleet benchmark's stand-in, bench/fleet_stream.py, opens it so
# too). No pings of its own: a renewal every ttl/3 shows the stream alive, and each waits for
# its answer (a fleet of 12,500 nodes pinged 625 times a second). No proxy from the
# environment, as the REST client (trust_env=False).
OPTIONS: dict[str, Any] = {"compression": None, "proxy": None, "ping_interval": None}


def stream_url(http_url: str) -> str:
    """``http(s)://host:port[/prefix]`` -> ``ws(s)://host:port[/prefix]/keepalive``."""
    scheme, _, rest = http_url.partition("://")
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest.rstrip('/')}{PATH}"


class KeepAliveStream:
    def __init__(
        self,
        client: RegistryClient,
        *,
        retry_s: float = RETRY_S,
        cap_s: float = CAP_S,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        self.client = client
        self.retry_s = retry_s
        self.backoff = Backoff(base_s=min(1.0, cap_s), cap_s=cap_s)
        self.clock = clock
        self.log = logger or log
        self.ws: ClientConnection | None = None
        self.next_try = 0.0  # no stream before this (clock())
        self.refused: int | None = None  # the last upgrade's refusal status, if refused
        self.renewals = 0  # answered over the stream
        self.connects = 0

    def renew(
        self, group_id: str, engine_id: str, ranks: Sequence[int], timeout_s: float
    ) -> list[RankExpiry] | None:
        """The ranks' new expiries; ``None``: no stream now, renew over REST. Raises the
        registry's answer as the REST heartbeat would (``ProblemError`` subclasses)."""
        ws = self.ws or self._open(timeout_s)
        if ws is None:
            return None
        try:
            ws.send(json.dumps([group_id, engine_id, list(ranks)], separators=(",", ":")))
            answer: dict[str, Any] = json.loads(ws.recv(timeout=timeout_s))
            if "agents" in answer:
                expiries = [RankExpiry.from_json(a) for a in answer["agents"]]
            else:
                status = int(answer["status"])
        except Exception as exc:  # whatever breaks the stream, the heartbeat goes over REST
            self._broken(f"the stream broke ({exc!r})")
            return None
        if "agents" in answer:
            self.renewals += 1
            self.backoff.reset()
            return expiries
        raise problem_class(status, answer)(answer, status=status, url=stream_url(self.client.url))

    def _open(self, timeout_s: float) -> ClientConnection | None:
        if self.clock() < self.next_try:
            return None
        client = self.client
        url = stream_url(client.url)
        headers = {name.lower(): value for name, value in client.http.headers.items()}
        token = {k: v for k, v in headers.items() if k == "authorization"}
        try:
            self.ws = connect(
                url,
                additional_headers=token,
                user_agent_header=headers.get("user-agent"),
                ssl=client.tls.context if url.startswith("wss:") else None,
                open_timeout=min(timeout_s, client.connect_timeout_s + 1.0),
                close_timeout=2.0,
                legacy=True,  # a connection held across calls, not a context manager
                max_size=1 << 20,
                **OPTIONS,
            )
        except InvalidStatus as exc:
            response = exc.response
            self.refused = response.status_code
            after = retry_after(response.headers.get("Retry-After"))
            self.next_try = self.clock() + max(self.retry_s, after or 0.0)
            self.log.info(
                "%s refused the keep-alive stream (HTTP %d); renewing over REST, stream again "
                "in %.0f s",
                url,
                response.status_code,
                self.next_try - self.clock(),
            )
            return None
        except Exception as exc:  # unreachable, a broken handshake: REST, and again later
            self._broken(f"cannot open it ({exc!r})")
            return None
        self.refused = None
        self.connects += 1
        return self.ws

    def _broken(self, why: str) -> None:
        self.close()
        pause = self.backoff.next()
        self.next_try = self.clock() + pause
        self.log.warning(
            "keep-alive stream to %s: %s; renewing over REST, stream again in %.1f s",
            self.client.url,
            why,
            pause,
        )

    def close(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            ws.close()
