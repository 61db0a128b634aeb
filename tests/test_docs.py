"""The docs kept true to the code, by reading both (nothing runs).

- Every alarm kind the code can raise has a row in the alarm tables an operator reads
  (docs/controller.md, docs/operations.md), and every row names a kind the code raises.
- Every migration's docstring names its own revision and the one it revises.
- References to docs/performance.md and the decision records point at sections and files
  that exist.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "powerd"
DOCS = ROOT / "docs"
MIGRATIONS = ROOT / "migrations" / "versions"

# The ways code raises an alarm or records an event: `Alarms.set` / `Alarms.once` on an
# `alarms` attribute or parameter, and the helpers that forward to them (`_alarm(kind,
# message)`, `set_alarm`, a stage's `alarm` callback).
ALARM_METHODS = {"set", "once"}
ALARM_HELPERS = {"_alarm", "set_alarm"}


def _is_alarm_call(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Name):  # an `alarm(kind, message)` callback a stage is given
        return func.id == "alarm" and bool(call.args)
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr in ALARM_HELPERS:
        return bool(call.args)  # a helper without arguments raises a constant kind inside
    receiver = func.value
    named = (isinstance(receiver, ast.Attribute) and receiver.attr == "alarms") or (
        isinstance(receiver, ast.Name) and receiver.id == "alarms"
    )
    return func.attr in ALARM_METHODS and named


def _forwards_own_parameter(call: ast.Call, function: ast.FunctionDef | None) -> bool:
    """`def _alarm(self, kind, message)` passing its `kind` on: a helper, not a raise."""
    first = call.args[0]
    return (
        function is not None
        and function.name in ALARM_HELPERS
        and isinstance(first, ast.Name)
        and first.id in {a.arg for a in function.args.args}
    )


def raised_alarm_kinds() -> dict[str, list[str]]:
    """Every kind raised anywhere in powerd/, with where; a kind that is not a literal (other
    than a helper passing its parameter on) fails, so a new raise cannot hide from this."""
    kinds: dict[str, list[str]] = {}
    unknown: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(ROOT)
        for function, call in _calls_with_function(tree):
            if not _is_alarm_call(call):
                continue
            first = call.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                kinds.setdefault(first.value, []).append(f"{where}:{call.lineno}")
            elif not _forwards_own_parameter(call, function):
                unknown.append(f"{where}:{call.lineno}: {ast.unparse(call)[:80]}")
    assert not unknown, "alarm kinds that are not literals (this test cannot see them):\n" + (
        "\n".join(unknown)
    )
    return kinds


def _calls_with_function(tree: ast.AST) -> list[tuple[ast.FunctionDef | None, ast.Call]]:
    found: list[tuple[ast.FunctionDef | None, ast.Call]] = []

    def visit(node: ast.AST, function: ast.FunctionDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.FunctionDef) else function
            if isinstance(child, ast.Call):
                found.append((function, child))
            visit(child, inner)

    visit(tree, None)
    return found


def table_kinds(doc: Path, heading: str) -> list[str]:
    """The first backticked word of each table row in `heading`'s section of `doc`."""
    lines = doc.read_text().splitlines()
    start = lines.index(heading)
    kinds = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        match = re.match(r"\| `([a-z_]+)`", line)
        if match:
            kinds.append(match.group(1))
    assert kinds, f"{doc.name}: no alarm table under {heading!r}"
    return kinds


ALARM_TABLES = [
    (DOCS / "controller.md", "## Alarms"),
    (DOCS / "operations.md", "## Alarms and what to do"),
]


def test_the_scan_finds_the_alarms_it_must() -> None:
    kinds = raised_alarm_kinds()
    # One of each way of raising: the engine's helper, the daemon's, Alarms.set and .once.
    assert {"budget_over", "store_unreachable", "cap_overridden", "wall_clock_step"} <= set(kinds)


@pytest.mark.parametrize(("doc", "heading"), ALARM_TABLES, ids=lambda v: getattr(v, "name", v))
def test_every_alarm_the_code_raises_has_a_row(doc: Path, heading: str) -> None:
    raised = raised_alarm_kinds()
    listed = table_kinds(doc, heading)
    missing = {k: raised[k] for k in sorted(set(raised) - set(listed))}
    assert not missing, f"{doc.name} lists no row for: {missing}"


