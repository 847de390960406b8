"""Config models for the serving side: fleet, gateway, workers, queue, serving profile.

Every model forbids unknown keys so a typo in YAML is an error, not a silently ignored setting.
Stage-specific configs (training, research, tuning) live in their own stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lorafleet.core import plugins

PACKAGED_MINILM = "all-MiniLM-L6-v2"
MIB = 1024 * 1024


class ConfigError(ValueError):
    """A config file or value that cannot be used; the message says what to fix."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServingProfile(StrictModel):
    """How a worker forms batches; tuned per bundle by `lorafleet tune`."""

    max_batch_items: int = Field(32, ge=1, le=4096, description="Most inputs in one batch.")
    max_batch_tokens: int = Field(
        4096, ge=1, description="Token budget of one batch, counted as items × longest item (padding)."
    )
    max_wait_ms: float = Field(
        2.0, ge=0, le=1000, description="How long an idle worker waits for more tasks to fill a batch."
    )
    max_batch_ms: float | None = Field(
        None, gt=0, le=60_000,
        description="Compute-time budget of one batch: each pull takes at most the tasks that this worker, at "
        "its own measured speed, computes within it, so a slower worker takes fewer and leaves the rest in the "
        "shared queue for faster peers. Set it from the latency objective (about 40 % of a p99 target leaves "
        "room for the batch a task waits behind). None: only the item and token caps. Worker-wide: read "
        "from the fleet's worker profile, not from a bundle's.",
    )
    batches_in_flight: int = Field(
        0, ge=0, le=64,
        description="Batches pulled ahead of the one being computed (pipelining); 0 pulls only when idle. "
        "Each one commits tasks to this worker that an idle peer could have served; it pays only where a "
        "pull takes long next to a batch (a fast GPU), which `lorafleet tune` measures.",
    )
    mixed_adapter_batches: bool = Field(
        True,
        description="Form batches per base, with rows of different adapters in one forward pass, when the base's "
        "runtime can (mixed adapters); False: one adapter per batch. Worker-wide: read from the fleet's worker "
        "profile.",
    )
    max_batch_adapters: int = Field(
        64, ge=1, le=4096,
        description="Most distinct adapters in one mixed batch; all of them stay loaded (pinned) while it computes, "
        "so it must fit adapter_device_bytes and worker.max_adapters. Worker-wide.",
    )
    adapter_device_bytes: int = Field(
        256 * MIB, ge=MIB,
        description="Per base, bytes of adapter weights kept loaded on the runtime's device (the hot tier); the "
        "least recently used beyond it move to host memory. An adapter larger than this cannot be served. "
        "Worker-wide.",
    )
    adapter_host_bytes: int = Field(
        512 * MIB, ge=0,
        description="Per base, bytes of host-memory copies of adapters evicted from the device (the warm tier, "
        "loaded back without reading disk); least recently used beyond it are dropped, 0 keeps none. Worker-wide.",
    )
    precision: Literal["auto", "fp32", "bf16", "fp16", "int8"] | None = Field(
        None,
        description="The precision this profile was measured (and its quality judged) at; null: not recorded. A "
        "worker serves a base at one precision: under `bases[].precision: auto`, the one its models were judged at.",
    )


