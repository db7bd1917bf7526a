"""One configuration tree for every process cpd starts (``cpd serve``, the worker, the router).

The tree (:class:`Config`) has one section per concern, each key with its ONE default:

* ``model`` — which weights and tokenizer, and the served model id;
* ``engine`` — L1 pool size, block size, scheduler budgets, torch threads;
* ``kv`` — L2 host pool size and the L3 store (URL, chunking, capacity);
* ``handoff`` — the prefill→decode KV handoff (staging arena, reclaim time, TCP only);
* ``router`` — listen address, routing (cold threshold), admission bounds, request body limit,
  the router→worker call bounds (:class:`cpd.router.timeouts.DispatchTimeouts`), and the
  worker list plus what the workers reported (written by the launcher);
* ``deployment`` — topology, pool sizes, logs, supervision of the children;
* ``auth`` — client API keys and the router/worker shared secret (:class:`cpd.auth.AuthSection`).

Sources, later ones win: the defaults below, a file (``.toml``, ``.yaml``/``.yml`` or
``.json``, with the same sections), then overrides from the command line — named flags
(:data:`FLAGS`, e.g. ``--num-blocks``) and ``--set section.key=value``. :func:`build_config`
is the one function every entry point calls. Errors (:class:`ConfigError`) name the key, what
was wrong and how to fix it; unknown keys are errors (with the closest known key).

``cpd config show [--config FILE] [flags]`` prints the effective tree; the launcher writes
it to a file that every child process reads (``--config``), so all processes of a
deployment agree on every setting.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, Sequence

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from cpd.auth import AuthSection

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib
from cpd.policy.roles import PlannerConfig
from cpd.policy.routing import RoutingConfig
from cpd.router.timeouts import DispatchTimeouts
from cpd.types import RoutingMode, WriteThrough
from cpd.types import Topology as TopologyEnum

Role = Literal["pre-prefill", "prefill", "decode"]
Topology = Literal["cpd", "pd"]


def _parse_bytes(v: object) -> object:
    """``"512M"``/``"1.5G"``/``"64KiB"`` -> bytes; anything else is left to the int check."""
    if isinstance(v, str) and v.strip():
        from cpd.store.sizes import parse_size
        try:
            return parse_size(v)
        except ValueError:
            return v
    return v


ByteCount = Annotated[int, BeforeValidator(_parse_bytes), Field(ge=0)]
"""A size in bytes; files and flags may write ``512M``, ``2G``, ``64KiB``."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    dir: str = Field("", description="HF Llama-family model directory (weights + tokenizer); empty = "
                                     "SmolLM2-135M-Instruct, converted once under ~/.cache/cpd/models")
    name: str = Field("", description="served model id; empty = the directory's last part")


class EngineSection(Section):
    num_blocks: int = Field(1024, ge=1, description="L1 KV blocks per worker")
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    max_num_batched_tokens: int = Field(512, ge=1, description="engine token budget per step")
    max_num_seqs: int = Field(32, ge=1, description="running requests per worker")
    max_prefill_chunk_tokens: int = Field(512, ge=1, description="prompt tokens of one request per step")
    torch_threads: int = Field(0, ge=0, description="torch threads per worker (0 = cores / workers under "
                                                    "cpd serve, torch's default for a lone worker)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="torch executor: model and KV dtype; auto = bfloat16 where the CPU (AVX512-BF16/AMX) "
                            "or GPU computes it natively, else float32; float16 on CUDA only (cpd.engine.dtype)")
    batch_invariant: bool = Field(False, description="torch executor: compute every token row by calls of fixed "
                                                     "shapes, so greedy tokens are bit-exact on every path in any "
                                                     "dtype (chunking, batching, decode-local append); ~2-3x "
                                                     "slower (cpd.engine.batch_invariant)")
    executor: Literal["torch", "modeled"] = Field(
        "torch", description="torch: real model math; modeled: the cost model's step times and pseudo tokens, "
                             "no torch (cpd.engine.executor_modeled)")
    hardware: str = Field("b200", description="modeled executor: GPU type of the cost model (cpd.costmodel.hardware)")
    model_shape: str = Field("llama-3.1-8b", description="modeled executor: model shape (shipped name, any case, "
                                                         "or a config.json path)")
    tp: int = Field(1, ge=1, description="modeled executor: GPUs per instance (tensor parallelism)")
    time_dilation: float = Field(1.0, gt=0, description="modeled executor: run K times slower than the modeled "
                                                        "hardware (bench divides times by K)")
    kv_payload_fraction: float = Field(1 / 8192, gt=0, le=1, description="modeled executor: KV bytes held per "
                                                                         "modeled KV byte")
    max_step_s: float = Field(120.0, gt=0, description="an engine step running longer than this is stuck: the "
                                                       "worker reports unhealthy and its streams say so, so the "
                                                       "router routes elsewhere and fails over (one step of the "
                                                       "token budget must fit, with room for a loaded CPU; "
                                                       "on GPUs, where a step takes milliseconds, lower it)")
    failed_steps_retry_after_s: float = Field(5.0, gt=0, description="a worker whose engine failed a step (a "
                                                                     "canary forward failed too) reports 503; idle, "
                                                                     "it probes its engine every this many seconds "
                                                                     "and reports 200 again once a probe runs "
                                                                     "(cpd.worker.runtime.StepHealth)")


