"""The command provider: an operator's program gets JSON on stdin and answers JSON."""

from __future__ import annotations

import sys

import pytest

from services.autoscaler.providers import CommandProvider, ProviderError

ECHO = [sys.executable, "-c", "import json, sys; r = json.load(sys.stdin); print(json.dumps({'node_id': 'cloud-' + r['node_id'], 'seen': r}))"]


async def test_provision_passes_the_request_and_reads_the_node_id_back():
    p = CommandProvider(ECHO, ECHO)
    assert await p.provision("gpu", "dgx-h100", "gpu-1-0") == "cloud-gpu-1-0"
    await p.terminate("gpu", "cloud-gpu-1-0")


@pytest.mark.parametrize("cmd,why", [
    ([sys.executable, "-c", "import sys; sys.stderr.write('quota exceeded'); sys.exit(3)"], "exited 3: quota exceeded"),
    ([sys.executable, "-c", "print('ok')"], "did not print JSON"),
    ([sys.executable, "-c", "print('[1]')"], "not a JSON object"),
])
async def test_a_failing_or_garbled_provider_is_a_clear_error(cmd, why):
    with pytest.raises(ProviderError, match=why):
        await CommandProvider(cmd, cmd).provision("gpu", "dgx-h100", "n")


async def test_the_simulated_provider_signals_only_the_agent_it_started_never_a_process_that_got_its_pid(tmp_path):
    """A pid file outlives its agent (a stack stopped with its pool nodes, a machine rebooted); the pid may then be
    another process's. terminate() and stop_all() used to send it SIGTERM, then SIGKILL, whoever it was."""
    import contextlib
    import os
    import signal
    import subprocess

    from services.autoscaler.providers import SimulatedProvider
    from shared.instance import process_start

    provider = SimulatedProvider("nats://127.0.0.1:1", tmp_path)
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    # "our agent": not this test's child (the provider's agents are reaped by their own parent), so that it is gone,
    # not a zombie, once stopped
    ours = int(subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                              check=True).stdout)
    try:
        for node, text in (("old", f"{bystander.pid}"), ("reused", f"{bystander.pid} 1")):  # no or another start time
            (tmp_path / node).mkdir()
            (tmp_path / node / "pid").write_text(text)
        provider.stop_all()
        await provider.terminate("p", "old")
        await provider.terminate("p", "reused")
        assert bystander.poll() is None, "a process that only shares the pid was signalled"
        assert not (tmp_path / "reused" / "pid").exists(), "a stale pid file is dropped"

        (tmp_path / "n1").mkdir()
        (tmp_path / "n1" / "pid").write_text(f"{ours} {process_start(ours)}")
        await provider.terminate("p", "n1")
        assert process_start(ours) == "", "the agent it started is stopped"
    finally:
        bystander.kill()
        bystander.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(ours, signal.SIGKILL)
