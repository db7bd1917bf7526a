"""The router's bound on a streamed prefill (:meth:`DispatchTimeouts.prefill_deadline`): by
progress, not by the estimate. Lines that keep coming with an advancing step count keep it alive
up to the cap; no line for ``prefill_idle_s`` or no step for ``prefill_stall_s`` ends it, and the
reason names which."""
from __future__ import annotations

import json

import pytest

from cpd.router.timeouts import DispatchTimeouts

T = DispatchTimeouts(prefill_idle_s=2.0, prefill_stall_s=5.0, prefill_cap_s=100.0)


def test_a_progressing_prefill_is_waited_for_until_the_cap_whatever_its_estimate():
    # sent at 0, a line and a new step just now (t = 60): far past any estimate-based bound
    deadline, _ = T.prefill_deadline(sent_s=0.0, last_line_s=60.0, last_step_s=60.0)
    assert deadline == 62.0
    deadline, why = T.prefill_deadline(sent_s=0.0, last_line_s=99.5, last_step_s=99.5)
    assert deadline == 100.0 and "cap" in why


def test_no_line_means_a_stopped_or_dead_worker():
    deadline, why = T.prefill_deadline(sent_s=0.0, last_line_s=10.0, last_step_s=10.0)
    assert deadline == 12.0 and "no line" in why


def test_lines_without_steps_mean_a_stuck_engine():
    deadline, why = T.prefill_deadline(sent_s=0.0, last_line_s=14.5, last_step_s=10.0)
    assert deadline == 15.0 and "no step" in why


def test_env_override_takes_the_new_fields_and_refuses_unknown_ones():
    t = DispatchTimeouts.from_env({"CPD_DISPATCH_TIMEOUTS": json.dumps({"prefill_idle_s": 1.5,
                                                                       "prefill_stall_s": 3.0})})
    assert (t.prefill_idle_s, t.prefill_stall_s) == (1.5, 3.0)
    with pytest.raises(ValueError, match="unknown"):
        DispatchTimeouts.from_env({"CPD_DISPATCH_TIMEOUTS": json.dumps({"prefill_idle": 1})})
