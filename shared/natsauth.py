"""Who may connect to the bus, and what each may publish and read: users per role, subject permissions.

Two roles. ``control`` (the services, the gateway, the operator's CLI) may do
anything. ``agent-<node>`` may read its own node's work (``gpuorch.work.<node>.>``,
not the event log) through JetStream consumers and publish only about its own
node: its reports (``gpuorch.agent.<node>.*``, which the inventory service checks
and appends to the log), its telemetry, its heartbeat key,
its dead letters; it answers the control plane's requests on ``gpuorch.agentctl.<node>.*``.
It cannot append to the log, read the token bucket or touch another node's subjects.

The embedded nats-server takes these users from ``users.json`` in its store (mode
0600, generated passwords); adding a node adds a user and reloads the server
(SIGHUP). Processes get their credentials from GPUORCH_NATS_USER/GPUORCH_NATS_PASSWORD
or a credentials file, never on the command line (which any local user can read).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import signal
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

CONTROL = "control"
AGENT_PREFIX = "agent-"
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def node_token(node_id: str) -> str:
    """A node id as one subject token (node ids never hold ':', so this is one-to-one)."""
    return node_id.replace(".", ":")


def agent_user(node_id: str) -> str:
    return AGENT_PREFIX + node_token(node_id)


def agent_inbox(node_id: str) -> str:
    return f"_INBOX.{agent_user(node_id)}"


def report_subject(node_id: str, kind: str) -> str:
    return f"gpuorch.agent.{node_token(node_id)}.{kind}"


def control_subject(node_id: str, verb: str) -> str:
    return f"gpuorch.agentctl.{node_token(node_id)}.{verb}"


def telemetry_subject(node_id: str, xid: bool = False) -> str:
    return f"gpuorch.telemetry.{node_token(node_id)}" + (".xid" if xid else "")


def node_of_subject(subject: str, prefix: str) -> str | None:
    """``gpuorch.agent.<token>.<kind>`` -> the node id in it (None if the subject is not under ``prefix``)."""
    if not subject.startswith(prefix + "."):
        return None
    token = subject[len(prefix) + 1:].split(".", 1)[0]
    node = token.replace(":", ".")
    return node if NODE_ID.match(node) else None


def agent_permissions(node_id: str) -> dict:
    t = node_token(node_id)
    return {
        "publish": {"allow": [
            f"gpuorch.agent.{t}.>",
            f"gpuorch.telemetry.{t}", f"gpuorch.telemetry.{t}.xid",
            f"$KV.gpuorch_heartbeats.{node_id}",
            f"gpuorch.dlq.{agent_user(node_id)}.>",
            "$JS.API.INFO",
            "$JS.API.STREAM.INFO.GPUORCH", "$JS.API.STREAM.INFO.KV_gpuorch_heartbeats",
            # its node's work only (services.inventory.work): a consumer is created by name with its filter in the
            # subject, so the filter is the permission's to bound; the event log itself it does not read
            "$JS.API.STREAM.INFO.GPUORCH_WORK", f"$JS.API.CONSUMER.CREATE.GPUORCH_WORK.*.gpuorch.work.{t}.>",
            "$JS.API.CONSUMER.INFO.GPUORCH_WORK.*", "$JS.API.CONSUMER.MSG.NEXT.GPUORCH_WORK.*", "$JS.ACK.GPUORCH_WORK.>",
        ]},
        "subscribe": {"allow": [f"{agent_inbox(node_id)}.>", f"gpuorch.agentctl.{t}.>"]},
        "allow_responses": True,
    }


@dataclass(frozen=True)
class NatsUser:
    name: str
    password: str
    node: str | None = None  # an agent's node; None for the control plane


class Credentials:
    """The users of one embedded nats-server, kept in ``<store>/auth/users.json`` (0600)."""

    @classmethod
    def of_data_dir(cls, data_dir: Path) -> "Credentials":
        """The embedded server's users of a `gpuorch up` data dir."""
        return cls(Path(data_dir) / "nats" / "auth")

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / "users.json"
        self.conf = self.directory / "auth.conf"  # included by the server's configuration
        self.pid_file = self.directory.parent / "nats-server.pid"  # the server there writes it

    @contextmanager
    def _locked(self) -> Iterator[dict[str, dict]]:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.directory, 0o700)
        with open(self.directory / "users.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            users = self._read()
            before = dict(users)
            yield users
            if users != before or not self.conf.exists():
                _write_private(self.path, json.dumps(users, indent=2))
                _write_private(self.conf, f"authorization: {json.dumps(self._authorization(users))}\n")
                self._reload_server()

    def _read(self) -> dict[str, dict]:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    def users(self) -> list[NatsUser]:
        return [NatsUser(**u) for u in self._read().values()]

    def ensure(self, name: str, node: str | None = None) -> NatsUser:
        with self._locked() as users:
            if name not in users:
                users[name] = asdict(NatsUser(name, secrets.token_urlsafe(24), node))
            return NatsUser(**users[name])

    def control(self) -> NatsUser:
        return self.ensure(CONTROL)

    def agent(self, node_id: str) -> NatsUser:
        if not NODE_ID.match(node_id):
            raise ValueError(f"node id {node_id!r}: letters, digits, '.', '_' or '-'")
        return self.ensure(agent_user(node_id), node_id)

    def write_conf(self) -> Path:
        with self._locked():
            pass
        return self.conf

    @staticmethod
    def _authorization(users: dict[str, dict]) -> dict:
        """The nats-server ``authorization`` block: every user with its permissions (control: all)."""
        out = []
        for u in users.values():
            entry: dict = {"user": u["name"], "password": u["password"]}
            if u.get("node") is not None:
                entry["permissions"] = agent_permissions(u["node"])
            out.append(entry)
        return {"users": out}

    def _reload_server(self) -> None:
        """A running server re-reads its configuration (new users) on SIGHUP."""
        try:
            os.kill(int(self.pid_file.read_text().strip()), signal.SIGHUP)
        except (OSError, ValueError):
            pass  # not running: it reads the file when it starts


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def client_env(user: NatsUser) -> dict[str, str]:
    """The environment that hands a child process its bus credentials."""
    return {"GPUORCH_NATS_USER": user.name, "GPUORCH_NATS_PASSWORD": user.password}


def credentials_from(env: Mapping[str, str], file: Path | None = None) -> tuple[str | None, str | None]:
    """(user, password) from a credentials file (JSON {"user", "password"}; ``file`` or GPUORCH_NATS_CREDENTIALS),
    else GPUORCH_NATS_USER/PASSWORD."""
    file = file or (Path(env["GPUORCH_NATS_CREDENTIALS"]) if env.get("GPUORCH_NATS_CREDENTIALS") else None)
    if file is not None:
        doc = json.loads(Path(file).read_text())
        return doc["user"], doc["password"]
    return env.get("GPUORCH_NATS_USER") or None, env.get("GPUORCH_NATS_PASSWORD") or None


def write_client_files(creds: Credentials, directory: Path) -> list[Path]:
    """One credentials file per user (``<user>.json``, 0600) to hand to its process: the operator's part of
    setting up an external NATS (compose) with the users in ``creds.conf``."""
    out = []
    for u in creds.users():
        path = Path(directory) / f"{u.name}.json"
        _write_private(path, json.dumps({"user": u.name, "password": u.password}))
        out.append(path)
    return out
