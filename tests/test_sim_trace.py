"""Infinite-cache token hit ratio of the Mooncake conversation trace (512-token blocks) = 37.4 %."""
import pytest

from cpd.analyze.stats import lru_hit_ratio, reuse_profile
from cpd.sim.workload import load_mooncake
from tests.conftest import TRACE


def test_conversation_trace_infinite_cache_hit_ratio():
    reqs = load_mooncake(TRACE)
    prof = reuse_profile(reqs)
    assert round(prof.token_hit_ratio * 100, 1) == 37.4
    assert lru_hit_ratio(reqs, None) == pytest.approx(reuse_profile(reqs, count_partial=False).token_hit_ratio)
