"""Router cost option and the sensitivity runner's override mechanics (fast: no sweeps)."""
from cpd.policy.cost_model import RooflineCostModel
from cpd.policy.routing import LinearCostModel
from cpd.sim.experiment import build_cluster, load_experiment
from cpd.sim.sensitivity import DEFAULT_ROWS, apply_overrides, markdown_table


def test_router_cost_linear_mirrors_live_router():
    exp = load_experiment("reference_b200")
    lin = build_cluster(apply_overrides(exp, {"router_cost": "linear"}), "pd").router_cost
    roof = build_cluster(apply_overrides(exp, {"router_cost": "roofline"}), "pd").router_cost
    flat = build_cluster(apply_overrides(exp, {"router_cost": "linear-flat"}), "pd").router_cost
    # the live router's shape: the architecture's attention term (what a worker's cost_prior advertises)
    assert isinstance(lin, LinearCostModel) and lin.attn_coeff == roof.prefill_attn_coeff > 0
    assert isinstance(flat, LinearCostModel) and flat.attn_coeff == 0.0
    assert isinstance(roof, RooflineCostModel)
    assert lin.kv_bytes_per_token == roof.kv_bytes_per_token
    w = exp["workload"]
    # calibrated on a typical warm turn: same time as the roofline there
    t = roof.prefill_time_s(w["turn_suffix"], w["first_context"])
    assert abs(lin.prefill_time_s(w["turn_suffix"], w["first_context"]) - t) < 1e-9
    assert abs(flat.prefill_time_s(w["turn_suffix"], w["first_context"]) - t) < 1e-9
    # one rate prices tokens linearly: two 100K prefills cost twice one (and a cold one ~1.7x the roofline)
    assert abs(flat.prefill_time_s(200_000, 0) - 2 * flat.prefill_time_s(100_000, 0)) < 1e-9
    assert abs(lin.prefill_time_s(100_000, 0) / roof.prefill_time_s(100_000, 0) - 1) < 0.1
    # the roofline prices the queue as one sequence: superlinear (the attention term)
    assert roof.prefill_time_s(200_000, 0) > 2.5 * roof.prefill_time_s(100_000, 0)
    assert abs(lin.load_time_s("L3", 10**9) - roof.load_time_s("L3", 10**9)) < 1e-9


def test_apply_overrides_is_a_copy_with_dotted_keys():
    exp = load_experiment("reference_b200")
    e = apply_overrides(exp, {"prefill.l2_bytes": 0, "slo.ttft_s": 2.0, "workload.cold_fraction": 0.5})
    assert e["prefill"]["l2_bytes"] == 0 and e["slo"]["ttft_s"] == 2.0 and e["workload"]["cold_fraction"] == 0.5
    assert exp["prefill"]["l2_bytes"] > 0 and exp["workload"]["cold_fraction"] != 0.5
    assert DEFAULT_ROWS[0][1] == {}


def test_markdown_table_formats_bounds():
    s = {"baseline": "A", "cpd": "B", "pooled": "C", "configs": ["A", "B", "C"], "qps_per_gpu": [0.4, 1.6],
         "rows": [{"label": "x", "realised_cold_fraction": 0.1, "qps_per_gpu": {"A": 0.5, "B": 1.6, "C": None},
                   "ci": {"A": [0.4, 0.6], "B": [1.6, 1.6], "C": [None, None]},
                   "at_least": {"A": False, "B": True, "C": False},
                   "gains_vs_baseline": {"B": 2.2, "C": None}}]}
    t = markdown_table(s)
    assert "< 0.4" in t and ">= 1.60" in t and "0.50 [0.40, 0.60]" in t and "+220 %" in t and "n/a" in t
    s["rows"][0]["realised_cold_fraction"] = None  # --configs without the baseline: no points to read it from
    assert "| x | — |" in markdown_table(s)

