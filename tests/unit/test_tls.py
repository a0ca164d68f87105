"""common.tls: the TLS flags, loading and checking certificate files (with errors that name the flag and the
file), the throwaway CA of `tandem up --tls`, and in-process servers that refuse what they should."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import tls
from common.service import channel, start_server
from common.tls import ClientTLS, ServerTLS, ServiceTLS, TLSConfigError
from tandem.dev_certs import VALIDITY, DevCA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory):
    """A CA with a service and a client certificate, and another CA with a certificate of its own."""
    root = tmp_path_factory.mktemp("pki")
    ca, other = DevCA(root / "ca", hosts=["tandem.test"]), DevCA(root / "other")
    return {"ca": ca, "svc": ca.issue("svc"), "client": ca.issue("client"), "other": other,
            "intruder": other.issue("intruder")}


@pytest.fixture(autouse=True)
def no_installed_identity():
    """A test that installs channel credentials process-wide takes them away again."""
    yield
    tls.install(None)


def parse(*argv: str, public: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    tls.add_tls_args(parser, public=public)
    return parser.parse_args(list(argv))


def service_flags(files) -> list[str]:
    return ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]


# ---- flags -> ServiceTLS --------------------------------------------------------------------------------


def test_no_flags_is_plaintext_without_a_health_port():
    for public in (False, True):
        assert tls.from_args(parse(public=public), public=public) == ServiceTLS()


def test_internal_service_with_cert_key_and_ca_is_mutual_tls(pki):
    files = pki["svc"]
    got = tls.from_args(parse(*service_flags(files)))
    ca, cert, key = files.ca.read_bytes(), files.cert.read_bytes(), files.key.read_bytes()
    assert got.server == ServerTLS(cert, key, client_ca=ca)  # client certificates required
    assert got.client == ClientTLS(ca, cert, key)  # its own channels present its certificate
    assert got.health_port == 0  # TLS on: a plaintext health port, a free one by default
    assert tls.from_args(parse(*service_flags(files), "--health-port", "-1")).health_port is None
    assert tls.from_args(parse(*service_flags(files), "--health-port", "8081")).health_port == 8081
    named = tls.from_args(parse(*service_flags(files), "--tls-server-name", "tandem.internal"))
    assert named.client.options() == [("grpc.ssl_target_name_override", "tandem.internal")]


def test_flags_come_from_tandem_variables_too(pki, monkeypatch):
    files = pki["svc"]
    monkeypatch.setenv("TANDEM_TLS_CERT", str(files.cert))
    monkeypatch.setenv("TANDEM_TLS_KEY", str(files.key))
    monkeypatch.setenv("TANDEM_TLS_CA", str(files.ca))
    monkeypatch.setenv("TANDEM_HEALTH_PORT", "8081")
    got = tls.from_args(parse())
    assert got.server.client_ca == files.ca.read_bytes() and got.health_port == 8081


def test_gateway_public_port_and_internal_identity(pki):
    svc, client = pki["svc"], pki["client"]
    public = ["--tls-cert", str(svc.cert), "--tls-key", str(svc.key)]
    only_tls = tls.from_args(parse(*public, public=True), public=True)
    assert only_tls.server.client_ca is None and only_tls.client is None  # TLS, no client certificates asked
    with_clients = tls.from_args(parse(*public, "--tls-client-ca", str(svc.ca), public=True), public=True)
    assert with_clients.server.client_ca == svc.ca.read_bytes()
    # --tls-ca: mutual TLS towards the services, with the public certificate unless an internal one is given
    same = tls.from_args(parse(*public, "--tls-ca", str(svc.ca), public=True), public=True)
    assert same.client.cert_chain == svc.cert.read_bytes() and same.server.client_ca is None
    split = tls.from_args(parse(*public, "--tls-ca", str(svc.ca), "--tls-internal-cert", str(client.cert),
                                "--tls-internal-key", str(client.key), public=True), public=True)
    assert split.server.cert_chain == svc.cert.read_bytes() and split.client.cert_chain == client.cert.read_bytes()
    # mutual TLS inside, plaintext public port (TLS ended in front of the gateway): no health port needed
    inside = tls.from_args(parse("--tls-ca", str(svc.ca), "--tls-internal-cert", str(client.cert),
                                 "--tls-internal-key", str(client.key), public=True), public=True)
    assert inside.server is None and inside.client.cert_chain == client.cert.read_bytes()
    assert inside.health_port is None


@pytest.mark.parametrize("argv, public, message", [
    (["--tls-cert", "{cert}"], False, "--tls-cert and --tls-key go together"),
    (["--tls-key", "{key}"], True, "--tls-cert and --tls-key go together"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}"], False, "internal services use mutual TLS"),
    (["--tls-ca", "{ca}"], False, "--tls-ca needs --tls-cert and --tls-key"),
    (["--tls-ca", "{ca}"], True, "--tls-ca needs the gateway's certificate"),
    (["--tls-client-ca", "{ca}"], True, "--tls-client-ca needs --tls-cert"),
    (["--tls-internal-cert", "{cert}", "--tls-internal-key", "{key}"], True, "--tls-internal-cert needs --tls-ca"),
])
def test_flags_that_do_not_fit_together(pki, argv, public, message):
    files = pki["svc"]
    argv = [a.format(cert=files.cert, key=files.key, ca=files.ca) for a in argv]
    with pytest.raises(TLSConfigError, match=message):
        tls.from_args(parse(*argv, public=public), public=public)


# ---- files ----------------------------------------------------------------------------------------------


def test_missing_file_names_the_flag_and_the_path(pki, tmp_path):
    files = pki["svc"]
    missing = tmp_path / "nope.pem"
    with pytest.raises(TLSConfigError, match=f"--tls-key {missing}: no such file"):
        tls.from_args(parse("--tls-cert", str(files.cert), "--tls-key", str(missing), "--tls-ca", str(files.ca)))
    with pytest.raises(TLSConfigError, match=f"--tls-ca {missing}: no such file"):
        tls.from_args(parse("--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(missing)))
    with pytest.raises(TLSConfigError, match=f"--tls-cert {tmp_path}: is a directory"):
        tls.load_cert(tmp_path, "--tls-cert")


def test_unreadable_file_says_permission_denied(pki, monkeypatch):
    files = pki["svc"]
    real = Path.read_bytes

    def read_bytes(self: Path) -> bytes:  # root reads any file, so the refusal is simulated
        if self == files.key:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(TLSConfigError, match=f"--tls-key {files.key}: permission denied"):
        tls.from_args(parse(*service_flags(files)))


def test_not_pem_encrypted_and_mismatched_keys(pki, tmp_path):
    files, other = pki["svc"], pki["intruder"]
    junk = tmp_path / "junk.pem"
    junk.write_text("hello\n")
    with pytest.raises(TLSConfigError, match="not a PEM certificate"):
        tls.load_cert(junk, "--tls-cert")
    with pytest.raises(TLSConfigError, match="--tls-key .*junk.pem: not a PEM private key"):
        tls.load_key(junk, "--tls-key")
    key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    locked = tmp_path / "locked.pem"
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(TLSConfigError, match="the key is encrypted"):
        tls.load_key(locked, "--tls-key")
    with pytest.raises(TLSConfigError, match="--tls-key does not belong to --tls-cert"):
        tls.from_args(parse("--tls-cert", str(files.cert), "--tls-key", str(other.key), "--tls-ca", str(files.ca)))


def test_expired_certificate_is_refused_at_start(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(days=10))
            .not_valid_after(now - datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    path = tmp_path / "old.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(TLSConfigError, match="--tls-ca .*old.pem: the certificate for CN=old expired on"):
        tls.load_cert(path, "--tls-ca")


def test_setup_exits_with_the_service_name_and_installs_the_identity(pki, tmp_path):
    with pytest.raises(SystemExit, match=r"tandem serve decode: --tls-cert .*: no such file"):
        tls.setup(parse("--tls-cert", str(tmp_path / "x"), "--tls-key", str(tmp_path / "y"), "--tls-ca",
                        str(pki["svc"].ca)), "decode")
    assert tls.internal_client() is None
    got = tls.setup(parse(*service_flags(pki["svc"])), "decode")
    assert tls.internal_client() is got.client is not None


def test_client_tls_from_files(pki):
    files = pki["client"]
    assert ClientTLS.from_files(files.ca) == ClientTLS(files.ca.read_bytes())
    assert ClientTLS.from_files(None).ca is None  # the system's roots
    with pytest.raises(TLSConfigError, match="go together"):
        ClientTLS.from_files(files.ca, cert=files.cert)


def test_generate_flags_build_the_client_tls(pki):
    from tandem.cli import build_parser, client_tls

    files = pki["client"]
    plain = build_parser().parse_args(["generate", "hi"])
    assert client_tls(plain) is None
    args = build_parser().parse_args(["generate", "hi", "--tls-ca", str(files.ca), "--tls-cert", str(files.cert),
                                      "--tls-key", str(files.key), "--tls-server-name", "gw.example.com"])
    got = client_tls(args)
    assert got.ca == files.ca.read_bytes() and got.cert_chain == files.cert.read_bytes()
    assert got.server_name == "gw.example.com"
    assert client_tls(build_parser().parse_args(["generate", "hi", "--tls"])) == ClientTLS()


# ---- the throwaway CA -----------------------------------------------------------------------------------


def test_dev_certificates(pki):
    ca, files = pki["ca"], pki["svc"]
    assert stat.S_IMODE(os.stat(ca.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(files.key).st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "tandem.test"} <= set(sans.get_values_for_type(x509.DNSName))
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.not_valid_after_utc - cert.not_valid_before_utc <= VALIDITY + datetime.timedelta(minutes=5)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey) and cert.public_key().curve.name == "secp256r1"
    cert.verify_directly_issued_by(ca.cert)
    assert not list(ca.directory.glob("ca-key*")), "the CA's key is never written"


def test_launcher_issues_a_certificate_per_service(tmp_path):
    from tandem.launcher import Cluster, ClusterConfig

    cluster = Cluster(ClusterConfig(tls=True, log_dir=tmp_path))
    flags = cluster.tls_flags("decode-0")
    cert, key, ca = (Path(flags[flags.index(f) + 1]) for f in ("--tls-cert", "--tls-key", "--tls-ca"))
    assert cert.parent == tmp_path / "tls" and ca == cluster.ca_path and key.stat().st_mode & 0o077 == 0
    assert cluster.tls_flags("decode-0") == flags  # issued once
    assert cluster.client_tls() == ClientTLS(ca.read_bytes())
    assert Cluster(ClusterConfig(log_dir=tmp_path / "plain")).tls_flags("decode-0") == []


# ---- servers: what gets in ------------------------------------------------------------------------------


async def health_check(address: str, security: ClientTLS | None) -> grpc.StatusCode:
    ch = channel(address, security) if security else grpc.aio.insecure_channel(address)
    try:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        await ch.close()


def test_mutual_tls_server_refuses_strangers_and_serves_plain_health(pki):
    ca, svc, client, intruder = pki["ca"], pki["svc"], pki["client"], pki["intruder"]
    settings = tls.from_args(parse(*service_flags(svc)))
    ca_pem = ca.ca_path.read_bytes()

    async def main() -> dict[str, grpc.StatusCode]:
        server = await start_server([], "127.0.0.1", 0, settings)
        address = f"127.0.0.1:{server.port}"
        try:
            return {
                "valid": await health_check(address, ClientTLS(ca_pem, client.cert.read_bytes(),
                                                               client.key.read_bytes())),
                "by name": await health_check(f"localhost:{server.port}", ClientTLS(
                    ca_pem, client.cert.read_bytes(), client.key.read_bytes())),
                "no certificate": await health_check(address, ClientTLS(ca_pem)),
                "another CA": await health_check(address, ClientTLS(ca_pem, intruder.cert.read_bytes(),
                                                                    intruder.key.read_bytes())),
                "plaintext": await health_check(address, None),
                "health port": await health_check(server.ready_fields("127.0.0.1")["health"], None),
            }
        finally:
            await server.stop(0)

    got = asyncio.run(main())
    assert got == {"valid": grpc.StatusCode.OK, "by name": grpc.StatusCode.OK,
                   "no certificate": grpc.StatusCode.UNAVAILABLE, "another CA": grpc.StatusCode.UNAVAILABLE,
                   "plaintext": grpc.StatusCode.UNAVAILABLE, "health port": grpc.StatusCode.OK}


def test_public_tls_server_checks_the_client_side_too(pki):
    ca, svc, other = pki["ca"], pki["svc"], pki["other"]
    settings = tls.from_args(parse("--tls-cert", str(svc.cert), "--tls-key", str(svc.key), public=True),
                             public=True)
    ca_pem = ca.ca_path.read_bytes()

    async def main() -> dict[str, grpc.StatusCode]:
        server = await start_server([], "127.0.0.1", 0, settings)
        address = f"127.0.0.1:{server.port}"
        try:
            return {
                "no client certificate needed": await health_check(address, ClientTLS(ca_pem)),
                "plaintext": await health_check(address, None),
                "untrusted server": await health_check(address, ClientTLS(other.ca_path.read_bytes())),
                "wrong name": await health_check(address, ClientTLS(ca_pem, server_name="elsewhere.example")),
                "name override": await health_check(address, ClientTLS(ca_pem, server_name="tandem.test")),
            }
        finally:
            await server.stop(0)

    got = asyncio.run(main())
    assert got == {"no client certificate needed": grpc.StatusCode.OK, "plaintext": grpc.StatusCode.UNAVAILABLE,
                   "untrusted server": grpc.StatusCode.UNAVAILABLE, "wrong name": grpc.StatusCode.UNAVAILABLE,
                   "name override": grpc.StatusCode.OK}


def test_channel_uses_the_installed_identity(pki):
    settings = tls.from_args(parse(*service_flags(pki["svc"])))

    async def main() -> tuple[grpc.StatusCode, grpc.StatusCode]:
        server = await start_server([], "127.0.0.1", 0, settings)
        address = f"127.0.0.1:{server.port}"
        try:
            tls.install(None)
            before = await health_check(address, None)  # plaintext: refused
            tls.install(tls.from_args(parse(*service_flags(pki["client"]))).client)
            ch = channel(address)  # what every service's client code calls
            try:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                after = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                after = exc.code()
            finally:
                await ch.close()
            return before, after
        finally:
            await server.stop(0)

    assert asyncio.run(main()) == (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK)
