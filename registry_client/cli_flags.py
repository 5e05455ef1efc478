"""The flags every client command shares (``status``, ``probe``, ``router-sync``): the registry's
URL and the TLS files, read as a ``ClientTLS``; an unreachable registry said with the fix."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import httpx

from registry_client.tls import ClientTLS, tls_failure

DEFAULT_URL = "http://127.0.0.1:8080"


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ca",
        default=os.environ.get("REGISTRY_CA") or os.environ.get("ENGINE_REGISTRY_CA") or None,
        help="PEM CA bundle that signed an https:// registry's certificate "
        "(REGISTRY_CA, ENGINE_REGISTRY_CA; default: the system trust store)",
    )
    parser.add_argument(
        "--cert",
        default=os.environ.get("REGISTRY_CERT") or os.environ.get("ENGINE_REGISTRY_CERT") or None,
        help="PEM client certificate, for a registry with mutual TLS "
        "(REGISTRY_CERT, ENGINE_REGISTRY_CERT)",
    )
    parser.add_argument(
        "--key",
        default=os.environ.get("REGISTRY_KEY") or os.environ.get("ENGINE_REGISTRY_KEY") or None,
        help="PEM key of --cert (REGISTRY_KEY, ENGINE_REGISTRY_KEY)",
    )


def client_tls(args: argparse.Namespace) -> ClientTLS:
    """The flags as a ``registry_client.tls.ClientTLS`` (ValueError naming a flag that is wrong)."""
    ca, cert, key = (Path(p) if p else None for p in (args.ca, args.cert, args.key))
    return ClientTLS(ca, cert, key, ca_name="--ca", cert_name="--cert", key_name="--key")


def unreachable(exc: httpx.HTTPError, url: str, tls: ClientTLS) -> str:
    """A TLS failure names what failed and the flag that fixes it; a plain ``http://``
    request the server closed unanswered names its likely cause (TLS there); anything else
    as is."""
    failure = tls_failure(exc, url, tls)
    if failure is not None:
        return str(failure)
    if isinstance(exc, httpx.RemoteProtocolError) and url.lower().startswith("http://"):
        return (
            f"cannot reach {url}: {exc}: the server likely speaks TLS there; use "
            "https://… with --ca (the CA that signed its certificate)"
        )
    return f"cannot reach {url}: {exc}"
