"""Transport security of tandem's gRPC ports, in one place: TLS on the gateway's public port and
mutual TLS between the services.

Flags of every service (each also a ``TANDEM_*`` variable, e.g. ``TANDEM_TLS_CERT``):

- ``--tls-cert`` / ``--tls-key``: this service's certificate (chain) and private key, PEM files.
- ``--tls-ca``: the CA that signs the other services' certificates. An internal service given
  cert, key and CA serves mutual TLS (a client must present a certificate signed by that CA), and
  every channel it opens to another service verifies the server against the CA and presents this
  service's certificate. No flags: plaintext, as before.
- ``--tls-server-name``: the name checked in the servers' certificates instead of the host of the
  address dialled (``grpc.ssl_target_name_override``), for when services are reached by names their
  certificates do not carry. (A worker the gateway finds through ``dns:///HOST:PORT`` is dialled by IP and
  checked against HOST unless this is given: ``gateway.workers.tls_checking``.)
- ``--health-port``: with TLS on, a plaintext port that serves only ``grpc.health.v1.Health``
  (Kubernetes' gRPC probes cannot speak TLS). Default: a free port when TLS is on (announced on the
  READY line as ``health=``), off when it is not; -1: off.

The gateway's public port: ``--tls-cert`` / ``--tls-key`` give TLS; ``--tls-client-ca`` also
requires client certificates signed by that CA. Towards the internal services the gateway presents
``--tls-internal-cert`` / ``--tls-internal-key`` (default: ``--tls-cert`` / ``--tls-key``) when
``--tls-ca`` is given.

Files are read once, at start (a renewed certificate takes a restart), and checked then: a missing or
unreadable file, something that is not PEM, an encrypted key, a key that does not belong to its
certificate or an expired certificate stop the service with a message naming the flag and the file.
The UCX data plane between workers and the kvstore is not encrypted: see the README's Security section.
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.settings import env_default

__all__ = [
    "ClientTLS", "ServerTLS", "ServiceTLS", "TLSConfigError", "add_tls_args", "from_args", "install",
    "internal_client", "setup",
]


class TLSConfigError(ValueError):
    """TLS flags that do not fit together, or a certificate / key file that cannot be used."""


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """What a TLS server port presents, and whom it lets in."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None  # set: clients must present a certificate signed by it (mTLS)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """How a channel checks its server, and the certificate it presents (if any)."""

    ca: bytes | None = None  # None: the system's trusted roots
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None  # checked instead of the address's host

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.private_key,
                                            certificate_chain=self.cert_chain)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    @classmethod
    def from_files(cls, ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None,
                   server_name: str | None = None) -> ClientTLS:
        """A client's TLS from PEM files (``tandem generate --tls-ca ...``); the flag names are in the errors."""
        chain, private = load_pair(cert, key)
        return cls(load_cert(ca, "--tls-ca") if ca else None, chain, private, server_name or None)


def load_pair(cert: str | Path | None, key: str | Path | None) -> tuple[bytes | None, bytes | None]:
    """The ``--tls-cert`` chain and ``--tls-key`` key (both or neither), checked to belong together."""
    if (cert is None) != (key is None):
        raise TLSConfigError("--tls-cert and --tls-key go together: give both or neither")
    chain = load_cert(cert, "--tls-cert") if cert else None
    private = load_key(key, "--tls-key") if key else None
    if chain and private:
        check_pair(chain, private, "--tls-cert", "--tls-key")
    return chain, private


@dataclass(frozen=True, slots=True)
class ServiceTLS:
    """One service's transport security, from its flags."""

    server: ServerTLS | None = None  # its gRPC port; None: plaintext
    client: ClientTLS | None = None  # its channels to other services; None: plaintext
    health_port: int | None = None  # the plaintext health-only port (0: a free one); None: none


# -- flags ----------------------------------------------------------------------------------------


