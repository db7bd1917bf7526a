"""A streamed prefill the router abandons (its client hung up) just as the engine's answer arrives:
the prefill task's late error must be retrieved, not left for asyncio to log as "Task exception was
never retrieved" (seen live: 2 such ERROR tracebacks, "its handoff was not staged by the engine
thread", in ~100 hang-ups on an elastic deployment; nothing leaked).

Before Python 3.12, ``asyncio.wait_for`` returns its inner result instead of raising when a
cancellation races with that result, so the cancellation of the prefill task is lost: the task goes
on, finds its staging already released by the abort, and fails after nobody awaits it any more.
Here the engine's output is queued in the same loop step as the hang-up, which makes the race certain."""
from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

import pytest

from cpd.worker.server import _prefill_lines


class _Request:
    async def is_disconnected(self) -> bool:
        return False


def _worker_state() -> SimpleNamespace:
    runner = SimpleNamespace(abort=lambda rid: None, close_stream=lambda rid: None, take_staged=lambda rid: None)
    return SimpleNamespace(runner=runner, sender=SimpleNamespace(release=lambda rid, generation=None: None),
                           connector=None, new_fallbacks=lambda: {}, new_transfers=lambda: [])


def _handoff_output() -> SimpleNamespace:
    return SimpleNamespace(finish_reason="handoff", new_token_ids=[7], num_cached_tokens_by_tier={},
                           queue_s=0.0, step_tokens=None, step_s=None)


def test_a_prefill_abandoned_as_its_answer_arrives_leaves_no_unretrieved_task_error():
    reported: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx))
        queue: asyncio.Queue = asyncio.Queue()
        lines = _prefill_lines(_worker_state(), "cmpl-x", SimpleNamespace(queue=queue), _Request(), 0.0)
        consumer = asyncio.ensure_future(lines.__anext__())
        await asyncio.sleep(0.05)                   # the prefill task waits for the engine
        queue.put_nowait(_handoff_output())         # the engine answers ...
        consumer.cancel()                           # ... as the router hangs up
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await lines.aclose()
        for _ in range(5):
            await asyncio.sleep(0.01)               # the task ends with its late error
        gc.collect()                                # an unretrieved task error is reported when collected

    asyncio.run(main())
    gc.collect()
    assert not [c for c in reported if "never retrieved" in str(c.get("message"))], \
        [(c.get("message"), c.get("exception")) for c in reported]
