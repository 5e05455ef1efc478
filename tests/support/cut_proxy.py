"""An HTTP proxy in front of a real registry that cuts a watch stream in the middle of a
revision: the first revision whose stream carries several changes (leases that lapsed
together) is cut after its first line, the connection closed as a replica killed mid-write
would. Everything else passes through (GETs only: what a watcher sends)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

CHANGES = ("ADDED", "MODIFIED", "DELETED")


class CutProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.cut: list[
            dict[str, Any]
        ] = []  # the lines of the revision it cut, as the registry sent them
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                proxy.forward(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        headers = {k: v for k, v in handler.headers.items() if k.lower() == "authorization"}
        timeout = httpx.Timeout(60.0, connect=5.0)
        with httpx.stream(
            "GET", self.upstream + handler.path, headers=headers, timeout=timeout
        ) as answer:
            handler.send_response(answer.status_code)
            handler.send_header("Content-Type", answer.headers.get("content-type", "text/plain"))
            if "watch=true" not in handler.path or answer.status_code != 200:
                body = answer.read()
                handler.send_header("Content-Length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)
                return
            handler.send_header("Connection", "close")  # the body ends when the stream does
            handler.end_headers()
            handler.close_connection = True
            self.stream(handler, answer)

    def stream(self, handler: BaseHTTPRequestHandler, answer: httpx.Response) -> None:
        """Pass lines on, one behind: a line goes once the next is known, so the first line
        of a revision with several changes can be sent alone and the stream cut there."""
        held: tuple[str, dict[str, Any]] | None = None
        for raw in answer.iter_lines():
            if not raw:
                continue
            line = json.loads(raw)
            if held is not None:
                first = held[1]
                several = (
                    first["type"] in CHANGES
                    and line["type"] in CHANGES
                    and first["revision"] == line["revision"]
                )
                with self.lock:
                    cut_now = several and not self.cut
                    if cut_now:
                        self.cut = [first, line]
                self.write(handler, held[0])
                if cut_now:
                    return  # closed after the revision's first line
            held = (raw, line)
            if line["type"] == "BOOKMARK":  # nothing comes after it for a while: send it now
                self.write(handler, raw)
                held = None

    @staticmethod
    def write(handler: BaseHTTPRequestHandler, raw: str) -> None:
        handler.wfile.write(raw.encode() + b"\n")
        handler.wfile.flush()


__all__ = ["CutProxy"]
