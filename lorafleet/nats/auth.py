"""Who is who on lorafleet's NATS: nkey credentials, the server's authorization block, client options (the
roles and their permissions are in permissions.py).

Model (docs/security.md): nats-server authenticates each client by an nkey (an Ed25519 key pair; the
client signs the server's nonce, the seed never leaves the client) and authorizes it by the
permissions listed for that public key in the server config. A role is a fixed permission set
(`PERMISSIONS`); a credential is one key pair with one role, stored as a bare seed file (`<name>.nk`,
mode 0600), the format `nats --nkey FILE` and nats-py's `nkeys_seed=` read. A credential's name is
its role, or `<role>-<suffix>` for a further one (`worker-gpu3`), so one host can be revoked alone.

Private inboxes: each credential gets its own reply namespace `_LF_INBOX.<public key>` (passed to
nats-py as `inbox_prefix`), so JetStream API answers, pulled tasks and receipts reach only that
client, and workers — who may publish to gateways' result inboxes under `_INBOX.>` — cannot forge
JetStream answers to anyone. A gateway's result inbox is `_INBOX.<public key>.<gateway id>`
(`gateway_inbox_prefix`); only that gateway credential may subscribe to it.

Server-config users rather than decentralised JWT accounts: lorafleet has four fixed roles in one
account, so the operator/account/resolver machinery buys nothing, and a user JWT would have to be
hand-built here (no `nsc`). The config holds only public keys (no secret); revoking a key is
deleting it and reloading the server (`NatsServer.reload()`). Needs the `nkeys` package (what
nats-py itself imports for nkey auth).
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.core.wire import INBOX_PREFIX, subject_token
from lorafleet.nats.conf import conf_quote as _q  # the one quoting rule (nats_server.py too)
from lorafleet.nats.permissions import PERMISSIONS, PRIVATE_INBOX, ROLES, Layout, Role

log = logging.getLogger(__name__)

ENV_CREDS = "LORAFLEET_NATS_CREDS"
ENV_TLS_CA = "LORAFLEET_NATS_TLS_CA"
ENV_TLS_CERT = "LORAFLEET_NATS_TLS_CERT"
ENV_TLS_KEY = "LORAFLEET_NATS_TLS_KEY"

CREDS_SUFFIX = ".nk"
_NAME_RE = re.compile(rf"^({'|'.join(ROLES)})(-[A-Za-z0-9_-]+)?$")


class CredentialsError(RuntimeError):
    """A credential file is missing, unreadable or not an nkey user seed."""


def role_of(name: str) -> Role:
    """`worker` and `worker-gpu3` → worker; anything else is an error (names decide roles)."""
    m = _NAME_RE.match(name)
    if m is None:
        raise CredentialsError(f"credential name {name!r} must be a role ({', '.join(ROLES)}), "
                               "optionally followed by -SUFFIX (letters, digits, _ and -)")
    return m.group(1)  # type: ignore[return-value]


# --- Credentials ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Credential:
    name: str
    role: Role
    path: Path  # the seed file; the seed itself is never kept in memory here
    public_key: str  # U…, what the server config holds

    def __repr__(self) -> str:  # safe to log: no secret in it
        return f"Credential({self.name!r}, role={self.role!r}, path={str(self.path)!r})"


@dataclass(frozen=True, slots=True)
class CredentialSet:
    dir: Path
    by_name: dict[str, Credential] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Credential:
        try:
            return self.by_name[name]
        except KeyError:
            raise CredentialsError(f"no credential {name!r} in {self.dir} (have: {', '.join(self.by_name)})") from None

    def path(self, name: str) -> Path:
        return self[name].path


def _nkeys() -> Any:
    try:
        import nkeys
    except ModuleNotFoundError as exc:
        raise CredentialsError("NATS nkey credentials need the 'nkeys' package: pip install nkeys") from exc
    return nkeys


def public_key_of(seed_path: str | Path) -> str:
    """The user public key (U…) of a seed file; the seed is wiped from memory after use (best effort)."""
    nkeys = _nkeys()
    path = Path(seed_path)
    try:
        seed = bytearray(path.read_bytes().strip())
    except OSError as exc:
        raise CredentialsError(f"cannot read NATS credential {path}: {exc.strerror}") from exc
    try:
        kp = nkeys.from_seed(seed)
        public = kp.public_key.decode()
        kp.wipe()
    except Exception as exc:  # nkeys raises several error types, all meaning "not a seed"
        raise CredentialsError(f"{path} is not an nkey seed file (expected one line starting with SU)") from exc
    finally:
        seed[:] = b"\0" * len(seed)
    if not public.startswith("U"):
        raise CredentialsError(f"{path} holds an nkey seed, but not a user seed (SU…)")
    return public


def _write_seed(path: Path) -> None:
    nkeys = _nkeys()
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    tmp = path.with_name(path.name + ".tmp")
    # Created 0600 (never world-readable, not even for an instant), then renamed into place.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, seed + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, path)


def add_credential(dir: str | Path, name: str) -> Credential:
    """Create `<dir>/<name>.nk` if missing (kept if present); the name says the role."""
    role = role_of(name)
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    path = d / f"{name}{CREDS_SUFFIX}"
    if not path.exists():
        _write_seed(path)
        log.info("wrote NATS credential %s (role %s)", path, role)
    return Credential(name, role, path, public_key_of(path))


def generate_credentials(dir: str | Path, names: Iterable[str] = ROLES) -> CredentialSet:
    """One credential per role (and any extra names) under `dir` (0700, files 0600); existing ones kept."""
    for name in names:
        add_credential(dir, name)
    return load_credentials(dir)


def load_credentials(dir: str | Path) -> CredentialSet:
    """Every `<name>.nk` under `dir`: what the server config is rendered from (a deleted file = revoked)."""
    d = Path(dir)
    out: dict[str, Credential] = {}
    for path in sorted(d.glob(f"*{CREDS_SUFFIX}")):
        name = path.name[: -len(CREDS_SUFFIX)]
        out[name] = Credential(name, role_of(name), path, public_key_of(path))
    return CredentialSet(d, out)


# --- Server config -------------------------------------------------------------------------------

def _subjects(templates: Iterable[str], layout: Layout, key: str) -> str:
    return "[" + ", ".join(_q(layout.render(t, key)) for t in templates) + "]"


def authorization_config(creds: CredentialSet, layout: Layout = Layout(), *, timeout_s: float = 2.0) -> str:
    """The `authorization { users = [...] }` block: one user per credential, its role's permissions.

    With users listed, nats-server refuses any client that presents none of their keys.
    """
    if not creds.by_name:
        raise CredentialsError(f"no credentials under {creds.dir}: generate them first")
    users = []
    for c in creds.by_name.values():
        p = PERMISSIONS[c.role]
        deny = f", deny: {_subjects(p.publish_deny, layout, c.public_key)}" if p.publish_deny else ""
        perms = (f"publish: {{ allow: {_subjects(p.publish, layout, c.public_key)}{deny} }}, "
                 f"subscribe: {{ allow: {_subjects(p.subscribe, layout, c.public_key)} }}")
        if p.allow_responses:
            perms += ', allow_responses: { max: 1, expires: "1m" }'
        users.append(f"    # {c.name} ({c.role})\n    {{ nkey: {_q(c.public_key)}, permissions: {{ {perms} }} }}")
    body = "\n".join(users)
    return f"authorization {{\n  timeout: {timeout_s}\n  users = [\n{body}\n  ]\n}}\n"


# --- TLS -----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files. Client: `ca` to trust a private CA, `cert`+`key` when the server verifies clients.
    Server (NatsServer): `cert`+`key` required, `ca` to verify clients' certificates with."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise CredentialsError("TLS needs both a certificate and its key, or neither")

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
        if self.cert is not None and self.key is not None:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx


def tls_from_env(environ: Mapping[str, str] | None = None) -> TlsFiles | None:
    env = os.environ if environ is None else environ
    ca, cert, key = (env.get(k) or None for k in (ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY))
    if not (ca or cert or key):
        return None
    return TlsFiles(*(Path(p).expanduser() if p else None for p in (ca, cert, key)))


# --- Client options ------------------------------------------------------------------------------

def private_inbox_prefix(public_key: str) -> str:
    return f"{PRIVATE_INBOX}.{public_key}"


def gateway_inbox_prefix(gateway_id: str, creds_path: str | Path | None = None) -> str:
    """Where a gateway's results arrive: `_INBOX.<public key>.<gateway id>` (`_INBOX.<gateway id>` without auth)."""
    if creds_path is None:
        return f"{INBOX_PREFIX}.{subject_token(gateway_id)}"
    return f"{INBOX_PREFIX}.{public_key_of(creds_path)}.{subject_token(gateway_id)}"


