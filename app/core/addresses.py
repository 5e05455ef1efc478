"""Addresses clients publish (an agent's ``host``, an instance's serving ``url`` and
``bootstrap``), validated and normalized: what is stored is the normalized text that was
validated, never the raw string (``urlsplit`` silently drops tabs and newlines, so a check
of its copy says nothing about the text kept).

Refused everywhere: control and other non-printable characters, non-ASCII text in an
address, credentials in a URL, unspecified addresses (``0.0.0.0``, ``::`` and their
IPv4-mapped and IPv4-compatible forms), a missing or zero port, digits other than ASCII
``0-9`` in a port. Errors are ``ValueError`` whose message shows the value quoted (repr) and
cut to a few dozen characters.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from urllib.parse import urlsplit

from app.core.budgets import clip

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_HOSTNAME = re.compile(
    r"(?=.{1,253}\Z)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
    r"(\.([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?))*\.?"
)
_PORT = re.compile(r"[0-9]{1,5}")
# A path as RFC 3986 allows it unencoded (pchar and "/"): no {}<>|^`\ or quotes.
_PATH = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@%/]*")


def printable(value: str, what: str) -> str:
    """``value`` when every character is printable (``str.isprintable``: no C0/C1 controls,
    no line or paragraph separators, no format characters such as bidi overrides)."""
    if not value.isprintable():
        raise ValueError(
            f"{what} {clip(value, 64)!r} contains control or other non-printable characters"
        )
    return value


@functools.lru_cache(maxsize=4096)
def parse_host(value: str) -> IPAddress | None:
    """The host as an IP address, None for a DNS name; ValueError when it is neither.
    Cached: a fleet has few hosts, each registering all its ranks (a ValueError is not
    cached and costs the parse again)."""
    if not value.isascii() or not value.isprintable():
        raise ValueError(f"host {clip(value, 64)!r} is neither an IP address nor a DNS name")
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        if _HOSTNAME.fullmatch(value) and not value.replace(".", "").isdigit():
            return None
        raise ValueError(
            f"host {clip(value, 64)!r} is neither an IP address nor a DNS name"
        ) from None


def unspecified(address: IPAddress | None) -> bool:
    """The wildcard a server binds, in any spelling: ``0.0.0.0``, ``::``, ``::ffff:0.0.0.0``."""
    if address is None:
        return False
    if address.is_unspecified:
        return True
    return isinstance(address, ipaddress.IPv6Address) and (
        address.ipv4_mapped is not None and address.ipv4_mapped.is_unspecified
    )


def _port(text: str, what: str, value: str) -> int:
    if not _PORT.fullmatch(text) or not 0 < int(text) < 65536:
        raise ValueError(f"{what} {clip(value, 64)!r} has no port in 1-65535")
    return int(text)


def _host_text(address: IPAddress | None, host: str) -> str:
    """The host as stored: an IP address in its canonical form (IPv6 compressed), a DNS
    name in lower case without a trailing dot."""
    if address is None:
        return host.lower().rstrip(".")
    return str(address)


def serving_url(value: str) -> str:
    """An instance's ``http(s)://host:port[/path]`` (``grpc://host:port``: vLLM's gRPC
    entrypoint, for smg), normalized: scheme and DNS name in lower case, an IP address
    canonical, IPv6 in brackets, the port explicit, no trailing slash."""
    what = "url"
    if not value.isascii() or not value.isprintable() or " " in value:
        raise ValueError(
            f"{what} {clip(value, 64)!r} contains control, space or non-ASCII characters"
        )
    parts = urlsplit(value)
    if parts.scheme.lower() not in ("http", "https", "grpc") or not parts.netloc:
        raise ValueError(
            f"url {clip(value, 64)!r} is not http(s)|grpc://host:port (the address a router "
            "reaches the instance's API at, with its port)"
        )
    if "@" in parts.netloc:
        raise ValueError(
            f"url {clip(value, 64)!r} carries credentials (user@ or user:password@): every "
            "reader of the registry would see them; publish the bare address"
        )
    if parts.query or parts.fragment or "?" in value or "#" in value:
        raise ValueError(f"url {clip(value, 64)!r} has a query or fragment: publish the base URL")
    netloc = parts.netloc
    if netloc.startswith("["):
        host, sep, port = netloc[1:].partition("]:")
    else:
        host, sep, port = netloc.rpartition(":")
    if not sep or not host:
        raise ValueError(
            f"url {clip(value, 64)!r} is not http(s)|grpc://host:port (the address a router "
            "reaches the instance's API at, with its port)"
        )
    number = _port(port, what, value)
    address = parse_host(host)
    if netloc.startswith("[") != isinstance(address, ipaddress.IPv6Address):
        raise ValueError(f"url {clip(value, 64)!r}: an IPv6 address goes in brackets, only it")
    if unspecified(address):
        raise ValueError(
            f"url {clip(value, 64)!r} names an unspecified host: advertise the address a "
            "router reaches (ENGINE_REGISTRY_ADVERTISE_URL), not the wildcard it binds"
        )
    path = parts.path.rstrip("/")
    if path and (parts.scheme.lower() == "grpc" or not _PATH.fullmatch(path)):
        raise ValueError(
            f"url {clip(value, 64)!r}: a path is http(s) only, of characters RFC 3986 allows "
            "(percent-encode others); grpc:// is grpc://host:port"
        )
    shown = _host_text(address, host)
    if isinstance(address, ipaddress.IPv6Address):
        shown = f"[{shown}]"
    return f"{parts.scheme.lower()}://{shown}:{number}{path}"


def bootstrap_address(value: str) -> str:
    """A side channel's ``host:port`` (IPv6 bare or in brackets), normalized as
    `serving_url`'s host; a bracketed IPv6 address keeps its brackets."""
    what = "bootstrap"
    if not value.isascii() or not value.isprintable() or " " in value:
        raise ValueError(
            f"{what} {clip(value, 64)!r} contains control, space or non-ASCII characters"
        )
    bracketed = value.startswith("[")
    if bracketed:
        host, sep, port = value[1:].partition("]:")
    else:
        host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"bootstrap {clip(value, 64)!r} is not host:port")
    number = _port(port, what, value)
    try:
        address = parse_host(host)
    except ValueError:
        raise ValueError(f"bootstrap {clip(value, 64)!r} is not host:port") from None
    if bracketed and not isinstance(address, ipaddress.IPv6Address):
        raise ValueError(f"bootstrap {clip(value, 64)!r}: only an IPv6 address goes in brackets")
    if unspecified(address):
        raise ValueError(
            f"bootstrap {clip(value, 64)!r} names an unspecified host: advertise an address "
            "peers reach, not the wildcard a side channel binds"
        )
    shown = _host_text(address, host)
    return f"[{shown}]:{number}" if bracketed else f"{shown}:{number}"
