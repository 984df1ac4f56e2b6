"""shared/eventlog.py replaces two private methods of nats-py's client on its own instance and reads two
private attributes (a subscription's ``_id``, the JetStream context's ``_jsm``). pyproject pins nats-py to the
releases these checks pass on: a new release that changes them fails here, loudly, before it fails in a replay."""

from __future__ import annotations

import inspect

import pytest
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext
from nats.js.manager import JetStreamManager
from nats.protocol.parser import Parser

from shared.eventlog import EventLog, _parse_header_lines


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_the_private_methods_we_replace_keep_their_signatures():
    assert params(Client._process_msg) == ["self", "sid", "subject", "reply", "data", "headers"]
    assert isinstance(inspect.getattr_static(Client, "_parse_header_lines"), staticmethod)
    assert params(Client._parse_header_lines) == ["raw"]
    # the client parses headers through the attribute we replace; the protocol parser calls the one we wrap
    assert "self._parse_header_lines(" in inspect.getsource(Client._process_headers)
    assert "self.nc._process_msg(sid, subject, reply, payload, hdr)" in inspect.getsource(Parser.parse)


def test_the_private_attributes_we_read_are_still_there():
    assert "self._id = id" in inspect.getsource(Subscription.__init__)
    assert isinstance(inspect.getattr_static(JetStreamContext, "_jsm"), property)
    assert params(JetStreamManager.add_consumer)[:3] == ["self", "stream", "config"]


BLOCKS = [
    b"Nats-Msg-Id: abc\r\nContent-Type: application/cloudevents+json\r\nce-type: io.gpuorch.job.queued.v1\r\n\r\n",
    b"a:b\r\nc:\tspaced \r\n\r\n",  # no space after the colon, tabs and trailing blanks around the value
    b"empty:\r\nno colon here\r\n\r\n",
    b"caf\xc3\xa9: x\r\nok: caf\xc3\xa9\r\nbad: \xff\xfe\r\n\r\n",  # a non-ASCII name is dropped; values decode leniently
    b"with space: x\r\nwith\ttab: y\r\nwith\x1csep: z\r\n good : w\r\n\r\n",  # whitespace inside a name drops it
    b"dup: 1\r\ndup: 2\r\n\r\n",
    b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n",
    b"",
]


@pytest.mark.parametrize("raw", BLOCKS, ids=range(len(BLOCKS)))
def test_our_header_parser_reads_every_block_as_nats_py_does(raw: bytes):
    assert _parse_header_lines(raw) == Client._parse_header_lines(raw)


async def test_a_message_with_headers_arrives_with_the_same_headers_through_our_client(eventlog: EventLog):
    headers = {"Nats-Msg-Id": "x-1", "ce-type": "io.gpuorch.job.queued.v1", "traceparent": "00-aa-bb-01", "ok": "café"}
    sub = await eventlog.nc.subscribe("probe.headers")
    await eventlog.nc.publish("probe.headers", b"body", headers=headers)
    msg = await sub.next_msg(timeout=2)
    assert msg.headers == headers and msg.data == b"body"
    assert eventlog.nc._parse_header_lines is _parse_header_lines
