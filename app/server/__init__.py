"""Serving HTTP: uvicorn with a control plane's limits, raw ASGI middleware, body parsing,
shedding, and the request bypass (``app.server.serve.bypass``)."""
