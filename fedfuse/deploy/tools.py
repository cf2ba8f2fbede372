"""Tooling for a real deployment: TLS certificates, SuperNode keys and site data files.

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
here is Flower-free; :func:`register_cli` adds the three subcommands to the ``fedfuse`` CLI.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import ipaddress
import logging
import os
import re
import sys
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
    "register_cli",
]

#: Always in the server certificate: the SuperLink's own ServerApp runner (SuperExec) connects
#: to it on 127.0.0.1, even when the SuperLink listens on a public address.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_CURVE = ec.SECP384R1
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


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


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        pass
    if not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9.*-]*[A-Za-z0-9])?", name):
        raise ValueError(f"host {name!r} is neither an IP address nor a DNS name")
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
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
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
    directory = Path(directory).expanduser()
    names = list(dict.fromkeys([*hosts, *(LOOPBACK_NAMES if loopback else ())]))
    if not names:
        raise ValueError("give at least one host name or IP address for the server certificate")
    if days < 1 or ca_days < 1:
        raise ValueError(f"validity must be >= 1 day, got days={days}, ca_days={ca_days}")
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
    key = ec.generate_private_key(_CURVE())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(general_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
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
    directory = Path(directory).expanduser()
    if not names:
        raise ValueError("give at least one site name")
    for name in names:
        if not _NAME_PATTERN.match(name):
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


# ------------------------------------------------------------------------------------- CLI
def _fail(command: str, error: Exception) -> int:
    print(f"fedfuse {command}: error: {error}", file=sys.stderr)
    return 2


def certs_command(args: argparse.Namespace) -> int:
    """``fedfuse certs``: CA + SuperLink server certificate."""
    try:
        made = make_server_certificates(
            args.out,
            args.host,
            days=args.days,
            ca_days=args.ca_days,
            loopback=not args.no_loopback,
            force=args.force,
        )
    except (FileExistsError, ValueError) as error:
        return _fail("certs", error)
    ca_pem = x509.load_pem_x509_certificate(made.ca_cert.read_bytes())
    print(f"{'created' if made.ca_created else 'reused'} CA: {made.ca_cert} (key {made.ca_key})")
    print(f"  CA fingerprint {fingerprint(ca_pem.public_bytes(serialization.Encoding.DER))}")
    print(f"server certificate: {made.server_cert} (key {made.server_key})")
    print(f"  valid for: {', '.join(made.names)}")
    print(f"give every site {made.ca_cert}; keep {made.ca_key} and {made.server_key} private")
    return 0


def keys_command(args: argparse.Namespace) -> int:
    """``fedfuse keys``: SuperNode authentication key pairs."""
    try:
        made = make_supernode_keys(args.out, args.names, force=args.force)
    except (FileExistsError, ValueError) as error:
        return _fail("keys", error)
    for site in made:
        print(f"{site.name}: private {site.private_key}, public {site.public_key}")
        print(f"  public key fingerprint {site.fingerprint}")
    return 0


def _floats(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


def _class_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return [c.strip() for c in text.split(",")]


def site_data_command(args: argparse.Namespace) -> int:
    """``fedfuse site-data``: convert a site's data to a validated ``.npz`` (or check one)."""
    from fedfuse.data import load_npz_dataset, save_npz_dataset
    from fedfuse.data.convert import from_arrays, from_image_folder, from_medmnist_npz, parse_shape

    try:
        if args.source == "check":
            dataset, names = load_npz_dataset(args.path), None
        else:
            out = Path(args.out).expanduser()
            if out.suffix != ".npz":
                raise ValueError(f"{out}: the site data file must end in .npz")
            if out.exists() and not args.force:
                raise FileExistsError(f"{out}: exists; refusing to overwrite it (use --force)")
            stats = {"mean": _floats(args.mean), "std": _floats(args.std)}
            shape = parse_shape(args.shape) if args.shape else None
            names = None
            if args.source == "folder":
                if shape is None:
                    raise ValueError("--shape is required for an image folder, e.g. 1x28x28")
                dataset, names = from_image_folder(
                    args.path,
                    shape,
                    classes=_class_list(args.classes),
                    num_classes=args.num_classes,
                    **stats,
                )
            elif args.source == "medmnist":
                dataset = from_medmnist_npz(
                    args.path, args.split, num_classes=args.num_classes, shape=shape, **stats
                )
            else:
                dataset = from_arrays(
                    args.images, args.labels, args.num_classes, shape=shape, **stats
                )
            save_npz_dataset(out, dataset)
            load_npz_dataset(out)  # what the SuperNode will read: prove it reads back
    except (FileExistsError, FileNotFoundError, ValueError, OSError) as error:
        return _fail("site-data", error)
    counts = dataset.labels.bincount(minlength=dataset.num_classes).tolist()
    label = [f"{i}" + (f" ({names[i]})" if names else "") for i in range(dataset.num_classes)]
    print(f"{len(dataset)} samples, shape {dataset.input_shape}, {dataset.num_classes} classes")
    print("per class: " + ", ".join(f"{lab}: {n}" for lab, n in zip(label, counts, strict=True)))
    print(f"mean {[round(m, 6) for m in dataset.mean]}, std {[round(s, 6) for s in dataset.std]}")
    if args.source != "check":
        print(f"wrote {args.out}")
    return 0


