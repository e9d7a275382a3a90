"""Secure mode of the local cluster: TLS material, SCRAM users, broker settings, ACLs.

``kfeed cluster up --secure`` serves clients on SASL_SSL (SCRAM-SHA-512) with
the StandardAuthorizer on. This module makes what that needs and nothing
else: a throwaway CA and one broker certificate (``cryptography``), random
passwords kept in files only their owner can read, the broker settings that
``_tool`` merges into each ``server.properties``, and the admin-side calls
(users, ACLs) that tests and demos make.

Files, under ``<state dir>/secure`` (mode 0700):

- ``ca.pem``: the CA certificate, what clients trust (``ssl.ca.location``).
  The CA's key is never written: no further certificate can be signed with it.
- ``broker.pem`` (0600): the brokers' unencrypted PKCS#8 key and certificate
  chain, read by Kafka as a PEM keystore.
- ``users/<name>.properties`` (0600): the librdkafka settings of one SCRAM
  user, password included; ``kcat -F`` reads them as they are. This is the
  one place a client password is stored.

A password is never printed, logged, put on a command line or into an
exception: ``StorageTool format`` receives only a salted form of it.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfeed.cluster._layout import HOST, Layout, write_private
from kfeed.errors import ClusterError, ConfigError

logger = logging.getLogger("kfeed.cluster")

SECURE_DIR = "secure"
PROTOCOL = "SASL_SSL"
MECHANISM = "SCRAM-SHA-512"
ADMIN = "admin"
# The brokers' own principal: inter-broker traffic (SCRAM over SASL_SSL) and
# the controller quorum (PLAIN over SASL_PLAINTEXT) both authenticate as it.
BROKER = "broker"
SUPER_USERS = (ADMIN, BROKER)
# Kafka's minimum for SCRAM-SHA-512, and librdkafka's default.
SCRAM_ITERATIONS = 4096
CERT_DAYS = 825
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_INSTALL_CRYPTOGRAPHY = "secure mode needs the cryptography package: pip install 'kfeed[secure]'"


@dataclass(frozen=True)
class SecurePaths:
    """Where the secure material of one cluster lives."""

    root: Path

    @classmethod
    def of(cls, state_dir: Path) -> SecurePaths:
        return cls(state_dir / SECURE_DIR)

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    @property
    def broker_keystore(self) -> Path:
        return self.root / "broker.pem"

    @property
    def users(self) -> Path:
        return self.root / "users"

    def user(self, name: str) -> Path:
        return self.users / f"{name}.properties"

    @property
    def complete(self) -> bool:
        return all(p.is_file() for p in (self.ca, self.broker_keystore, self.user(ADMIN), self.user(BROKER)))


# -- material ------------------------------------------------------------------


def ensure_material(layout: Layout, state_dir: Path, formatted: bool) -> None:
    """Create the CA, broker certificate and super users' passwords unless they exist.

    ``formatted``: some node already holds data. Its SCRAM credentials were
    fixed at format time, so new passwords could never log in; refuse instead.
    """
    paths = SecurePaths.of(state_dir)
    if paths.complete:
        return
    if formatted:
        raise ClusterError(
            f"{paths.root} is incomplete but the nodes are formatted with its users; "
            f"start afresh with: kfeed cluster down --dir {state_dir} --wipe"
        )
    ca_pem, keystore_pem = make_certificates()
    paths.root.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths.root.chmod(0o700)
    paths.users.mkdir(mode=0o700, exist_ok=True)
    paths.ca.write_bytes(ca_pem)
    write_private(paths.broker_keystore, keystore_pem.decode())
    for name in SUPER_USERS:
        _write_user(paths, layout, name, new_password())


def new_password() -> str:
    # URL-safe base64: no character that a JAAS string, a properties file or
    # a StorageTool argument would need to escape.
    return secrets.token_urlsafe(24)


def make_certificates(common_name: str = "kfeed local CA") -> tuple[bytes, bytes]:
    """A fresh self-signed CA and a broker certificate for 127.0.0.1 and localhost.

    Returns (CA certificate PEM, broker keystore PEM = PKCS#8 key + leaf + CA).
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:
        raise ClusterError(_INSTALL_CRYPTOGRAPHY) from exc

    now = dt.datetime.now(dt.timezone.utc)
    # A little slack before now: a clock that differs by seconds between the
    # processes must not make the certificate "not yet valid".
    not_before = now - dt.timedelta(hours=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST)), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        # Server for clients, client too: brokers open TLS connections to each other.
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    # Kafka's PEM keystore reads an unencrypted key only in PKCS#8 form.
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return ca_pem, key_pem + leaf.public_bytes(serialization.Encoding.PEM) + ca_pem


