"""The one bridge from a pydantic-settings class to argparse flags, shared by the service
(``engine-registry serve``) and the workers' entry points.

Each field is a flag named after it (``--group-id``; older spellings kept as aliases, listed
first when given), its help the field's description with its environment variable and
default. A flag's default is None: an absent flag leaves the variable (then the field's
default) its say, so ``given`` holds only what the command line set."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pydantic-settings is the caller's: this package needs no import of it
    from pydantic_settings import BaseSettings


def env_name(cls: type[BaseSettings], field: str) -> str:
    """The environment variable of `field`."""
    return f"{cls.model_config.get('env_prefix', '')}{field}".upper()


def flag_names(field: str, aliases: Mapping[str, Sequence[str]]) -> list[str]:
    """A field's flags: its older spellings first (they are what the docs show), then
    `--field-name` (or where ``aliases`` places it)."""
    names = list(aliases.get(field, ()))
    own = f"--{field.replace('_', '-')}"
    return names if own in names else [*names, own]


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type[BaseSettings],
    aliases: Mapping[str, Sequence[str]] = {},
    *,
    env_shown: str = "${}",
) -> None:
    """One flag per field of `cls` (default None: an absent flag leaves the variable's say).
    ``env_shown``: how the help writes the variable (``$WORKERS_GROUP_ID`` by default)."""
    for name, info in cls.model_fields.items():
        default = "none" if info.default is None else info.default
        if info.is_required():
            default = "required"
        variable = env_shown.format(env_name(cls, name))
        text = f"{info.description or ''} ({variable}, default {default})"
        flags = flag_names(name, aliases)
        if info.annotation is bool:
            parser.add_argument(
                *flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        else:
            parser.add_argument(*flags, dest=name, default=None, metavar="V", help=text)


def given(args: argparse.Namespace, cls: type[BaseSettings]) -> dict[str, Any]:
    """The fields the command line set (its flags from ``add_flags``)."""
    return {
        name: value for name in cls.model_fields if (value := getattr(args, name, None)) is not None
    }
