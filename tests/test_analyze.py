"""`cpd analyze` on a slice of the Mooncake conversation trace (no quick simulation: fast)."""
from typer.testing import CliRunner
import typer

from cpd.analyze.cli import analyze
from tests.conftest import TRACE


def test_analyze_report_and_plots(tmp_path):
    sl = tmp_path / "slice.jsonl"
    with open(TRACE) as f:
        sl.write_text("".join(next(f) for _ in range(2000)))
    app = typer.Typer()
    app.command()(analyze)
    r = CliRunner().invoke(app, [str(sl), "--out", str(tmp_path / "o"), "--no-simulate"])
    assert r.exit_code == 0, r.output
    rep = (tmp_path / "o" / "report.md").read_text()
    for s in ("token hit ratio", "Recompute vs load", "Verdict", "suggested split", "reuse distance"):
        assert s in rep
    assert (tmp_path / "o" / "reuse.png").stat().st_size > 1000
    assert (tmp_path / "o" / "lru_curve.png").exists()
