"""Pool providers come from the admin's providers file; pools and events only name them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from services.autoscaler.providers import (CommandProvider, ProviderError, ProvidersFileError, load_providers,
                                           providers_path)
from services.autoscaler.service import build
from shared import events as ev
from shared.events import decode
from shared.settings import Settings

GOLDEN = Path(__file__).parent / "golden"

GOOD = """
providers:
  aws-p5:
    kind: command
    provision: ["/opt/gpuorch/provision-p5", "--region", "us-east-1"]
    terminate: ["/opt/gpuorch/terminate-p5"]
    timeout_s: 600
    env: {AWS_PROFILE: gpuorch}
"""


def providers_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "providers.yaml"
    path.write_text(text)
    return path


def one_provider(**fields) -> str:
    entry = {"kind": "command", "provision": ["/opt/p"], "terminate": ["/opt/t"], **fields}
    return json.dumps({"providers": {"gpu": entry}})  # JSON is YAML


def test_an_admins_file_names_providers_with_their_commands(tmp_path):
    conf = load_providers(providers_file(tmp_path, GOOD))["aws-p5"]
    assert conf.provision == ["/opt/gpuorch/provision-p5", "--region", "us-east-1"]
    assert conf.terminate == ["/opt/gpuorch/terminate-p5"] and conf.timeout_s == 600
    assert conf.env == {"AWS_PROFILE": "gpuorch"}


@pytest.mark.parametrize("text,why", [
    pytest.param(one_provider(provision=["provision-p5", "--fast"]),
                 "providers.gpu.provision: the executable must be an absolute path, got 'provision-p5'", id="relative path"),
    pytest.param(one_provider(kind="shell"), "providers.gpu.kind: Input should be 'command', got 'shell'", id="unknown kind"),
    pytest.param(one_provider(terminate=["/opt/t", "a\0b"]), "providers.gpu.terminate: an argument contains a NUL byte",
                 id="NUL in an argument"),
    pytest.param(one_provider(provision="/opt/p --all"), "providers.gpu.provision: Input should be a valid list",
                 id="a string, not an argv list"),
    pytest.param(one_provider(provision=[]), "providers.gpu.provision: needs at least the executable", id="empty argv"),
    pytest.param(one_provider(comand=["/opt/p"]), "providers.gpu.comand: Extra inputs are not permitted", id="a typo"),
    pytest.param(one_provider(env={"A B": "x"}), "providers.gpu.env: 'A B' is not an environment variable name",
                 id="bad env name"),
    pytest.param(json.dumps({"providers": {"simulated": json.loads(one_provider())["providers"]["gpu"]}}),
                 "'simulated' is built in", id="the built-in name"),
    pytest.param("providers: [oops", "not valid YAML", id="not YAML"),
])
def test_a_bad_providers_file_says_which_file_and_field(tmp_path, text, why):
    path = providers_file(tmp_path, text)
    with pytest.raises(ProvidersFileError) as e:
        load_providers(path)
    assert str(path) in str(e.value) and why in str(e.value)


def test_the_autoscaler_does_not_start_on_a_bad_providers_file(tmp_path):
    path = providers_file(tmp_path, one_provider(provision=["provision-p5"]))
    with pytest.raises(SystemExit, match=f"error: providers file {path}: providers.gpu.provision: the executable"):
        build(Settings(data_dir=tmp_path / "d", providers_file=path))


def test_the_providers_file_is_the_setting_or_else_the_one_in_the_data_dir(tmp_path):
    assert providers_path(Settings(data_dir=tmp_path)) is None
    assert load_providers(None) == {}
    default = providers_file(tmp_path, GOOD)
    assert providers_path(Settings(data_dir=tmp_path)) == default
    assert providers_path(Settings(data_dir=tmp_path, providers_file=tmp_path / "other.yaml")) == tmp_path / "other.yaml"
    with pytest.raises(ProvidersFileError, match="other.yaml"):  # named but missing: an error, not "no providers"
        load_providers(tmp_path / "other.yaml")


def test_a_v1_pool_event_is_read_as_v2_without_its_commands():
    env = decode((GOLDEN / "pool.defined.v1.json").read_bytes())
    assert env.type == "io.gpuorch.pool.defined.v2"
    assert env.data == ev.PoolDefined(pool="cloud-h100", profile="dgx-h100", max_nodes=8, provision_delay_s=120,
                                      cost_per_node_hour=98.32, provider="command")
    assert "provision_command" not in env.data.model_dump() and "terminate_command" not in env.data.model_dump()


def test_a_v2_pool_event_that_smuggles_commands_carries_none():
    golden = json.loads((GOLDEN / "pool.defined.v1.json").read_text())
    body = json.dumps({**golden, "type": "io.gpuorch.pool.defined.v2"}).encode()
    assert "/usr/local/bin" not in decode(body).data.model_dump_json()


async def test_a_provider_command_gets_a_minimal_environment_plus_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUORCH_ADMIN_TOKEN", "do-not-leak")
    dump = tmp_path / "env.json"
    show_env = [sys.executable, "-c", f"import json, os; open({str(dump)!r}, 'w').write(json.dumps(dict(os.environ))); "
                                      "print(json.dumps({'node_id': 'n'}))"]
    assert await CommandProvider(show_env, show_env, env={"AWS_PROFILE": "lab"}).provision("p", "dgx-h100", "n") == "n"
    env = json.loads(dump.read_text())
    assert "GPUORCH_ADMIN_TOKEN" not in env
    assert env["AWS_PROFILE"] == "lab" and env["PATH"]


async def test_a_provider_naming_a_node_that_is_no_node_id_is_an_error():
    bad = [sys.executable, "-c", "import json; print(json.dumps({'node_id': '../../etc'}))"]
    with pytest.raises(ProviderError, match="not a node id"):
        await CommandProvider(bad, bad).provision("p", "dgx-h100", "n")


async def test_a_provider_command_past_its_timeout_is_killed():
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(ProviderError, match="did not finish within 0.3s"):
        await CommandProvider(sleeper, sleeper, timeout_s=0.3).provision("p", "dgx-h100", "n")
