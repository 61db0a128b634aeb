"""`powerd pilot report` fed what an operator may give it: windows far wider than the data,
windows the data covers in part, outputs that cannot be written (the store as in
test_pilot)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pilot import B0, SPAN_S, filled

from powerd.pilot.source import StoreSource
from powerd.pilot.windows import Window

YEAR_S = 365 * 86400.0


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return filled(f"sqlite:///{tmp_path_factory.mktemp('pilot-inputs') / 'powerd.db'}")


@pytest.mark.parametrize("groups", [True, False])
def test_a_window_of_years_reads_only_where_the_store_has_data(
    groups: bool, tmp_path: Path, sqlite_store: str
) -> None:
    # Before: one SQL round per 6 hours of the window, data or not (1,460 for a year; a
    # window of centuries never finished). `groups=False`: a store that kept ticks only.
    url = sqlite_store if groups else filled(f"sqlite:///{tmp_path / 'old.db'}", groups=False)
    lines: list[str] = []
    source = StoreSource(url, lines.append)
    try:
        wide = source.read(Window("baseline", B0 - YEAR_S, B0 + SPAN_S))
        tight = source.read(Window("baseline", B0, B0 + SPAN_S))
    finally:
        source.close()
    rounds = [ln for ln in lines if "GPU minutes" in ln or "ticks" in ln]
    assert rounds and all(" 1/1 " in ln for ln in rounds), rounds[:3]
    assert (wide.fleet.minute == tight.fleet.minute).all()
    assert [g.name for g in wide.groups] == [g.name for g in tight.groups]