class KVSection(Section):
    host_kv_bytes: ByteCount = Field(256 << 20, description="L2 host KV pool bytes per worker")
    swap_space_bytes: ByteCount = Field(4 << 30, description="host bytes per worker for the KV of requests "
                                                             "preempted under KV-pool pressure: swapped out and "
                                                             "back exactly (0, or past it: recomputed, whose KV "
                                                             "need not be bit-identical in bf16)")
    l3_url: str = Field("", description="L3 store: file:///dev/shm/DIR, redis://HOST:PORT or "
                                        "redis+cluster://HOST:PORT,...; empty = a fresh file:// dir per "
                                        "deployment (a worker started alone: no L3)")
    l3_chunk_blocks: int = Field(0, ge=0, description="blocks per L3 store value (0 = the URL's chunk_blocks, "
                                                      "else 1); every process sharing a store must agree")
    l3_capacity_bytes: Optional[ByteCount] = Field(
        None, description="L3 store capacity, e.g. 8G (0 = unlimited); unset = the URL's capacity_bytes, "
                          "else sized from the machine (cpd.store.capacity)")

    @field_validator("l3_url")
    @classmethod
    def _known_store_scheme(cls, url: str) -> str:
        """A URL no store opens fails here, not in every worker at start-up (a traceback each)."""
        from urllib.parse import urlsplit

        from cpd.store import STORE_URL_SCHEMES

        if url and urlsplit(url).scheme not in STORE_URL_SCHEMES:
            raise ValueError(f"expected an L3 store URL ({', '.join(s + '://' for s in STORE_URL_SCHEMES)}) "
                             "or empty")
        return url


class HandoffSection(Section):
    arena_bytes: ByteCount = Field(256 << 20, description="prefill side: shared-memory staging arena bytes")
    reclaim_after_s: float = Field(120.0, gt=0, description="prefill side: free a staging nobody released "
                                                            "after this many seconds")
    force_tcp: bool = Field(False, description="decode side: fetch KV over TCP even from a same-host sender "
                                               "(the cross-host path)")


class WorkerEndpoint(Section):
    """Where the router reaches one worker."""

    worker_id: str
    role: Role
    url: str = Field(description="internal HTTP API, e.g. http://10.0.0.5:9001")
    events_endpoint: str = Field(description="KV event publisher, e.g. tcp://10.0.0.5:9002")


class ServedModel(Section):
    """What the workers reported (the launcher writes it): the router hashes blocks in this KV
    namespace and refuses workers that report another one or a smaller context."""

    namespace: dict[str, Any]
    max_model_len: int = Field(ge=1)
    kv_bytes_per_token: int = Field(ge=1)


