"""HTTPS for the service: the server's TLS context, and a uvloop loop that bounds handshakes.

Given ``--tls-cert`` and ``--tls-key`` the registry serves HTTPS only (TLS 1.2 or newer, ALPN
``http/1.1``); with ``--tls-client-ca`` too, every client must present a certificate that CA
signed, checked during the handshake (mutual TLS): a client without one never reaches the app.

The guarded protocol (``app.server.serve``) sees a TLS connection once its handshake is done, so
its header and body clocks and its connection limit apply to decrypted requests as to plain
ones. The handshake itself is bounded by ``header_timeout_s`` (asyncio's default is 60 s): a
connection that opens TCP and never completes TLS is closed as fast as one that never sends
its headers. A refused handshake sends its alert to the client before the connection closes
(see :class:`AlertingSSLProtocol`), so clients can tell "no client certificate" from weather.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from asyncio import selector_events, sslproto
from collections.abc import Callable
from pathlib import Path
from typing import Any


class TlsConfigError(ValueError):
    """The certificate, key or client CA cannot be used; the message names the file and fix."""


def _readable(path: Path, setting: str) -> None:
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise TlsConfigError(
            f"{setting} {path}: cannot read it ({exc.strerror}); give a readable PEM file"
        ) from None


def server_context(cert: Path, key: Path, client_ca: Path | None = None) -> ssl.SSLContext:
    """The server's context: TLS >= 1.2, the certificate chain and key, and (mutual TLS)
    client certificates required and verified against ``client_ca``."""
    _readable(cert, "REGISTRY_TLS_CERT (--tls-cert)")
    _readable(key, "REGISTRY_TLS_KEY (--tls-key)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise TlsConfigError(
            f"REGISTRY_TLS_CERT {cert} with REGISTRY_TLS_KEY {key}: {exc.reason or exc}; give "
            "the PEM certificate chain (the server's certificate first) and its private key"
        ) from None
    if client_ca is not None:
        _readable(client_ca, "REGISTRY_TLS_CLIENT_CA (--tls-client-ca)")
        try:
            context.load_verify_locations(cafile=client_ca)
        except ssl.SSLError as exc:
            raise TlsConfigError(
                f"REGISTRY_TLS_CLIENT_CA {client_ca}: {exc.reason or exc}; give a PEM bundle "
                "of the CA certificates that sign the clients' certificates"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class AlertingSSLProtocol(sslproto.SSLProtocol):
    """asyncio's TLS layer, sending the alert of a failed handshake before it closes.

    asyncio (and uvloop) close a connection whose handshake failed without writing the alert
    OpenSSL made: a client refused for want of a certificate sees the connection end, not why,
    and would retry. Flushed, the client reads ``certificate required`` or ``bad
    certificate`` and can say so.
    """

    def _on_handshake_complete(self, handshake_exc: BaseException | None) -> None:
        if handshake_exc is not None:
            with contextlib.suppress(Exception):
                alert = self._outgoing.read()  # type: ignore[attr-defined]
                if alert and isinstance(self._transport, asyncio.Transport):
                    self._transport.write(alert)
        super()._on_handshake_complete(handshake_exc)


def tls_loop_factory(handshake_timeout_s: float) -> Callable[[], asyncio.AbstractEventLoop]:
    """An event loop for the HTTPS server: asyncio's (uvloop's TLS layer cannot be taught to
    send its alerts), with :class:`AlertingSSLProtocol` and handshakes bounded."""

    class TlsEventLoop(asyncio.SelectorEventLoop):
        async def create_server(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("ssl") is not None:
                kwargs.setdefault("ssl_handshake_timeout", handshake_timeout_s)
            return await super().create_server(*args, **kwargs)

        def _make_ssl_transport(  # the same as asyncio's, with the alerting protocol
            self,
            rawsock: Any,
            protocol: Any,
            sslcontext: ssl.SSLContext,
            waiter: Any = None,
            *,
            server_side: bool = False,
            server_hostname: str | None = None,
            extra: Any = None,
            server: Any = None,
            ssl_handshake_timeout: float | None = None,
            ssl_shutdown_timeout: float | None = None,
        ) -> Any:
            ssl_protocol = AlertingSSLProtocol(
                self,
                protocol,
                sslcontext,
                waiter,
                server_side,
                server_hostname,
                ssl_handshake_timeout=ssl_handshake_timeout,  # type: ignore[arg-type]
                ssl_shutdown_timeout=ssl_shutdown_timeout,
            )
            selector_events._SelectorSocketTransport(  # type: ignore[attr-defined]
                self, rawsock, ssl_protocol, extra=extra, server=server
            )
            return ssl_protocol._app_transport

    return TlsEventLoop
