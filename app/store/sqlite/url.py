"""The SQLite store's URL: ``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db``
(as SQLAlchemy spells them), with ``?synchronous=normal|full|extra``."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit


def parse_url(url: str) -> tuple[str, str]:
    """``sqlite:///path`` → (path, synchronous)."""
    parts = urlsplit(url)
    if parts.scheme != "sqlite" or parts.netloc or not parts.path.lstrip("/"):
        raise ValueError(
            f"Bad SQLite store URL {url!r}: use sqlite:///relative/path.db "
            "or sqlite:////absolute/path.db"
        )
    synchronous = parse_qs(parts.query).get("synchronous", ["normal"])[0]
    if synchronous.upper() not in {"NORMAL", "FULL", "EXTRA"}:
        raise ValueError(f"Bad SQLite store URL {url!r}: synchronous=normal|full|extra")
    return parts.path[1:], synchronous