class RouterSection(Section):
    host: str = Field("127.0.0.1", description="listen address of the router (and, under cpd serve, of "
                                               "the workers)")
    port: int = Field(8000, ge=0, le=65535, description="router port (0 = a free port)")
    cold_threshold: float = Field(0.5, ge=0.0, le=1.0, description="static routing: reuse ratio below which a "
                                                                   "request is cold")
    routing_mode: Literal["static", "adaptive"] = Field(
        "adaptive", description="adaptive (default): per-worker remaining-work estimates, spill-over, "
                                "decode-local append, read-after-write (cpd.policy.routing); static: the "
                                "published rule, reuse ratio -> fixed pool")
    write_through: Optional[Literal["none", "cold", "all"]] = Field(
        None, description="which prefills write their blocks through to L3: none, cold, all (unset = the "
                          "default: pd -> none, cpd static -> cold, cpd adaptive -> all; pd + all is the pd-l3 "
                          "configuration)")
    ttft_slo_s: float = Field(2.0, gt=0, description="TTFT SLO the adaptive rules and admission aim at (s)")
    tpot_slo_s: float = Field(0.1, gt=0, description="TPOT SLO (s); decode-local append must keep it")
    heavy_uncached_s: Optional[float] = Field(None, gt=0, description="adaptive: uncached work above this is "
                                                                      "heavy (s; unset = 0.25 x ttft_slo_s)")
    spill_margin: float = Field(0.25, ge=0, description="adaptive: relative TTFT gain needed before work spills "
                                                        "out of its home pool")
    admission_factor: Optional[float] = Field(None, gt=0, description="reject with 429 + Retry-After when every "
                                                                      "candidate's predicted TTFT exceeds this x "
                                                                      "ttft_slo_s (unset = admit everything)")
    decode_append_max_tokens: int = Field(0, ge=0, description="adaptive: prefill an uncached suffix of at most "
                                                               "this many tokens on the decode worker holding "
                                                               "the prefix (0 = off)")
    decode_affinity_margin: int = Field(2, description="decode choice: a decode worker holding at least half "
                                                       "the prompt more in L1 wins if it ends at most this many "
                                                       "assigned requests above the least-loaded one (< 0 = off)")
    waste_weight: float = Field(1.0, ge=0, description="choice within a pool: weight of a worker's extra work "
                                                       "(the prefix it would recompute) added to its predicted "
                                                       "TTFT (0 = the smallest TTFT)")
    prefill_cost_fit: bool = Field(False, description="price prefills by a fitted overhead + per-token + "
                                                      "attention model (cpd.router.estimates) instead of one "
                                                      "measured rate")
    queue_remaining: bool = Field(False, description="a worker's predicted prefill queue counts a started "
                                                     "prefill's remaining estimate (its estimate less the time "
                                                     "since the worker reported it running), not the whole "
                                                     "estimate until its first token")
    raw_wait_max_s: float = Field(0.0, ge=0, description="read-after-write: longest hold of a request for "
                                                         "blocks being written through to L3 (0 = never wait)")
    raw_ready_margin_s: float = Field(0.25, ge=0, description="read-after-write: blocks being written through "
                                                              "are predicted visible this long after their "
                                                              "prefill's predicted end (s)")
    elastic: bool = Field(False, description="move prefill-side workers between pre-prefill and prefill at run "
                                             "time (cpd.router.elastic; settings in router.planner)")
    role_window_s: float = Field(30.0, gt=0, description="elastic: the measurement window of the roles "
                                                         "planner (s)")
    planner: PlannerConfig = Field(default_factory=PlannerConfig,
                                   description="elastic roles planner settings (cpd.policy.roles)")
    max_in_flight: int = Field(256, ge=1, description="requests in flight; beyond it 429")
    max_decode_per_worker: int = Field(0, ge=0, description="requests per decode worker "
                                                            "(0 = 2 x engine.max_num_seqs)")
    max_request_body_bytes: ByteCount = Field(16 << 20, description="larger request bodies get 413")
    timeouts: DispatchTimeouts = Field(default_factory=DispatchTimeouts,
                                       description="bounds of every router->worker call (seconds)")
    workers: list[WorkerEndpoint] = Field(default_factory=list, description="the workers to route to")
    served: Optional[ServedModel] = Field(None, description="what the workers reported (KV namespace, "
                                                            "context); written by the launcher")
    supervisor_status: str = Field("", description="the launcher's supervisor status file (served at "
                                                   "/cpd/processes); empty = none")
    background_stall_timeout_s: float = Field(
        60.0, gt=0, description="the router answers /health 503 background_stalled when one of its background "
                                "tasks (KV-event subscriber, worker poller, maintenance, elastic planner) died or "
                                "completed no iteration for this long (s; at least 3 planner intervals); cpd serve "
                                "then restarts it (cpd.router.background)")

    def decode_slots(self, max_num_seqs: int) -> int:
        """Requests per decode worker (``max_decode_per_worker``, 0 = twice ``max_num_seqs``)."""
        return self.max_decode_per_worker or 2 * max_num_seqs


