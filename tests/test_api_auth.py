"""API tokens: hashed storage, roles, and what the configuration refuses outside --dev."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from powerd.auth import (
    MIN_SECRET_LEN,
    AuthConfigError,
    Principal,
    Role,
    TokenStore,
    check_secret,
    hash_token,
    new_token_entry,
)


def test_generated_entry_round_trips_through_a_config_file(tmp_path: Path) -> None:
    token, entry = new_token_entry("alice", "operator")
    assert token.startswith("pwd_") and len(token) >= MIN_SECRET_LEN
    assert token not in entry  # only the hash is written down
    path = tmp_path / "tokens.toml"
    path.write_text(entry)
    store = TokenStore.from_file(path)
    assert store.authenticate(token) == Principal("alice", Role.OPERATOR)
    assert store.authenticate(token + "x") is None
    assert store.authenticate("") is None


def test_several_tokens_each_map_to_its_own_principal() -> None:
    entries = [
        new_token_entry(n, r) for n, r in [("v", "viewer"), ("o", "operator"), ("a", "admin")]
    ]
    store = TokenStore.from_config(tomllib.loads("\n".join(e for _, e in entries)))
    assert [store.authenticate(t) for t, _ in entries] == [
        Principal("v", Role.VIEWER),
        Principal("o", Role.OPERATOR),
        Principal("a", Role.ADMIN),
    ]


def test_roles_are_ordered() -> None:
    assert Role.VIEWER < Role.OPERATOR < Role.ADMIN
    assert Role.parse("Admin") is Role.ADMIN
    with pytest.raises(ValueError, match="valid: viewer, operator, admin"):
        Role.parse("root")


def test_same_token_hashes_differently_with_each_salt() -> None:
    assert hash_token("pwd_same") != hash_token("pwd_same")


def test_placeholder_hash_plaintext_and_bad_entries_are_refused() -> None:
    config = {
        "token": [
            {"name": "a", "role": "admin", "hash": hash_token("changethis")},
            {"name": "b", "role": "viewer", "token": "pwd_plain"},
            {"name": "c", "role": "boss", "hash": hash_token("pwd_x" * 10)},
            {"name": "d", "role": "viewer", "hash": "md5$00$11"},
            {"name": "e", "role": "viewer"},
        ]
    }
    with pytest.raises(AuthConfigError) as err:
        TokenStore.from_config(config, source="/etc/powerd/tokens.toml")
    where = [p for p, _ in err.value.problems]
    assert where == ["token[0]", "token[1]", "token[2]", "token[3]", "token[4]"]
    text = str(err.value)
    assert text.startswith("/etc/powerd/tokens.toml: invalid token configuration")
    assert "placeholder" in text and "--dev only" in text and "unknown role" in text


def test_dev_mode_takes_plain_and_placeholder_tokens() -> None:
    config = {
        "token": [
            {"name": "dev", "role": "admin", "token": "dev"},
            {"name": "x", "role": "viewer", "hash": hash_token("changethis")},
        ]
    }
    store = TokenStore.from_config(config, dev=True)
    assert store.authenticate("dev") == Principal("dev", Role.ADMIN)
    assert store.authenticate("changethis") == Principal("x", Role.VIEWER)


def test_no_tokens_or_duplicate_names_are_refused() -> None:
    with pytest.raises(AuthConfigError, match="no tokens"):
        TokenStore.from_config({})
    _, e1 = new_token_entry("same", "viewer")
    _, e2 = new_token_entry("same", "admin")
    with pytest.raises(AuthConfigError, match="unique"):
        TokenStore.from_config(tomllib.loads(e1 + e2))


def test_unreadable_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(AuthConfigError, match="cannot read"):
        TokenStore.from_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[token]\n")
    with pytest.raises(AuthConfigError, match="not valid TOML"):
        TokenStore.from_file(bad)


@pytest.mark.parametrize("secret", [None, "", "changethis", "  CHANGEME ", "short-but-real"])
def test_check_secret_refuses_weak_values_outside_dev(secret: str | None) -> None:
    with pytest.raises(ValueError, match="broker password"):
        check_secret(secret, "broker password")
    check_secret(secret, "broker password", dev=True)


def test_check_secret_accepts_a_generated_token() -> None:
    token, _ = new_token_entry("x", "viewer")
    check_secret(token, "token")
