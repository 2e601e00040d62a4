"""Security: TLS, mutual TLS and bearer-token auth on real server processes."""

from __future__ import annotations

import datetime
import ipaddress
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from pooling_client import PoolingClient, PoolingError
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.service.ops.auth import BearerKeys
from tests.server_process import ServerProcess, running_server, start_server

UNAUTHENTICATED_MESSAGE = "missing or invalid credentials"
SERVING = health_pb2.HealthCheckResponse.SERVING


# --------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Pem:
    cert: bytes
    key: bytes
    cert_file: Path
    key_file: Path


@dataclass(frozen=True)
class Pki:
    ca: Pem
    server: Pem
    client: Pem
    other_ca: Pem  # a CA nobody trusts
    other_client: Pem  # a client certificate signed by other_ca


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    cert_file, key_file = folder / f"{stem}.crt", folder / f"{stem}.key"
    cert_file.write_bytes(cert_pem)
    key_file.write_bytes(key_pem)
    return Pem(cert_pem, key_pem, cert_file, key_file)


def _builder(
    subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
    )


def _ca(folder: Path, stem: str) -> tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(f"{stem} test CA", _name(f"{stem} test CA"), key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
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
        .sign(key, hashes.SHA256())
    )
    return _write(folder, stem, cert, key), cert, key