class DeploymentSection(Section):
    topology: Topology = Field("cpd", description="cpd (pre-prefill + prefill + decode) or pd (prefill + decode)")
    num_pre_prefill: Optional[int] = Field(None, ge=0, description="pre-prefill workers (cpd: 1; pd: none)")
    num_prefill: Optional[int] = Field(None, ge=1, description="prefill workers (cpd: 1, pd: 2)")
    num_decode: int = Field(1, ge=1, description="decode workers")
    log_dir: str = Field("", description="where worker/router logs go (empty = a temp dir)")
    supervise: bool = Field(True, description="restart a child that exits (same command line and ports)")
    restart_backoff_s: float = Field(1.0, gt=0, description="first restart delay; doubles per consecutive "
                                                            "quick exit")
    restart_backoff_max_s: float = Field(30.0, gt=0, description="cap of the restart delay")
    restart_stable_s: float = Field(60.0, gt=0, description="an exit after this much uptime starts the "
                                                            "backoff over")
    restart_ready_timeout_s: float = Field(300.0, gt=0, description="a restarted child must be ready "
                                                                    "within this")
    liveness_timeout_s: float = Field(60.0, ge=0, description="restart a ready worker whose /health has failed "
                                                              "(unhealthy or no answer) for this long without one "
                                                              "good answer: a stuck engine after about "
                                                              "engine.max_step_s + this, a process that no longer "
                                                              "answers after about this; the router likewise once "
                                                              "its /health has not answered for this long (needs "
                                                              "supervise; 0 = off; cpd.liveness)")
    liveness_probe_interval_s: float = Field(5.0, gt=0, description="seconds between two /health probes of a "
                                                                    "worker (liveness)")
    liveness_probe_timeout_s: float = Field(5.0, gt=0, description="a /health probe without an answer within "
                                                                   "this counts as failed (no_answer)")
    liveness_startup_grace_s: float = Field(10.0, ge=0, description="failed probes in this long after a worker "
                                                                    "reports READY do not count (a worker not yet "
                                                                    "READY is never probed)")
    liveness_max_failed_steps: int = Field(10, ge=0, description="restart a ready worker whose /health reports "
                                                                 "this many consecutive failed engine steps (no good "
                                                                 "step between: its engine fails whatever it runs); "
                                                                 "one bad request fails one step, so never restarts "
                                                                 "a worker unless this is 1 (needs supervise; 0 = "
                                                                 "off; cpd.liveness)")

    @model_validator(mode="after")
    def _pd_has_no_pre_prefill(self) -> "DeploymentSection":
        if self.topology == "pd" and self.num_pre_prefill:
            raise ValueError("topology pd has no pre-prefill pool: set deployment.num_pre_prefill = 0 "
                             "(or leave it unset), or use topology cpd")
        return self

    def pool_sizes(self) -> dict[str, int]:
        """Workers per role, with the topology's defaults for unset sizes."""
        cpd = self.topology == "cpd"
        pre = self.num_pre_prefill if self.num_pre_prefill is not None else 1
        return {"pre-prefill": pre if cpd else 0,
                "prefill": self.num_prefill if self.num_prefill is not None else (1 if cpd else 2),
                "decode": self.num_decode}

    def roles(self) -> list[str]:
        """One entry per worker, in start order."""
        return [role for role, n in self.pool_sizes().items() for _ in range(n)]


