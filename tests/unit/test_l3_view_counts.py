"""The L3 view keeps its chunk and block counts as chunks come and go (the router reads them every
0.2 s for its metrics, under the index lock): after any sequence of updates they equal a full
recount."""
from __future__ import annotations

import random

from cpd.router.l3_view import L3View


def _recount(v: L3View) -> tuple[int, int]:
    return sum(len(ns) for ns in v._ends.values()), sum(sum(ns) for ns in v._ends.values())


def test_counts_follow_every_update():
    r = random.Random(4)
    for chunk_blocks in (None, 1, 4):
        clock = iter(range(10 ** 6))
        v = L3View(chunk_blocks=chunk_blocks, clock=lambda: float(next(clock)))
        for step in range(3000):
            hs = [r.randrange(40) for _ in range(r.randint(0, 9))]
            op = r.random()
            if op < 0.4:
                v.stored(hs)
            elif op < 0.6:
                v.removed(hs)
            elif op < 0.8:
                present = [(h, r.randint(1, 8)) for h in hs[: r.randint(0, len(hs))]]
                gone = [(r.randrange(40), r.randint(1, 8)) for _ in range(r.randint(0, 2))]
                v.observe(hs, present, gone, since=float(r.randrange(step + 1)) if r.random() < 0.5 else None)
            elif op < 0.9:
                v.discard((r.randrange(40), r.randint(1, 8)))
            elif op < 0.95:
                v.begin_resync()
            else:
                v.finish_resync([(r.randrange(40), r.randint(1, 8)) for _ in range(r.randint(0, 20))])
            assert (v.num_chunks(), v.num_blocks()) == _recount(v), (chunk_blocks, step)
        assert v.num_chunks() > 0


def test_observe_gives_what_the_plain_loop_gave():
    """``observe`` looks only at the hashes that end a known chunk; the view after it is the one the
    plain walk over every hash gave."""
    def plain_observe(v: L3View, block_hashes, present, gone, since):
        present = [(int(h), int(n)) for h, n in present]
        seen = set(present)
        for h in block_hashes:
            for n in list(v._ends.get(int(h), ())):
                if (int(h), n) not in seen:
                    v._discard_older((int(h), n), since)
        for key in present:
            if key[1] not in v._ends.get(key[0], ()):
                v._add(key, since)
        for key in gone:
            v._discard_older((int(key[0]), int(key[1])), since)

    r = random.Random(9)
    for trial in range(300):
        views = []
        for _ in range(2):
            clock = iter(range(10 ** 6))
            views.append(L3View(clock=lambda c=clock: float(next(c))))
        for v in views:
            rr = random.Random(trial)
            for _ in range(60):
                v.stored([rr.randrange(30) for _ in range(rr.randint(1, 5))])
        hs = [r.randrange(30) for _ in range(r.randint(0, 40))]
        present = [(h, r.randint(1, 5)) for h in hs[: r.randint(0, len(hs))]]
        gone = [(r.randrange(30), r.randint(1, 5)) for _ in range(r.randint(0, 3))]
        since = float(r.randrange(80)) if r.random() < 0.7 else None
        views[0].observe(hs, present, gone, since)
        plain_observe(views[1], hs, present, gone, since)
        assert views[0]._ends == views[1]._ends, trial
        assert (views[0].num_chunks(), views[0].num_blocks()) == _recount(views[0])
