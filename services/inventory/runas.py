"""Which local account a task runs as: its owner's, by the node's user map or the system's, never root unless allowed.

A root agent resolves each job's owner (the API user who submitted it) to a uid, a gid and supplementary
groups, in this order:

1. the user map given with ``--user-map`` (YAML)::

       users:
         alice: {uid: 1001, gid: 1001}
         bob: {uid: 1002, gid: 1002, groups: [2000]}
       default: nobody      # local account for owners found nowhere else; null: refuse them
       allow_root: false    # true lets an owner resolve to uid or gid 0

2. the system account of the same name (``pwd.getpwnam``),
3. the map's ``default`` account (``nobody`` when no map is given), looked up in the map, then the system,

else the task is refused with a reason a person can act on. Supplementary groups: a system account gets
its own groups (``os.getgrouplist``), as a login or a Slurm job step has them, so group-shared datasets
stay readable; a map entry gets exactly the ``groups`` it lists (none by default). Never the agent's.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

Id = Annotated[int, Field(ge=0, lt=2**32 - 1)]  # a uid or gid (2**32-1 is -1: "unchanged" to setreuid)


class MappedAccount(BaseModel):
    model_config = ConfigDict(extra="forbid")
    uid: Id
    gid: Id
    groups: list[Id] = Field(default_factory=list, max_length=1024)


class UserMap(BaseModel):
    model_config = ConfigDict(extra="forbid")
    users: dict[str, MappedAccount] = Field(default_factory=dict)
    default: str | None = "nobody"
    allow_root: bool = False


@dataclass(frozen=True)
class RunAs:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    @property
    def root(self) -> bool:
        return self.uid == 0 or self.gid == 0 or 0 in self.groups


class UserMapError(Exception):
    """The user map file cannot be read or does not fit its schema."""


class RunAsRefused(Exception):
    """No account a task of this owner may run as, on this node."""


def load_user_map(path: Path) -> UserMap:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserMapError(f"cannot read the user map {path}: {e}") from None
    try:
        return UserMap.model_validate(raw or {})
    except ValidationError as e:
        errors = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise UserMapError(f"user map {path}: {errors}") from None


def system_account(name: str) -> RunAs | None:
    try:
        pw = pwd.getpwnam(name)
    except (KeyError, ValueError):
        return None
    return RunAs(pw.pw_name, pw.pw_uid, pw.pw_gid, tuple(os.getgrouplist(pw.pw_name, pw.pw_gid)))


def agent_account() -> RunAs:
    """The agent's own user: what tasks run as when the agent cannot switch (it is not root)."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    return RunAs(name, uid, gid)


def resolve(owner: str, node_id: str, user_map: UserMap | None = None, allow_root: bool = False,
            lookup: Callable[[str], RunAs | None] = system_account) -> RunAs:
    """The account a task of ``owner`` runs as on ``node_id``; raises RunAsRefused with the reason."""
    m = user_map or UserMap()

    def find(name: str) -> RunAs | None:
        if name in m.users:
            a = m.users[name]
            return RunAs(name, a.uid, a.gid, tuple(a.groups))
        return lookup(name) if name else None

    who = f"owner {owner!r}" if owner else "a job submitted before users existed (no owner)"
    account = find(owner)
    if account is None:
        if m.default is None:
            raise RunAsRefused(f"no local account for {who} on node {node_id}: add it to the user map")
        account = find(m.default)
        if account is None:
            raise RunAsRefused(f"no local account for {who} on node {node_id}, nor the default account "
                               f"{m.default!r}: add it to the user map")
    if account.root and not (allow_root or m.allow_root):
        raise RunAsRefused(f"{who} would run as root on node {node_id} (account {account.name!r}, uid {account.uid}, "
                           f"gid {account.gid}): refused; allow it with allow_root: true in the user map "
                           "or the agent's --allow-root-tasks")
    return account
