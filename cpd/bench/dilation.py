"""Time dilation of a modeled deployment (``--time-dilation K``, :mod:`cpd.engine.executor_modeled`):
the deployment runs K× slower than the hardware it models, so the bench replays arrivals K×
slower and reports every measured time divided by K (times of the modeled hardware)."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from cpd.bench.client import RequestRecord

TIME_FIELDS = ("send_s", "sched_lag_s", "ttft_s", "tpot_s", "e2e_s")


def undilate(records: Sequence[RequestRecord], k: float) -> list[RequestRecord]:
    """``records`` with every time (``arrival_s``, the fields of :data:`TIME_FIELDS`, ``itls_s``)
    divided by ``k`` (> 0); ``k == 1`` returns them unchanged."""
    if k <= 0:
        raise ValueError("time dilation must be > 0")
    if k == 1:
        return list(records)
    out = []
    for r in records:
        times = {f: getattr(r, f) / k for f in TIME_FIELDS if getattr(r, f) is not None}
        out.append(replace(r, arrival_s=r.arrival_s / k, itls_s=[x / k for x in r.itls_s], **times))
    return out