class QueueConfig(StrictModel):
    """The JetStream work queue shared by gateways and workers."""

    stream: str = "LORAFLEET_WORK"
    dlq_stream: str = "LORAFLEET_DLQ"
    storage: Literal["file", "memory"] = "file"
    max_msgs: int = Field(
        100_000, ge=1,
        description="Hard bound of waiting tasks per base model (each base's subject is bounded on its own, so one "
        "base cannot fill the stream for the others); beyond it the gateway answers 429. Admission control "
        "(GatewayConfig.admit_fraction) refuses work long before this bound.",
    )
    max_bytes: int = Field(512 * 1024 * 1024, ge=1024)
    max_age_s: float | None = Field(
        None, gt=0,
        description="Tasks older than this leave the stream unanswered. None: the gateway's max_deadline_s plus "
        "10 s (no task can be answered after its deadline, and the deadline is capped by max_deadline_s).",
    )
    duplicate_window_s: float = Field(120.0, gt=0)
    ack_wait_s: float = Field(10.0, gt=0, description="Redelivery after this long without ack or progress.")
    max_deliver: int = Field(5, ge=1)
    backoff_s: list[float] | None = Field(
        None, description="Redelivery delays per attempt; default doubles from ack_wait_s."
    )
    nak_delay_s: float = Field(0.5, ge=0, description="Delay before a failed batch's tasks are retried.")
    max_ack_pending: int = Field(20_000, ge=1)
    dlq_max_age_s: float = Field(7 * 24 * 3600.0, gt=0)

    @model_validator(mode="after")
    def _check_backoff(self) -> QueueConfig:
        if self.backoff_s is not None and len(self.backoff_s) > self.max_deliver:
            raise ValueError("backoff_s may not have more entries than max_deliver")
        return self

    def effective_backoff(self) -> list[float]:
        if self.backoff_s is not None:
            return list(self.backoff_s)
        return [self.ack_wait_s * 2**i for i in range(max(self.max_deliver - 1, 1))]


class BaseModelSpec(StrictModel):
    """A base model the fleet serves; its served name is `name`."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    source: str = Field(
        PACKAGED_MINILM,
        description="'all-MiniLM-L6-v2' (the packaged copy), a Hugging Face hub id, or a local folder.",
    )
    revision: str | None = None
    runtime: str = Field(
        "sentence-transformers",
        description="A runtime plugin (entry-point group lorafleet.runtimes): sentence-transformers, …",
    )
    max_seq_length: int | None = Field(None, ge=8)
    normalize: bool | None = Field(None, description="None: as the model's own config says.")
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="Settings of this base's runtime plugin; the runtime checks them.")
    precision: Literal["auto", "fp32", "bf16", "fp16", "int8"] = Field(
        "auto",
        description="Number format the base computes in: fp32; bf16 (CPUs with native bf16, CUDA); fp16 (CUDA); "
        "int8 (dynamic quantisation, CPU, no adapters); auto: what the models served on it were judged at (their "
        "bundles' tuned precision; fp32, the gated precision, without one, or where they differ; embeddings without "
        "one are probed with their adapter, cosine 0.999 to fp32's, cached under LORAFLEET_HOME). An explicit "
        "precision overrides that (promote says so); one the runtime cannot run there stops `lorafleet up`.",
    )
    scale_to_zero: bool = Field(
        False,
        description="Accept this base's requests while no worker for it is live: they wait in the queue (up to "
        "their deadline) for an autoscaler, e.g. KEDA on the base's consumer lag, to start one. False: the "
        "gateway answers 503 no_worker at once, which is right for a base that always has workers.",
    )

    @field_validator("runtime")
    @classmethod
    def _known_runtime(cls, runtime: str) -> str:
        known = plugins.names(plugins.RUNTIMES)
        if runtime not in known:
            raise ValueError(f"unknown runtime {runtime!r}; installed runtimes: {', '.join(known) or 'none'}")
        return runtime


class ServedModel(StrictModel):
    """A served name that resolves to a base model plus a LoRA adapter."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]*$")
    base: str
    adapter: str = Field(description="Adapter directory (peft format) or a URI the workers can fetch.")
    adapter_id: str | None = Field(None, description="Cache key for workers; defaults to the served name.")
    profile: ServingProfile | None = None

    @property
    def resolved_adapter_id(self) -> str:
        return self.adapter_id or self.name


