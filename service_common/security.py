"""Transport security: TLS on every gRPC server and channel, mutual between roles.

Each role is given three PEM files (`*_TLS_CERT`, `*_TLS_KEY`, `*_TLS_CA`): its own
certificate and key, and the cluster CA. A role's server then accepts only peers whose
certificate the CA signed (`require_client_auth`), and its calls to other roles present
its own certificate and trust only servers the CA signed. Without the files everything
is plaintext, the default for a local run on loopback.

`write_throwaway_pki` makes a CA and a certificate per role for a TLS run of
`python -m launcher --tls` and for the tests; a deployment brings its own (deploy/).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from foundation.errors import InvalidArgument


@dataclass(frozen=True)
class Tls:
    """A role's TLS material, read once at start-up."""

    cert: bytes  # PEM: this role's certificate chain
    key: bytes  # PEM: its private key
    ca: bytes  # PEM: the CA that signs every role's certificate
    cert_path: str = ""
    key_path: str = ""
    ca_path: str = ""
    # The name the servers this role calls must carry in their certificates; empty =
    # the host dialled. A pool of pods reached by IP shares one name (deploy/README.md).
    server_name: str = ""

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str, server_name: str = "") -> Tls:
        return cls(
            _read(cert, "tls_cert"),
            _read(key, "tls_key"),
            _read(ca, "tls_ca"),
            cert,
            key,
            ca,
            server_name,
        )

    def server_credentials(self, require_client_auth: bool = True) -> grpc.ServerCredentials:
        """Server side: this role's certificate; with require_client_auth only clients
        presenting a certificate the CA signed get past the handshake."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca,
            require_client_auth=require_client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: trusts only servers the CA signed, and presents this role's certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def tls_of(config) -> Tls | None:
    """The TLS material a role's config names (a service_common.options.ServerConfig),
    or None for plaintext. All three files or none: half a configuration is refused
    at start-up rather than silently serving plaintext."""
    files = {"tls_cert": config.tls_cert, "tls_key": config.tls_key, "tls_ca": config.tls_ca}
    given = [name for name, path in files.items() if path]
    if not given:
        return None
    if len(given) < len(files):
        missing = sorted(set(files) - set(given))
        raise InvalidArgument(
            f"TLS needs tls_cert, tls_key and tls_ca together; missing {', '.join(missing)}"
        )
    return Tls.from_files(config.tls_cert, config.tls_key, config.tls_ca, config.tls_server_name)


def aio_channel(address: str, tls: Tls | None, options) -> grpc.aio.Channel:
    """service_common.server.channel() for asyncio clients (the HTTP front), which do
    not import the telemetry that one wraps channels in: plaintext, or TLS with a
    role's certificate."""
    options = list(options)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


def client_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """For a client outside the cluster (python -m client): trusts servers the CA
    signed; presents a certificate only when given one (an orchestrator may ask)."""
    if bool(cert) != bool(key):
        raise InvalidArgument("a client certificate needs both --tls-cert and --tls-key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "tls_ca"),
        private_key=_read(key, "tls_key") if key else None,
        certificate_chain=_read(cert, "tls_cert") if cert else None,
    )


def _read(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise InvalidArgument(f"{setting}: cannot read {path!r}: {error.strerror}") from None


# A throwaway PKI: one CA, one certificate per role, for local TLS runs and tests.

ROLES = ("orchestrator", "target", "draft", "client")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 30  # throwaway: long enough for a run, short if a file leaks


@dataclass(frozen=True)
class TlsFiles:
    """Paths of one role's PEM files."""

    cert: str
    key: str
    ca: str

    def flags(self) -> list[str]:
        """The role's command-line flags (every role's config has these fields)."""
        return ["--tls-cert", self.cert, "--tls-key", self.key, "--tls-ca", self.ca]

    def load(self, server_name: str = "") -> Tls:
        return Tls.from_files(self.cert, self.key, self.ca, server_name)


def write_throwaway_pki(
    directory: Path, roles=ROLES, hosts=LOCAL_HOSTS, ca_name: str = "specdec throwaway CA"
) -> dict[str, TlsFiles]:
    """Writes ca.pem and <role>.pem / <role>-key.pem (keys readable by the owner only)
    under directory; each certificate names the hosts (DNS names or IPs) and serves both
    as a server's and as a client's. Returns each role's files."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca(ca_name)
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(_pem(ca_cert))
    files = {}
    for role in roles:
        key, cert = _leaf(role, hosts, ca_key, ca_cert)
        cert_path, key_path = directory / f"{role}.pem", directory / f"{role}-key.pem"
        cert_path.write_bytes(_pem(cert))
        key_path.touch(mode=0o600)
        key_path.write_bytes(_key_pem(key))
        files[role] = TlsFiles(str(cert_path), str(key_path), str(ca_path))
    return files


def _ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _validity(x509.CertificateBuilder())
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(name: str, hosts, ca_key, ca_cert):
    key = ec.generate_private_key(ec.SECP256R1())
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        _validity(x509.CertificateBuilder())
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _validity(builder):
    now = datetime.datetime.now(datetime.UTC)
    # An hour back: a peer whose clock runs a little behind still accepts it.
    return (
        builder.serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
