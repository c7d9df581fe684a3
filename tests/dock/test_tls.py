"""The dock over mutual TLS with a run's own certificates: its clients get through, nobody else does."""

from __future__ import annotations

import pyarrow.flight as flight
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from dockrl.dock import GRPO_SCHEMA
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.server import DockShardServer
from dockrl.dock.tls import CA_ENV, DockTLS, RunCertificates, connect

TOKEN = "driver-token"
QUICK = flight.FlightCallOptions(timeout=5.0, headers=[(b"authorization", f"Bearer {TOKEN}".encode())])


@pytest.fixture(scope="module")
def certs() -> RunCertificates:
    return RunCertificates.generate(["127.0.0.1", "shard-0.run.ns.svc"], run="test-run")


def test_the_certificates_name_the_shards_and_their_uses(certs):
    server = x509.load_pem_x509_certificate(certs.server.cert)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == ["shard-0.run.ns.svc"]
    assert list(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    client = x509.load_pem_x509_certificate(certs.client.cert)
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    ca = x509.load_pem_x509_certificate(certs.server.ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca and certs.server.ca == certs.client.ca
    assert server.issuer == client.issuer == ca.subject


def test_only_a_client_with_the_runs_certificate_reaches_the_shard(certs):
    with DockShardServer(GRPO_SCHEMA, token=TOKEN, tls=certs.server) as server:
        assert server.location.startswith("grpc+tls://127.0.0.1:")
        with DockClient([server.location], GRPO_SCHEMA, token=TOKEN, tls=certs.client, rpc_timeout_s=10.0) as dock:
            dock.open_iteration(0, 4, 2)
            dock.put(range(4), {"prompt_ids": [[1]] * 4})
            assert dock.claim("rollout", ["prompt_ids"], 4).rows == [0, 1, 2, 3]
        other = RunCertificates.generate(["127.0.0.1"], run="another-run")
        refused = [
            connect(server.location, other.client),  # another run's client certificate
            flight.connect(server.location, tls_root_certs=certs.client.ca),  # the run's authority, no client certificate
            flight.connect(server.location.replace("grpc+tls", "grpc")),  # plain gRPC
        ]
        for client in refused:
            with pytest.raises(flight.FlightUnavailableError):
                list(client.list_actions(QUICK))
            client.close()
        # and a client trusting another authority does not accept the shard
        impostor = DockTLS(other.client.ca, certs.client.cert, certs.client.key)
        with pytest.raises(flight.FlightUnavailableError):
            list(connect(server.location, impostor).list_actions(QUICK))


def test_the_ends_travel_as_environment_variables(certs):
    assert DockTLS.from_env(certs.client.env("client"), "client") == certs.client
    assert DockTLS.from_env(certs.server.env("server"), "server") == certs.server
    assert DockTLS.from_env({}, "client") is None
    with pytest.raises(ValueError, match="DOCKRL_DOCK_TLS_CLIENT_CERT, DOCKRL_DOCK_TLS_CLIENT_KEY not"):
        DockTLS.from_env({CA_ENV: "x"}, "client")
    with pytest.raises(ValueError, match="no shard host"):
        RunCertificates.generate([])