class GatewayConfig(StrictModel):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    api_keys: list[str] = Field(default_factory=list, description="Also from LORAFLEET_API_KEYS (comma-separated).")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_inputs: int = Field(2048, ge=1, description="Most inputs in one request.")
    max_input_tokens: int = Field(
        512, ge=1, description="Longest input accepted, in model tokens; longer inputs get 400."
    )
    max_rerank_documents: int = Field(1000, ge=1, description="Most documents in one rerank request.")
    rerank_chunk: int = Field(
        32, ge=1, le=256,
        description="Documents per task of a rerank request: a large request is spread over many tasks (and "
        "workers) instead of holding one, and small requests' pairs still fill one batch.",
    )
    default_deadline_s: float = Field(30.0, gt=0)
    max_deadline_s: float = Field(300.0, gt=0)
    worker_liveness_s: float = Field(
        5.0, gt=0, description="A worker whose last heartbeat is older than this no longer counts as serving."
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After of 503 answers, and the least one of a 429.")
    admit_fraction: float | None = Field(
        0.5, gt=0, le=1,
        description="Admission control: a request is refused with 429 when the tasks ahead of it, at the service "
        "rate the workers of its base measured, would take more than this share of its deadline. The rest of "
        "the deadline absorbs batching, jitter and the way back. None: no admission control (only the stream's "
        "bound, queue.max_msgs).",
    )
    monitor_s: float = Field(
        0.5, gt=0, le=10,
        description="How often the gateway reads the stream and its consumers (backlog for admission, "
        "readiness, re-creating a lost stream).",
    )
    # Issue 25: read by `lorafleet promote`/`rollback` from this fleet file and written into the fleet state.
    retain_s: float | None = Field(
        7 * 24 * 3600.0, ge=0,
        description="After a promote, how long the previous champion stays served under its pinned name NAME@N "
        "(seconds; null: no time limit), so clients re-embed their corpus with the new version before it goes.",
    )
    retain_versions: int | None = Field(
        2, ge=0, description="At most this many former champions stay served as NAME@N (null: no count limit).")


class WorkerConfig(StrictModel):
    profile: ServingProfile = Field(default_factory=ServingProfile)
    max_adapters: int = Field(
        1024, ge=1,
        description="Most adapters loaded on a base's device at once (besides profile.adapter_device_bytes); the "
        "least recently used beyond it move to host memory.",
    )
    heartbeat_s: float = Field(1.0, gt=0)
    device: str = Field("auto", description="'auto', 'cpu', 'cuda', 'cuda:0', …")
    threads: int | None = Field(
        None, ge=1,
        description="torch intra-op threads per worker. null: the CPUs this host gives lorafleet (affinity and "
        "cgroup quota) divided among the workers `lorafleet up` starts on it (a worker started alone takes all); "
        "OMP_NUM_THREADS in the environment is used when set.",
    )
    drain_timeout_s: float = Field(30.0, gt=0, description="On SIGTERM, how long to finish in-flight work.")
    adapter_roots: list[str] = Field(
        default_factory=list,
        description="Local folders adapters may be loaded from, besides registry references (models:/NAME/N, "
        "verified by digest) and the adapter folders this fleet file names itself. A task or fleet entry that "
        "names any other path is refused without saying whether it exists.",
    )
    orphan_grace_s: float = Field(
        3.0, ge=0,
        description="A task whose gateway no longer listens (no subscriber on its reply inbox) is dropped once "
        "that has lasted this long: long enough for a gateway to come back after a NATS reconnect. Meanwhile the "
        "task is retried, its deliveries left (queue.max_deliver, at least 2 unless this is 0) spread over the "
        "grace, so its last one comes only once the grace has passed.",
    )


class NatsClientConfig(StrictModel):
    """How gateways, workers and the CLI connect to NATS; each setting can also come from the environment
    (LORAFLEET_NATS_CREDS, LORAFLEET_NATS_TLS_CA/_CERT/_KEY), which wins over the file, and a command-line
    flag wins over both. Credentials are per process, so the fleet file rarely names one. `replicas` is the
    cluster's: how many copies JetStream keeps of what lorafleet stores."""

    creds: str | None = Field(None, description="nkey credential file (a seed, mode 0600) whose name gives the role.")
    tls_ca: str | None = Field(None, description="CA certificate that signed the server's (private CA).")
    tls_cert: str | None = Field(None, description="Client certificate, when the server verifies clients.")
    tls_key: str | None = Field(None, description="Key of the client certificate.")
    replicas: int | None = Field(
        None, ge=1, le=5,
        description="Copies JetStream keeps of the work and dead-letter streams and the fleet KV bucket (R3 on a "
        "3-node cluster survives the loss of one node). None: as many as the nodes `lorafleet up --nats-nodes` "
        "starts (at most 3), else 1. More than the cluster has nodes: the streams cannot be created.",
    )

    def stream_replicas(self) -> int:
        return self.replicas or 1


class FleetConfig(StrictModel):
    """A whole serving cluster: which models it serves and how its parts behave."""

    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS server URL, or a comma-separated list of a cluster's servers (a client fails over among "
        "them).",
    )
    nats: NatsClientConfig = Field(default_factory=NatsClientConfig)
    bases: list[BaseModelSpec] = Field(default_factory=lambda: [BaseModelSpec(name=PACKAGED_MINILM)])
    models: list[ServedModel] = Field(default_factory=list)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)

    @field_validator("bases")
    @classmethod
    def _unique_bases(cls, bases: list[BaseModelSpec]) -> list[BaseModelSpec]:
        names = [b.name for b in bases]
        if len(set(names)) != len(names):
            raise ValueError(f"base model names must be unique, got {names}")
        return bases

    @model_validator(mode="after")
    def _check_models(self) -> FleetConfig:
        check_served_models([b.name for b in self.bases], self.models)
        return self

    @model_validator(mode="after")
    def _check_orphan_grace(self) -> FleetConfig:
        # A task whose gateway is away is retried on later deliveries, spread over the grace (sidecar/acks.py):
        # with a single delivery there is no later one, and the grace could not be waited out.
        if self.worker.orphan_grace_s > 0 and self.queue.max_deliver < 2:
            raise ValueError(f"worker.orphan_grace_s ({self.worker.orphan_grace_s:g}s) needs queue.max_deliver of at "
                             "least 2: a task whose gateway is reconnecting waits for it on a later delivery "
                             "(or set orphan_grace_s to 0)")
        return self

    def work_max_age_s(self) -> float:
        """How long a task may wait in the work stream: queue.max_age_s, else past the largest deadline."""
        if self.queue.max_age_s is not None:
            return self.queue.max_age_s
        return self.gateway.max_deadline_s + 10.0

    def base(self, name: str) -> BaseModelSpec:
        for b in self.bases:
            if b.name == name:
                return b
        raise KeyError(name)


