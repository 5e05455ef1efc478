"""TLS for every client of the registry: the worker library, the vLLM plugin, the CLI.

One frozen :class:`ClientTLS` holds the CA bundle to trust (default: the system trust store,
which ``SSL_CERT_FILE``/``SSL_CERT_DIR`` can point elsewhere) and an optional client
certificate and key (mutual TLS). Its paths are checked when it is made, its
``ssl.SSLContext`` is built once. Verification is never turned off: there is no option to.

A TLS failure is not weather: :func:`tls_failure` turns one into :class:`RegistryTLSError`,
which names the URL, what failed, and the setting that fixes it; the client raises it at once
instead of retrying until its deadline. Torch-free (the CLI imports it).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

from registry_client.errors import RegistryError

# The CA bundle, client certificate and key: of the worker library, and of the vLLM plugin.
VARS_OF_WORKERS = ("WORKERS_REGISTRY_CA", "WORKERS_REGISTRY_CERT", "WORKERS_REGISTRY_KEY")
VARS_OF_PLUGIN = ("ENGINE_REGISTRY_CA", "ENGINE_REGISTRY_CERT", "ENGINE_REGISTRY_KEY")


class TLSConfigError(ValueError):
    """A CA, certificate or key that cannot be used; the message names the setting."""


class RegistryTLSError(RegistryError):
    """The TLS handshake with a registry failed for a reason retrying cannot fix."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


# A file: a path as text or a path object; None (or empty) for none.
PathArg = str | os.PathLike[str] | None


@dataclass(frozen=True, init=False)
class ClientTLS:
    """CA bundle, client certificate and key for HTTPS registry URLs; names say how each is
    set (a variable or a flag), for error messages."""

    ca: Path | None
    cert: Path | None
    key: Path | None
    ca_name: str
    cert_name: str
    key_name: str

    def __init__(
        self,
        ca: PathArg = None,
        cert: PathArg = None,
        key: PathArg = None,
        ca_name: str = "WORKERS_REGISTRY_CA",
        cert_name: str = "WORKERS_REGISTRY_CERT",
        key_name: str = "WORKERS_REGISTRY_KEY",
    ) -> None:
        paths = [Path(p) if p is not None and os.fspath(p) else None for p in (ca, cert, key)]
        names = (ca_name, cert_name, key_name)
        fields = ("ca", "cert", "key", "ca_name", "cert_name", "key_name")
        for field_name, value in zip(fields, (*paths, *names), strict=True):
            object.__setattr__(self, field_name, value)  # frozen: set once, here
        if self.key is not None and self.cert is None:
            raise TLSConfigError(
                f"{self.key_name} is set but {self.cert_name} is not: a client key needs its "
                "certificate (PEM)"
            )
        for path, name in zip(paths, names, strict=True):
            _readable(path, name)

    @classmethod
    def from_env(
        cls,
        names: str | tuple[str, str, str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ClientTLS:
        """The CA, certificate and key named by these variables, or by a prefix
        (``"WORKERS_REGISTRY"``: ``WORKERS_REGISTRY_CA``, ``_CERT``, ``_KEY``; the default);
        unset or empty: none."""
        env = os.environ if environ is None else environ
        if isinstance(names, str):
            names = (f"{names}_CA", f"{names}_CERT", f"{names}_KEY")
        names = names or VARS_OF_WORKERS
        ca, cert, key = (v if (v := env.get(n, "").strip()) else None for n in names)
        return cls(ca, cert, key, *names)

    @cached_property
    def context(self) -> ssl.SSLContext:
        """Verifies the server against ``ca`` (else the system store) and its host name;
        presents ``cert`` when given. Built on first use, then reused."""
        if self.ca is None and self.cert is None:
            return system_context()
        try:
            context = ssl.create_default_context(cafile=self.ca)
        except ssl.SSLError as exc:
            raise TLSConfigError(
                f"{self.ca_name} {self.ca}: not a PEM CA bundle ({exc.reason or exc})"
            ) from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert is not None:
            try:
                context.load_cert_chain(self.cert, self.key)
            except ssl.SSLError as exc:
                raise TLSConfigError(
                    f"{self.cert_name} {self.cert} / {self.key_name} {self.key}: "
                    f"{exc.reason or exc}; give the PEM client certificate and its private key"
                ) from None
        return context

    def hint(self, failure: str) -> str:
        """What to change for a failure ``classify`` named."""
        if failure == "verify":
            return (
                f"set {self.ca_name} to the CA that signed the registry's certificate, or use "
                "the host name the certificate names"
            )
        if failure == "client_cert":
            return (
                f"the registry requires a client certificate signed by its client CA: set "
                f"{self.cert_name} and {self.key_name}"
            )
        if failure == "not_tls":
            return "the server does not speak TLS at that address: use http:// or the TLS port"
        return f"check {self.ca_name}, {self.cert_name} and {self.key_name}"


def _readable(path: Path | None, name: str) -> None:
    if path is None:
        return
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise TLSConfigError(f"{name} {path}: cannot read it ({exc.strerror})") from None


@cache
def system_context() -> ssl.SSLContext:
    """The system trust store, TLS >= 1.2, host names checked (one per process)."""
    context = ssl.create_default_context()
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


# OpenSSL reasons that mean the configuration is wrong, not that the network hiccuped.
_CLIENT_CERT = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED",
    "SSLV3_ALERT_BAD_CERTIFICATE",
    "TLSV1_ALERT_UNKNOWN_CA",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
    "TLSV1_ALERT_DECRYPT_ERROR",
    "SSLV3_ALERT_HANDSHAKE_FAILURE",
}
_NOT_TLS = {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"}
_PERMANENT = {"TLSV1_ALERT_PROTOCOL_VERSION", "UNSUPPORTED_PROTOCOL", "NO_PROTOCOLS_AVAILABLE"}


def classify(exc: BaseException) -> tuple[str, ssl.SSLError] | None:
    """("verify" | "client_cert" | "not_tls" | "protocol", the error) when ``exc`` or its
    causes hold a TLS error retrying cannot fix; None otherwise (EOF, reset: transient)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            return "verify", current
        if isinstance(current, ssl.SSLError) and not isinstance(
            current, ssl.SSLEOFError | ssl.SSLZeroReturnError | ssl.SSLSyscallError
        ):
            reason = current.reason or ""
            if reason in _CLIENT_CERT:
                return "client_cert", current
            if reason in _NOT_TLS:
                return "not_tls", current
            if reason in _PERMANENT:
                return "protocol", current
        current = current.__cause__ or current.__context__
    return None


def tls_failure(exc: BaseException, url: str, tls: ClientTLS) -> RegistryTLSError | None:
    """The permanent TLS error ``exc`` carries, as a message naming ``url`` and the fix."""
    found = classify(exc)
    if found is None:
        return None
    kind, error = found
    what = str(error.reason or error).lower().replace("_", " ")
    if isinstance(error, ssl.SSLCertVerificationError):
        what = f"certificate verify failed: {error.verify_message}"
    return RegistryTLSError(f"TLS with {url} failed: {what}; {tls.hint(kind)}", url=url)
