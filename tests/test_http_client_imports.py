"""The gateway forwards every request through httpx, whose httpcore asks ``sniffio`` which async library runs, at
every request, by importing it. Without the package each ask is a failed import that searches sys.path again (34 us
against 0.7, a few per request); ``sniffio`` is a dependency, so no request searches the import path."""

from __future__ import annotations

import asyncio
import importlib.machinery

import pytest
from httpcore._synchronization import current_async_library


async def test_asking_the_async_library_searches_no_path(monkeypatch: pytest.MonkeyPatch):
    searched: list[str] = []
    find_spec = importlib.machinery.PathFinder.find_spec

    def counting(name, path=None, target=None):
        searched.append(name)
        return find_spec(name, path, target)
    monkeypatch.setattr(importlib.machinery.PathFinder, "find_spec", counting)
    for _ in range(3):
        assert current_async_library() == "asyncio"
        await asyncio.sleep(0)
    assert searched == [], f"searched the import path for {searched}"