class Config(Section):
    """The whole configuration of a deployment (see the module docstring)."""

    model: ModelSection = Field(default_factory=ModelSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    kv: KVSection = Field(default_factory=KVSection)
    handoff: HandoffSection = Field(default_factory=HandoffSection)
    router: RouterSection = Field(default_factory=RouterSection)
    deployment: DeploymentSection = Field(default_factory=DeploymentSection)
    auth: AuthSection = Field(default_factory=AuthSection)

    @model_validator(mode="after")
    def _elastic_needs_cpd(self) -> "Config":
        if self.router.elastic and self.deployment.topology != "cpd":
            raise ValueError("router.elastic moves workers between the pre-prefill and prefill pools: it needs "
                             "deployment.topology = cpd (or leave --elastic off)")
        return self


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names each bad key and the fix."""


# ---- command-line flags ------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """A command-line flag that overrides one key. ``worker``: the worker process accepts it
    too (the engine/KV/handoff settings); ``router``: ``cpd router`` accepts it too (routing
    settings); every flag is accepted by ``cpd serve``."""

    key: str
    names: tuple[str, ...]
    worker: bool = False
    router: bool = False


FLAGS: tuple[Flag, ...] = (
    Flag("model.dir", ("--model",), worker=True),
    Flag("model.name", ("--model-name",)),
    Flag("engine.num_blocks", ("--num-blocks",), worker=True),
    Flag("engine.block_size", ("--block-size",), worker=True),
    Flag("engine.max_num_batched_tokens", ("--max-num-batched-tokens",), worker=True),
    Flag("engine.max_num_seqs", ("--max-num-seqs",), worker=True),
    Flag("engine.max_prefill_chunk_tokens", ("--max-prefill-chunk-tokens",), worker=True),
    Flag("engine.torch_threads", ("--torch-threads",), worker=True),
    Flag("engine.dtype", ("--dtype",), worker=True),
    Flag("engine.batch_invariant", ("--batch-invariant",), worker=True),
    Flag("engine.executor", ("--executor",), worker=True),
    Flag("engine.hardware", ("--hardware",), worker=True),
    Flag("engine.model_shape", ("--model-shape",), worker=True),
    Flag("engine.tp", ("--tp",), worker=True),
    Flag("engine.time_dilation", ("--time-dilation",), worker=True),
    Flag("engine.kv_payload_fraction", ("--kv-payload-fraction",), worker=True),
    Flag("engine.max_step_s", ("--max-step-s",), worker=True),
    Flag("kv.host_kv_bytes", ("--host-kv-bytes",), worker=True),
    Flag("kv.swap_space_bytes", ("--swap-space-bytes",), worker=True),
    Flag("kv.l3_url", ("--kv-store",), worker=True),
    Flag("kv.l3_chunk_blocks", ("--l3-chunk-blocks",), worker=True),
    Flag("kv.l3_capacity_bytes", ("--l3-capacity-bytes", "--l3-capacity"), worker=True),
    Flag("handoff.arena_bytes", ("--handoff-arena-bytes",), worker=True),
    Flag("handoff.reclaim_after_s", ("--handoff-reclaim-after-s",), worker=True),
    Flag("handoff.force_tcp", ("--handoff-force-tcp",), worker=True),
    Flag("router.host", ("--host",)),
    Flag("router.port", ("--port",)),
    Flag("router.cold_threshold", ("--cold-threshold",), router=True),
    Flag("router.max_in_flight", ("--max-in-flight",), router=True),
    Flag("router.routing_mode", ("--routing-mode",), router=True),
    Flag("router.write_through", ("--write-through",), router=True),
    Flag("router.ttft_slo_s", ("--ttft-slo",), router=True),
    Flag("router.tpot_slo_s", ("--tpot-slo",), router=True),
    Flag("router.heavy_uncached_s", ("--heavy-uncached",), router=True),
    Flag("router.spill_margin", ("--spill-margin",), router=True),
    Flag("router.admission_factor", ("--admission-factor",), router=True),
    Flag("router.decode_append_max_tokens", ("--decode-append-max-tokens",), router=True),
    Flag("router.raw_wait_max_s", ("--raw-wait-max",), router=True),
    Flag("router.prefill_cost_fit", ("--prefill-cost-fit",), router=True),
    Flag("router.queue_remaining", ("--queue-remaining",), router=True),
    Flag("router.decode_affinity_margin", ("--decode-affinity-margin",), router=True),
    Flag("router.waste_weight", ("--waste-weight",), router=True),
    Flag("router.elastic", ("--elastic",), router=True),
    Flag("deployment.topology", ("--topology",), router=True),
    Flag("deployment.num_pre_prefill", ("--pre-prefill",)),
    Flag("deployment.num_prefill", ("--prefill",)),
    Flag("deployment.num_decode", ("--decode",)),
    Flag("deployment.log_dir", ("--log-dir",)),
    Flag("deployment.restart_backoff_s", ("--restart-backoff-s",)),
    Flag("deployment.restart_backoff_max_s", ("--restart-backoff-max-s",)),
    Flag("deployment.liveness_timeout_s", ("--liveness-timeout-s",)),
    Flag("deployment.liveness_max_failed_steps", ("--liveness-max-failed-steps",)),
)


def add_argparse_flags(p: Any, flags: "Sequence[Flag]") -> None:
    """Add ``flags`` to an ``argparse`` parser (``cpd worker``, ``cpd router``); read them back
    with :func:`argparse_overrides`. A boolean flag takes no value (``--elastic``)."""
    for f in flags:
        help_text = f"{field_info(f.key)[1]} (key {f.key})".replace("%", "%%")
        if field_info(f.key)[0] is bool:
            p.add_argument(*f.names, dest=_argparse_dest(f.key), action="store_const", const=True, default=None,
                           help=help_text)
        else:
            p.add_argument(*f.names, dest=_argparse_dest(f.key), default=None, metavar="VALUE", help=help_text)


def argparse_overrides(a: Any, flags: "Sequence[Flag]") -> dict[str, Any]:
    """The keys set by ``flags`` in parsed ``argparse`` arguments (unset ones are None)."""
    return {f.key: getattr(a, _argparse_dest(f.key)) for f in flags}


def _argparse_dest(key: str) -> str:
    return "cfg__" + key.replace(".", "__")


def routing_config(cfg: Config, block_size: int | None = None) -> RoutingConfig:
    """The policy's :class:`RoutingConfig` from ``router.*`` and ``deployment.topology`` (the one
    place it is built live); ``block_size``: the served KV namespace's (default ``engine.block_size``)."""
    r = cfg.router
    return RoutingConfig(topology=TopologyEnum(cfg.deployment.topology), cold_threshold=r.cold_threshold,
                         block_size=block_size or cfg.engine.block_size, mode=RoutingMode(r.routing_mode),
                         write_through=WriteThrough(r.write_through) if r.write_through is not None else None,
                         ttft_slo_s=r.ttft_slo_s, tpot_slo_s=r.tpot_slo_s, heavy_uncached_s=r.heavy_uncached_s,
                         spill_margin=r.spill_margin, admission_factor=r.admission_factor,
                         decode_append_max_tokens=r.decode_append_max_tokens, raw_wait_max_s=r.raw_wait_max_s,
                         decode_affinity_margin=r.decode_affinity_margin, waste_weight=r.waste_weight)