def _check_mode(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise CredentialsError(f"cannot read NATS credential {path}: {exc.strerror}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("NATS credential %s is readable by other users (mode %o); chmod 600 it", path, mode & 0o777)


def connect_options(creds_path: str | Path | None = None,
                    tls: TlsFiles | ssl.SSLContext | None = None) -> dict[str, Any]:
    """Keyword arguments for `nats.connect(url, **opts)`: nkey auth, private inbox, TLS.

    Holds the seed's path, never the seed (nats-py reads the file when it signs), so the dict is safe
    to log. No credentials and no TLS → {} (a server without auth).
    """
    opts: dict[str, Any] = {}
    if creds_path is not None:
        path = Path(creds_path).expanduser()
        _check_mode(path)
        opts["nkeys_seed"] = str(path)
        opts["inbox_prefix"] = private_inbox_prefix(public_key_of(path))
    if isinstance(tls, TlsFiles):
        opts["tls"] = tls.client_context()
    elif tls is not None:
        opts["tls"] = tls
    return opts


def options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`connect_options` from LORAFLEET_NATS_CREDS and LORAFLEET_NATS_TLS_{CA,CERT,KEY}."""
    env = os.environ if environ is None else environ
    creds = env.get(ENV_CREDS) or None
    return connect_options(Path(creds).expanduser() if creds else None, tls_from_env(env))


def explain_connect_error(exc: BaseException, url: str) -> str:
    """A sentence for a failed connect that says what to set; never includes secrets."""
    text = str(exc)
    if "Authorization Violation" in text or type(exc).__name__ == "AuthorizationError":
        return (f"NATS at {url} refused the connection: it requires credentials (or these are not authorized). "
                f"Set {ENV_CREDS} to a credential file (`lorafleet up` writes them to LORAFLEET_HOME/creds/).")
    if "Authentication Timeout" in text:
        return f"NATS at {url} timed out waiting for credentials: set {ENV_CREDS} to a credential file."
    if isinstance(exc, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in text or "SSL" in text:
        return (f"TLS with NATS at {url} failed ({text}): the server requires TLS; set {ENV_TLS_CA} to the CA "
                f"that signed its certificate (and {ENV_TLS_CERT}/{ENV_TLS_KEY} if it verifies clients).")
    if isinstance(exc, ConnectionResetError) or "Connection lost" in text:
        return (f"NATS at {url} closed the connection during the handshake: if it verifies client certificates, "
                f"set {ENV_TLS_CERT} and {ENV_TLS_KEY} to a certificate its CA signed.")
    return f"cannot connect to NATS at {url}: {type(exc).__name__}: {text}"
