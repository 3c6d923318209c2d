"""Per-run, per-role credentials: made by ``astraflow up``, kept owner-only in the run directory.

A credential file is everything a worker needs to join the run's plane as one role, and nothing
more: ``{"user", "password", "run", "url", "tls_ca_pem"}``. Hand ``credentials/rollout.json`` to
a remote machine and ``astraflow worker rollout --credential rollout.json --recipe recipe.yaml``
joins (docs/deploy.md). Secrets never appear on a command line or in a log: the launcher passes
files, and URLs are printed with their userinfo removed.

When the embedded server listens beyond loopback, TLS is on: ``up`` makes a CA and a server
certificate for the listening host in ``RUN_DIR/credentials/tls`` and puts the CA in every
credential file, so a node verifies the server it talks to.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from astraflow.streams.permissions import User


@dataclass(frozen=True)
class Credential:
    user: str
    password: str
    run: str
    url: str = ""
    tls_ca_pem: str | None = None

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.__dict__, f, indent=2)
        return path

    @classmethod
    def read(cls, path: str | Path) -> Credential:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"credential {path} is not readable as an astraflow credential file: {e}") from None


def run_users(policies: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(user, role, policy) of every credential a run gets: one trainer user per policy."""
    return [("admin", "admin", "*"), ("dataflow", "dataflow", "*"), *((f"trainer-{p}", "trainer", p) for p in policies),
            ("rollout", "rollout", "*"), ("evaluator", "evaluator", "*"), ("observer", "observer", "*")]


def issue(cred_dir: Path, run: str, policies: tuple[str, ...], url: str = "", tls_ca_pem: str | None = None) -> dict[str, Credential]:
    """The run's credentials: read back when ``cred_dir`` has them (a resumed run keeps its secrets), else made."""
    out = {}
    for user, _, _ in run_users(policies):
        path = cred_dir / f"{user}.json"
        if path.exists():
            old = Credential.read(path)
            cred = Credential(user, old.password, run, url or old.url, tls_ca_pem or old.tls_ca_pem)
        else:
            cred = Credential(user, secrets.token_urlsafe(24), run, url, tls_ca_pem)
        out[user] = cred
        cred.write(path)
    return out


def server_users(creds: dict[str, Credential], policies: tuple[str, ...]) -> list[User]:
    return [User(user, role, creds[user].password, policy) for user, role, policy in run_users(policies)]


def redact(url: str) -> str:
    """``nats://user:secret@host:4222`` -> ``nats://user:***@host:4222`` (each URL of a comma-separated list)."""
    out = []
    for u in url.split(","):
        parts = urlsplit(u.strip())
        if parts.password:
            netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
            u = urlunsplit(parts._replace(netloc=netloc))
        out.append(u)
    return ",".join(out)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TlsFiles:
    ca_pem: str
    cert_file: Path
    key_file: Path


def make_tls(tls_dir: Path, hosts: list[str], days: int = 365) -> TlsFiles:
    """A CA and a server certificate for ``hosts`` (names or IPs), reused when already made."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_path, cert_path, key_path = tls_dir / "ca.pem", tls_dir / "server.pem", tls_dir / "server-key.pem"
    if ca_path.exists() and cert_path.exists() and key_path.exists():
        return TlsFiles(ca_path.read_text(), cert_path, key_path)
    tls_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "astraflow run CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in dict.fromkeys([*hosts, "localhost", "127.0.0.1"]):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False).sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    ca_pem = ca.public_bytes(pem).decode()
    ca_path.write_text(ca_pem)
    cert_path.write_bytes(cert.public_bytes(pem))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return TlsFiles(ca_pem, cert_path, key_path)
