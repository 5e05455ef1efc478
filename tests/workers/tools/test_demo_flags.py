"""The demo orchestrator's flags (its promise to import neither torch nor nixl: test_imports)."""

from __future__ import annotations

import pytest

from workers.tools import demo

pytestmark = pytest.mark.unit


def test_the_defaults_are_a_two_node_prefill_and_a_decode_of_another_tp_size() -> None:
    args = demo.parse_args([])
    assert (args.prefill_tp, args.prefill_nodes) == (2, 2)
    assert args.decode_tp != args.prefill_tp
    assert args.engine_id_source == "registry"


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill-tp", "3", "--prefill-nodes", "2"],  # ranks do not split over the nodes
        ["--prefill-tp", "2", "--decode-tp", "3", "--num-heads", "6"],  # 3 is no multiple of 2
        ["--decode-tp", "4", "--num-heads", "2"],  # heads do not split over the decode TP
    ],
)
def test_impossible_topologies_are_refused_up_front(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        demo.parse_args(argv)
    assert info.value.code == 2
