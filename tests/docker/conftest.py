"""A real Docker engine for the deploy tier's container tests, per module: the running one,
or one started for the module and stopped after it, its network changes undone
(tests/support/dockerd.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import dockerd


@pytest.fixture(scope="module")
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dockerd.DockerEngine]:
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with dockerd.DockerEngine(log) as engine:
        yield engine
    assert engine.problems == [], engine.problems
    assert not engine.started
