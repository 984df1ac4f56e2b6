"""Derandomized Hypothesis examples are the same whatever else the process imported (tests/conftest.py)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def drawn() -> list[tuple[int, ...]]:
    seen: list[tuple[int, ...]] = []

    @given(st.lists(st.integers(0, 1_000), min_size=5, max_size=5))
    @settings(derandomize=True, database=None, max_examples=200)
    def run(xs: list[int]) -> None:
        seen.append(tuple(xs))

    run()
    return seen


def test_importing_a_module_full_of_constants_changes_no_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = drawn()
    # a module of this project's kind (not a test file, not installed): Hypothesis would mix its literals in
    (tmp_path / "gpuorch_probe_constants.py").write_text(
        "VALUES = [" + ", ".join(str(i) for i in range(3, 1_000, 7)) + "]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gpuorch_probe_constants", raising=False)
    importlib.import_module("gpuorch_probe_constants")
    try:
        assert drawn() == before
    finally:
        sys.modules.pop("gpuorch_probe_constants", None)
