"""TLS for both of a shard's ports: encryption and the server's identity, next to auth.py's token.

The token (psgd/ps/auth.py) says who may talk to a shard; it does not hide the tensors or the
token itself from anyone who can read the network. TLS does, with certificates from a lab CA:

- `psgd certs DIR --hosts H1,H2,...` (`make_certs`) writes `ca.pem` (the lab's CA, 10 years),
  `server.pem` and `server-key.pem` (one certificate for all shard hosts: every address in
  --hosts is a subjectAltName). Keys are ECDSA P-256, written with mode 0600.
- A shard with `--tls-cert server.pem --tls-key server-key.pem` serves gRPC on a secure port and
  wraps every accepted data-plane connection in TLS (the handshake runs in the connection's own
  thread, under its first-frame deadline). Nothing is served in the clear then.
- A worker with `--tls-ca ca.pem` verifies the shard's certificate and its address on both ports;
  a shard that presents none, or one the CA did not sign, is refused (UNAVAILABLE).
Workers are not authenticated by certificate (that is the token's job), so one CA file is all a
worker needs. TLS 1.2 or newer; the library's default ciphers.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from pathlib import Path

import grpc

from psgd.core.errors import UsageError


class TlsError(ValueError):
    """Files that cannot make a TLS setup (missing, unreadable, mismatched)."""


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise TlsError(f"{what} {path}: cannot read it ({e.strerror or e})") from None


# -- shard side ---------------------------------------------------------------------------------
def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(_read(key, "--tls-key"), _read(cert, "--tls-cert"))])


def server_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise TlsError(f"--tls-cert {cert} / --tls-key {key}: {e}") from None
    return ctx


# -- worker side --------------------------------------------------------------------------------
def channel_credentials(ca: str) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=_read(ca, "--tls-ca"))


def client_context(ca: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the certificate and the host name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(ca)
    except (OSError, ssl.SSLError) as e:
        raise TlsError(f"--tls-ca {ca}: {e}") from None
    return ctx


# -- psgd certs ---------------------------------------------------------------------------------
def make_certs(folder: Path, hosts: list[str]) -> list[Path]:
    """A lab CA and one server certificate valid for every host in `hosts` (IP addresses or names)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def alt(host: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("psgd lab CA")).issuer_name(name("psgd lab CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=3650))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name(hosts[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=825))
            .add_extension(x509.SubjectAlternativeName([alt(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    secret = dict(encoding=pem, format=serialization.PrivateFormat.PKCS8,
                  encryption_algorithm=serialization.NoEncryption())
    files = {"ca.pem": ca.public_bytes(pem), "ca-key.pem": ca_key.private_bytes(**secret),
             "server.pem": cert.public_bytes(pem), "server-key.pem": key.private_bytes(**secret)}
    written = []
    for file, data in files.items():
        path = folder / file
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if "key" in file else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        written.append(path)
    return written


def cmd_certs(folder: str, hosts: str) -> int:
    """`psgd certs DIR --hosts A,B`: a lab CA and a shard certificate in a folder that holds no keys yet
    (psgd never overwrites one); the paths it wrote, a line each."""
    names = [h.strip() for h in hosts.split(",") if h.strip()]
    if not names:
        raise UsageError("--hosts needs at least one address")
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} is a file, not a folder")
    taken = [f for f in ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem") if (out / f).exists()]
    if taken:
        raise UsageError(f"{out} already holds {', '.join(taken)}: psgd never overwrites keys; choose another folder")
    for path in make_certs(out, names):
        print(path)
    return 0