def add_tls_args(p: argparse.ArgumentParser, public: bool = False) -> None:
    """The TLS flags of a service; ``public`` adds the gateway's public-port and internal-identity flags."""
    g = p.add_argument_group("transport security (see common/tls.py)")
    own = "the public port's" if public else "this service's"
    g.add_argument("--tls-cert", default=env_default("--tls-cert", None, str), metavar="PEM",
                   help=f"{own} certificate chain (with --tls-key: TLS on the gRPC port)")
    g.add_argument("--tls-key", default=env_default("--tls-key", None, str), metavar="PEM",
                   help=f"{own} private key (unencrypted PEM)")
    g.add_argument("--tls-ca", default=env_default("--tls-ca", None, str), metavar="PEM",
                   help="the CA of the internal services' certificates: mutual TLS with them (" +
                        ("the gateway verifies them and presents its internal certificate)" if public else
                         "clients must present a certificate it signed; this service's channels verify servers "
                         "against it and present --tls-cert)"))
    g.add_argument("--tls-server-name", default=env_default("--tls-server-name", None, str), metavar="NAME",
                   help="name to verify in other services' certificates instead of the dialled host")
    if public:
        g.add_argument("--tls-client-ca", default=env_default("--tls-client-ca", None, str), metavar="PEM",
                       help="require client certificates signed by this CA on the public port")
        g.add_argument("--tls-internal-cert", default=env_default("--tls-internal-cert", None, str), metavar="PEM",
                       help="the certificate the gateway presents to internal services (default: --tls-cert)")
        g.add_argument("--tls-internal-key", default=env_default("--tls-internal-key", None, str), metavar="PEM",
                       help="its private key (default: --tls-key)")
    g.add_argument("--health-port", type=int, default=env_default("--health-port", None, int),
                   help="plaintext port serving only grpc.health.v1 (for Kubernetes probes); default: a free one "
                        "when TLS is on (announced as health=), off otherwise; -1: off")


def from_args(args: argparse.Namespace, public: bool = False) -> ServiceTLS:
    """Read and check the files the TLS flags name; ``TLSConfigError`` says which flag is wrong."""
    cert, key, ca = _path(args, "tls_cert"), _path(args, "tls_key"), _path(args, "tls_ca")
    chain, private = load_pair(cert, key)
    ca_pem = load_cert(ca, "--tls-ca") if ca else None
    name = getattr(args, "tls_server_name", None) or None
    if public:
        server, client = _gateway(args, chain, private, ca_pem, name)
    else:
        if chain and not ca_pem:
            raise TLSConfigError("--tls-cert without --tls-ca: internal services use mutual TLS; give --tls-ca, "
                                 "the CA that signs the other services' certificates")
        if ca_pem and not chain:
            raise TLSConfigError("--tls-ca needs --tls-cert and --tls-key: with mutual TLS this service presents "
                                 "its own certificate")
        server = ServerTLS(chain, private, ca_pem) if chain else None
        client = ClientTLS(ca_pem, chain, private, name) if ca_pem else None
    health = getattr(args, "health_port", None)
    if health is None:
        health = 0 if server is not None else -1
    return ServiceTLS(server, client, None if health < 0 else health)


def _gateway(args: argparse.Namespace, chain: bytes | None, private: bytes | None, ca: bytes | None,
             name: str | None) -> tuple[ServerTLS | None, ClientTLS | None]:
    client_ca_path = _path(args, "tls_client_ca")
    if client_ca_path and not chain:
        raise TLSConfigError("--tls-client-ca needs --tls-cert and --tls-key: client certificates are asked for "
                             "over TLS")
    client_ca = load_cert(client_ca_path, "--tls-client-ca") if client_ca_path else None
    server = ServerTLS(chain, private, client_ca) if chain else None
    icert, ikey = _path(args, "tls_internal_cert"), _path(args, "tls_internal_key")
    if (icert is None) != (ikey is None):
        raise TLSConfigError("--tls-internal-cert and --tls-internal-key go together: give both or neither")
    if icert:
        if not ca:
            raise TLSConfigError("--tls-internal-cert needs --tls-ca, the CA of the internal services")
        ichain, iprivate = load_cert(icert, "--tls-internal-cert"), load_key(ikey, "--tls-internal-key")
        check_pair(ichain, iprivate, "--tls-internal-cert", "--tls-internal-key")
    else:
        ichain, iprivate = chain, private
    if ca and not ichain:
        raise TLSConfigError("--tls-ca needs the gateway's certificate for the internal services: give "
                             "--tls-internal-cert and --tls-internal-key (or --tls-cert and --tls-key)")
    client = ClientTLS(ca, ichain, iprivate, name) if ca else None
    return server, client


