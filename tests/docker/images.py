"""The images the container tier runs: built with a real Docker engine, cached between runs.

Where no container registry answers, the base images come from Debian packages, as a user
without registry access would make them: `mmdebstrap --variant=minbase` with python3 and its
venv module (the project's base) or Debian's etcd server (the `ha` profile's members), then
`docker import`. They are passed in as `PYTHON_IMAGE` and `ETCD_IMAGE`; with a registry
reachable, the defaults stay. Their tags carry a hash of what made them, so a later run
reuses them.

Packages come the way this machine's pip finds them: `pip config list` (its files and the
`PIP_*` variables) is read at test time and handed to the build as build args. A local wheel
directory (`find-links`), a `file://` index, a constraints file and the CA bundle pip names
are served over HTTP on the host's loopback for the build (run with `--network host`); the
Dockerfile and the repository name none of them.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tests.docker.compose_support import ROOT

DEFAULT_PYTHON_IMAGE = "python:3.11-slim-bookworm"
DEFAULT_ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd")
ETCD_PACKAGES = ("etcd-server",)
# Documentation and translations are of no use in a container.
DPKG_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*")
# pip's settings that say where packages come from, by their `pip config` names.
PIP_KEYS = ("index-url", "extra-index-url", "find-links", "trusted-host", "constraint", "cert")
SCOPES = (":env:", "site", "user", "global")  # pip's precedence, strongest first
PIP_PORT = 47431


def pip_settings(python: str = sys.executable) -> dict[str, str]:
    """The pip settings (`PIP_KEYS`) this machine's pip uses, as `pip config list` shows them."""
    listed = subprocess.run(
        [python, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    found: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        name, _, raw = line.partition("=")
        scope, _, key = name.rpartition(".")
        if key not in PIP_KEYS or scope not in (*SCOPES, "install"):
            continue
        rank = SCOPES.index(scope) if scope in SCOPES else len(SCOPES)
        value = raw.strip().strip("'\"")
        if key not in found or rank < found[key][0]:
            found[key] = (rank, value)
    return {key: value for key, (_, value) in found.items()}


class _Files(http.server.SimpleHTTPRequestHandler):
    """Serves local directories under /0/, /1/, …"""

    roots: tuple[Path, ...] = ()

    def translate_path(self, path: str) -> str:
        parts = unquote(urlsplit(path).path).lstrip("/").split("/", 1)
        if not parts[0].isdigit() or int(parts[0]) >= len(self.roots):
            return "/nonexistent"
        root = self.roots[int(parts[0])]
        rest = parts[1] if len(parts) > 1 else ""
        target = (root / rest).resolve()
        return str(target) if target.is_relative_to(root) else "/nonexistent"

    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass
class PipSources:
    """Build args for pip, and the loopback server behind the local ones."""

    args: dict[str, str] = field(default_factory=dict)
    served: list[Path] = field(default_factory=list)

    def url(self, base: str, path: Path) -> str:
        root = path if path.is_dir() else path.parent
        if root not in self.served:
            self.served.append(root)
        index = self.served.index(root)
        suffix = "" if path.is_dir() else path.name
        return f"{base}/{index}/{suffix}"


@contextmanager
def served_pip_sources(settings: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """Build args (`PIP_*`, `PIP_CERT_URL`) for `settings`, local parts served on loopback."""

    class Handler(_Files):
        pass

    try:  # one port from run to run: the URLs are build args, part of the build cache's key
        server = http.server.ThreadingHTTPServer(("127.0.0.1", PIP_PORT), Handler)
    except OSError:  # taken (another run): any port, at the price of a rebuild
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    sources = PipSources()

    def local(value: str) -> Path | None:
        path = Path(value[len("file://") :] if value.startswith("file://") else value)
        return path if path.is_absolute() and path.exists() else None

    def convert(value: str, *, index: bool) -> str:
        items = []
        for item in value.split():
            path = local(item)
            if path is None:
                items.append(item)
            elif index and path.is_dir():  # a PEP 503 tree: its links are relative to it
                items.append(sources.url(base, path.parent) + path.name)
            else:
                items.append(sources.url(base, path))
        return " ".join(items)

    for key, env in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL")):
        if key in settings:
            sources.args[env] = convert(settings[key], index=True)
    if "find-links" in settings:
        sources.args["PIP_FIND_LINKS"] = convert(settings["find-links"], index=False)
    if "trusted-host" in settings:
        sources.args["PIP_TRUSTED_HOST"] = settings["trusted-host"]
    if "constraint" in settings:
        sources.args["PIP_CONSTRAINT"] = convert(settings["constraint"], index=False)
    cert = local(settings.get("cert", ""))
    if cert is not None and cert.is_file():
        sources.args["PIP_CERT_URL"] = sources.url(base, cert)
    Handler.roots = tuple(sources.served)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield sources.args
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Images:
    """Builds and names the tier's images with one Docker client."""

    docker: str
    log_dir: Path
    timings: dict[str, float] = field(default_factory=dict)

    def run(self, *argv: str, timeout: float = 1800, **env: str) -> str:
        started = time.monotonic()
        run = subprocess.run(
            [self.docker, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, **env},
        )
        if run.returncode != 0:
            raise RuntimeError(
                f"docker {' '.join(argv[:6])}… failed ({run.returncode}) after "
                f"{time.monotonic() - started:.1f}s:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
            )
        return run.stdout + run.stderr  # BuildKit's progress goes to stderr

    def exists(self, image: str) -> bool:
        run = subprocess.run(
            [self.docker, "image", "inspect", image], capture_output=True, timeout=60, check=False
        )
        return run.returncode == 0

    def pullable(self, image: str) -> bool:
        """True when `image` is here or a registry gives it."""
        if self.exists(image):
            return True
        try:
            run = subprocess.run(
                [self.docker, "pull", "-q", image], capture_output=True, timeout=120, check=False
            )
        except subprocess.TimeoutExpired:
            return False
        return run.returncode == 0

    def size(self, image: str) -> int:
        return int(self.run("image", "inspect", "--format", "{{.Size}}", image).strip())

    def debian_image(self, name: str, packages: tuple[str, ...]) -> str:
        """`name:SUITE-HASH` made with mmdebstrap from Debian packages (cached by its tag)."""
        recipe = f"{SUITE} minbase {' '.join(packages)} {' '.join(DPKG_EXCLUDES)}"
        tag = f"{name}:{SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
        if self.exists(tag):
            return tag
        started = time.monotonic()
        tarball = self.log_dir / f"{name}.tar"
        mmdebstrap = [
            "mmdebstrap",
            "--variant=minbase",
            "--quiet",
            f"--include={','.join(packages)}",
            *(f"--dpkgopt=path-exclude={p}" for p in DPKG_EXCLUDES),
            SUITE,
            str(tarball),
        ]
        made = subprocess.run(mmdebstrap, capture_output=True, text=True, timeout=900, check=False)
        if made.returncode != 0:
            raise RuntimeError(f"{' '.join(mmdebstrap)}: {made.stderr[-4000:]}")
        self.run("import", str(tarball), tag)
        tarball.unlink()
        self.timings[f"{name} (mmdebstrap + import)"] = time.monotonic() - started
        return tag

    def bases(self) -> dict[str, str]:
        """`PYTHON_IMAGE` and `ETCD_IMAGE`: the defaults when a registry gives them, else
        images made from Debian packages."""
        chosen = {}
        for var, default, name, packages in (
            ("PYTHON_IMAGE", DEFAULT_PYTHON_IMAGE, "engine-registry-base", BASE_PACKAGES),
            ("ETCD_IMAGE", DEFAULT_ETCD_IMAGE, "engine-registry-etcd", ETCD_PACKAGES),
        ):
            chosen[var] = default if self.pullable(default) else self.debian_image(name, packages)
        return chosen

    def build(self, tag: str, build_args: Mapping[str, str], *, buildkit: bool = True) -> float:
        """`docker build` of docker/Dockerfile's default target; the seconds it took."""
        args = [a for key, value in build_args.items() for a in ("--build-arg", f"{key}={value}")]
        started = time.monotonic()
        out = self.run(
            "build",
            "--network",
            "host",
            "-f",
            str(ROOT / "docker" / "Dockerfile"),
            "-t",
            tag,
            *args,
            str(ROOT),
            DOCKER_BUILDKIT="1" if buildkit else "0",
        )
        took = time.monotonic() - started
        self.build_log(tag).write_text(out)
        self.timings[f"build {tag}"] = took
        return took

    def build_log(self, tag: str) -> Path:
        return self.log_dir / f"build-{tag.replace(':', '_').replace('/', '_')}.log"
