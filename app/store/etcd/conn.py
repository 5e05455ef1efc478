"""Reaching etcd members: one gRPC channel per member (TLS for ``etcds://``), the auth token
its calls carry, and failures turned into their cause and fix.

- TLS: the CA that signed etcd's certificate (``REGISTRY_ETCD_CA``; the system's CAs when not
  given) and, for etcd's ``--client-cert-auth``, a client certificate and key.
- Auth: the user and password are exchanged for a token per member (``Authenticate``); every
  call carries it (gRPC call credentials, so streams too). etcd drops a token unused for
  ``--auth-token-ttl`` (or on a restart): a call refused with "invalid auth token" makes the
  member authenticate again, once for all the calls that saw it, and the call is repeated, as
  etcd's own clients do. Watch streams opened with the old token are closed then (their
  waiters re-read) since etcd checks a stream's token when a watch is added to it.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aetcd
import grpc  # type: ignore[import-untyped]
from aetcd import rpc, watcher

from app.store.base import Unavailable
from app.store.etcd.config import EtcdAccess

log = logging.getLogger("app.store")
T = TypeVar("T")


class EtcdAccessError(Unavailable):
    """etcd refuses this replica (TLS, user, password, permissions): a configuration problem
    that waiting does not fix. It stops the start; later, calls answer 503 with it."""


class EtcdAuthError(EtcdAccessError):
    """A refusal every member would give alike (a wrong password, a missing role)."""


class _Token(grpc.AuthMetadataPlugin):  # type: ignore[misc]
    """The member's current auth token, added to every call but ``Authenticate``."""

    def __init__(self) -> None:
        self.value: str | None = None

    def __call__(self, context: Any, callback: Any) -> None:
        token = self.value
        if token is None or str(context.method_name).endswith("Authenticate"):
            callback((), None)
        else:
            callback((("token", token),), None)


class _Client(aetcd.Client):  # type: ignore[misc]
    """aetcd's client on a channel built here (aetcd itself dials plain gRPC only)."""

    def __init__(
        self, host: str, port: int, credentials: Any, timeout: float, options: dict[str, Any]
    ) -> None:
        super().__init__(host, port, timeout=timeout, options=options)
        self._credentials = credentials

    async def connect(self) -> None:
        if getattr(self, "kvstub", None) is not None:
            return
        target = f"{self._host}:{self._port}"
        options = list(self._options.items())
        if self._credentials is None:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        else:
            self.channel = grpc.aio.secure_channel(target, self._credentials, options=options)
        self.kvstub = rpc.KVStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout)
        self._connected.set()

    async def renew_watcher(self) -> None:
        """Close the watch stream (its watches end); the next watch opens a new one."""
        old, self._watcher = (
            self._watcher,
            watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout),
        )
        if old is not None:
            await old.shutdown()


@dataclass(frozen=True)
class Secrets:
    """What ``EtcdAccess`` names, read from its files once for every member."""

    ca: bytes | None = None
    key: bytes | None = None
    cert: bytes | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def read(cls, access: EtcdAccess, tls: bool) -> Secrets:
        if access.user and not tls:
            raise ValueError("An etcd user needs TLS (etcds://): its token would cross in clear")
        password = access.read_password() if access.user else None
        if not tls:
            return cls(password=password)
        return cls(access.read_ca(), access.read_key(), access.read_cert(), password)


