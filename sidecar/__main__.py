"""`python -m lorafleet.sidecar --fleet FLEET.yaml --nats-url URL`: run one worker until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import yaml

from lorafleet.config import ConfigError, FleetConfig, load_yaml_model, validate_model
from lorafleet.nats_auth import CredentialsError
from lorafleet.nats_client import add_client_arguments, quiet_tls_noise, settings_from_args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m lorafleet.sidecar",
        description="A lorafleet worker: pulls tasks (embed, generate) from the JetStream work queue, batches them "
                    "per (base model, adapter) or feeds them to an engine (vLLM), runs the model, replies and acks. "
                    "Stops cleanly on SIGTERM.",
    )
    p.add_argument("--fleet", required=True, help="FleetConfig YAML file, or '-' to read it from stdin.")
    p.add_argument("--nats-url", default=None, help="NATS server URL (default: the fleet config's nats_url).")
    p.add_argument("--worker-id", default=None, help="Name in logs and heartbeats (default: HOST-PID).")
    p.add_argument("--base", action="append", default=None, metavar="NAME",
                   help="Serve only this base model (repeatable; default: every base in the fleet).")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
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
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
        fleet = load_fleet(args.fleet)
        options = settings_from_args(args, fleet.nats).options()
    except (ConfigError, CredentialsError, OSError) as exc:  # OSError: unreadable TLS files
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return run_worker(fleet, nats_url=args.nats_url, worker_id=worker_id, bases=args.base,
                          client_options=options)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
