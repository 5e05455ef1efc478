"""The tokens file's lines (app/security/credentials.py): older ``role:token`` lines read as
before, a
line's ``name=`` and ``groups=``, the inline form's commas, scope matching, and errors that name
the line but never the token; the auth check's scope refusal (app/security/auth.py)."""

from __future__ import annotations

import pytest

from app.security.auth import AuthMiddleware, OutOfScope, check_scope, credential_of
from app.security.credentials import TokenFileError, inline_tokens, parse_tokens

pytestmark = pytest.mark.unit

T1 = "t1-" + "a" * 20
T2 = "t2-" + "b" * 20


def test_older_lines_read_as_before_unscoped_and_called_by_their_line() -> None:
    tokens = parse_tokens(f"# fleet\nreader:{T1}\nworker:{T2}  # nodes\n", source="f")
    reader, worker = credential_of(tokens, T1), credential_of(tokens, T2)
    assert reader is not None
    assert worker is not None
    assert (reader.role, reader.name, reader.scope) == ("reader", "reader#2", None)
    assert (worker.role, worker.name, worker.scope) == ("worker", "worker#3", None)
    # A token holding ':' (allowed before) is still one token.
    colon = "abc:" + "d" * 20
    assert credential_of(parse_tokens(f"admin:{colon}", source="f"), colon) is not None
    assert credential_of(tokens, T1[:-1]) is None
    assert credential_of(tokens, "") is None


def test_a_line_names_its_token_and_scopes_it_to_groups() -> None:
    line = f"worker:{T1}:name=node-7:groups=prefill-7*,decode-7?,exact-7"
    credential = credential_of(parse_tokens(line, source="f"), T1)
    assert credential is not None
    assert credential.scope is not None
    assert credential.name == "node-7"
    assert str(credential.scope) == "prefill-7*,decode-7?,exact-7"
    allows = credential.scope.allows
    assert allows("prefill-7")
    assert allows("prefill-70-a")
    assert allows("decode-71")
    assert allows("exact-7")
    assert not allows("prefill-8")
    assert not allows("decode-7")
    assert not allows("decode-712")
    assert not allows("exact-70")
    assert not allows("xprefill-7")
    assert not allows("exact.7")


def test_the_inline_form_keeps_its_commas_and_takes_group_lists() -> None:
    old = inline_tokens(f"reader:{T1},worker:{T2}")
    assert [c.name for c in old.values()] == ["inline-reader#1", "inline-worker#2"]
    scoped = inline_tokens(f"worker:{T1}:name=n7:groups=p7-*,d7-*,reader:{T2}")
    worker, reader = credential_of(scoped, T1), credential_of(scoped, T2)
    assert worker is not None
    assert worker.scope is not None
    assert worker.scope.patterns == ("p7-*", "d7-*")
    assert reader is not None
    assert reader.role == "reader"
    with pytest.raises(TokenFileError, match="entry 2"):  # a stray piece is still an error
        inline_tokens(f"worker:{T1},garbage")


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (f"reader:{T1}:groups=a-*", "worker tokens only"),
        (f"admin:{T1}:groups=a-*", "worker tokens only"),
        (f"worker:{T1}:groups=", "groups= takes"),
        (f"worker:{T1}:groups=A-*", "groups= takes"),
        (f"worker:{T1}:groups=a/b", "groups= takes"),
        (f"worker:{T1}:name=has space", "name= takes"),
        (f"worker:{T1}:name=a:name=b", "given twice"),
        (f"worker:{T1}:name=a:owner=b", "unknown option"),
        ("worker:short:name=a", "shorter than 16"),
        ("worker::name=a", "token is empty"),
    ],
)
def test_a_bad_option_names_the_line_never_the_token(line: str, says: str) -> None:
    with pytest.raises(TokenFileError, match="line 2") as info:
        parse_tokens(f"admin:{T2}\n{line}\n", source="tokens.txt")
    assert says in str(info.value)
    assert T1 not in str(info.value)
    assert T2 not in str(info.value)


def _scope(method: str, path: str, token: str) -> dict[str, object]:
    headers = [(b"authorization", f"Bearer {token}".encode())]
    return {"type": "http", "method": method, "path": path, "headers": headers}


def test_a_scoped_worker_token_writes_only_its_groups_and_reads_all() -> None:
    tokens = parse_tokens(f"worker:{T1}:name=node-7:groups=p7-*\nworker:{T2}", source="f")
    verdict = AuthMiddleware.verdict
    assert verdict(_scope("PUT", "/tp-groups/p7-a/engine", T1), tokens, "worker") is None
    refused = verdict(_scope("PUT", "/tp-groups/p8-a/engine/agents/0", T1), tokens, "worker")
    assert isinstance(refused, OutOfScope)
    assert refused.status == 403
    assert refused.extras == {"token_name": "node-7", "scope": ["p7-*"], "group_id": "p8-a"}
    assert T1 not in refused.detail
    assert verdict(_scope("GET", "/tp-groups/p8-a/engine", T1), tokens, "reader") is None
    assert verdict(_scope("PUT", "/tp-groups/p8-a/engine", T2), tokens, "worker") is None
    # A group named in a body (the handshake's decode): the handler's check.
    asked = _scope("POST", "/engines/e/handshake", T1)
    assert verdict(asked, tokens, "worker") is None
    check_scope(asked, "p7-b")
    with pytest.raises(OutOfScope, match="'d8-b' is outside"):
        check_scope(asked, "d8-b", "the decode group")