def field_info(key: str) -> tuple[Any, str]:
    """``(annotation, description)`` of a dotted key such as ``engine.num_blocks``."""
    section, _, name = key.partition(".")
    sec_type = Config.model_fields[section].annotation
    f = sec_type.model_fields[name]  # type: ignore[union-attr]
    return f.annotation, f.description or ""


def flag_for(key: str) -> str | None:
    """The first command-line flag that sets ``key`` (for error messages)."""
    return next((f.names[0] for f in FLAGS if f.key == key), None)


# ---- loading -----------------------------------------------------------------------------
def load_file(path: str | Path) -> dict[str, Any]:
    """Raw tree from a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file.

    Raises:
        ConfigError: missing file, unknown suffix, or a syntax error (with the file's message).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"config file {p}: {e.strerror or e}") from None
    try:
        data = _parse_text(text, p.suffix.lower())
    except ConfigError as e:
        raise ConfigError(f"config file {p}: {e}") from None
    except ValueError as e:  # tomllib / json / yaml syntax errors
        raise ConfigError(f"config file {p}: not valid {p.suffix.lstrip('.')}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: expected a table of sections (model, engine, ...) at the top")
    return data


def _parse_text(text: str, suffix: str) -> Any:
    if suffix == ".toml":
        return tomllib.loads(text)
    if suffix == ".json":
        return json.loads(text)
    if suffix in (".yaml", ".yml"):
        import yaml
        try:
            return yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ValueError(str(e)) from None
    raise ConfigError(f"unknown config format {suffix!r}: use .toml, .yaml/.yml or .json")


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """``["engine.num_blocks=2048", "kv.l3_url=redis://h:6379"]`` -> ``{key: value}``. Values
    are read as JSON when they parse (numbers, true/false, lists, objects), else as strings.

    Raises:
        ConfigError: an item without ``=``.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. engine.num_blocks=2048")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out


