"""Which requests made a batched model forward fail: bisection over the step's sequences.

A forward runs every scheduled sequence at once, so an exception from it does not say whose
it is. Failing the whole step (as the engine once did) lets one bad request fail its batch
neighbours. Instead the engine runs the failed step again on halves of it, recursively, until
each failing part is one sequence (:func:`isolate`); the sequences that run in some part are
innocent and are run again together. With ``k`` culprits among ``n`` sequences that costs at most
``2·k·log2(n)`` extra forwards, bounded by ``max_runs`` (past it the parts not yet split fail
whole, the old rule). A batch that fails because it is too big (out of device memory) also comes
through: its halves run.

Re-running a forward is safe: it writes the K/V of the step's positions only (blocks not yet full,
hence not in the prefix cache, owned by their sequence) and computes them from the same tokens, so
a part that runs twice writes the same values; a part that fails leaves partial K/V in exactly
those positions, which the survivors' run overwrites and a failed sequence's release frees.

Whether the *engine* is at fault when nothing runs (a single-sequence step, or every part fails)
is a separate question: :meth:`cpd.engine.engine.Engine.probe` runs a canary forward.
"""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

MAX_ISOLATION_FORWARDS = 16  # extra forwards one failed step may spend finding its culprits


def isolate(items: Sequence[T], error: BaseException, run: Callable[[Sequence[T]], BaseException | None],
            max_runs: int = MAX_ISOLATION_FORWARDS) -> dict[int, BaseException]:
    """The positions in ``items`` that fail on their own, with their errors.

    ``items`` failed together with ``error``; ``run(part)`` runs a part again and returns its
    exception (None: it ran). At most ``max_runs`` calls of ``run``; a failing part that the budget
    cannot split further is blamed whole. Positions not returned ran in some part."""
    failed: dict[int, BaseException] = {}
    budget = [max_runs]

    def split(lo: int, hi: int, err: BaseException) -> None:
        if hi - lo == 1 or budget[0] < 2:
            failed.update((i, err) for i in range(lo, hi))
            return
        mid = (lo + hi) // 2
        for a, b in ((lo, mid), (mid, hi)):
            if budget[0] < 1:  # spent inside the first half: the second is blamed untried
                failed.update((i, err) for i in range(a, b))
                continue
            budget[0] -= 1
            e = run(items[a:b])
            if e is not None:
                split(a, b, e)

    split(0, len(items), error)
    return failed
