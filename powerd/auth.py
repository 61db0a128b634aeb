"""Bearer tokens for the admin API: stored hashed, checked in constant time, with roles.

Tokens come from the controller's configuration (`/etc/powerd/tokens.toml`):

    [[token]]
    name = "alice"                   # the actor written to the audit log
    role = "operator"                # viewer < operator < admin
    hash = "sha256$<salt>$<digest>"  # from `powerd token new`; never the token itself

Why a salted SHA-256 and not scrypt/bcrypt: the tokens are 256 random bits made by
`generate_token`, so guessing one from its hash is out of reach however fast the hash is;
slow KDFs protect low-entropy human passwords, and on every API request they would cost tens
of milliseconds of CPU per call (a cheap denial of service). The salt keeps two entries of
the same token from looking alike and defeats precomputed tables.

Outside `--dev`, tokens in plain text, empty or short tokens and well-known placeholders
(hashed with the entry's own salt and compared) are refused at start-up.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from powerd.input_errors import InputError

TOKEN_PREFIX = "pwd_"  # recognisable in logs and by secret scanners
MIN_SECRET_LEN = 32
SCHEME = "sha256"
PLACEHOLDERS = frozenset(
    {
        "",
        "changethis",
        "changeme",
        "change-me",
        "secret",
        "password",
        "token",
        "admin",
        "test",
        "example",
        "xxx",
        "TODO",
        "REPLACE_ME",
    }
)


class AuthConfigError(InputError):
    kind = "token configuration"


class Role(IntEnum):
    """Ordered: a role may do everything the roles below it may."""

    VIEWER = 1  # reads
    OPERATOR = 2  # budgets, classes, pins, drains
    ADMIN = 3  # the policy

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: str) -> Role:
        try:
            return cls[value.upper()]
        except KeyError:
            valid = ", ".join(r.label for r in cls)
            raise ValueError(f"unknown role {value!r}; valid: {valid}") from None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who made a request: the audit log's actor, and what they may do."""

    name: str
    role: Role


@dataclass(frozen=True, slots=True)
class TokenEntry:
    name: str
    role: Role
    salt: bytes
    digest: bytes


def _digest(token: str, salt: bytes) -> bytes:
    return hashlib.sha256(salt + token.encode()).digest()


def hash_token(token: str, salt: bytes | None = None) -> str:
    """The string to put in the configuration for `token`: `sha256$<salt hex>$<digest hex>`."""
    salt = secrets.token_bytes(16) if salt is None else salt
    return f"{SCHEME}${salt.hex()}${_digest(token, salt).hex()}"


def parse_hash(value: str) -> tuple[bytes, bytes]:
    parts = value.split("$")
    if len(parts) != 3 or parts[0] != SCHEME:
        raise ValueError(f"expected '{SCHEME}$<salt hex>$<digest hex>' (from `powerd token new`)")
    try:
        salt, digest = bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
    except ValueError:
        raise ValueError("salt and digest must be hexadecimal") from None
    if len(salt) < 8 or len(digest) != hashlib.sha256().digest_size:
        raise ValueError("salt must be at least 8 bytes and the digest 32")
    return salt, digest


def generate_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_token_entry(name: str, role: Role | str) -> tuple[str, str]:
    """A fresh token and the TOML entry that grants it `role`: hand out the first, store the
    second. What `powerd token new` prints."""
    role = role if isinstance(role, Role) else Role.parse(role)
    token = generate_token()
    entry = f'[[token]]\nname = "{name}"\nrole = "{role.label}"\nhash = "{hash_token(token)}"\n'
    return token, entry


def check_secret(value: str | None, what: str, *, dev: bool = False) -> None:
    """Refuse an empty, placeholder or short secret (a token, a broker password) unless dev."""
    if dev:
        return
    if value is None or value.strip().lower() in {p.lower() for p in PLACEHOLDERS}:
        raise ValueError(f"{what} is empty or a placeholder; set a real secret (or run with --dev)")
    if len(value) < MIN_SECRET_LEN:
        raise ValueError(
            f"{what} is {len(value)} characters; use at least {MIN_SECRET_LEN} "
            "(`powerd token new` makes one)"
        )


