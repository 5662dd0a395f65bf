"""Test certificates: a CA, a server certificate for one IP address, a client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def write_certificates(directory: Path, server_ip: str) -> dict[str, str]:
    """ca.pem, server.pem/.key (for `server_ip`) and client.pem/.key in `directory`; returns
    their paths as ca_cert, server_cert, server_key, client_cert, client_key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve test CA")])

    def issue(name: str, key, ca: bool, san=None):  # noqa: ANN001
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(ca_key, hashes.SHA256())

    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    files: dict[str, str] = {}

    def write(name: str, cert, key) -> None:  # noqa: ANN001
        files[f"{name}_cert"] = str(directory / f"{name}.pem")
        Path(files[f"{name}_cert"]).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            files[f"{name}_key"] = str(directory / f"{name}.key")
            Path(files[f"{name}_key"]).write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )

    write("ca", issue("pdserve test CA", ca_key, True), None)
    for name, san in (("server", [x509.IPAddress(ipaddress.ip_address(server_ip))]), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        write(name, issue(name, key, False, san), key)
    return files
