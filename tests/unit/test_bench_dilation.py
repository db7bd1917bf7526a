"""cpd bench --time-dilation K: every reported time of a K× dilated run is divided by K."""
import pytest

from cpd.bench.client import RequestRecord
from cpd.bench.dilation import undilate
from cpd.bench.report import summarize


def _rec(i, k):
    return RequestRecord(id=str(i), line=i, trace_class="warm", reuse=0.5, arrival_s=i * k, prompt_len=100,
                         max_tokens=3, send_s=i * k, ttft_s=0.2 * k, tpot_s=0.05 * k, e2e_s=0.3 * k,
                         itls_s=[0.05 * k, 0.05 * k], output_tokens=3)


def test_undilated_records_and_summary_equal_an_undilated_run():
    k = 4.0
    plain = [_rec(i, 1.0) for i in range(5)]
    back = undilate([_rec(i, k) for i in range(5)], k)
    for a, b in zip(back, plain):
        for f in ("arrival_s", "send_s", "ttft_s", "tpot_s", "e2e_s"):
            assert getattr(a, f) == pytest.approx(getattr(b, f)), f
        assert a.itls_s == pytest.approx(b.itls_s)
        assert (a.output_tokens, a.prompt_len) == (b.output_tokens, b.prompt_len)
    s1 = summarize(plain, 5.0, slo_ttft_s=0.25, slo_tpot_s=0.06)
    s2 = summarize(back, 5.0, slo_ttft_s=0.25, slo_tpot_s=0.06)
    assert s1 == s2
    assert undilate(plain, 1.0) == plain
    with pytest.raises(ValueError):
        undilate(plain, 0)
