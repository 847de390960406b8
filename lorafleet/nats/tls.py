"""A private CA and certificates for NATS TLS on one machine (`lorafleet up --tls`, tests).

A real deployment brings certificates from its own CA; this is for a single host or a lab, where
a self-signed CA is the honest option. Keys are EC P-256, written 0600; certificates are public.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.nats.auth import TlsFiles
from lorafleet.nats.conf import write_private

_VALID_DAYS = 825  # the longest lifetime clients such as macOS still accept for a server certificate


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    cert: Path
    key: Path


def _write(path: Path, data: bytes, mode: int) -> None:
    # A new file with `mode` from the start, renamed over any old one (whose mode O_TRUNC would keep).
    write_private(path, data, mode)


def _new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load(ca: CertificateAuthority) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    return (x509.load_pem_x509_certificate(ca.cert.read_bytes()),
            serialization.load_pem_private_key(ca.key.read_bytes(), password=None))


def make_self_signed_ca(dir: str | Path, name: str = "lorafleet NATS CA") -> CertificateAuthority:
    """`<dir>/ca.pem` + `<dir>/ca-key.pem`, created once (kept if present)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca = CertificateAuthority(d / "ca.pem", d / "ca-key.pem")
    if ca.cert.exists() and ca.key.exists():
        return ca
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(ca.key, _key_pem(key), 0o600)
    _write(ca.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return ca


def issue_certificate(ca: CertificateAuthority, dir: str | Path, name: str, *,
                      hosts: tuple[str, ...] = ("localhost", "127.0.0.1"), client: bool = False) -> TlsFiles:
    """`<dir>/<name>.pem` + `<dir>/<name>-key.pem` signed by `ca`: a server certificate for `hosts`
    (DNS names or IPs), or a client certificate. Returns TlsFiles(ca, cert, key), ready for either side."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    files = TlsFiles(ca=ca.cert, cert=d / f"{name}.pem", key=d / f"{name}-key.pem")
    assert files.cert is not None and files.key is not None
    if files.cert.exists() and files.key.exists():
        return files
    ca_cert, ca_key = _load(ca)
    key = _new_key()
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    now = dt.datetime.now(dt.UTC)
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans and not client:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write(files.key, _key_pem(key), 0o600)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return files
