from __future__ import annotations

import pytest

from registry_client.compat import equal, mismatches, same_value

pytestmark = pytest.mark.unit


def test_integer_and_float_of_same_value_match() -> None:
    assert same_value(16, 16.0)


def test_string_never_matches_a_number() -> None:
    assert not same_value("16", 16)


def test_boolean_never_matches_a_number() -> None:
    assert not same_value(True, 1)
    assert not same_value(False, 0)


def test_only_shared_keys_are_compared() -> None:
    assert mismatches({"model": "a", "dtype": "bf16"}, {"model": "a", "block_size": 16}) == []


def test_mismatches_name_field_and_both_values() -> None:
    found = mismatches({"block_size": 16, "model": "a"}, {"block_size": 32, "model": "a"})
    assert found == [{"field": "block_size", "remote": 16, "local": 32}]


def test_equal_needs_the_same_keys() -> None:
    assert equal({"a": 1}, {"a": 1.0})
    assert not equal({"a": 1}, {"a": 1, "b": 2})
