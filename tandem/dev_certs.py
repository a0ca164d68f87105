"""Throwaway certificates for ``tandem up --tls``: a CA made for one run and a certificate per service.

Everything is ECDSA P-256, valid for a week (from five minutes ago, for clocks that disagree a little).
The CA's private key lives only in the ``DevCA`` object, so nothing can be signed by it once the run
is over; the services' keys are written with mode 0600 into a 0700 folder. Each service certificate
names ``localhost``, ``127.0.0.1``, ``::1`` and the extra hosts given (the address the services bind and
announce, which is what the others dial, even ``0.0.0.0``), and is good for both ends of a connection
(server and client auth), as mutual TLS needs.
Not for production: there, certificates come from files or Kubernetes secrets (e.g. cert-manager).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=7)
CLOCK_SKEW = datetime.timedelta(minutes=5)
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True, slots=True)
class CertFiles:
    """One service's certificate and key, and the CA that signed it (the flags --tls-cert/-key/-ca)."""

    cert: Path
    key: Path
    ca: Path

    def flags(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


class DevCA:
    """A certificate authority for one run; ``issue(name)`` writes ``<name>.pem`` and ``<name>-key.pem``."""

    def __init__(self, directory: str | Path, hosts: Sequence[str] = (), name: str = "tandem throwaway CA") -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        self.hosts = _hosts([*LOCAL_HOSTS, *hosts])
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = _name(name)
        now = _now()
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.ca_path = self.directory / "ca.pem"
        self.ca_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, hosts: Sequence[str] = ()) -> CertFiles:
        """A certificate for ``name`` (its common name and file names) valid for this CA's hosts and ``hosts``."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.SubjectAlternativeName(_san(_hosts([*self.hosts, *hosts]))), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        files = CertFiles(self.directory / f"{name}.pem", self.directory / f"{name}-key.pem", self.ca_path)
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_private(files.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
        return files


def write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by its owner only (0600 from the start, not chmod-ed after)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # a file that was already there keeps its mode through O_CREAT
        f.write(data)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tandem"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_usage(ca: bool) -> x509.KeyUsage:
    """Signatures (ECDSA), and for the CA signing certificates and CRLs too."""
    return x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                         decipher_only=False)


def _hosts(hosts: Sequence[str]) -> list[str]:
    """Distinct hosts in order (``[::1]`` as ``::1``)."""
    seen: list[str] = []
    for host in hosts:
        host = host.strip().strip("[]")
        if host and host not in seen:
            seen.append(host)
    return seen


def _san(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names
