"""One bad pool never stops the others: a pool.defined with a profile this release does not know (an old or
forged event) is left alone and says why; the other pools keep scaling."""

from __future__ import annotations

import logging

from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope
from tests.autoscaler.test_autoscaler_stack import cycles_pass, events_of
from tests.support import in_process_stack, until


async def test_a_pool_with_an_unknown_profile_is_left_alone_and_the_others_still_scale(eventlog: EventLog, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="gpuorch.autoscaler")
    async with in_process_stack(eventlog, autoscale_interval_s=0.3, data_dir=tmp_path / "d") as (client, services):
        await eventlog.append(Envelope(ev.PoolDefined(pool="old", profile="dgx-a100-retired", min_nodes=1, max_nodes=2),
                                       source="/gpuorch/autoscaler"))
        r = await client.put("/v1/pools/good", json={"profile": "t4-4x", "min_nodes": 1, "max_nodes": 1})
        assert r.status_code == 200, r.text

        async def good_pool_grew() -> bool:
            return any(e["data"]["pool"] == "good" for e in await events_of(client, "pool.scale_requested"))

        await until(good_pool_grew, 20, "the good pool to reach its minimum")
        await cycles_pass(client, 3)
        pools = {p["name"]: p for p in (await client.get("/v1/pools")).json()}
        assert pools["old"]["provider_error"].startswith("unknown node profile 'dgx-a100-retired'")
        assert pools["good"]["provider_error"] is None
        assert not any(e["data"]["pool"] == "old" for e in await events_of(client, "pool.scale_requested"))
    said = [r for r in caplog.records if "pool=old" in r.getMessage()]
    assert len(said) == 1 and "pool_not_scaled" in said[0].getMessage(), [r.getMessage() for r in said]
    assert not [r for r in caplog.records if "autoscale_failed" in r.getMessage()]
