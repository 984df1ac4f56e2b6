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