def check_served_models(bases: list[str] | tuple[str, ...], models: Iterable[ServedModel]) -> None:
    """ConfigError unless every served model names a known base and every served name is unique.

    Base models serve under their own names, so a served model may not take one of those either.
    """
    seen = set(bases)
    for m in models:
        if m.base not in bases:
            raise ConfigError(f"served model {m.name!r} names base {m.base!r}, not among bases {sorted(bases)}")
        if m.name in seen:
            raise ConfigError(f"served name {m.name!r} is used twice")
        seen.add(m.name)


def read_yaml(path: str | Path) -> Any:
    """The parsed YAML of `path` (`{}` for an empty file), or a ConfigError that names the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc


def load_yaml_model(model: type[StrictModel], path: str | Path, section: str | None = None) -> Any:
    """Load `path` (optionally one top-level `section` of it) into `model`, with readable errors."""
    raw = read_yaml(path)
    if section is not None:
        if not isinstance(raw, dict) or section not in raw:
            raise ConfigError(f"{path} has no top-level '{section}:' section")
        raw = raw[section] or {}
    return validate_model(model, raw, source=str(path))


def validate_model(model: type[StrictModel], raw: Any, source: str = "config") -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from exc


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: {exc.error_count()} invalid setting(s)"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = "unknown key (check the spelling)" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides (values parsed as YAML) to a raw config dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. train.epochs=2)")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = raw
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = yaml.safe_load(value)
    return raw
