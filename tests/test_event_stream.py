"""GET /v1/events/stream: server-sent events of the log, filtered by type and subject, over real HTTP."""

from __future__ import annotations

import asyncio
import json

import httpx

from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope
from shared.model import QueueSpec
from shared.natsd import free_port
from shared.runtime import http_server
from tests.support import eventually, in_process_stack


async def test_the_stream_sends_the_events_of_its_type_from_the_position_asked_each_with_its_sequence(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, services):
        first = await eventlog.append(Envelope(ev.QueueDefined(path="research", spec=QueueSpec())))
        await eventlog.append(Envelope(ev.QueueDefined(path="prod", spec=QueueSpec())))
        port = free_port()
        server = http_server(client.app, "127.0.0.1", port)
        serving = asyncio.create_task(server.serve())
        try:
            await eventually(lambda: server.started, what="the HTTP server")
            got: list[tuple[str, dict]] = []
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=client.headers) as http:
                params = {"after": first - 1, "type": "queue.defined"}
                async with http.stream("GET", "/v1/events/stream", params=params, timeout=10) as r:
                    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                    lines = r.aiter_lines()
                    while len(got) < 2:
                        fields = {}
                        async for line in lines:
                            if not line:
                                break
                            key, _, value = line.partition(": ")
                            fields[key] = value
                        if "data" in fields:
                            got.append((fields["event"], {"sse_id": fields["id"], **json.loads(fields["data"])}))
            assert [(kind, row["data"]["path"]) for kind, row in got] == [("io.gpuorch.queue.defined.v1", "research"),
                                                                         ("io.gpuorch.queue.defined.v1", "prod")]
            assert [int(row["sse_id"]) for _, row in got] == [row["seq"] for _, row in got] and got[0][1]["seq"] == first
            bad = await client.get("/v1/events/stream", params={"subject": "job.>"})
            assert bad.status_code == 422, "a NATS wildcard is not a subject"
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 10)
