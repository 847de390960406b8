"""How a lorafleet process connects to NATS: where its credential and TLS files come from, and quiet logs.

A flag (`--creds`, `--tls-ca`, …) wins over the environment (`LORAFLEET_NATS_CREDS`,
`LORAFLEET_NATS_TLS_CA`, …), which wins over the fleet file (`FleetConfig.nats`); the CLI falls back
to its role's file under LORAFLEET_HOME/creds. `ClientSettings.options()` is what `nats.connect`
takes (`nats_auth.connect_options`: nkey, private inbox, TLS), `env()` what a child process gets.

A NATS URL may name several servers, comma-separated (a JetStream cluster's nodes): `server_urls` turns it
into the list `nats.connect(servers=...)` takes, and `RECONNECT_OPTIONS` make a client fail over among them,
and notice within seconds (pings) a server that went silent without closing the connection.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.core.urls import NatsUrlError, join_urls, server_urls  # noqa: F401  (the client's URL grammar, re-exported)
from lorafleet.nats.auth import ENV_CREDS, ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, TlsFiles, connect_options

# A server that stops answering without closing the connection (its host lost, a network that drops packets,
# a stopped process) sends no TCP reset: only the client's pings notice. nats-py pings every `ping_interval`
# seconds and declares the connection stale (then reconnects, to another node if it can) when more than
# `max_outstanding_pings` pings are unanswered at a tick: within (max + 2) × interval = 8 s here, against
# nats-py's default 120 s × 2 (minutes during which `is_connected`, /readyz and publishes believe the server).
PING_INTERVAL_S = 2
MAX_OUTSTANDING_PINGS = 2


def stale_after_s() -> float:
    """The longest a silent server goes unnoticed: the ping window of `RECONNECT_OPTIONS`."""
    return float((MAX_OUTSTANDING_PINGS + 2) * PING_INTERVAL_S)


# Failover among a cluster's servers: never give up, and try the next server soon. nats-py moves to the next
# server of its pool at once; the wait applies only to a server it tried within this many seconds.
RECONNECT_OPTIONS: dict[str, Any] = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.5,
                                     "ping_interval": PING_INTERVAL_S, "max_outstanding_pings": MAX_OUTSTANDING_PINGS}


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """Where a process's NATS credential and TLS files are: a flag wins over the environment, which wins
    over the fleet file (`FleetConfig.nats`); `fallback_creds` (the CLI's role file under
    LORAFLEET_HOME/creds) is used only when none of them names a credential."""

    creds: Path | None = None
    tls: TlsFiles | None = None

    @classmethod
    def resolve(cls, *, creds: str | Path | None = None, tls_ca: str | Path | None = None,
                tls_cert: str | Path | None = None, tls_key: str | Path | None = None, config: Any = None,
                environ: Mapping[str, str] | None = None, fallback_creds: Path | None = None) -> ClientSettings:
        env = os.environ if environ is None else environ

        def pick(flag: str | Path | None, var: str, attr: str) -> Path | None:
            value = flag or env.get(var) or (getattr(config, attr, None) if config is not None else None)
            return Path(value).expanduser() if value else None

        path = pick(creds, ENV_CREDS, "creds")
        if path is None and fallback_creds is not None and fallback_creds.is_file():
            path = fallback_creds
        ca, cert, key = (pick(tls_ca, ENV_TLS_CA, "tls_ca"), pick(tls_cert, ENV_TLS_CERT, "tls_cert"),
                         pick(tls_key, ENV_TLS_KEY, "tls_key"))
        tls = TlsFiles(ca, cert, key) if (ca or cert or key) else None
        return cls(path, tls)

    def options(self) -> dict[str, Any]:
        """Keyword arguments for `nats.connect` (see `connect_options`)."""
        return connect_options(self.creds, self.tls)

    def env(self) -> dict[str, str]:
        """The same settings as environment variables, for a child process."""
        out = {ENV_CREDS: str(self.creds)} if self.creds else {}
        if self.tls is not None:
            for var, value in ((ENV_TLS_CA, self.tls.ca), (ENV_TLS_CERT, self.tls.cert), (ENV_TLS_KEY, self.tls.key)):
                if value is not None:
                    out[var] = str(value)
        return out



def add_client_arguments(parser: Any) -> None:
    """--creds and --tls-* for an argparse parser (gateway, worker): flag > environment > fleet file.

    Their --nats-url takes one URL or a comma-separated list of a cluster's servers (`server_urls`)."""
    parser.add_argument("--creds", default=None, metavar="FILE",
                        help=f"NATS credential file (default: ${ENV_CREDS}, else the fleet file's nats.creds).")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help=f"CA of the server's certificate (${ENV_TLS_CA}).")
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help=f"Client certificate, if the server verifies clients (${ENV_TLS_CERT}).")
    parser.add_argument("--tls-key", default=None, metavar="PEM",
                        help=f"Key of the client certificate (${ENV_TLS_KEY}).")


def settings_from_args(args: Any, config: Any = None) -> ClientSettings:
    return ClientSettings.resolve(creds=args.creds, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                                  tls_key=args.tls_key, config=config)


class _TlsNoise(logging.Filter):
    """asyncio's "returning true from eof_received() has no effect when using ssl": logged whenever a TLS
    peer closes (nats-py's protocol returns True), harmless, and it would fill logs at every reconnect."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("returning true from eof_received()")


def quiet_tls_noise() -> None:
    """Filter the harmless TLS close noise from this process's logs (idempotent)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _TlsNoise) for f in logger.filters):
        logger.addFilter(_TlsNoise())
