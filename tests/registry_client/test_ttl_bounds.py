"""The lease's bounds (``ttl_s``) are one constant (``registry_client.models``): the service's
request model and both workers' settings take them from there, and no module writes them
again."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from annotated_types import Ge, Le
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from app.core.schemas import RegisterAgentRequest
from registry_client.models import TTL_S_DEFAULT, TTL_S_MAX, TTL_S_MIN
from workers.settings import WorkerSettings
from workers.vllm_plugin.settings import PluginSettings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _bounds(info: FieldInfo) -> tuple[object, object, object]:
    ge = next(m.ge for m in info.metadata if isinstance(m, Ge))
    le = next(m.le for m in info.metadata if isinstance(m, Le))
    return ge, le, info.default


@pytest.mark.parametrize("model", [RegisterAgentRequest, WorkerSettings, PluginSettings])
def test_every_ttl_s_takes_the_one_bound(model: type[BaseModel]) -> None:
    assert _bounds(model.model_fields["ttl_s"]) == (TTL_S_MIN, TTL_S_MAX, TTL_S_DEFAULT)


def test_no_module_writes_the_bounds_again() -> None:
    literal = re.compile(r"ttl_s.*\b(ge=5|le=3600)\b|\b(ge=5|le=3600)\b.*ttl")
    again = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("app", "registry_client", "workers")
        for path in sorted((ROOT / top).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert not again, again
