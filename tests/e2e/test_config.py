"""One configuration tree (cpd.config): one set of defaults, file < flags precedence in every
entry point (cpd serve / cpd config show, the worker, the router), errors that name the key and
the fix, and a live deployment whose workers and router run with the configured values."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import httpx
import pytest
import yaml

from cpd.config import Config, ConfigError, build_config, dump, load_file, write
from cpd.router.main import build_router
from cpd.worker.main import parse_args as worker_args

CPD = [sys.executable, "-m", "cpd.cli"]
WORKER_ID = ["--role", "prefill", "--worker-id", "p0", "--port", "1", "--events-port", "2"]


def _show(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CPD, "config", "show", *args], capture_output=True, text=True, timeout=120)


def test_one_set_of_defaults_in_every_entry_point():
    """cpd config show, a worker started with no settings and the tree itself agree."""
    shown = tomllib.loads(_show().stdout)
    _, worker = worker_args([*WORKER_ID, "--model", "/m"])
    assert shown == json.loads(dump(Config(), "json"))
    assert shown["engine"] == worker.engine.model_dump() == Config().engine.model_dump()
    assert shown["kv"]["host_kv_bytes"] == worker.kv.host_kv_bytes == 256 << 20
    assert shown["engine"]["num_blocks"] == 1024  # was 2048 in cpd serve, 1024 in the worker


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".json"])
def test_file_then_flags_win(tmp_path, suffix):
    tree = {"engine": {"num_blocks": 4096, "block_size": 32}, "kv": {"host_kv_bytes": "1G"},
            "deployment": {"topology": "pd"}}
    path = tmp_path / f"c{suffix}"
    text = {".toml": lambda: "[engine]\nnum_blocks = 4096\nblock_size = 32\n[kv]\nhost_kv_bytes = '1G'\n"
                             "[deployment]\ntopology = 'pd'\n",
            ".yaml": lambda: yaml.safe_dump(tree), ".json": lambda: json.dumps(tree)}[suffix]()
    path.write_text(text)
    cfg = build_config(path, {"engine.num_blocks": 8, "kv.l3_url": None})
    assert (cfg.engine.num_blocks, cfg.engine.block_size, cfg.kv.host_kv_bytes) == (8, 32, 1 << 30)
    assert cfg.deployment.roles() == ["prefill", "prefill", "decode"]
    out = tomllib.loads(_show("--config", str(path), "--num-blocks", "9", "--set", "router.timeouts.connect_s=1.5",
                              "--handoff-force-tcp").stdout)
    assert out["engine"]["num_blocks"] == 9 and out["engine"]["block_size"] == 32
    assert out["router"]["timeouts"]["connect_s"] == 1.5 and out["handoff"]["force_tcp"] is True
    _, w = worker_args([*WORKER_ID, "--config", str(path), "--block-size", "64", "--model", "/m"])
    assert (w.engine.num_blocks, w.engine.block_size, w.kv.host_kv_bytes) == (4096, 64, 1 << 30)


@pytest.mark.parametrize("fmt", ["toml", "json", "yaml"])
def test_dump_loads_back_unchanged(tmp_path, fmt):
    cfg = build_config(overrides={"engine.num_blocks": 77, "kv.l3_capacity_bytes": "2G",
                                  "router.timeouts.max_decode_attempts": 5, "auth.api_keys": ["k1"]})
    path = write(cfg, tmp_path / f"c.{fmt}")
    assert build_config(path) == cfg
    assert load_file(path)["kv"]["l3_capacity_bytes"] == 2 << 30


def test_errors_name_the_key_and_the_fix(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[engine]\nnum_block = 5\nblock_size = 0\n[kvv]\n")
    with pytest.raises(ConfigError) as e:
        build_config(path)
    msg = str(e.value)
    assert "engine.num_block: unknown key (did you mean engine.num_blocks?)" in msg
    assert "engine.block_size: Input should be greater than or equal to 1 (got 0)" in msg
    assert f"set it in [engine] in {path} or with --block-size" in msg
    assert "kvv: unknown key (did you mean kv?)" in msg
    with pytest.raises(ConfigError, match="topology pd has no pre-prefill pool: set deployment.num_pre_prefill"):
        build_config(overrides={"deployment.topology": "pd", "deployment.num_pre_prefill": 1})
    with pytest.raises(ConfigError, match=r"router.timeouts.conect_s: unknown key \(did you mean "
                                          r"router.timeouts.connect_s\?\)"):
        build_config(overrides={"router.timeouts.conect_s": 1})
    (tmp_path / "syntax.toml").write_text("[engine\n")
    with pytest.raises(ConfigError, match="syntax.toml: not valid toml"):
        build_config(tmp_path / "syntax.toml")


def test_cli_reports_bad_config_with_exit_2(tmp_path):
    r = _show("--num-blocks", "0")
    assert r.returncode == 2 and "engine.num_blocks: Input should be greater than or equal to 1" in r.stderr
    assert "--num-blocks" in r.stderr
    r = _show("--set", "engine.numblocks=3")
    assert r.returncode == 2 and "did you mean engine.num_blocks?" in r.stderr
    w = subprocess.run([sys.executable, "-m", "cpd.worker.main", *WORKER_ID, "--model", "/m", "--num-blocks", "x"],
                       capture_output=True, text=True, timeout=120)
    assert w.returncode == 2 and "engine.num_blocks" in w.stderr


def test_router_refuses_a_config_without_workers():
    with pytest.raises(ConfigError, match="router needs router.served"):
        build_router(build_config(overrides={"model.dir": "/m"}))


def test_live_deployment_runs_with_the_configured_values(tiny_model_dir):
    """Workers and router of a deployment read the one tree: the L1 size decides the context the
    workers report, the router's admission bound and model id come from the file."""
    from deploy_util import start
    dep = start(tiny_model_dir, "pd", num_blocks=24, max_in_flight=3, num_prefill=1)
    try:
        workers = httpx.get(f"{dep.url}/cpd/workers", timeout=10).json()
        assert {w["max_model_len"] for w in workers.values()} == {24 * 16}
        router_cfg = build_config(dep._tmp + "/router.toml")
        assert router_cfg.router.max_in_flight == 3 and router_cfg.engine.num_blocks == 24
        assert [w.worker_id for w in router_cfg.router.workers] == ["p0", "d0"]
        assert router_cfg.router.served is not None and router_cfg.router.served.max_model_len == 24 * 16
        r = httpx.post(f"{dep.url}/v1/completions", json={"model": dep.model_name, "prompt": [5] * 400,
                                                          "max_tokens": 1}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        dep.stop()


def test_routing_flags_reach_the_one_routing_config():
    """The routing flags of cpd serve / cpd router set router.* keys, and routing_config builds the
    policy's RoutingConfig from them (the one place it is built live)."""
    from cpd.config import routing_config
    from cpd.types import RoutingMode, Topology, WriteThrough
    out = _show("--format", "json", "--topology", "pd", "--routing-mode", "adaptive", "--write-through", "all",
                "--ttft-slo", "0.5", "--tpot-slo", "0.05", "--admission-factor", "3", "--decode-append-max-tokens",
                "128", "--raw-wait-max", "0.4", "--spill-margin", "0.1", "--heavy-uncached", "0.2")
    assert out.returncode == 0, out.stderr
    cfg = Config.model_validate(json.loads(out.stdout))
    rc = routing_config(cfg)
    assert (rc.topology, rc.mode, rc.resolved_write_through(), rc.ttft_slo_s, rc.tpot_slo_s, rc.admission_factor,
            rc.decode_append_max_tokens, rc.raw_wait_max_s, rc.spill_margin, rc.heavy_uncached_s) == (
        Topology.PD, RoutingMode.ADAPTIVE, WriteThrough.ALL, 0.5, 0.05, 3.0, 128, 0.4, 0.1, 0.2)
    elastic = _show("--elastic", "--set", "router.planner.min_dwell_s=5")
    assert tomllib.loads(elastic.stdout)["router"]["elastic"] is True
    assert tomllib.loads(elastic.stdout)["router"]["planner"]["min_dwell_s"] == 5
    refused = _show("--topology", "pd", "--elastic")
    assert refused.returncode == 2 and "router.elastic" in refused.stderr and "topology = cpd" in refused.stderr