@pytest.mark.parametrize(("doc", "heading"), ALARM_TABLES, ids=lambda v: getattr(v, "name", v))
def test_every_alarm_row_is_one_the_code_raises(doc: Path, heading: str) -> None:
    listed = table_kinds(doc, heading)
    assert len(listed) == len(set(listed)), f"{doc.name}: a kind listed twice"
    stale = sorted(set(listed) - set(raised_alarm_kinds()))
    assert not stale, f"{doc.name} lists kinds nothing raises: {stale}"


def _migration_fields(path: Path) -> tuple[str | None, str | None, str | None, str | None]:
    """(docstring's Revision ID, its Revises, `revision`, `down_revision`)."""
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree) or ""
    said_id = re.search(r"^Revision ID: *(\S*)$", doc, re.M)
    said_revises = re.search(r"^Revises: *(\S*)$", doc, re.M)
    values: dict[str, str | None] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            for target in targets:
                if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
                    values[target.id] = node.value.value
    return (
        said_id.group(1) if said_id else None,
        said_revises.group(1) if said_revises else None,
        values.get("revision"),
        values.get("down_revision"),
    )


MIGRATION_FILES = sorted(p for p in MIGRATIONS.glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", MIGRATION_FILES, ids=lambda p: p.name)
def test_a_migrations_docstring_names_its_revisions(path: Path) -> None:
    said_id, said_revises, revision, down_revision = _migration_fields(path)
    assert revision is not None and path.name.startswith(revision + "_")
    assert said_id == revision
    assert said_revises == (down_revision or "")


# ---- references into docs/performance.md and docs/decisions/ ----


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _headings(doc: Path) -> list[str]:
    in_code = False
    out = []
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


TARGET_DOCS = [DOCS / "performance.md", *sorted((DOCS / "decisions").glob("*.md"))]


@pytest.mark.parametrize("doc", TARGET_DOCS, ids=lambda p: p.name)
def test_links_within_the_figures_and_decisions_resolve(doc: Path) -> None:
    anchors = {_slug(h) for h in _headings(doc)}
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith("http"):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        assert linked.exists(), f"{doc.name}: link to a missing file {target}"
        if anchor:
            assert anchor in {_slug(h) for h in _headings(linked)} | (
                anchors if linked == doc else set()
            ), f"{doc.name}: no section for #{anchor}"


def _quoted_sections(source: str, doc_name: str) -> list[str]:
    """Section names quoted after a reference such as `docs/performance.md, "Steering loop"`,
    with line breaks and comment markers inside the quote taken out."""
    pattern = re.escape(doc_name) + r',?\s+"([^"]+)"'
    names = []
    for match in re.finditer(pattern, source):
        words = [w for w in match.group(1).split() if w not in {"#", "--"}]
        names.append(" ".join(words))
    return names


def _sources() -> list[Path]:
    found = [*DOCS.rglob("*.md"), ROOT / "README.md"]
    for folder in (PACKAGE, ROOT / "tests", ROOT / "bench"):
        found.extend(folder.rglob("*.py"))
    return sorted(found)


@pytest.mark.parametrize("doc_name", ["docs/performance.md"])
def test_quoted_sections_of_the_figures_exist(doc_name: str) -> None:
    headings = _headings(ROOT / doc_name)
    missing = []
    for source in _sources():
        for name in _quoted_sections(source.read_text(), doc_name):
            if not any(h.startswith(name) for h in headings):
                missing.append(f"{source.relative_to(ROOT)}: {name!r}")
    assert not missing, f"sections of {doc_name} that do not exist:\n" + "\n".join(missing)


def test_every_decision_record_is_in_the_index() -> None:
    index = (DOCS / "decisions" / "README.md").read_text()
    records = sorted(p.name for p in (DOCS / "decisions").glob("[0-9][0-9][0-9][0-9]-*.md"))
    assert records, "no decision records"
    assert [n for n in records if f"({n})" not in index] == []
    numbers = [n[:4] for n in records]
    assert numbers == [f"{i:04d}" for i in range(1, len(records) + 1)], "numbers with gaps"
