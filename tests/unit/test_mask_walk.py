"""The C prefix walk of the router's mask table (``MaskTable.runs``, ``cpd/router/_mask_walk.c``)
answers what the numpy walk (``cpd.router.index._walk`` over ``MaskTable.lookup``) answers, and
the index's random-event equivalence holds on the numpy walk too (the C one is what
``test_index_equivalence.py`` exercises where the extension is built)."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpd.router import index, mask_table
from cpd.router.mask_table import MaskTable

from test_index_equivalence import CONFIGS, _config, _run_sequence

native = pytest.mark.skipif(mask_table._walk_native is None, reason="C extension cpd.router._mask_walk not built")
M64 = (1 << 64) - 1


def _numpy_runs(table: MaskTable, keys, group: int) -> dict[int, tuple[int, int]]:
    return index._walk(table, index._Query(keys), group)


@native
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), min_slots=st.sampled_from([8, 64, 1024]))
def test_c_walk_equals_numpy_walk(seed, min_slots):
    """Random chains stored and partly removed per worker and tier in a small table (probe
    collisions, deleted slots, rebuilds), random prompts along and off them: same runs."""
    rng = random.Random(seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mask_table, "MIN_SLOTS", min_slots)
        t = MaskTable()
        chain = [rng.choice([rng.getrandbits(64), rng.randrange(8), M64 - rng.randrange(3)]) for _ in range(80)]
        bits = [1 << i for i in rng.sample(range(63), 5)]
        for _ in range(rng.randrange(1, 30)):
            s = rng.randrange(len(chain))
            part = chain[s:s + rng.randrange(1, 40)]
            (t.add if rng.random() < 0.7 else t.remove)(rng.randrange(2), rng.choice(bits), part)
        for _ in range(10):
            cut = rng.randrange(len(chain) + 1)
            keys = chain[:cut] + [rng.getrandbits(64) for _ in range(rng.randrange(3))] + chain[cut:]
            group = sum(rng.sample(bits, rng.randrange(1, len(bits) + 1)))
            for q in (keys, tuple(keys), keys[:rng.randrange(len(keys) + 1)]):
                assert t.runs(q, group) == _numpy_runs(t, list(q), group)


@native
def test_c_walk_declines_what_it_cannot_read():
    """Keys outside [0, 2**64) (they live in the side dict), non-ints and arrays: None, and the
    index walks them in Python."""
    t = MaskTable()
    t.add(0, 1, [5, 6, 7])
    assert t.runs([5, 6, 7], 1) == {1: (3, 3)}
    assert t.runs([5, 6, 8], 3) == {1: (2, 2), 2: (0, 0)}
    assert t.runs([], 1) == {1: (0, 0)}
    for bad in ([5, -1, 7], [5, 1 << 64], [5, np.uint64(6)], np.array([5, 6], np.uint64), [5, "6"]):
        assert t.runs(bad, 1) is None
    assert t.runs([9, -1], 1) == {1: (0, 0)}  # the walk stopped before reaching the odd key
    with pytest.raises(ValueError):
        mask_table._walk_native(np.zeros((3, 3), np.uint64), 1, 62, [1], 1)  # 3 slots: not a power of two


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[-1]])
@pytest.mark.parametrize("num_workers", [3, 70])
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_index_matches_reference_on_the_numpy_walk(config, num_workers, seed):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mask_table, "_walk_native", None)
        with _config(*config):
            _run_sequence(seed, num_workers, num_ops=60)
