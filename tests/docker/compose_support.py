"""Read docker/compose.yaml and docker/Dockerfile the way Docker does, for tests that run them.

`load_services` parses the compose file with PyYAML (merge keys included), interpolates
`${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `${VAR?error}`, `$VAR` and `$$`
as compose does, keeps the services of the active profiles, and returns each service's
command, environment, hostname, mounts, health check and dependencies. test_compose.py checks
this reading against `docker-compose config`, so the two-host test runs what compose would.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE_FILE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
HA_ENV_FILE = DOCKER / "ha.env"

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


class InterpolationError(ValueError):
    pass


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution; `$$` stands for a literal `$`."""

    def sub(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        name = match.group("braced") or match.group("named")
        op, arg = match.group("op"), match.group("arg") or ""
        value = env.get(name)
        missing = not value if op in (":-", ":?") else value is None
        if op and op.endswith("-") and missing:
            return interpolate(arg, env)
        if op and op.endswith("?") and missing:
            raise InterpolationError(f"required variable {name} is missing: {arg}")
        return value or ""

    return _VAR.sub(sub, text)


def _interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, env) for key, value in node.items()}
    return node


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (`#` comments), as `--env-file` reads them."""
    values: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip()
    return values


@dataclass(frozen=True)
class Mount:
    source: str  # a named volume, or a host path
    target: str  # the path inside the container


@dataclass
class Service:
    name: str
    command: list[str]
    environment: dict[str, str]
    hostname: str | None
    profiles: list[str]
    mounts: list[Mount] = field(default_factory=list)
    secrets: list[str] = field(default_factory=list)
    healthcheck: list[str] | None = None  # the test's argv (CMD form), None when disabled
    depends_on: dict[str, str] = field(default_factory=dict)  # service -> condition
    ports: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)


def _environment(node: Any) -> dict[str, str]:
    if node is None:
        return {}
    if isinstance(node, list):
        pairs = (item.partition("=") for item in node)
        return {k: v for k, _, v in pairs}
    return {str(k): "" if v is None else str(v) for k, v in node.items()}


def _command(node: Any) -> list[str]:
    if node is None:
        return []
    if isinstance(node, str):
        return shlex.split(node)
    return [str(item) for item in node]


def _healthcheck(node: Any) -> list[str] | None:
    if not node or node.get("disable"):
        return None
    test = node.get("test")
    if isinstance(test, str):
        return ["/bin/sh", "-c", test]
    if test[0] == "NONE":
        return None
    if test[0] == "CMD-SHELL":
        return ["/bin/sh", "-c", test[1]]
    return [str(item) for item in test[1:]]


def _depends_on(node: Any) -> dict[str, str]:
    if node is None:
        return {}
    if isinstance(node, list):
        return {name: "service_started" for name in node}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in node.items()}


def _mounts(node: Any) -> list[Mount]:
    mounts = []
    for item in node or []:
        if isinstance(item, str):
            source, _, rest = item.partition(":")
            target = rest.split(":")[0]
        else:
            source, target = item.get("source", ""), item["target"]
        mounts.append(Mount(source, target))
    return mounts


def load_compose(env: Mapping[str, str], path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The whole file, interpolated (extension fields and merge keys resolved)."""
    document = yaml.safe_load(path.read_text())
    return dict(_interpolate_tree(document, env))


def load_services(
    env: Mapping[str, str],
    *,
    profiles: Iterable[str] = (),
    path: Path = COMPOSE_FILE,
) -> dict[str, Service]:
    """The services compose would start with `profiles` active (plus COMPOSE_PROFILES)."""
    document = load_compose(env, path)
    active = set(profiles) | {p for p in env.get("COMPOSE_PROFILES", "").split(",") if p}
    services: dict[str, Service] = {}
    for name, spec in document["services"].items():
        wanted = spec.get("profiles") or []
        if wanted and not active.intersection(wanted):
            continue
        services[name] = Service(
            name=name,
            command=_command(spec.get("command")),
            environment=_environment(spec.get("environment")),
            hostname=spec.get("hostname"),
            profiles=list(wanted),
            mounts=_mounts(spec.get("volumes")),
            secrets=[s if isinstance(s, str) else s["source"] for s in spec.get("secrets", [])],
            healthcheck=_healthcheck(spec.get("healthcheck")),
            depends_on=_depends_on(spec.get("depends_on")),
            ports=[str(p) for p in spec.get("ports", [])],
            raw=spec,
        )
    return services


# -- Dockerfile -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int  # index of the FROM it belongs to (-1 before the first)


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    """Instructions with continuation lines joined and comment lines dropped."""
    instructions: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and pending):
            continue
        if not line:
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, args.strip(), stage))
    return instructions


def image_environment(path: Path = DOCKERFILE) -> dict[str, str]:
    """ENV of the final stage, `$VAR` references expanded as the builder does."""
    instructions = dockerfile_instructions(path)
    last = max(i.stage for i in instructions)
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.stage != last or ins.keyword != "ENV":
            continue
        for item in shlex.split(ins.args):
            key, _, value = item.partition("=")
            env[key] = interpolate(value, {**_BASE_IMAGE_ENV, **env})
    return env


# What the python base image sets that the final stage's ENV refers to.
_BASE_IMAGE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


def healthcheck_command(path: Path = DOCKERFILE) -> list[str]:
    """The argv of the image's HEALTHCHECK (exec form)."""
    import json

    for ins in dockerfile_instructions(path):
        if ins.keyword == "HEALTHCHECK":
            _, _, cmd = ins.args.partition("CMD ")
            return [str(item) for item in json.loads(cmd)]
    raise LookupError("no HEALTHCHECK in the Dockerfile")
