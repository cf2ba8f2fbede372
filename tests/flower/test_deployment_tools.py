"""`fedfuse certs` and `fedfuse keys`: files Flower's own readers accept, private and kept."""

from __future__ import annotations

import argparse
import ipaddress
import ssl
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import verification
from flwr.cli.supernode.register import try_load_public_key
from flwr.supercore.primitives.asymmetric import public_key_to_bytes
from flwr.supernode.cli.flower_supernode import _try_setup_client_authentication

from fedfuse.cli.main import main
from fedfuse.deploy.credentials import make_server_certificates, make_supernode_keys


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _verify(made, name: verification.DNSName | verification.IPAddress) -> None:
    ca = x509.load_pem_x509_certificate(made.ca_cert.read_bytes())
    leaf = x509.load_pem_x509_certificate(made.server_cert.read_bytes())
    store = verification.Store([ca])
    verification.PolicyBuilder().store(store).build_server_verifier(name).verify(leaf, [])


def test_server_certificate_chains_to_the_ca_for_every_host(tmp_path):
    made = make_server_certificates(tmp_path / "certs", ["link.hospital.example", "10.1.2.3"])
    assert made.names == ("link.hospital.example", "10.1.2.3", "localhost", "127.0.0.1", "::1")
    for name in ("link.hospital.example", "localhost"):
        _verify(made, verification.DNSName(name))
    for address in ("10.1.2.3", "127.0.0.1", "::1"):
        _verify(made, verification.IPAddress(ipaddress.ip_address(address)))
    with pytest.raises(verification.VerificationError):
        _verify(made, verification.DNSName("other.example"))
    assert _mode(made.ca_key) == 0o600 and _mode(made.server_key) == 0o600
    assert _mode(made.ca_cert) == 0o644 and _mode(made.server_cert) == 0o644
    assert _mode(made.ca_key.parent) == 0o700
    # what flower-superlink hands to uvicorn: Python's ssl must load the pair
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
        made.server_cert, made.server_key
    )


def test_existing_keys_are_kept_unless_forced_and_the_ca_is_reused(tmp_path):
    first = make_server_certificates(tmp_path, ["a.example"])
    ca_before, key_before = first.ca_cert.read_bytes(), first.server_key.read_bytes()
    with pytest.raises(FileExistsError, match=r"server.pem: exists; refusing to overwrite"):
        make_server_certificates(tmp_path, ["b.example"])
    assert first.server_key.read_bytes() == key_before
    second = make_server_certificates(tmp_path, ["b.example"], force=True)
    assert not second.ca_created and second.ca_cert.read_bytes() == ca_before
    assert second.server_key.read_bytes() != key_before
    _verify(second, verification.DNSName("b.example"))
    second.ca_key.unlink()
    with pytest.raises(ValueError, match=r"ca.crt exists without its pair"):
        make_server_certificates(tmp_path, ["c.example"], force=True)


def test_bad_host_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"host 'bad host' is neither an IP address nor a DNS"):
        make_server_certificates(tmp_path, ["bad host"])
    with pytest.raises(ValueError, match="at least one host"):
        make_server_certificates(tmp_path, [], loopback=False)


@pytest.mark.parametrize("host", ["*", "*.example.org"])
def test_a_wildcard_certificate_is_refused_before_anything_is_written(tmp_path, capsys, host):
    assert main(["certs", "--out", str(tmp_path / "certs"), "--host", host]) == 2
    assert "wildcard certificates are refused" in capsys.readouterr().err
    assert not (tmp_path / "certs").exists()  # not even the CA


def test_supernode_keys_are_read_by_flower_itself(tmp_path):
    made = make_supernode_keys(tmp_path / "keys", ["site-0", "site-1"])
    assert [k.name for k in made] == ["site-0", "site-1"]
    for keys in made:
        assert _mode(keys.private_key) == 0o600 and _mode(keys.public_key) == 0o644
        assert keys.public_key.read_text().startswith("ecdsa-sha2-nistp384 ")
        # `flwr supernode register` and `flower-supernode --auth-supernode-private-key`
        registered = try_load_public_key(keys.public_key)
        private, public = _try_setup_client_authentication(
            argparse.Namespace(
                auth_supernode_private_key=str(keys.private_key), auth_supernode_public_key=None
            )
        )
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        assert public_key_to_bytes(public) == registered
        assert keys.fingerprint.startswith("SHA256:")
    assert made[0].fingerprint != made[1].fingerprint


def test_keys_refuse_to_overwrite_and_validate_names(tmp_path):
    (first,) = make_supernode_keys(tmp_path, ["site-0"])
    before = first.private_key.read_bytes()
    with pytest.raises(FileExistsError, match=r"site-0.key: exists; refusing to overwrite"):
        make_supernode_keys(tmp_path, ["site-1", "site-0"])
    assert not (tmp_path / "site-1.key").exists()  # nothing written when one name clashes
    assert first.private_key.read_bytes() == before
    (again,) = make_supernode_keys(tmp_path, ["site-0"], force=True)
    assert again.private_key.read_bytes() != before and _mode(again.private_key) == 0o600
    for bad in (["../escape"], ["a b"], ["x", "x"], []):
        with pytest.raises(ValueError):
            make_supernode_keys(tmp_path, bad)


def test_certs_and_keys_commands(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--host", "10.0.0.7", "--days", "30"]) == 0
    printed = capsys.readouterr().out
    assert "created CA" in printed and "valid for: 10.0.0.7, localhost, 127.0.0.1, ::1" in printed
    assert main(["certs", "--out", str(out), "--host", "10.0.0.7"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert main(["keys", "--out", str(tmp_path / "keys"), "ward-a", "ward-b"]) == 0
    assert printed.count("SHA256:") == 1 and capsys.readouterr().out.count("SHA256:") == 2
    assert main(["keys", "--out", str(tmp_path / "keys"), "ward-a"]) == 2
    assert "ward-a.key: exists" in capsys.readouterr().err