def register_cli(commands: argparse._SubParsersAction) -> None:
    """Add ``certs``, ``keys`` and ``site-data`` to the ``fedfuse`` command line."""
    certs = commands.add_parser(
        "certs",
        help="make a CA and the SuperLink's TLS server certificate",
        description=make_server_certificates.__doc__.splitlines()[0],
    )
    certs.add_argument("--out", required=True, help="directory for ca.crt, server.pem, keys")
    certs.add_argument(
        "--host",
        action="append",
        required=True,
        help="a DNS name or IP address the sites use to reach the SuperLink (repeatable)",
    )
    certs.add_argument("--days", type=int, default=825, help="server certificate validity")
    certs.add_argument("--ca-days", type=int, default=3650, help="validity of a new CA")
    certs.add_argument(
        "--no-loopback",
        action="store_true",
        help=f"leave out {', '.join(LOOPBACK_NAMES)} (the SuperLink needs them itself)",
    )
    certs.add_argument("--force", action="store_true", help="overwrite server.pem/server.key")
    certs.set_defaults(handler=certs_command)

    keys = commands.add_parser(
        "keys",
        help="make SuperNode authentication key pairs (<name>.key, <name>.pub)",
        description=make_supernode_keys.__doc__.splitlines()[0],
    )
    keys.add_argument("names", nargs="+", help="site names, e.g. site-0 site-1")
    keys.add_argument("--out", required=True, help="directory for the key files")
    keys.add_argument("--force", action="store_true", help="overwrite existing key files")
    keys.set_defaults(handler=keys_command)

    site = commands.add_parser(
        "site-data",
        help="turn a site's images into a validated .npz site data file (or check one)",
        description="Convert a site's data to the .npz file a SuperNode reads (data-path).",
    )
    sources = site.add_subparsers(dest="source", required=True)
    folder = sources.add_parser("folder", help="an image folder, one sub-folder per class")
    folder.add_argument("path", help="folder holding <class>/<image files>")
    folder.add_argument(
        "--classes",
        help="the federation's classes in label order, comma-separated or @file "
        "(default: sorted folder names, or the folder names as integer labels)",
    )
    medmnist = sources.add_parser("medmnist", help="a MedMNIST-format .npz")
    medmnist.add_argument("path", help="e.g. bloodmnist.npz (keys train_images, ...)")
    medmnist.add_argument("--split", default="train", choices=["train", "val", "test"])
    arrays = sources.add_parser("arrays", help="images and labels as two .npy files")
    arrays.add_argument("images", help="uint8 images .npy: (N,H,W), (N,H,W,C) or (N,C,H,W)")
    arrays.add_argument("labels", help="integer labels .npy: (N,) or (N,1)")
    for parser in (folder, medmnist, arrays):
        parser.add_argument("--out", required=True, help="the .npz file to write")
        parser.add_argument(
            "--shape",
            help="CxHxW of the federation's model input, e.g. 1x28x28 (images are converted "
            "and resized; required for folders)",
        )
        parser.add_argument(
            "--num-classes",
            type=int,
            required=parser is arrays,
            help="the federation's number of classes",
        )
        parser.add_argument("--mean", help="per-channel mean of x/255, e.g. 0.286 (agreed)")
        parser.add_argument("--std", help="per-channel std of x/255, e.g. 0.353 (agreed)")
        parser.add_argument("--force", action="store_true", help="overwrite --out")
    check = sources.add_parser("check", help="validate a site .npz file and summarise it")
    check.add_argument("path")
    site.set_defaults(handler=site_data_command)
