"""`lorafleet creds add NAME`, `revoke NAME`, `list`: NATS credentials of the local cluster (docs/security.md).

A credential is an nkey seed file `LORAFLEET_HOME/creds/<name>.nk` (0600) whose name gives its role
(`worker-gpu3` is a worker). Adding or revoking one re-renders nats-server's config and reloads the
running server (SIGHUP): a new key is admitted, a revoked key's connections are cut at once.
"""

from __future__ import annotations

import typer

creds_app = typer.Typer(help="NATS credentials of the local cluster: one nkey file per role or host.",
                        no_args_is_help=True)

BASE_ROLES_NOTE = ("the four role files (admin, gateway, worker, control) are re-created at the next reload: "
                   "revoking one rotates its key, and every process of that role needs the new file")


def _fail(message: str, code: int = 1) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def _reload() -> str:
    """Reload the running nats-server node(s) of LORAFLEET_HOME's cluster; what happened, in words."""
    from lorafleet.core import settings
    from lorafleet.nats.server import NatsServerError
    from lorafleet.ops.cluster_state import STATE_FILE, ClusterState
    from lorafleet.ops.processes import find_parts

    home = settings.home()
    parts = find_parts(home)
    if not (home / STATE_FILE).is_file() or not any(name.startswith("nats-server") for name in parts):
        return "no running cluster here: the change applies at the next `lorafleet up`"
    state = ClusterState.load(home)
    if not state.auth:
        return "the running cluster has no authentication (--insecure-no-auth): restart it without that flag"
    reloaded = []
    for name, server in state.nats_servers().items():  # every node: a key must be valid on whichever it reaches
        pid = parts.get(name)
        if pid is None:
            continue  # a node that is down reads the new config when the supervisor restarts it
        try:
            server.adopt(pid).reload()
        except NatsServerError as exc:
            _fail(f"reloading {name} failed: {exc}")
        reloaded.append(f"{name} (pid {pid})")
    return f"reloaded {', '.join(reloaded)}"


@creds_app.command("add")
def add(name: str = typer.Argument(..., help="ROLE or ROLE-SUFFIX, e.g. worker-gpu3 or gateway-eu1.")) -> None:
    """Create a credential (kept if it exists) and admit it on the running server."""
    from lorafleet.core import settings
    from lorafleet.nats.auth import CredentialsError, add_credential

    try:
        cred = add_credential(settings.home() / "creds", name)
    except CredentialsError as exc:
        _fail(str(exc))
        return
    typer.echo(f"{cred.path}  (role {cred.role}, public key {cred.public_key}); {_reload()}")
    typer.echo(f"  give it to the {cred.role} as LORAFLEET_NATS_CREDS (keep it 0600: it is a secret key)")


@creds_app.command("revoke")
def revoke(name: str = typer.Argument(..., help="The credential to revoke, e.g. worker-gpu3.")) -> None:
    """Delete a credential and reload the server: its holders are disconnected and cannot reconnect."""
    from lorafleet.core import settings
    from lorafleet.nats.auth import CREDS_SUFFIX, ROLES, CredentialsError, role_of

    try:
        role_of(name)
    except CredentialsError as exc:
        _fail(str(exc))
        return
    path = settings.home() / "creds" / f"{name}{CREDS_SUFFIX}"
    if not path.is_file():
        _fail(f"no credential {name!r} under {path.parent}")
    path.unlink()
    typer.echo(f"deleted {path}; {_reload()}")
    if name in ROLES:
        typer.secho(f"note: {BASE_ROLES_NOTE}", fg=typer.colors.YELLOW)


@creds_app.command("list")
def list_cmd() -> None:
    """Every credential: name, role, public key (never the secret)."""
    from lorafleet.core import settings
    from lorafleet.nats.auth import CredentialsError, load_credentials

    try:
        creds = load_credentials(settings.home() / "creds")
    except CredentialsError as exc:
        _fail(str(exc))
        return
    if not creds.by_name:
        typer.echo(f"no credentials under {creds.dir} (`lorafleet up` writes them)")
    for cred in creds.by_name.values():
        typer.echo(f"{cred.name:<20} {cred.role:<8} {cred.public_key}")


def register(app: typer.Typer) -> None:
    app.add_typer(creds_app, name="creds")
