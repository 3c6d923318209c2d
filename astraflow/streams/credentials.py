"""Per-run, per-role and per-node credentials: made by ``astraflow up``, kept owner-only in the run directory.

A credential file is everything a worker needs to join the run's plane as one role, and nothing
more: ``{"user", "password", "run", "url", "tls_ca_pem"}``. Every rollout node has its own
(``credentials/nodes/NAME.json``, user ``node-NAME``): ``up`` issues one per node it starts, and
``astraflow node add NAME --run-dir RUN`` one for a node joining from elsewhere; hand that file to
the machine and ``astraflow worker rollout --credential NAME.json --recipe recipe.yaml`` joins
(docs/deploy.md). A node may publish trajectories only under its own name, so the server vouches
for who sent each one, and one node is cut off (quarantined, revoked) without touching the others
(``launch/access.py``). Secrets never appear on a command line or in a log: the launcher passes
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
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from astraflow.streams.permissions import NODE_PREFIX, User, node_of
from astraflow.streams.subjects import check_token


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
    """(user, role, policy) of every role credential a run gets: one trainer user per policy (nodes have their own)."""
    return [("admin", "admin", "*"), ("dataflow", "dataflow", "*"), *((f"trainer-{p}", "trainer", p) for p in policies),
            ("evaluator", "evaluator", "*"), ("observer", "observer", "*")]


def node_path(cred_dir: Path, name: str) -> Path:
    return cred_dir / "nodes" / f"{check_token('node name', name)}.json"


def _kept(path: Path, user: str, run: str, url: str, tls_ca_pem: str | None) -> Credential:
    """The credential at ``path`` with this server's address (its secret kept), or a new one; written owner-only."""
    if path.exists():
        old = Credential.read(path)
        cred = Credential(user, old.password, run, url or old.url, tls_ca_pem or old.tls_ca_pem)
    else:
        cred = Credential(user, secrets.token_urlsafe(24), run, url, tls_ca_pem)
    cred.write(path)
    return cred


def issue(cred_dir: Path, run: str, policies: tuple[str, ...], url: str = "", tls_ca_pem: str | None = None,
          nodes: tuple[str, ...] = ()) -> dict[str, Credential]:
    """The run's credentials, by user: read back when ``cred_dir`` has them (a resumed run keeps its secrets), else
    made; with one for each of ``nodes`` (and every node issued before)."""
    out = {user: _kept(cred_dir / f"{user}.json", user, run, url, tls_ca_pem) for user, _, _ in run_users(policies)}
    for name in dict.fromkeys([*node_names(cred_dir), *nodes]):
        out[NODE_PREFIX + name] = issue_node(cred_dir, run, name, url, tls_ca_pem)
    return out


def issued(cred_dir: Path, policies: tuple[str, ...]) -> dict[str, Credential]:
    """The credentials ``issue`` wrote under ``cred_dir``, by user, read as they are (nothing is written)."""
    out = {user: Credential.read(cred_dir / f"{user}.json") for user, _, _ in run_users(policies)}
    out.update({NODE_PREFIX + name: Credential.read(node_path(cred_dir, name)) for name in node_names(cred_dir)})
    return out


def issue_node(cred_dir: Path, run: str, name: str, url: str = "", tls_ca_pem: str | None = None) -> Credential:
    """Node ``name``'s own credential (``cred_dir/nodes/NAME.json``): kept when it exists, else made."""
    return _kept(node_path(cred_dir, name), NODE_PREFIX + name, run, url, tls_ca_pem)


def node_names(cred_dir: Path) -> list[str]:
    """The nodes ``cred_dir`` holds a credential for, by name."""
    return sorted(p.stem for p in (cred_dir / "nodes").glob("*.json"))


def server_users(creds: dict[str, Credential], policies: tuple[str, ...], shut_out: Collection[str] = ()) -> list[User]:
    """The server's users: every role of the run, and every node in ``creds`` but those in ``shut_out`` (by name)."""
    roles = [User(user, role, creds[user].password, policy) for user, role, policy in run_users(policies)]
    nodes = [User(user, "rollout", c.password) for user, c in sorted(creds.items())
             if (name := node_of(user)) is not None and name not in shut_out]
    return roles + nodes


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
