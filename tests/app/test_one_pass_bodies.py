"""A registration's body in one pass of pydantic's parser (``app.server.jsonbody.validate_json``)
and
strict base64 through pybase64 (``app.core.schemas.strict_base64``) accept exactly what the two
passes and ``binascii`` did, with the same result: each is checked against the long way on a
corpus of valid bodies and near misses, at the limits' edges."""

from __future__ import annotations

import base64
import binascii
import json
import random
from typing import Any

import pytest
from pydantic import BaseModel

from app.core.schemas import (
    EngineIdBody,
    HeartbeatsRequest,
    RegisterAgentRequest,
    RegisterAgentsRequest,
    strict_base64,
)
from app.server.bypass.fastpath import _BATCH_KV, _NONE, _ONE_KV, Fallback, FreeParts, _body
from app.server.jsonbody import MAX_DEPTH, validate_json

pytestmark = pytest.mark.unit

KV = {"mem_type": "VRAM", "device_id": 0, "num_blocks": 86_000, "block_len": 65_536}


def agent(rank: int, **extra: Any) -> dict[str, Any]:
    blob = base64.b64encode(random.Random(rank).randbytes(3_928)).decode()
    kv = KV | {"base_addrs": [0x7F0000000000 + (r << 20) for r in range(80)]} | extra
    return {
        "engine_id": "e-1",
        "agent_name": f"e-1-rank{rank}",
        "agent_metadata": blob,
        "host": "10.0.0.7",
        "kv": kv,
        "ttl_s": 30,
    }


def batch(**extra: Any) -> dict[str, Any]:
    return {"agents": [agent(r, **extra) | {"rank": r} for r in range(8)]}


def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def long_way(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return _body(model, raw)
    except Fallback:
        return Fallback


def one_pass(model: type[BaseModel], raw: bytes, free: FreeParts) -> Any:
    try:
        return _body(model, raw, free)
    except Fallback:
        return Fallback


def same(model: type[BaseModel], raw: bytes, free: FreeParts) -> bool:
    """Both refuse, or both give the same model and the same blobs; True when taken in one pass."""
    quick, slow = one_pass(model, raw, free), long_way(model, raw)
    if slow is Fallback or quick is Fallback:
        assert quick is slow, raw[:200]
    else:
        assert quick.model_dump() == slow.model_dump()
        if isinstance(quick, RegisterAgentRequest | RegisterAgentsRequest):
            items = quick.agents if isinstance(quick, RegisterAgentsRequest) else [quick]
            slows = slow.agents if isinstance(slow, RegisterAgentsRequest) else [slow]
            assert [i.agent_metadata.data for i in items] == [s.agent_metadata.data for s in slows]
    return validate_json(model, raw, *free) is not None


def text(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()


# Raw JSON for a kv extra: what json.dumps cannot write, and the edges of the limits.
EXTRAS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e309",
    "-1e400",
    "1.5e-400",
    "0.1",
    "-0.0",
    "123456789012345678901234567890",
    '{"a": [1, NaN]}',
    '"\\ud800"',
    '"\\udfff x"',
    '"\\u00e9t\\u00e9"',
    '"tab\\tnew\\nline"',
    "true",
    "null",
    "[]",
    "{}",
    '{"k": 1, "k": 2}',
    '"' + "x" * 5000 + '"',
]


@pytest.mark.parametrize("extra", EXTRAS)
def test_a_kv_extra_is_judged_alike_one_rank_and_a_batch(extra: str) -> None:
    odd = extra.encode()
    one = text(agent(0, extra="@@")).replace(b'"@@"', odd)
    same(RegisterAgentRequest, one, _ONE_KV)
    every = text(batch(extra="@@"))
    same(RegisterAgentsRequest, every.replace(b'"@@"', odd), _BATCH_KV)
    # only the last rank's extra is odd
    same(RegisterAgentsRequest, every.replace(b'"@@"', b"0", 7).replace(b'"@@"', odd), _BATCH_KV)


@pytest.mark.parametrize(
    ("model", "base", "free"),
    [
        (RegisterAgentRequest, 2, _ONE_KV),
        (RegisterAgentsRequest, 4, _BATCH_KV),
    ],
)
def test_nesting_at_the_limit_is_taken_in_one_pass_and_past_it_refused(
    model: type[BaseModel], base: int, free: FreeParts
) -> None:
    # kv's extra value stands at nesting ``base``; ``levels`` lists put its innermost number at
    # ``base + levels``.
    make = agent(0, deep="@@") if model is RegisterAgentRequest else batch(deep="@@")
    for levels, refused in ((MAX_DEPTH - base, False), (MAX_DEPTH - base + 1, True)):
        raw = text(make).replace(b'"@@"', json.dumps(nested(levels)).encode())
        assert same(model, raw, free) is not refused
        assert (long_way(model, raw) is Fallback) is refused


def test_the_fleets_body_and_its_near_misses() -> None:
    body = batch()
    raw = text(body)
    assert same(RegisterAgentsRequest, raw, _BATCH_KV), "the fleet's body took the long way"
    near: list[bytes] = [
        raw.replace(b'"ttl_s": 30', b'"ttl_s": 30.0', 1),
        raw.replace(b'"ttl_s": 30', b'"ttl_s": NaN', 1),
        raw.replace(b'"device_id": 0', b'"device_id": 1e309', 1),
        raw.replace(b'"device_id": 0', b'"device_id": "0"', 1),
        raw.replace(b'"mem_type": "VRAM"', b'"mem_type": "vram"', 1),
        raw.replace(b'"host": "10.0.0.7"', b'"host": "0.0.0.0"', 1),
        raw.replace(b'"engine_id": "e-1"', b'"engine_id": "e-1", "engine_id": "e 2"', 1),
        raw.replace(b'"rank": 7', b'"rank": 6', 1),
        raw.replace(b'"agents": [', b'"agents": [], "x": [', 1),
        raw.replace(b"=", b"==", 1),
        raw.replace(b"=", b"", 1),
        raw.replace(b'"agent_metadata": "', b'"agent_metadata": " ', 1),
        raw.replace(b'"agent_metadata": "', b'"agent_metadata": "\\u0041', 1),
        raw.replace(b'"e-1-rank0"', b'"e-1-rank\xc3\xa9"', 1),
        raw.replace(b'"e-1-rank0"', b'"e-1-rank\xe9"', 1),  # not UTF-8
        raw.replace(b'"e-1-rank0"', b'"e-1-rank\\ud83d\\ude00"', 1),  # a pair: one character
        b"\xef\xbb\xbf" + raw,
        raw + b" \n",
        raw + b" x",
        raw[:-1],
    ]
    rng = random.Random(27)
    for _ in range(60):  # a byte changed anywhere
        at = rng.randrange(len(raw))
        near.append(raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1 :])
    for one in near:
        same(RegisterAgentsRequest, one, _BATCH_KV)


