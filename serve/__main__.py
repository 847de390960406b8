"""`python -m lorafleet.serve --fleet FLEET.yaml [--nats-url URL] [--host H] [--port P]`: run one gateway."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from lorafleet.core.config import ConfigError, FleetConfig, load_yaml_model
from lorafleet.core.fleet_state import FleetStateError, fetch_fleet_config
from lorafleet.nats.auth import CredentialsError
from lorafleet.nats.client import add_client_arguments, quiet_tls_noise, settings_from_args
from lorafleet.ops.threads import GATEWAY_THREADS, pool_env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lorafleet.serve",
                                description="Run the lorafleet HTTP gateway (OpenAI-compatible embeddings and "
                                            "chat/completions over NATS).")
    p.add_argument("--fleet", default=None, help="Fleet YAML (see configs/fleet.yaml; default: the fleet file "
                   "`lorafleet up` published in NATS, which needs --nats-url).")
    p.add_argument("--nats-url", default=None, help="NATS server URL, or a cluster's URLs comma-separated "
                   "(nats://h1:4222,nats://h2:4222,…: fails over among them; default: the fleet's nats_url).")
    p.add_argument("--host", default=None, help="Address to listen on (default: the fleet's gateway.host).")
    p.add_argument("--port", type=int, default=None, help="Port to listen on (default: the fleet's gateway.port).")
    p.add_argument("--gateway-id", default=None, help="Stable id for this gateway's reply inbox (default: random).")
    p.add_argument("--forwarded-allow-ips", default=None, metavar="IPS",
                   help="Proxies whose X-Forwarded-For is believed for the client address (comma-separated "
                   "addresses or networks, '*' for any; default: $FORWARDED_ALLOW_IPS, else 127.0.0.1). Behind a "
                   "load balancer, name it: a canary splits by client, and without an API key or "
                   "X-Lorafleet-Route-Key the client is its address.")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="Log level of the gateway (uvicorn itself logs warnings and errors only).")
    add_client_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The gateway does no math: one thread per pool (tokenizers, OpenMP, BLAS) leaves the cores to the workers.
    # Large inputs are tokenized in one thread beside the event loop (encode_batch releases the GIL).
    os.environ.update(pool_env(GATEWAY_THREADS))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_tls_noise()
    try:
        if args.fleet is not None:
            fleet = load_yaml_model(FleetConfig, args.fleet)
            client = settings_from_args(args, fleet.nats)
            client.options()  # fail here, with a message, on an unreadable credential or TLS file
        elif not args.nats_url:
            raise ConfigError("give --fleet FLEET.yaml, or --nats-url (and --creds) to read the fleet file from NATS")
        else:  # joining from another host: only the URL and a credential
            client = settings_from_args(args)
            fleet = fetch_fleet_config(args.nats_url, client.options())
    except (ConfigError, CredentialsError, OSError, FleetStateError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from lorafleet.serve.routes import run_gateway

    run_gateway(fleet, nats_url=args.nats_url, host=args.host, port=args.port, gateway_id=args.gateway_id,
                log_level="warning" if args.log_level in ("debug", "info") else args.log_level, client=client,
                forwarded_allow_ips=args.forwarded_allow_ips)
    return 0


if __name__ == "__main__":
    sys.exit(main())
