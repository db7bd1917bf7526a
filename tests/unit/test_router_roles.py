"""The router's record of worker roles (elastic roles, issue 11 §3): which reported roles it
adopts, the change record, the metrics it feeds."""
from __future__ import annotations

from cpd.router.metrics import RouterMetrics
from cpd.router.workers import WorkerInfo, WorkerSet, _adopts_role
from cpd.types import Role


def _w(wid: str, role: str, state: str = "accepted") -> WorkerInfo:
    return WorkerInfo(wid, role, f"http://{wid}", f"tcp://{wid}:1", state=state)


def test_only_accepted_prefill_side_roles_are_adopted():
    assert _adopts_role(_w("pp0", "pre-prefill"), Role.PREFILL)
    assert _adopts_role(_w("p0", "prefill"), Role.PRE_PREFILL)
    assert not _adopts_role(_w("p0", "prefill"), Role.PREFILL)  # unchanged
    assert not _adopts_role(_w("p0", "prefill", state="refused"), Role.PRE_PREFILL)  # a refusal stays one
    assert not _adopts_role(_w("d0", "decode"), Role.PREFILL)
    assert not _adopts_role(_w("x", "prefill"), Role.DECODE)


def test_set_role_records_counts_and_exports():
    ws = WorkerSet([_w("pp0", "pre-prefill"), _w("p0", "prefill"), _w("d0", "decode")])
    m = RouterMetrics()
    m.watch_workers(ws)
    change = ws.set_role("pp0", Role.PREFILL, "planner: test")
    assert change is not None and (change["from_role"], change["to_role"]) == ("pre-prefill", "prefill")
    assert ws.by_id["pp0"].last_role_change == change and ws.by_id["pp0"].snapshot().role is Role.PREFILL
    assert ws.set_role("pp0", "prefill", "again") is None  # no change, nothing counted
    assert ws.role_counts() == {"pre-prefill": 0, "prefill": 2, "decode": 1}
    text = m.render().decode()
    assert 'cpd_role_changes_total{from_role="pre-prefill",to_role="prefill"} 1.0' in text
    assert 'cpd_workers{role="prefill"} 2.0' in text and 'cpd_workers{role="pre-prefill"} 0.0' in text