# -- users ---------------------------------------------------------------------


def read_user(paths: SecurePaths, name: str) -> dict[str, str]:
    path = paths.user(name)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ClusterError(f"no user {name!r} in {paths.root} (add one with kfeed.cluster.add_user)") from None
    except OSError as exc:
        raise ClusterError(f"cannot read {path}: {exc.strerror}") from exc
    settings = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            settings[key.strip()] = value.strip()
    return settings


def _write_user(paths: SecurePaths, layout: Layout, name: str, password: str) -> None:
    settings = {
        "bootstrap.servers": layout.bootstrap,
        "security.protocol": PROTOCOL,
        "sasl.mechanisms": MECHANISM,
        "sasl.username": name,
        "sasl.password": password,
        "ssl.ca.location": str(paths.ca),
    }
    lines = [f"# librdkafka settings of SCRAM user {name} (keep private)\n"]
    lines += [f"{key}={value}\n" for key, value in settings.items()]
    write_private(paths.user(name), "".join(lines))


def check_user_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"a user name is 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit: {name!r}"
        )
    return name


def client_config(state_dir: Path, user: str = ADMIN) -> dict[str, str]:
    """The librdkafka settings of ``user``: bootstrap, SASL_SSL, SCRAM-SHA-512, credentials, CA."""
    return read_user(SecurePaths.of(state_dir), check_user_name(user))