def _leaf(
    folder: Path,
    stem: str,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    usage: x509.ObjectIdentifier,
    names: list[x509.GeneralName] | None = None,
) -> Pem:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(stem, ca_cert.subject, key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return _write(folder, stem, builder.sign(ca_key, hashes.SHA256()), key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca, ca_cert, ca_key = _ca(folder, "ca")
    other_ca, other_cert, other_key = _ca(folder, "other-ca")
    server_names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    server = _leaf(folder, "server", ca_cert, ca_key, ExtendedKeyUsageOID.SERVER_AUTH, server_names)
    client = _leaf(folder, "client", ca_cert, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH)
    other_client = _leaf(
        folder, "other-client", other_cert, other_key, ExtendedKeyUsageOID.CLIENT_AUTH
    )
    return Pki(ca, server, client, other_ca, other_client)


# --------------------------------------------------------------------------- servers


def model_args(model_folders: dict[str, Path]) -> list[str]:
    return ["--model", f"tiny-bert={model_folders['tiny-bert']}", "--dtype", "float32"]


def tls_args(pki: Pki, model_folders: dict[str, Path]) -> list[str]:
    """model_args, served over TLS with the server's certificate."""
    tls = ["--tls-cert", str(pki.server.cert_file), "--tls-key", str(pki.server.key_file)]
    return [*model_args(model_folders), *tls]


@pytest.fixture(scope="module")
def tls_server(
    pki: Pki, model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert)
    args = tls_args(pki, model_folders)
    yield from running_server(
        args, tmp_path_factory.mktemp("tls-logs"), "tls", credentials=credentials
    )


@pytest.fixture(scope="module")
def mtls_server(
    pki: Pki, model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = [*tls_args(pki, model_folders), "--tls-client-ca", str(pki.ca.cert_file)]
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.cert,
        private_key=pki.client.key,
        certificate_chain=pki.client.cert,
    )
    yield from running_server(
        args, tmp_path_factory.mktemp("mtls-logs"), "mtls", credentials=credentials
    )


@pytest.fixture(scope="module")
def auth_server(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("auth")
    key_file = folder / "keys.txt"
    key_file.write_text("# accepted keys\n\n  k2  \n")
    args = [*model_args(model_folders), "--api-key", "k1", "--api-key-file", str(key_file)]
    yield from running_server(args, folder, "auth")


def embed_ok(client: PoolingClient) -> None:
    [output] = client.embed(["hello secure world"])
    assert output.outputs.hidden_size == 32


def embed_error(client: PoolingClient) -> PoolingError:
    """The error of an embed call that must fail; closes the client."""
    with client, pytest.raises(PoolingError) as caught:
        client.embed(["should not get through"])
    return caught.value


# --------------------------------------------------------------------------- TLS


def test_tls_client_trusting_the_ca_can_embed(tls_server: ServerProcess, pki: Pki) -> None:
    with PoolingClient(tls_server.address, root_certificates=pki.ca.cert, timeout=30) as client:
        embed_ok(client)


def test_tls_certificate_name_localhost_verifies(tls_server: ServerProcess, pki: Pki) -> None:
    target = f"localhost:{tls_server.port}"
    with PoolingClient(target, root_certificates=pki.ca.cert, timeout=30) as client:
        embed_ok(client)


def test_insecure_channel_to_tls_server_fails(tls_server: ServerProcess) -> None:
    with grpc.insecure_channel(tls_server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Pool(pb.PoolRequest(embed=pb.TextInput(texts=["plaintext"])), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_client_trusting_another_ca_fails(tls_server: ServerProcess, pki: Pki) -> None:
    client = PoolingClient(tls_server.address, root_certificates=pki.other_ca.cert, timeout=10)
    assert embed_error(client).code == grpc.StatusCode.UNAVAILABLE


# --------------------------------------------------------------------------- mutual TLS


def test_mtls_client_with_certificate_can_embed(mtls_server: ServerProcess, pki: Pki) -> None:
    with PoolingClient(
        mtls_server.address,
        root_certificates=pki.ca.cert,
        private_key=pki.client.key,
        certificate_chain=pki.client.cert,
        timeout=30,
    ) as client:
        embed_ok(client)


def test_mtls_client_without_certificate_is_refused(mtls_server: ServerProcess, pki: Pki) -> None:
    client = PoolingClient(mtls_server.address, root_certificates=pki.ca.cert, timeout=10)
    assert embed_error(client).code == grpc.StatusCode.UNAVAILABLE


def test_mtls_client_with_certificate_from_another_ca_is_refused(
    mtls_server: ServerProcess, pki: Pki
) -> None:
    client = PoolingClient(
        mtls_server.address,
        root_certificates=pki.ca.cert,
        private_key=pki.other_client.key,
        certificate_chain=pki.other_client.cert,
        timeout=10,
    )
    assert embed_error(client).code == grpc.StatusCode.UNAVAILABLE


# --------------------------------------------------------------------------- bearer tokens


def assert_unauthenticated(error: grpc.RpcError) -> None:
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert error.details() == UNAUTHENTICATED_MESSAGE  # type: ignore[attr-defined]
    # No google.rpc.Status details: nothing that hints at why.
    assert rpc_status.from_call(error) is None  # type: ignore[arg-type]
    trailers = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
    assert "grpc-status-details-bin" not in trailers


BAD_METADATA = [
    pytest.param((), id="no-token"),
    pytest.param((("authorization", "Bearer wrong"),), id="wrong-token"),
    pytest.param((("authorization", "Bearer k1x"),), id="token-with-suffix"),
    pytest.param((("authorization", "Bearer "),), id="empty-token"),
    pytest.param((("authorization", "Basic k1"),), id="wrong-scheme"),
    pytest.param((("authorization", "k1"),), id="no-scheme"),
    pytest.param((("authorization", "Bearer # accepted keys"),), id="comment-line"),
]


@pytest.mark.parametrize("metadata", BAD_METADATA)
def test_calls_without_a_valid_token_are_unauthenticated(
    auth_server: ServerProcess, metadata: tuple[tuple[str, str], ...]
) -> None:
    with grpc.insecure_channel(auth_server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        calls = (
            lambda: stub.Pool(pb.PoolRequest(embed=pb.TextInput(texts=["x"])), metadata=metadata),
            lambda: stub.ListModels(pb.ListModelsRequest(), metadata=metadata),
            lambda: stub.Tokenize(pb.TokenizeRequest(texts=["x"]), metadata=metadata),
        )
        for call in calls:
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert_unauthenticated(caught.value)


def stream_one(server: ServerProcess, request_id: str, **call: Any) -> list[Any]:
    """The answers to a PoolStream of one request (`call`: the call's keywords)."""
    request = pb.PoolStreamRequest(
        request=pb.PoolRequest(request_id=request_id, embed=pb.TextInput(texts=["x"]))
    )
    with grpc.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        return list(stub.PoolStream(iter([request]), timeout=10, **call))


def test_pool_stream_without_a_token_is_unauthenticated(auth_server: ServerProcess) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stream_one(auth_server, "s-1")
    assert_unauthenticated(caught.value)


def test_pool_stream_with_a_token_works(auth_server: ServerProcess) -> None:
    [response] = stream_one(auth_server, "s-2", metadata=(("authorization", "Bearer k1"),))
    assert response.request_id == "s-2" and response.WhichOneof("result") == "response"


@pytest.mark.parametrize("key", ["k1", "k2"])
def test_keys_from_flag_and_file_both_work(auth_server: ServerProcess, key: str) -> None:
    with PoolingClient(auth_server.address, api_key=key, timeout=30) as client:
        embed_ok(client)
        assert [info.name for info in client.models()] == ["tiny-bert"]


def test_scheme_is_case_insensitive(auth_server: ServerProcess) -> None:
    with grpc.insecure_channel(auth_server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        response = stub.ListModels(
            pb.ListModelsRequest(), metadata=(("authorization", "bearer k2"),), timeout=10
        )
    assert [card.name for card in response.models] == ["tiny-bert"]


def test_client_without_a_key_gets_pooling_error(auth_server: ServerProcess) -> None:
    error = embed_error(PoolingClient(auth_server.address, timeout=10))
    assert error.code == grpc.StatusCode.UNAUTHENTICATED
    assert error.message == UNAUTHENTICATED_MESSAGE
    assert error.reason is None and not error.field_violations


def test_health_and_reflection_answer_without_a_token(auth_server: ServerProcess) -> None:
    assert auth_server.health("") == SERVING
    assert auth_server.health("pooling.v1.PoolingService") == SERVING
    with grpc.insecure_channel(auth_server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = {service.name for service in response.list_services_response.service}
    assert {"pooling.v1.PoolingService", "grpc.health.v1.Health"} <= names


def test_auth_flags_without_a_usable_key_do_not_leave_the_server_open(
    model_folders: dict[str, Path], tmp_path: Path
) -> None:
    """Asked for auth but given no key (unset env var, empty secret mount): fail closed."""
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# keys are mounted here\n\n")
    args = [*model_args(model_folders), "--api-key", "", "--api-key-file", str(key_file)]
    try:
        process = start_server(args, tmp_path, "no-keys")
    except RuntimeError:
        return  # refusing to start is a fine answer
    try:
        with grpc.insecure_channel(process.address) as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Pool(pb.PoolRequest(embed=pb.TextInput(texts=["open?"])), timeout=10)
        assert_unauthenticated(caught.value)
    finally:
        process.stop(signal.SIGTERM)


def test_tls_client_ca_needs_a_server_certificate() -> None:
    from pooling_server.service.cli import build_parser, config_from_args

    for argv in (["--tls-client-ca", "ca.crt"], ["--tls-cert", "s.crt"], ["--tls-key", "s.key"]):
        with pytest.raises(SystemExit, match="--tls-cert and --tls-key go together"):
            config_from_args(build_parser().parse_args(argv))


def test_one_key_check_for_every_door() -> None:
    """BearerKeys, which the gRPC interceptor and the HTTP middleware both ask: any case of
    the scheme, any of the keys, the exact bytes sent; bytes that are not UTF-8 (aiohttp's
    surrogates) or a lone surrogate are refused, not an exception."""
    keys = BearerKeys(["k1", "k2", ""])
    assert keys and not BearerKeys([""])
    assert keys.allow("Bearer k1") and keys.allow("bearer k2") and keys.allow(b"BEARER k1")
    for refused in (None, "", "k1", "Basic k1", "Bearer k1x", "Bearer ", "Bearer  k1"):
        assert not keys.allow(refused), refused
    not_utf8 = b"Bearer \xff\xfe".decode("utf-8", "surrogateescape")
    assert not keys.allow(not_utf8) and not keys.allow("Bearer \ud800")
    assert keys.allow_metadata((("x-other", "v"), ("authorization", "Bearer k2")))
    assert not keys.allow_metadata((("authorization", "Basic k1"),))
    assert not keys.allow_metadata((("authorization-bin", b"Bearer k1"),))