def _merge(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` in a nested dict, creating tables on the way."""
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {} if child is None else _as_dict(child, key)
        node = child
    node[leaf] = value


def _as_dict(value: Any, key: str) -> dict[str, Any]:
    raise ConfigError(f"{key}: {key.rsplit('.', 1)[0]} is a value, not a section ({value!r})")


def build_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """The effective configuration: defaults, then the file at ``path`` (if any), then
    ``overrides`` (dotted keys -> values; ``None`` values are ignored, so unset flags can be
    passed as they are).

    Raises:
        ConfigError: unreadable file or invalid values; the message names every bad key.
    """
    tree = load_file(path) if path else {}
    for key, value in (overrides or {}).items():
        if value is not None:
            _merge(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_explain(e, path)) from None


def _explain(err: ValidationError, path: str | Path | None) -> str:
    """One line per error: the key, what was wrong, the value given, and where to fix it."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        lines.append(_explain_one(key, e, path))
    return "invalid configuration:\n" + "\n".join(lines)


def _explain_one(key: str, e: Mapping[str, Any], path: str | Path | None) -> str:
    if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"  {key}: unknown key{_did_you_mean(key)}; remove it"
    msg = str(e["msg"]).removeprefix("Value error, ")
    if "." not in key:  # a rule over several keys (of one section, or of the tree): the message says the fix
        return f"  {key}: {msg}" if key else f"  {msg}"
    where = f"[{key.split('.')[0]}] in {path}" if path else "a config file"
    flag = flag_for(key)
    fix = f"set it in {where}" + (f" or with {flag}" if flag else "") + f" or --set {key}=VALUE"
    got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
    return f"  {key}: {msg}{got}; {fix}"


def _did_you_mean(key: str) -> str:
    """`` (did you mean engine.num_blocks?)`` for a misspelt key, else ``""``."""
    *parents, leaf = key.split(".")
    node: Any = Config
    for part in parents:
        node = _child_names(node).get(part)
    close = difflib.get_close_matches(leaf, list(_child_names(node)), n=1)
    return f" (did you mean {'.'.join([*parents, close[0]])}?)" if close else ""


def _child_names(node: Any) -> dict[str, Any]:
    """Key -> type of the keys below a section type (pydantic model or dataclass)."""
    if hasattr(node, "model_fields"):
        return {n: f.annotation for n, f in node.model_fields.items()}
    if dataclasses.is_dataclass(node):
        return {f.name: f.type for f in dataclasses.fields(node)}
    return {}


# ---- output ------------------------------------------------------------------------------
def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain data (unset optional keys left out, so the result is valid TOML and loads back)."""
    return cfg.model_dump(mode="json", exclude_none=True)


def dump(cfg: Config, fmt: Literal["toml", "json", "yaml"] = "toml") -> str:
    """The tree as TOML, JSON or YAML text; :func:`build_config` reads each back unchanged."""
    data = to_dict(cfg)
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    if fmt == "yaml":
        import yaml
        return yaml.safe_dump(data, sort_keys=False)
    import tomli_w
    return tomli_w.dumps(data)


def write(cfg: Config, path: str | Path) -> Path:
    """Write the tree to ``path`` in the format its suffix names (``.toml``, ``.json``, ``.yaml``)."""
    p = Path(path)
    fmt = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}.get(p.suffix.lower(), "toml")
    p.write_text(dump(cfg, fmt))  # type: ignore[arg-type]
    return p
