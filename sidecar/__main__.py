"""`python -m lorafleet.sidecar --fleet FLEET.yaml --nats-url URL`: run one worker until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import yaml

from lorafleet.core.config import ConfigError, FleetConfig, load_yaml_model, validate_model
from lorafleet.core.fleet_state import FleetStateError, fetch_fleet_config
from lorafleet.nats.auth import CredentialsError
from lorafleet.nats.client import add_client_arguments, quiet_tls_noise, settings_from_args
from lorafleet.ops.threads import available_cpus, plan_threads, pool_env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m lorafleet.sidecar",
        description="A lorafleet worker: pulls tasks (embed, generate) from the JetStream work queue, batches them "
                    "per (base model, adapter) or feeds them to an engine (vLLM), runs the model, replies and acks. "
                    "Stops cleanly on SIGTERM.",
    )
    p.add_argument("--fleet", default=None,
                   help="FleetConfig YAML file, or '-' to read it from stdin (default: the fleet file `lorafleet up` "
                        "published in NATS; needs --nats-url).")
    p.add_argument("--nats-url", default=None, help="NATS server URL, or a cluster's URLs comma-separated "
                   "(nats://h1:4222,nats://h2:4222,…: fails over among them; default: the fleet config's nats_url).")
    p.add_argument("--worker-id", default=None, help="Name in logs and heartbeats (default: HOST-PID).")
    p.add_argument("--base", action="append", default=None, metavar="NAME",
                   help="Serve only this base model (repeatable; default: every base in the fleet).")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads (default: the fleet's worker.threads, else OMP_NUM_THREADS, else "
                        "every CPU this process may use, cgroup quota included; `lorafleet up` passes each "
                        "worker its share of the host).")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="Serve Prometheus metrics on http://HOST:PORT/metrics (9464 is the usual; 0: any free "
                        "port, logged). Default: off, nothing listens.")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="Address the metrics server binds (default 127.0.0.1; 0.0.0.0 for a scraper on another "
                        "host, e.g. in a pod).")
    add_client_arguments(p)
    return p.parse_args(argv)


def load_fleet(source: str) -> FleetConfig:
    if source != "-":
        return load_yaml_model(FleetConfig, source)
    try:
        raw = yaml.safe_load(sys.stdin.read()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"<stdin> is not valid YAML: {exc}") from exc
    return validate_model(FleetConfig, raw, source="<stdin>")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None and args.threads < 1:
        print(f"error: --threads must be at least 1, got {args.threads}", file=sys.stderr)
        return 2
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        print(f"error: --metrics-port must be 0..65535, got {args.metrics_port}", file=sys.stderr)
        return 2
    from lorafleet.sidecar.worker import default_worker_id, run_worker

    worker_id = args.worker_id or default_worker_id()
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s worker={worker_id} %(name)s: %(message)s",
    )
    logging.getLogger("nats").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine request otherwise
    quiet_tls_noise()
    try:
        if args.fleet is not None:
            fleet = load_fleet(args.fleet)
            options = settings_from_args(args, fleet.nats).options()
        elif not args.nats_url:
            raise ConfigError("give --fleet FLEET.yaml, or --nats-url (and --creds) to read the fleet file from NATS")
        else:  # joining from another host: only the URL and a credential
            options = settings_from_args(args).options()
            fleet = fetch_fleet_config(args.nats_url, options)
    except (ConfigError, CredentialsError, OSError, FleetStateError) as exc:  # OSError: unreadable TLS files
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Before torch is imported (the runtime imports it): OpenMP sizes its team from the environment.
    plan = plan_threads(available_cpus(), 1, args.threads or fleet.worker.threads)
    os.environ.update(pool_env(plan.worker))
    logging.getLogger("lorafleet.sidecar").info("threads: %s", plan.describe())
    try:
        return run_worker(fleet, nats_url=args.nats_url, worker_id=worker_id, bases=args.base,
                          client_options=options,
                          metrics_addr=None if args.metrics_port is None else (args.metrics_host, args.metrics_port))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
