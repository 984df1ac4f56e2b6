"""The control plane asks an agent over the bus: a task's logs, an injected XID (simulated nodes).

Requests go to ``gpuorch.agentctl.<node>.<verb>``: only control-plane credentials may
publish there and only that node's agent may subscribe (shared.natsauth), so an agent
has no HTTP endpoint for anyone to call and the API never dials an address an agent
announced. Every request is checked by the agent against the models below.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import nats
from pydantic import BaseModel, ConfigDict, Field

from shared.model import JOB_ID, Int
from shared.natsauth import control_subject

MAX_LOG_CHUNK = 1 << 20  # bytes per answer: far below the bus's max payload


class LogRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job_id: str = Field(pattern=JOB_ID)
    task: int = Field(0, ge=0, le=1_000_000)
    attempt: int | None = Field(None, ge=0)
    stream: Literal["stdout", "stderr"] = "stdout"
    offset: int = Field(0, ge=0)
    limit: int = Field(MAX_LOG_CHUNK, ge=1, le=MAX_LOG_CHUNK)
    tail: bool = False  # the last ``limit`` bytes, whatever ``offset``


class XidRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpu_index: Int = Field(ge=0, le=1024)
    xid: Int = Field(ge=1, le=65535)


class AgentError(Exception):
    """The agent answered no (``status`` as HTTP would say it), or did not answer (503)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


async def ask(nc: Any, node_id: str, verb: str, body: BaseModel, timeout: float = 10) -> dict[str, Any]:
    try:
        # what is not the default is sent: an older agent, which forbids fields it does not know, reads the rest
        msg = await nc.request(control_subject(node_id, verb), body.model_dump_json(exclude_defaults=True).encode(),
                               timeout=timeout)
    except nats.errors.NoRespondersError:
        raise AgentError(503, f"the agent of {node_id} is not connected") from None
    except (nats.errors.TimeoutError, TimeoutError):
        raise AgentError(503, f"the agent of {node_id} did not answer within {timeout:g}s") from None
    try:
        doc = json.loads(msg.data)
    except ValueError:
        raise AgentError(502, f"the agent of {node_id} answered something unreadable") from None
    if not isinstance(doc, dict):
        raise AgentError(502, f"the agent of {node_id} answered something unreadable")
    if "error" in doc:
        status = doc.get("status")
        raise AgentError(status if isinstance(status, int) and 400 <= status < 600 else 502, str(doc["error"])[:2000])
    return doc


def answer(result: dict[str, Any] | None = None, *, status: int = 200, error: str | None = None) -> bytes:
    return json.dumps({"status": status, "error": error} if error is not None else result).encode()