class Member:
    """One etcd member as this store reaches it."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        tls: bool,
        access: EtcdAccess,
        secrets: Secrets,
        timeout_s: float,
        options: dict[str, Any],
    ) -> None:
        self.where = f"{host}:{port}"
        self._tls = tls
        self._access = access
        self._user = access.user
        self._password = secrets.password
        self._token = _Token()
        credentials = None
        if tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=secrets.ca,
                private_key=secrets.key,
                certificate_chain=secrets.cert,
            )
            if self._user:
                calls = grpc.metadata_call_credentials(self._token, name="etcd-token")
                credentials = grpc.composite_channel_credentials(credentials, calls)
        self._client: _Client | None = None
        self._dial: tuple[str, int, Any, float, dict[str, Any]] = (
            host,
            port,
            credentials,
            timeout_s,
            options,
        )
        self._authenticated = False
        self._auth_lock = asyncio.Lock()

    @property
    def client(self) -> aetcd.Client | None:
        return self._client

    async def call(self, fn: Callable[[aetcd.Client, float], Awaitable[T]], seconds: float) -> T:
        """``fn(client, seconds)`` on this member, authenticated; a stale token is renewed
        once and the call repeated, within ``seconds``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        client = await self._connect(seconds)
        token = self._token.value
        try:
            return await fn(client, seconds)
        except rpc.AioRpcError as exc:
            if not (self._user and _stale_token(exc)):
                raise self.refusal(exc) or exc from None
        await self._authenticate(client, deadline - loop.time(), stale=token)
        try:
            return await fn(client, max(0.0, deadline - loop.time()))
        except rpc.AioRpcError as exc:
            raise self.refusal(exc) or exc from None

    async def _connect(self, seconds: float) -> _Client:
        if self._client is None:
            self._client = _Client(*self._dial)
        await self._client.connect()  # builds the channel and stubs; dials lazily
        if self._user and not self._authenticated:
            await self._authenticate(self._client, seconds, stale=None)
        return self._client

    async def _authenticate(self, client: _Client, seconds: float, stale: str | None) -> None:
        async with self._auth_lock:
            if self._authenticated and self._token.value != stale:
                return  # another call renewed it meanwhile
            request = rpc.AuthenticateRequest(name=self._user, password=self._password)
            try:
                reply = await rpc.AuthStub(client.channel).Authenticate(
                    request, timeout=max(0.0, seconds)
                )
            except rpc.AioRpcError as exc:
                if "authentication is not enabled" in (exc.details() or ""):
                    log.warning(
                        "etcd has authentication disabled: REGISTRY_ETCD_USER is not used",
                        extra={"etcd": self.where, "user": self._user},
                    )
                    self._authenticated = True
                    return
                raise self.refusal(exc) or exc from None
            renewed = self._token.value is not None
            self._token.value = str(reply.token)
            self._authenticated = True
            if renewed:  # streams opened with the old token cannot add watches any more
                await client.renew_watcher()
                log.info("etcd auth token renewed", extra={"etcd": self.where})

    def refusal(self, exc: rpc.AioRpcError) -> EtcdAccessError | None:
        """The access problem ``exc`` reports (TLS, user, password, permission), with its
        cause and fix; None when it is not one (etcd down, slow, electing)."""
        why = exc.details() or ""
        if "authentication failed" in why:
            return EtcdAuthError(
                f"etcd refused user {self._user}: authentication failed (etcd at {self.where}: "
                f"{why}); check {self._access.password_source}"
            )
        if exc.code() == rpc.StatusCode.PERMISSION_DENIED:
            who = f"user {self._user}" if self._user else "this client (its certificate's CN)"
            return EtcdAuthError(
                f"etcd at {self.where} denied {who} access to the store's keys ({why}): grant "
                "the user a role with readwrite on the store's prefix (etcdctl role "
                "grant-permission ROLE --prefix=true readwrite /PREFIX/), see docs/deployment.md"
            )
        if "user name is empty" in why or "invalid auth token" in why:
            return EtcdAccessError(
                f"etcd at {self.where} requires authentication ({why}): set REGISTRY_ETCD_USER "
                "and REGISTRY_ETCD_PASSWORD_FILE, or a client certificate whose CN is an etcd "
                "user (REGISTRY_ETCD_CERT, REGISTRY_ETCD_KEY)"
            )
        return self._transport_refusal(why)

    def _transport_refusal(self, why: str) -> EtcdAccessError | None:
        if "CERTIFICATE_VERIFY_FAILED" in why:
            reason = why.split("CERTIFICATE_VERIFY_FAILED:", 1)[-1].split(":")[0].strip()
            trust = (
                f"REGISTRY_ETCD_CA={self._access.ca} did not sign it"
                if self._access.ca
                else "no REGISTRY_ETCD_CA given: the system's CAs were used"
            )
            return EtcdAccessError(
                f"TLS handshake with etcd at {self.where} failed: certificate verify failed "
                f"({reason}; {trust}); set REGISTRY_ETCD_CA to the CA that signed etcd's "
                "certificate"
            )
        if "not in peer certificate" in why or "hostname" in why.lower():
            return EtcdAccessError(
                f"TLS handshake with etcd at {self.where} failed: etcd's certificate does not "
                f"name this host ({why}); reach etcd by a name its certificate lists, or add "
                "this one to its certificate's subject alternative names"
            )
        if self._tls and any(s in why for s in _CLIENT_CERT_REFUSED):
            mine = f"REGISTRY_ETCD_CERT={self._access.cert}" if self._access.cert else "none"
            return EtcdAccessError(
                f"etcd at {self.where} refused this client's TLS certificate ({mine}; {why}): "
                "etcd runs with --client-cert-auth; set REGISTRY_ETCD_CERT and "
                "REGISTRY_ETCD_KEY to a certificate signed by a CA in etcd's --trusted-ca-file"
            )
        return None

    async def check(self, key: bytes, seconds: float) -> tuple[str, bool] | None:
        """One linearizable read of ``key``: None when it answers, else (what failed, whether
        it is an access problem rather than etcd being down)."""
        request = rpc.RangeRequest(key=key)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        problem = f"{self.where}: no answer within {seconds:g} s"
        for _ in range(50):  # a connection lost in the handshake, a leader being elected
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                await self.call(lambda c, t: c.kvstub.Range(request, timeout=t), left)
                return None
            except EtcdAccessError as exc:
                return exc.detail, True
            except rpc.AioRpcError as exc:
                why = exc.details() or ""
                problem = f"{self.where}: {exc.code().name} {why}"
                if "closed" in why or "closing" in why:  # in the handshake: TLS mismatch?
                    mismatch = await self._tls_mismatch(why, deadline - loop.time())
                    if mismatch:
                        return mismatch, True
            except (aetcd.ClientError, OSError, TimeoutError) as exc:
                problem = f"{self.where}: {exc!r}"
            await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))
        return problem, False

    async def _tls_mismatch(self, why: str, seconds: float) -> str | None:
        """When the member hung up in the handshake, whether it speaks TLS and this store
        does not, or the reverse (one TLS handshake, nothing verified, nothing sent)."""
        host, port = self.where.rsplit(":", 1)
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        try:
            async with asyncio.timeout(max(0.1, min(seconds, 2.0))):
                _, writer = await asyncio.open_connection(host.strip("[]"), int(port), ssl=context)
            writer.close()
            speaks_tls = True
        except (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError):
            speaks_tls = False
        except (TimeoutError, OSError):
            return None  # no answer either way: etcd is down, not misconfigured
        if speaks_tls and not self._tls:
            return (
                f"etcd at {self.where} closed the connection during the handshake ({why}): it "
                "serves TLS (https:// client URLs), so write the store as etcds://… and set "
                "REGISTRY_ETCD_CA (and REGISTRY_ETCD_CERT/KEY for --client-cert-auth)"
            )
        if self._tls and not speaks_tls:
            return (
                f"TLS handshake with etcd at {self.where} failed ({why}): etcd does not serve "
                "TLS there (http:// client URLs); write the store as etcd://… or give etcd "
                "--cert-file/--key-file and https:// client URLs"
            )
        return None

    async def close(self) -> None:
        client, self._client = self._client, None
        self._authenticated = False
        if client is not None:
            await asyncio.wait_for(client.close(), 2.0)


_CLIENT_CERT_REFUSED = (
    "Unwrap failed",
    "BAD_CERTIFICATE",
    "CERTIFICATE_REQUIRED",
    "certificate required",
    "UNKNOWN_CA",
)


def _stale_token(exc: rpc.AioRpcError) -> bool:
    why = exc.details() or ""
    return "invalid auth token" in why or "revision of auth store is old" in why


async def check_members(members: Sequence[Member], key: bytes, seconds: float) -> None:
    """At start: read ``key`` from the members until one answers. If none does and any refused this
    replica (TLS, user, password, permission), raise that, naming cause and fix; members
    merely down are logged and left to the calls (503 until etcd is back)."""
    tasks = [asyncio.create_task(m.check(key, seconds)) for m in members]
    problems: list[tuple[str, bool]] = []
    try:
        for next_done in asyncio.as_completed(tasks):
            problem = await next_done
            if problem is None:
                return
            problems.append(problem)
    finally:
        for task in tasks:
            task.cancel()
    refused = [what for what, access in problems if access]
    if refused:
        raise EtcdAccessError("; ".join(refused))
    log.warning(
        "etcd does not answer yet; calls answer 503 until it does",
        extra={"problems": "; ".join(what for what, _ in problems)},
    )