HEARTBEATS = [
    b'{"engine_id": "e-1", "ranks": [0, 1, 2, 3, 4, 5, 6, 7]}',
    b'{"engine_id": "e-1", "ranks": [0, 0]}',
    b'{"engine_id": "e-1", "ranks": []}',
    b'{"engine_id": "e-1", "ranks": [1.0]}',
    b'{"engine_id": "e-1", "ranks": [NaN]}',
    b'{"engine_id": "e-1", "ranks": [1e309]}',
    b'{"engine_id": "e-1", "ranks": [true]}',
    b'{"engine_id": "e-1", "ranks": [65536]}',
    b'{"engine_id": "e-1", "ranks": [-1]}',
    b'{"engine_id": "e-1", "ranks": [1], "x": 1}',
    b'{"engine_id": "e\\ud800", "ranks": [1]}',
    b'{"engine_id": "e 1", "ranks": [1]}',
    b'{"engine_id": "", "ranks": [1]}',
    b'{"engine_id": "e-1", "engine_id": "e-2", "ranks": [3]}',
    b'{"engine_id": "e-1", "ranks": [[1]]}',
    b'{"ranks": [1]}',
    b"[]",
    b"null",
]


@pytest.mark.parametrize("raw", HEARTBEATS)
def test_heartbeat_bodies_are_judged_alike(raw: bytes) -> None:
    taken = same(HeartbeatsRequest, raw, _NONE)
    assert taken is (raw in (HEARTBEATS[0], HEARTBEATS[13]))
    if raw.startswith(b'{"engine_id"'):
        engine_only = raw.split(b', "ranks"')[0] + b"}"
        same(EngineIdBody, engine_only, _NONE)


def test_a_body_long_enough_to_pass_the_value_limit_takes_the_long_way() -> None:
    padded = agent(0, pad="x" * 400_000)
    assert validate_json(RegisterAgentRequest, text(padded), *_ONE_KV) is None
    assert validate_json(RegisterAgentRequest, text(agent(0)), *_ONE_KV) is not None


def near_base64(rng: random.Random) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    if rng.random() < 0.5:
        return "".join(
            rng.choice(alphabet + "=" * 8 + "\n -_.é\x00") for _ in range(rng.randint(0, 14))
        )
    text = base64.b64encode(rng.randbytes(rng.randint(0, 12))).decode()
    if text and rng.random() < 0.7:
        at = rng.randrange(len(text) + 1)
        text = text[:at] + rng.choice(alphabet + "=\n é") + text[at + 1 :]
    return text


def test_strict_base64_is_binasciis_strict_mode() -> None:
    rng = random.Random(4648)
    differ = 0
    for _ in range(100_000):
        text = near_base64(rng)
        try:
            expected: bytes | None = binascii.a2b_base64(text, strict_mode=True)
        except ValueError:
            expected = None
        try:
            got: bytes | None = strict_base64(text)
        except ValueError:
            got = None
        assert got == expected, repr(text)
        differ += expected is not None and text.endswith("=") and not text.endswith("==")
    assert differ > 0  # the corpus holds accepted padded texts, not only refusals
    big = base64.b64encode(rng.randbytes(256 << 10)).decode()
    assert strict_base64(big) == binascii.a2b_base64(big, strict_mode=True)
