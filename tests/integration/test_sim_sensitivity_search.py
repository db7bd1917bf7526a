"""The sensitivity study's ``--search`` rows: each configuration's saturation by the same per-seed
saturation search as the adaptive grid (``cpd.sim.sweep.search_saturation``), on the real
engine-object simulator (tiny windows: a few seconds per search)."""
import json

from cpd.sim.experiment import load_experiment, with_overrides
from cpd.sim.sensitivity import run_sensitivity
from cpd.sim.sweep import search_saturation

TINY = {"ramp_s": 1, "steady_s": 4, "drain_s": 2, "qps_per_gpu": [0.2, 0.4], "search.iters": 0}


def test_a_search_row_is_the_saturation_search_of_each_configuration():
    exp = with_overrides(load_experiment("reference_b200"), TINY)
    row_overrides = {"slo.ttft_s": 2.0}
    s = run_sensitivity(exp, rows=[("TTFT SLO 2 s", row_overrides)], configs=("pd", "cpd"), cpd="cpd",
                        pooled="cpd", search=True, progress=False, seeds=1, jobs=1)
    r = s["rows"][0]
    assert s["search"] and r["label"] == "TTFT SLO 2 s"
    direct = search_saturation(with_overrides(exp, row_overrides), "pd", 1)
    assert r["qps_per_gpu"]["pd"] == direct["qps_per_gpu"] and r["qps_per_gpu"]["pd"] > 0
    assert r["saturation"]["pd"]["per_seed"] == [direct["qps_per_gpu"]]
    assert r["saturation"]["pd"]["bounded"] == direct["bounded"]
    assert r["gain_cpd_vs_baseline"] == round(r["qps_per_gpu"]["cpd"] / r["qps_per_gpu"]["pd"] - 1, 4)
    assert 0 <= r["realised_cold_fraction"] <= 1


def test_an_earlier_study_supplies_the_configurations_not_run_again():
    """After a change to one configuration's code only that one runs again: ``earlier`` joins the
    others' saturations (and the realised cold share of the baseline's points) to each row, and the
    gains are computed on the merged row; a row the earlier study lacks is an error."""
    import pytest

    exp = with_overrides(load_experiment("reference_b200"), TINY)
    rows = [("TTFT SLO 2 s", {"slo.ttft_s": 2.0})]
    first = run_sensitivity(exp, rows=rows, configs=("pd",), search=True, progress=False, seeds=1, jobs=1)
    again = run_sensitivity(exp, rows=rows, configs=("cpd",), search=True, progress=False, seeds=1, jobs=1,
                            earlier=first)
    r0, r = first["rows"][0], again["rows"][0]
    assert again["configs"] == ["pd", "cpd"]
    assert r["saturation"]["pd"] == r0["saturation"]["pd"]
    assert r["realised_cold_fraction"] == r0["realised_cold_fraction"]
    assert r["gains_vs_baseline"]["cpd"] == round(r["qps_per_gpu"]["cpd"] / r["qps_per_gpu"]["pd"] - 1, 4)
    assert r["adaptive_over_best_other"] == round(r["qps_per_gpu"]["cpd"] / r["qps_per_gpu"]["pd"] - 1, 4)
    with pytest.raises(ValueError, match="no row"):
        run_sensitivity(exp, rows=[("TTFT SLO 1 s", {"slo.ttft_s": 1.0})], configs=("cpd",), search=True,
                        progress=False, seeds=1, jobs=1, earlier=first)


def test_a_rerun_reads_finished_rows_back(tmp_path):
    """Each finished row is kept under ``cache_dir/rows/``; a rerun with the same inputs reads it
    back (a study killed part-way resumes) and gives the same result; other inputs run anew."""
    exp = with_overrides(load_experiment("reference_b200"), TINY)
    rows = [("TTFT SLO 2 s", {"slo.ttft_s": 2.0})]
    kw = dict(rows=rows, configs=("pd",), search=True, progress=False, seeds=1, jobs=1, cache_dir=tmp_path)
    first = run_sensitivity(exp, **kw)
    kept = list((tmp_path / "rows").glob("*.json"))
    assert len(kept) == 1
    row = json.loads(kept[0].read_text())
    assert row["saturation"]["pd"] == first["rows"][0]["saturation"]["pd"]
    row["saturation"]["pd"]["qps_per_gpu"] = 9.99
    kept[0].write_text(json.dumps(row))
    assert run_sensitivity(exp, **kw)["rows"][0]["qps_per_gpu"]["pd"] == 9.99  # read back, not rerun
    other = run_sensitivity(exp, **{**kw, "rows": [("TTFT SLO 1 s", {"slo.ttft_s": 1.0})]})
    assert len(list((tmp_path / "rows").glob("*.json"))) == 2 and other["rows"][0]["label"] == "TTFT SLO 1 s"
