import asyncio, time, sys
import pytest
from tests.support import in_process_stack
from tests.builders import job
from tests.health.test_health_stack import nodes_up, submit, SLEEPER

async def dump():
    await asyncio.sleep(6)
    for t in asyncio.all_tasks():
        print("TASK", t.get_name(), file=sys.stderr)
        t.print_stack(file=sys.stderr)

@pytest.mark.parametrize("delay", [0.0, 0.5, 1.0, 1.5])
async def test_shutdown(eventlog, agents, delay):
    async with in_process_stack(eventlog) as (client, services):
        agents("a")
        await nodes_up(client, 1)
        spec = job("overrun").gpus(1).time_limit(1).build().model_copy(update={"command": SLEEPER, "max_retries": 3})
        job_id = await submit(client, spec)
        await asyncio.sleep(delay)
        t1 = time.monotonic()
        d = asyncio.create_task(dump())
    print("exit took", time.monotonic() - t1)
