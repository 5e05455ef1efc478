"""Times as the API writes them: ``2026-11-29T14:00:00.123Z`` (UTC, milliseconds)."""

from __future__ import annotations

from datetime import UTC, datetime

_SECONDS: dict[int, str] = {}  # whole seconds formatted lately (now, now + each ttl, ...)


def utc_iso(ts: float) -> str:
    """``2026-11-29T14:00:00.123Z``; each whole second is formatted once (a request formats
    both now and now + its ttl, so one cached second would be replaced at every call)."""
    whole = int(ts)
    text = _SECONDS.get(whole)
    if text is None:
        if len(_SECONDS) >= 4096:
            _SECONDS.clear()
        text = _SECONDS[whole] = datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{int((ts - whole) * 1000):03d}Z"