def add_user(admin: Any, layout: Layout, state_dir: Path, name: str, password: str | None, timeout: float) -> None:
    """Create (or reset) SCRAM user ``name`` on the running cluster and store its settings."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    check_user_name(name)
    if name in SUPER_USERS:
        raise ConfigError(f"{name!r} is the cluster's own super user; choose another name")
    password = new_password() if password is None else password
    if not isinstance(password, str) or not password or "\n" in password:
        raise ConfigError("a password is a non-empty string on one line")
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
    upsert = UserScramCredentialUpsertion(name, info, password.encode())
    try:
        admin.alter_user_scram_credentials([upsert])[name].result(timeout=timeout)
    except KafkaException as exc:
        raise ClusterError(f"could not create user {name!r}: {exc.args[0].str()}") from exc
    _write_user(SecurePaths.of(state_dir), layout, name, password)

    def visible() -> bool:
        described = admin.describe_user_scram_credentials([name])[name].result(timeout=timeout)
        return any(info.mechanism == ScramMechanism.SCRAM_SHA_512 for info in described.scram_credential_infos)

    _wait_visible(visible, timeout, f"user {name!r}")


def grant(
    admin: Any,
    principal: str,
    operations: Iterable[str],
    resources: Mapping[str, str | None],
    prefixed: bool,
    timeout: float,
) -> None:
    """Allow ``principal`` the ``operations`` on each named resource (ACLs, from any host)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import (
        AclBinding,
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    if ":" not in principal:
        principal = f"User:{check_user_name(principal)}"
    ops = [operations] if isinstance(operations, str) else list(operations)
    try:
        acl_ops = [AclOperation[op.upper()] for op in ops]
    except (KeyError, AttributeError):
        raise ConfigError(f"operations are names such as READ, WRITE, DESCRIBE, ALL: {ops!r}") from None
    named = {kind: name for kind, name in resources.items() if name is not None}
    if not named or not acl_ops:
        raise ConfigError("grant needs at least one operation and one of topic=, group=, transactional_id=, cluster=")
    pattern = ResourcePatternType.PREFIXED if prefixed else ResourcePatternType.LITERAL
    bindings = []
    for kind, name in named.items():
        if kind == "cluster":
            kind_type, name = ResourceType.BROKER, "kafka-cluster"
        else:
            kind_type = ResourceType[kind.upper()]
        bindings += [
            AclBinding(kind_type, name, pattern, principal, "*", op, AclPermissionType.ALLOW) for op in acl_ops
        ]
    try:
        for future in admin.create_acls(bindings).values():
            future.result(timeout=timeout)
    except KafkaException as exc:
        raise ClusterError(f"could not grant {ops} to {principal}: {exc.args[0].str()}") from exc

    def visible() -> bool:
        filters = [
            AclBindingFilter(b.restype, b.name, b.resource_pattern_type, b.principal, b.host, b.operation,
                             b.permission_type)
            for b in bindings
        ]  # fmt: skip
        return all(admin.describe_acls(f).result(timeout=timeout) for f in filters)

    _wait_visible(visible, timeout, f"the ACLs of {principal}")


def _wait_visible(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait until the broker serves what the controller just committed.

    The controller acknowledges a new user or ACL before the broker has
    replayed it; a client that logs in right away could still be refused.
    """
    from confluent_kafka import KafkaException

    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except KafkaException as exc:
            logger.debug("%s not visible yet: %s", what, exc.args[0].str())
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} not visible on the brokers after {timeout:.0f} s")
        time.sleep(0.1)


# -- broker side ---------------------------------------------------------------


def broker_properties(layout: Layout, node_id: int, state_dir: Path) -> dict[str, str]:
    """What a secure node adds to its ``server.properties`` (the broker's password included).

    One SASL_SSL listener serves clients and the other brokers; the controller
    listener speaks SASL_PLAINTEXT with PLAIN, because KRaft controllers cannot
    check SCRAM (its credentials live in the metadata they serve). Both bind
    127.0.0.1 only.
    """
    paths = SecurePaths.of(state_dir)
    password = read_user(paths, BROKER)["sasl.password"]
    client = f"{PROTOCOL}://{HOST}:{layout.broker_port(node_id)}"
    scram_login = "org.apache.kafka.common.security.scram.ScramLoginModule"
    plain_login = "org.apache.kafka.common.security.plain.PlainLoginModule"
    return {
        "listeners": f"{client},CONTROLLER://{HOST}:{layout.controller_port(node_id)}",
        "advertised.listeners": client,
        "listener.security.protocol.map": f"{PROTOCOL}:{PROTOCOL},CONTROLLER:SASL_PLAINTEXT",
        "inter.broker.listener.name": PROTOCOL,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        "sasl.mechanism.controller.protocol": "PLAIN",
        f"listener.name.{PROTOCOL.lower()}.sasl.enabled.mechanisms": MECHANISM,
        f"listener.name.{PROTOCOL.lower()}.{MECHANISM.lower()}.sasl.jaas.config": (
            f'{scram_login} required username="{BROKER}" password="{password}";'
        ),
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config": (
            f'{plain_login} required username="{BROKER}" password="{password}" user_{BROKER}="{password}";'
        ),
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(paths.broker_keystore),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(paths.ca),
        "ssl.endpoint.identification.algorithm": "https",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": ";".join(f"User:{name}" for name in SUPER_USERS),
        "allow.everyone.if.no.acl.found": "false",
    }


def format_args(state_dir: Path) -> list[str]:
    """``--add-scram`` arguments that create the super users at format time.

    They carry a salted password (PBKDF2, as Kafka's ScramFormatter computes
    it), never the password itself, so no command line shows it.
    """
    paths = SecurePaths.of(state_dir)
    args = []
    for name in SUPER_USERS:
        password = read_user(paths, name)["sasl.password"]
        salt = secrets.token_bytes(32)
        salted = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, SCRAM_ITERATIONS)
        spec = (
            f'name={name},salt="{base64.b64encode(salt).decode()}",'
            f'saltedpassword="{base64.b64encode(salted).decode()}",iterations={SCRAM_ITERATIONS}'
        )
        args += ["--add-scram", f"{MECHANISM}=[{spec}]"]
    return args

