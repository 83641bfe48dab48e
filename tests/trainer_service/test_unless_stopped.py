"""The trainer's wait on a task publish gives way to a stop (the publish is cancelled), and
still raises a publish's own error when no stop came."""

import asyncio

import pytest

from trainer_service.service import unless_stopped


def test_a_stop_cancels_a_publish_that_does_not_end():
    async def scenario():
        stopping, hung = asyncio.Event(), asyncio.Event()
        job = asyncio.ensure_future(hung.wait())  # a publish waiting on a NATS that never answers
        asyncio.get_running_loop().call_soon(stopping.set)
        finished = await unless_stopped(job, stopping)
        return finished, job.cancelled()

    assert asyncio.run(scenario()) == (False, True)


def test_a_finished_publish_counts_and_its_error_is_raised():
    async def ok():
        return 3

    async def fails():
        raise RuntimeError("no PubAck")

    async def scenario(work):
        return await unless_stopped(work(), asyncio.Event())

    assert asyncio.run(scenario(ok)) is True
    with pytest.raises(RuntimeError, match="no PubAck"):
        asyncio.run(scenario(fails))