def _path(args: argparse.Namespace, dest: str) -> Path | None:
    value = getattr(args, dest, None)
    return Path(value).expanduser() if value else None


# -- the process's own channels -------------------------------------------------------------------

_internal: ClientTLS | None = None


def install(client: ClientTLS | None) -> None:
    """Make ``client`` what ``common.service.channel`` uses for this process's channels to other services
    (a service sets it once at start, before it opens any; None: plaintext)."""
    global _internal
    _internal = client


def internal_client() -> ClientTLS | None:
    return _internal


def setup(args: argparse.Namespace, service: str, public: bool = False) -> ServiceTLS:
    """A service's TLS from its flags, with its channels' credentials installed; a flag or file that
    cannot be used ends the process with a message that says which and why."""
    try:
        tls = from_args(args, public)
    except TLSConfigError as exc:
        raise SystemExit(f"tandem serve {service}: {exc}") from exc
    install(tls.client)
    return tls


# -- files ----------------------------------------------------------------------------------------


def read_file(path: str | Path, flag: str) -> bytes:
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TLSConfigError(f"{flag} {path}: no such file") from None
    except PermissionError:
        raise TLSConfigError(f"{flag} {path}: permission denied (this process cannot read it)") from None
    except IsADirectoryError:
        raise TLSConfigError(f"{flag} {path}: is a directory, not a PEM file") from None
    except OSError as exc:
        raise TLSConfigError(f"{flag} {path}: cannot be read: {exc.strerror or exc}") from None


def load_cert(path: str | Path, flag: str) -> bytes:
    """PEM certificates (a chain, or a CA bundle), checked: parseable and none expired."""
    from cryptography import x509

    data = read_file(path, flag)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise TLSConfigError(f"{flag} {path}: not a PEM certificate (expected '-----BEGIN CERTIFICATE-----')") \
            from None
    now = datetime.datetime.now(datetime.timezone.utc)
    for cert in certs:
        if cert.not_valid_after_utc < now:
            raise TLSConfigError(f"{flag} {path}: the certificate for {cert.subject.rfc4514_string()} expired on "
                                 f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
    return data


def load_key(path: str | Path, flag: str) -> bytes:
    """An unencrypted PEM private key."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    data = read_file(path, flag)
    try:
        load_pem_private_key(data, password=None)
    except TypeError:
        raise TLSConfigError(f"{flag} {path}: the key is encrypted; give it unencrypted (protect the file instead)") \
            from None
    except (ValueError, UnsupportedAlgorithm):
        raise TLSConfigError(f"{flag} {path}: not a PEM private key (expected '-----BEGIN PRIVATE KEY-----', "
                             "'-----BEGIN EC PRIVATE KEY-----' or '-----BEGIN RSA PRIVATE KEY-----')") from None
    return data


def check_pair(chain: bytes, key: bytes, cert_flag: str, key_flag: str) -> None:
    """The key must belong to the chain's first (leaf) certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import (
        Encoding,
        PublicFormat,
        load_pem_private_key,
    )

    leaf = x509.load_pem_x509_certificates(chain)[0]
    public = load_pem_private_key(key, password=None).public_key()
    der = (Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    if leaf.public_key().public_bytes(*der) != public.public_bytes(*der):
        raise TLSConfigError(f"{key_flag} does not belong to {cert_flag} ({leaf.subject.rfc4514_string()}): "
                             "the key and the certificate are from different pairs")
