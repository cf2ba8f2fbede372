"""Credentials for a real deployment: TLS certificates and SuperNode keys.

A deployment (``docs/deployment.md``) runs Flower's own ``flower-superlink`` at the server and
one ``flower-supernode`` per hospital site. This module makes what those processes read:

* ``fedfuse certs``: a private certificate authority (``ca.crt``, ``ca.key``) and the
  SuperLink's server certificate (``server.pem``, ``server.key``) for given host names and IP
  addresses (subject alternative names). ``flower-superlink`` takes them as ``--ssl-ca-certfile``,
  ``--ssl-certfile``, ``--ssl-keyfile``; sites verify the server with ``--root-certificates
  ca.crt``.
* ``fedfuse keys``: one SuperNode authentication key pair per site, ECDSA P-384 in OpenSSH
  format: ``<name>.key`` for ``flower-supernode --auth-supernode-private-key`` (it reads OpenSSH
  private keys) and ``<name>.pub`` for ``flwr supernode register`` (it reads OpenSSH public keys
  on a NIST curve).
* ``fedfuse site-data``: a site's images as the ``.npz`` file of :mod:`fedfuse.data.arrays`.

Private keys are written with mode 0600 and never overwritten without ``--force``. Everything
here is Flower-free; :mod:`fedfuse.cli.deploy` holds the three subcommands.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger(__name__)

__all__ = [
    "LOOPBACK_NAMES",
    "ServerCertificates",
    "SiteKeys",
    "fingerprint",
    "make_server_certificates",
    "make_supernode_keys",
]

#: Always in the server certificate: the SuperLink's own ServerApp runner (SuperExec) connects
#: to it on 127.0.0.1, even when the SuperLink listens on a public address.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_CURVE = ec.SECP384R1
#: Longest validity of a certificate: a century (a larger count overflows the clock's dates)
MAX_DAYS = 36_500
_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # fullmatch: "site\n" is no name


# ------------------------------------------------------------------------------ file writing
def _write(path: Path, data: bytes, *, private: bool, force: bool) -> Path:
    """Write ``data`` atomically; private files are 0600 from creation, public ones 0644."""
    if path.exists() and not force:
        raise FileExistsError(f"{path}: exists; refusing to overwrite it (use --force)")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _output_folder(directory: str | Path) -> Path:
    """``directory`` as a path, refused when something other than a folder is there (writing
    into it would fail half-way, ``[Errno 17] File exists``)."""
    directory = Path(directory).expanduser()
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory}: exists and is not a folder; give --out a folder")
    return directory


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def fingerprint(data: bytes) -> str:
    """``SHA256:<base64>`` of ``data`` (OpenSSH's style), to compare files over the phone."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


# ------------------------------------------------------------------------------ certificates
@dataclass(frozen=True)
class ServerCertificates:
    """Paths of a CA and the SuperLink certificate it signed."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    names: tuple[str, ...]
    ca_created: bool


#: the key usages of an X.509 KeyUsage extension, in its constructor's order
_KEY_USAGES = (
    "digital_signature",
    "content_commitment",
    "key_encipherment",
    "data_encipherment",
    "key_agreement",
    "key_cert_sign",
    "crl_sign",
    "encipher_only",
    "decipher_only",
)


def _key_usage(*allowed: str) -> x509.KeyUsage:
    """A KeyUsage extension that allows ``allowed`` and nothing else."""
    return x509.KeyUsage(**{usage: usage in allowed for usage in _KEY_USAGES})


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        pass
    if "*" in name:
        raise ValueError(
            f"host {name!r}: wildcard certificates are refused (any machine under the name could "
            "then pose as the SuperLink); name the server's host"
        )
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", name):
        raise ValueError(f"host {name!r} is neither an IP address nor a DNS name")
    if len(name) > 253 or any(not 1 <= len(label) <= 63 for label in name.split(".")):
        raise ValueError(
            f"host {name!r:.80}: a DNS name has at most 253 characters, in labels of 1 to 63"
        )
    return x509.DNSName(name.lower())


def _load_ca(
    cert_path: Path, key_path: Path
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except ValueError as error:
        raise ValueError(f"{cert_path.parent}: cannot read the existing CA ({error})") from None
    if cert.public_key().public_numbers() != key.public_key().public_numbers():
        raise ValueError(f"{cert_path} and {key_path} do not belong together")
    return cert, key  # type: ignore[return-value]


def _new_ca(common_name: str, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(_CURVE())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage("key_cert_sign", "crl_sign"), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA384())
    )
    return cert, key


def make_server_certificates(
    directory: str | Path,
    hosts: Sequence[str],
    *,
    days: int = 825,
    ca_days: int = 3650,
    common_name: str = "fedfuse SuperLink",
    loopback: bool = True,
    force: bool = False,
) -> ServerCertificates:
    """Create (or reuse) a CA in ``directory`` and issue the SuperLink's server certificate.

    An existing ``ca.crt`` + ``ca.key`` pair is reused, so a renewed server certificate keeps
    the sites' trusted ``ca.crt`` valid; delete both to start a new CA. ``hosts`` are the names
    and IP addresses the sites dial (``--superlink host:port``); ``loopback`` adds
    :data:`LOOPBACK_NAMES`, which the SuperLink itself needs.

    Raises:
        FileExistsError: ``server.key`` or ``server.pem`` exists and ``force`` is false.
        ValueError: a host is not a DNS name or IP address, or the existing CA is unusable.
    """
    directory = _output_folder(directory)
    names = list(dict.fromkeys([*hosts, *(LOOPBACK_NAMES if loopback else ())]))
    if not names:
        raise ValueError("give at least one host name or IP address for the server certificate")
    if not (1 <= days <= MAX_DAYS and 1 <= ca_days <= MAX_DAYS):
        raise ValueError(
            f"validity must be 1 to {MAX_DAYS} days, got days={days}, ca_days={ca_days} "
            "(options --days, --ca-days)"
        )
    general_names = [_general_name(n) for n in names]
    ca_cert_path, ca_key_path = directory / "ca.crt", directory / "ca.key"
    cert_path, key_path = directory / "server.pem", directory / "server.key"
    if not force:
        for path in (cert_path, key_path):
            if path.exists():
                raise FileExistsError(f"{path}: exists; refusing to overwrite it (use --force)")
    if ca_cert_path.exists() != ca_key_path.exists():
        present = ca_cert_path if ca_cert_path.exists() else ca_key_path
        raise ValueError(f"{present} exists without its pair; restore it or delete it")
    ca_created = not ca_cert_path.exists()
    if ca_created:
        ca_cert, ca_key = _new_ca(f"{common_name} CA", ca_days)
        _write(ca_key_path, _private_pem(ca_key), private=True, force=False)
        _write(
            ca_cert_path,
            ca_cert.public_bytes(serialization.Encoding.PEM),
            private=False,
            force=False,
        )
    else:
        ca_cert, ca_key = _load_ca(ca_cert_path, ca_key_path)
        log.info("reusing the CA in %s", ca_cert_path)
    now = dt.datetime.now(dt.UTC)
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    subject = names[0] if len(names[0]) <= 64 else common_name  # X.509 caps a CN at 64
    key = ec.generate_private_key(_CURVE())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(general_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage("digital_signature", "key_agreement"), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA384())
    )
    _write(key_path, _private_pem(key), private=True, force=force)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False, force=force)
    return ServerCertificates(
        ca_cert_path, ca_key_path, cert_path, key_path, tuple(names), ca_created
    )


# ------------------------------------------------------------------------------ SuperNode keys
@dataclass(frozen=True)
class SiteKeys:
    """A site's SuperNode authentication key pair."""

    name: str
    private_key: Path
    public_key: Path
    fingerprint: str


def make_supernode_keys(
    directory: str | Path, names: Sequence[str], *, force: bool = False
) -> list[SiteKeys]:
    """One ECDSA P-384 key pair per site name: ``<name>.key`` (OpenSSH private, 0600) and
    ``<name>.pub`` (OpenSSH public, the file to register with ``flwr supernode register``).

    Raises:
        FileExistsError: a key file exists and ``force`` is false (nothing is written then).
        ValueError: a name is not a plain file name or is repeated.
    """
    directory = _output_folder(directory)
    if not names:
        raise ValueError("give at least one site name")
    for name in names:
        if not _NAME_PATTERN.fullmatch(name):
            raise ValueError(f"site name {name!r}: use letters, digits, '.', '_' or '-'")
    if len(set(names)) != len(names):
        raise ValueError(f"site names {list(names)} repeat a name")
    if not force:
        for name in names:
            for suffix in (".key", ".pub"):
                if (directory / f"{name}{suffix}").exists():
                    raise FileExistsError(
                        f"{directory / (name + suffix)}: exists; refusing to overwrite it "
                        "(use --force)"
                    )
    made = []
    for name in names:
        key = ec.generate_private_key(_CURVE())
        private = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
        public = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        blob = base64.b64decode(public.split()[1])
        made.append(
            SiteKeys(
                name,
                _write(directory / f"{name}.key", private, private=True, force=force),
                _write(
                    directory / f"{name}.pub",
                    public + f" fedfuse-{name}\n".encode(),
                    private=False,
                    force=force,
                ),
                fingerprint(blob),
            )
        )
    return made
