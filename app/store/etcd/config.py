"""The etcd store's configuration, checked without its client library: the URL
(``etcd://`` plain, ``etcds://`` TLS: ``host:port[,host:port…]/prefix``) and the credentials
(a CA, a client certificate and key, a user and password), read from the files the settings
name. Credentials never travel in the URL: one with ``user:password@`` is refused, and every
message shows the URL with them masked."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

SCHEMES = ("etcd", "etcds")
DEFAULT_PREFIX = "engine-registry"
_EXAMPLE = "etcd://127.0.0.1:2379,127.0.0.1:22379/registry (etcds:// for TLS)"
_USERINFO = re.compile(r"^([a-z][a-z0-9+.-]*://)[^/@]*@", re.IGNORECASE)


def redact(url: str) -> str:
    """The URL with any ``user:password@`` masked, for messages and logs."""
    return _USERINFO.sub(r"\1***@", url)


@dataclass(frozen=True)
class EtcdUrl:
    endpoints: list[tuple[str, int]]
    prefix: str
    tls: bool

    @property
    def scheme(self) -> str:
        return "etcds" if self.tls else "etcd"

    def describe(self) -> str:
        """For logs, /readyz and status: no credentials are ever part of it."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"{self.scheme}://{hosts}/{self.prefix}"


def parse_url(url: str) -> EtcdUrl:
    """``etcd[s]://h:p[,h:p…]/prefix``; the prefix defaults to ``engine-registry``."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"Not an etcd store URL: {redact(url)!r}: expected {_EXAMPLE}")
    hosts, _, prefix = rest.partition("/")
    if "@" in hosts:
        raise ValueError(
            f"Credentials in the etcd store URL {redact(url)!r} are not accepted (URLs end up "
            "in logs): give the user with REGISTRY_ETCD_USER and its password with "
            "REGISTRY_ETCD_PASSWORD_FILE"
        )
    endpoints: list[tuple[str, int]] = []
    for part in filter(None, (h.strip() for h in hosts.split(","))):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"Bad etcd endpoint {part!r} in {url!r}: expected host:port, e.g. {_EXAMPLE}"
            )
        endpoints.append((host, int(port)))  # an IPv6 host keeps its brackets for gRPC
    if not endpoints:
        raise ValueError(f"No etcd endpoint in {url!r}: expected {scheme}://host:port/prefix")
    return EtcdUrl(endpoints, prefix.strip("/") or DEFAULT_PREFIX, scheme == "etcds")


@dataclass(frozen=True)
class EtcdAccess:
    """How the store proves itself to etcd and checks etcd: file paths and a user (the
    password inline or in a file). Empty by default: plain, unauthenticated etcd."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    password_file: Path | None = None

    def given(self) -> list[str]:
        """The settings given, by variable name."""
        names = ["ca", "cert", "key", "user", "password", "password_file"]
        return [f"REGISTRY_ETCD_{n.upper()}" for n in names if getattr(self, n) is not None]

    @property
    def password_source(self) -> str:
        return "REGISTRY_ETCD_PASSWORD_FILE" if self.password_file else "REGISTRY_ETCD_PASSWORD"

    def read_ca(self) -> bytes | None:
        return _read_pem(self.ca, "REGISTRY_ETCD_CA", "CERTIFICATE") if self.ca else None

    def read_cert(self) -> bytes | None:
        return _read_pem(self.cert, "REGISTRY_ETCD_CERT", "CERTIFICATE") if self.cert else None

    def read_key(self) -> bytes | None:
        return _read_pem(self.key, "REGISTRY_ETCD_KEY", "PRIVATE KEY") if self.key else None

    def read_password(self) -> str | None:
        if self.password_file is None:
            return self.password
        text = _read(self.password_file, "REGISTRY_ETCD_PASSWORD_FILE").decode().rstrip("\r\n")
        if not text:
            raise ValueError(
                f"REGISTRY_ETCD_PASSWORD_FILE={self.password_file} is empty: write the etcd "
                "user's password in it"
            )
        return text

    def check(self, url: str) -> None:
        """Refuse, naming the settings, what cannot work with the store ``url``: TLS files
        or a user with a store that is not ``etcds://``, half a key pair, a user without a
        password, unreadable files. Reads every file once, so a bad one stops the start."""
        given = self.given()
        if not given:
            return
        scheme = url.partition("://")[0]
        names, one = ", ".join(given), len(given) == 1
        if scheme not in SCHEMES:
            raise ValueError(
                f"{names} {'applies' if one else 'apply'} to an etcd store, but the store is "
                f"{redact(url)!r}: unset {'it' if one else 'them'} or use an etcds:// store"
            )
        if scheme == "etcd":
            raise ValueError(
                f"{names} {'needs' if one else 'need'} an etcds:// store (TLS): over etcd:// the "
                "certificates are unused and a password or its token would cross the network "
                "in clear text. Write the store as etcds://…"
            )
        if (self.cert is None) != (self.key is None):
            raise ValueError(
                "REGISTRY_ETCD_CERT and REGISTRY_ETCD_KEY go together (the client certificate "
                "and its private key): give both or neither"
            )
        if self.password is not None and self.password_file is not None:
            raise ValueError(
                "Give the etcd password once: REGISTRY_ETCD_PASSWORD_FILE or "
                "REGISTRY_ETCD_PASSWORD, not both"
            )
        has_password = self.password is not None or self.password_file is not None
        if has_password and not self.user:
            raise ValueError("An etcd password was given without REGISTRY_ETCD_USER: name the user")
        if self.user and not has_password:
            raise ValueError(
                f"REGISTRY_ETCD_USER={self.user} has no password: put it in a file named by "
                "REGISTRY_ETCD_PASSWORD_FILE (or in REGISTRY_ETCD_PASSWORD)"
            )
        self.read_ca()
        self.read_cert()
        self.read_key()
        self.read_password()


def _read(path: Path, variable: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{variable}={path} cannot be read: {exc.strerror or exc}") from None


def _read_pem(path: Path, variable: str, kind: str) -> bytes:
    data = _read(path, variable)
    if f"{kind}-----".encode() not in data:
        raise ValueError(f"{variable}={path} holds no PEM {kind.lower()} (-----BEGIN …{kind}-----)")
    return data