class TokenStore:
    """The configured tokens. `authenticate` hashes the presented token with every entry's
    salt and compares every digest, so the time taken says nothing about which entry, if
    any, is close."""

    def __init__(self, entries: Iterable[TokenEntry]) -> None:
        self.entries = list(entries)
        names = [e.name for e in self.entries]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"token names must be unique (audit actors): {', '.join(dup)}")

    def authenticate(self, token: str) -> Principal | None:
        found: TokenEntry | None = None
        for entry in self.entries:
            if hmac.compare_digest(_digest(token, entry.salt), entry.digest) and found is None:
                found = entry
        return None if found is None else Principal(found.name, found.role)

    @classmethod
    def from_config(
        cls, data: Mapping[str, Any], *, source: str = "tokens", dev: bool = False
    ) -> TokenStore:
        """From `{"token": [{"name", "role", "hash" | "token"}, ...]}`; AuthConfigError."""
        problems: list[tuple[str, str]] = []
        entries: list[TokenEntry] = []
        items = data.get("token", [])
        if not isinstance(items, list):
            raise AuthConfigError(source, [("token", "must be a list of [[token]] tables")])
        unknown = sorted(set(data) - {"token"})
        if unknown:
            problems.append((unknown[0], "unknown key; only [[token]] tables belong here"))
        for i, item in enumerate(items):
            where = f"token[{i}]"
            try:
                entries.append(_entry(item, dev=dev))
            except ValueError as exc:
                problems.append((where, str(exc)))
        if not entries and not problems:
            problems.append(("token", "no tokens: nobody could use the API"))
        if problems:
            raise AuthConfigError(source, problems)
        try:
            return cls(entries)
        except ValueError as exc:
            raise AuthConfigError(source, [("token", str(exc))]) from None

    @classmethod
    def from_file(cls, path: str | Path, *, dev: bool = False) -> TokenStore:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise AuthConfigError(str(path), [("", f"cannot read: {exc.strerror}")]) from None
        except tomllib.TOMLDecodeError as exc:
            raise AuthConfigError(str(path), [("", f"not valid TOML: {exc}")]) from None
        return cls.from_config(data, source=str(path), dev=dev)

    @classmethod
    def single(cls, token: str, role: Role = Role.ADMIN, name: str = "dev") -> TokenStore:
        """One token held in memory (the demo, tests); check it with `check_secret` first."""
        salt = secrets.token_bytes(16)
        return cls([TokenEntry(name, role, salt, _digest(token, salt))])


def _entry(item: object, *, dev: bool) -> TokenEntry:
    if not isinstance(item, dict):
        raise ValueError("must be a table with name, role and hash")
    extra = sorted(set(item) - {"name", "role", "hash", "token"})
    if extra:
        raise ValueError(f"unknown key {extra[0]!r}; valid: name, role, hash")
    name, role = item.get("name"), item.get("role")
    if not isinstance(name, str) or not name.strip():
        raise ValueError("name is required (it is the actor in the audit log)")
    if not isinstance(role, str):
        raise ValueError("role is required: viewer, operator or admin")
    parsed_role = Role.parse(role)
    if "token" in item:
        # A plain-text token in a config file: fine on a laptop, refused in production.
        if not dev:
            raise ValueError("plain-text 'token' is for --dev only; store its 'hash' instead")
        salt = secrets.token_bytes(16)
        return TokenEntry(name, parsed_role, salt, _digest(str(item["token"]), salt))
    if not isinstance(item.get("hash"), str):
        raise ValueError("hash is required (`powerd token new` prints one)")
    salt, digest = parse_hash(item["hash"])
    if not dev and _is_placeholder(salt, digest):
        raise ValueError("hash is of an empty or placeholder token; make a real one")
    return TokenEntry(name, parsed_role, salt, digest)


def _is_placeholder(salt: bytes, digest: bytes) -> bool:
    """Whether the hash is of an empty or example token (copied from the docs)."""
    return any(hmac.compare_digest(_digest(p, salt), digest) for p in PLACEHOLDERS)
