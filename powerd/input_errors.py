"""Errors in what a user hands us (files, requests): where, and what would be valid."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError


class InputError(ValueError):
    """Unusable input, with each problem's path inside the source and what is wrong."""

    kind = "input"

    def __init__(self, source: str, problems: Sequence[tuple[str, str]]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = [f"{source}: invalid {self.kind} ({len(self.problems)} problem(s))"]
        lines += [f"  at {path or '<top>'}: {msg}" for path, msg in self.problems]
        super().__init__("\n".join(lines))


def format_loc(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def validation_problems(exc: ValidationError) -> list[tuple[str, str]]:
    """pydantic's errors as (path, message) pairs a person can act on."""
    problems = []
    for err in exc.errors():
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check spelling; see docs/ for the keys allowed here)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        problems.append((format_loc(loc), msg))
    return problems


def read_text(path: str | Path, error: type[InputError]) -> str:
    """A UTF-8 text file, or `error` saying why it cannot be read."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(str(p), [("", f"cannot read the file: {exc.strerror or exc}")]) from None
    except UnicodeDecodeError:
        raise error(str(p), [("", "the file is not UTF-8 text")]) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load's loader, refusing a key given twice in one mapping: YAML keeps the last
    silently, so `tick_s: 60` then `tick_s: 30` (or a budget given twice) would run on
    whichever came last, with no word."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: keys given here win
            continue
        key = loader.construct_object(key_node)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: construct_mapping says so
            continue
        seen.setdefault(key, key_node.start_mark.line)
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first given on line {first + 1}): give each key once",
                key_node.start_mark,
            )
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def parse_yaml(text: str, source: str, error: type[InputError]) -> Any:
    """YAML data, or `error` with the line and column of the mistake (a key given twice in
    one mapping is one)."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no Python objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise error(source, [(where, f"malformed YAML: {problem}")]) from None
