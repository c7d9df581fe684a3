"""The dock over mutual TLS: certificates made for one run at its start, used by Arrow Flight.

``RunCertificates.generate(hosts)`` makes, with the ``cryptography`` library, a certificate
authority for the run (ECDSA P-256, valid ``days``), a server certificate for the dock shards
(subject alternative names: ``hosts``, the shards' host names or IP addresses as clients dial
them) and a client certificate for the driver and the stages, both signed by that authority. The
authority's key signs these two and is then dropped: nothing else can ever be signed by it.
Each shard serves over ``grpc+tls://`` and asks every client for a certificate of the run's
authority (Flight's ``verify_client``); each client checks the shard's against the same authority.
A process from outside the run — or from another run — can neither read the traffic nor open a
connection, whatever token it holds.

A ``DockTLS`` is one end's part: the authority's certificate, its own certificate and key (PEM).
They travel to the members as secrets (``WorkerGroup.secret_env``: ``env``), read back with
``from_env``; ``connect`` opens a Flight connection with one (or a plain one without).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import pyarrow.flight as flight

CA_ENV = "DOCKRL_DOCK_TLS_CA"
"""Environment variable with the run's authority certificate (PEM), for shards and clients."""
CERT_ENV = {"server": "DOCKRL_DOCK_TLS_SERVER_CERT", "client": "DOCKRL_DOCK_TLS_CLIENT_CERT"}
"""Environment variables with each end's certificate (PEM)."""
KEY_ENV = {"server": "DOCKRL_DOCK_TLS_SERVER_KEY", "client": "DOCKRL_DOCK_TLS_CLIENT_KEY"}
"""Environment variables with each end's private key (PEM, PKCS #8)."""

End = Literal["server", "client"]


@dataclass(frozen=True)
class DockTLS:
    """One end of the dock's mutual TLS: the run's authority, this end's certificate and key (PEM bytes)."""

    ca: bytes
    cert: bytes
    key: bytes

    def env(self, end: End) -> dict[str, str]:
        """This end's part as environment variables (``from_env`` reads them back)."""
        return {CA_ENV: self.ca.decode(), CERT_ENV[end]: self.cert.decode(), KEY_ENV[end]: self.key.decode()}

    @classmethod
    def from_env(cls, env: Mapping[str, str], end: End) -> DockTLS | None:
        """The part of ``end`` in ``env``; None when the run has no TLS (no ``CA_ENV``).

        Raises:
            ValueError: ``CA_ENV`` is set but this end's certificate or key is not.
        """
        if not env.get(CA_ENV):
            return None
        missing = [name for name in (CERT_ENV[end], KEY_ENV[end]) if not env.get(name)]
        if missing:
            raise ValueError(f"dock TLS: {CA_ENV} is set but {', '.join(missing)} not; the launcher sets them together")
        return cls(env[CA_ENV].encode(), env[CERT_ENV[end]].encode(), env[KEY_ENV[end]].encode())


def scheme(tls: DockTLS | None) -> str:
    """The Flight location scheme of a shard with or without TLS."""
    return "grpc+tls" if tls else "grpc"


def connect(location: str, tls: DockTLS | None) -> flight.FlightClient:
    """A Flight connection to ``location``: mutual TLS with ``tls``, plain without."""
    if tls is None:
        return flight.connect(location)
    return flight.connect(location, tls_root_certs=tls.ca, cert_chain=tls.cert, private_key=tls.key)


@dataclass(frozen=True)
class RunCertificates:
    """The run's two ends (see the module docstring)."""

    server: DockTLS
    client: DockTLS

    @classmethod
    def generate(cls, hosts: Sequence[str], *, run: str = "dockrl", days: float = 30.0) -> RunCertificates:
        """Certificates of one run for shards reached at ``hosts`` (names or IP addresses).

        Raises:
            ValueError: ``hosts`` is empty.
        """
        from cryptography import x509  # lazy: only a distributed run's launcher makes certificates
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        if not hosts:
            raise ValueError("dock TLS: no shard host to certify")
        now = datetime.datetime.now(datetime.UTC)
        start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)  # 5 min: clocks apart

        def name(common: str) -> x509.Name:
            return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

        def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
            return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = name(f"{run} dock authority")
        ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                           data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                           encipher_only=False, decipher_only=False), critical=True)
              .sign(ca_key, hashes.SHA256()))
        ca_pem = ca.public_bytes(serialization.Encoding.PEM)

        def leaf(common: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]) -> DockTLS:
            key = ec.generate_private_key(ec.SECP256R1())
            builder = (x509.CertificateBuilder().subject_name(name(common)).issuer_name(ca_name).public_key(key.public_key())
                       .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                       .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                       .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
            if sans:
                builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
            cert = builder.sign(ca_key, hashes.SHA256())
            return DockTLS(ca_pem, cert.public_bytes(serialization.Encoding.PEM), pem_key(key))

        sans: list[x509.GeneralName] = []
        for host in dict.fromkeys(hosts):
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        return cls(server=leaf(f"{run} dock shards", ExtendedKeyUsageOID.SERVER_AUTH, sans),
                   client=leaf(f"{run} dock clients", ExtendedKeyUsageOID.CLIENT_AUTH, []))
