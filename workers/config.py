"""One configuration style for the workers and the vLLM plugin: a pydantic-settings class.

Each field is an environment variable (the class's prefix + the field's name in capitals:
`WORKERS_GROUP_ID`, `ENGINE_REGISTRY_TTL_S`) and, for the entrypoints, a flag named after it
(`--group-id`; older spellings kept as aliases). A flag wins over the variable, the variable
over the default; an empty variable counts as unset. A bad value stops the start with one
line per problem naming the variable (or flag), the value given and the form expected.

Adding a setting is adding a field: its variable, its flag, its check and its line in
`--help` follow (the flags: ``registry_client.settings_flags``, which the service's
``engine-registry serve`` shares). Field descriptions say what is expected;
docs/configuration.md lists every field (a test in tests/docs holds the two together).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from registry_client.settings_flags import add_flags, env_name, flag_names, given

S = TypeVar("S", bound=BaseSettings)

__all__ = ["add_flags", "describe", "env_name", "flag_names", "parse", "read_token_file"]


def read_token_file(path: Path, variable: str) -> str:
    """The first line of a token file (a Kubernetes or compose secret)."""
    try:
        lines = path.read_text().strip().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {variable} {path}: {exc}") from None
    if not lines:
        raise ValueError(f"{variable} {path} is empty: put the token on its first line")
    return lines[0].strip()


def describe(
    exc: ValidationError,
    cls: type[BaseSettings],
    *,
    flags: Mapping[str, str] | None = None,
) -> str:
    """The errors as lines naming the variable or flag, the value and the expected form.

    `flags`: field -> the flag that gave the value (when a flag did, not the environment).
    """
    lines = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        message = str(error["msg"]).removeprefix("Value error, ")
        field = loc[0] if loc else ""
        info = cls.model_fields.get(field)
        if info is None:  # a check over several fields: its message names them
            lines.append(message)
            continue
        where = (flags or {}).get(field) or env_name(cls, field)
        given = " is not set:" if error["type"] == "missing" else f"={error['input']!r}:"
        expected = f"; expected {info.description}" if info.description else ""
        lines.append(f"{where}{given} {message}{expected}")
    return "\n".join(lines)


def parse(
    cls: type[S],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str | None,
    aliases: Mapping[str, Sequence[str]] = {},
) -> S:
    """Flags over variables over defaults; a bad value exits 2 with `describe`'s lines."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(parser, cls, aliases)
    args = parser.parse_args(argv)
    values = given(args, cls)
    try:
        return cls(**values)
    except ValidationError as exc:
        flags = {name: flag_names(name, aliases)[0] for name in values}
        parser.error("\n" + describe(exc, cls, flags=flags))
