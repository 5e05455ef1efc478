"""The registry as an app for Granian (``granian --interface asgi --factory
bench.granian_app:app``), with the service's settings from its environment (``REGISTRY_*``):
``bench/lean.py`` measures it against the registry's own uvicorn server."""

from __future__ import annotations

from fastapi import FastAPI


def app() -> FastAPI:
    import gc

    from app.core import logs
    from app.main import create_app
    from app.server.serve import GC_THRESHOLD
    from app.server.settings import Settings

    gc.set_threshold(*GC_THRESHOLD)  # as the registry's own server sets it
    settings = Settings()
    logs.configure(settings.log_level)
    return create_app(settings)
