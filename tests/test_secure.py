"""Secure mode (``kfeed cluster up --secure``): who gets in, who is kept out, and no password leaks.

One secure 1-node cluster serves the whole module. It is started with the
CLI, as a user would (its output is checked for passwords), on a free port
base in a temporary folder, and always stopped. The ``bootstrap`` fixture is
overridden here, so these integration tests never start the plaintext
session cluster as well.

Users, each with prefixed ACLs on topics and groups named ``kfeed-secure-*``:

- ``alice``: READ, WRITE, DESCRIBE on the topics, READ on the groups;
- ``bob``: DESCRIBE on the topics and READ on the groups, no READ or WRITE;
- ``mallory``: no ACL at all.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kfeed
from kfeed import cluster

SRC = Path(__file__).resolve().parents[1] / "src"
# Away from the ports of make test (29092), the session fallback (39392) and
# test_cluster (39592).
FIRST_PORT = 40192
PREFIX = "kfeed-secure-"
SCHEMA = kfeed.Schema({"x": ("float32", (4,)), "id": ("int64", ())})
SAMPLES = 512
# Short, so that the tests of what happens today stay quick.
CONNECT_TIMEOUT_S = 3.0
USERS = ("alice", "bob", "mallory")
# A child producer still running after this long hangs (it fails within a
# second otherwise, torch's import included).
PRODUCER_HANG_S = 20.0


def kfeed_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kfeed cluster ARGS`` with this checkout's sources."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "kfeed", "cluster", *args],
        capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip


class Secure:
    """The module's secure cluster: its folder, bootstrap, and the CLI output seen so far."""

    def __init__(self, state_dir: Path, servers: str) -> None:
        self.dir = state_dir
        self.bootstrap = servers
        self.outputs: list[str] = []

    def config(self, user: str = "admin", **extra: Any) -> dict[str, Any]:
        return {**cluster.secure_client_config(self.dir, user), **extra}

    def password(self, user: str) -> str:
        return cluster.secure_client_config(self.dir, user)["sasl.password"]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    pytest.importorskip("cryptography", reason="secure mode needs kfeed[secure]")
    state_dir = tmp_path_factory.mktemp("kfeed-secure") / "cluster"
    try:
        for _attempt in range(3):
            port = cluster.free_port_base(1, FIRST_PORT)
            started = kfeed_cli("up", "--secure", "--dir", str(state_dir), "--port", str(port))
            # The port was free when chosen, but it lies in the range the
            # system gives client sockets: one may take it before the broker binds.
            if "Address already in use" not in started.stdout + started.stderr:
                break
            cluster.down(state_dir, wipe=True)
        assert started.returncode == 0, started.stdout + started.stderr
        servers = started.stdout.strip().splitlines()[-1]
        assert servers == f"127.0.0.1:{port}"
        secure = Secure(state_dir, servers)
        secure.outputs.append(started.stdout + started.stderr)
        for user in USERS:
            cluster.add_user(state_dir, user)
        cluster.grant(state_dir, "alice", ["READ", "WRITE", "DESCRIBE"], topic=PREFIX, prefixed=True)
        cluster.grant(state_dir, "bob", ["DESCRIBE"], topic=PREFIX, prefixed=True)
        for user in ("alice", "bob"):
            cluster.grant(state_dir, user, "READ", group=PREFIX, prefixed=True)
        yield secure
    finally:
        if (state_dir / "cluster.json").exists():
            cluster.down(state_dir, wipe=True)


@pytest.fixture(scope="module")
def bootstrap(secure: Secure) -> str:
    # Overrides the session fixture for this module: the secure cluster is
    # the test cluster here.
    return secure.bootstrap


@pytest.fixture
def topic(secure: Secure) -> str:
    """A fresh 2-partition topic holding SAMPLES records, written as the admin."""
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"{PREFIX}{uuid.uuid4().hex}"
    admin = AdminClient(secure.config())
    admin.create_topics([NewTopic(name, 2, 1)])[name].result(timeout=60)
    deadline = time.monotonic() + 60
    while True:
        meta = admin.list_topics(topic=name, timeout=10).topics.get(name)
        if meta is not None and meta.error is None and all(p.leader >= 0 for p in meta.partitions.values()):
            break
        assert time.monotonic() < deadline, f"{name} has no leaders"
        time.sleep(0.1)
    with kfeed.Producer(secure.config(), name, SCHEMA) as producer:
        producer.send(columns(0, SAMPLES))
    return name


def columns(first: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(first, first + n, dtype=np.int64)
    return {"x": np.repeat(ids[:, None], 4, axis=1).astype(np.float32), "id": ids}


def group() -> str:
    return f"{PREFIX}{uuid.uuid4().hex}"


def read_ids(config: dict[str, Any], topic: str, **kwargs: Any) -> list[int]:
    ids: list[int] = []
    with kfeed.Loader(config, topic, SCHEMA, 64, until="end", device="cpu", **kwargs) as loader:
        for batch in loader:
            ids.extend(batch["id"].tolist())
    return ids


def timed(call: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """Run ``call``; return what it raised (or None) and how long it took."""
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the tests judge it
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


def wait_for_errors(errors: list[Any], client: Any, wanted: Callable[[Any], bool], seconds: float = 15.0) -> list[Any]:
    """Serve ``client``'s callbacks until its error_cb has reported a ``wanted`` error; return those."""
    deadline = time.monotonic() + seconds
    while True:
        found = [e for e in errors if wanted(e)]
        if found or time.monotonic() > deadline:
            break
        client.poll(0.2)
    assert found, f"no such error within {seconds:.0f} s, only {errors}"
    return found


# -- the right user gets in ------------------------------------------------------


@pytest.mark.integration
def test_status_names_the_protocol_and_where_the_settings_live(secure: Secure) -> None:
    result = kfeed_cli("status", "--dir", str(secure.dir))
    secure.outputs.append(result.stdout + result.stderr)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == secure.bootstrap
    assert "SASL_SSL" in lines[0]
    assert str(secure.dir / "secure" / "users" / "admin.properties") in lines[0]
    assert "node 1" in result.stdout and "registered" in result.stdout
    state = cluster.status(secure.dir)
    assert state["security_protocol"] == "SASL_SSL" and state["brokers"] == [1]


@pytest.mark.integration
def test_client_settings_are_librdkafka_sasl_ssl(secure: Secure) -> None:
    config = secure.config("alice")
    assert config["bootstrap.servers"] == secure.bootstrap
    assert config["security.protocol"] == "SASL_SSL"
    assert config["sasl.mechanisms"] == "SCRAM-SHA-512"
    assert config["sasl.username"] == "alice"
    assert len(config["sasl.password"]) >= 24
    assert Path(config["ssl.ca.location"]).read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    with pytest.raises(kfeed.ClusterError, match="no user 'nobody'"):
        cluster.secure_client_config(secure.dir, "nobody")


@pytest.mark.integration
def test_granted_user_writes_and_reads_with_confluent_kafka(secure: Secure, topic: str) -> None:
    from confluent_kafka import Consumer, Producer

    errors: list[Any] = []
    producer = Producer(secure.config("alice", acks="all", **{"enable.idempotence": True}))
    producer.produce(topic, b"from alice", key=b"k", on_delivery=lambda err, _m: err and errors.append(err))
    assert producer.flush(30) == 0 and errors == []

    consumer = Consumer(
        secure.config("alice", **{"group.id": group(), "auto.offset.reset": "earliest", "enable.auto.commit": False})
    )
    try:
        consumer.subscribe([topic])
        seen = []
        deadline = time.monotonic() + 60
        while b"from alice" not in seen and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None:
                assert msg.error() is None, msg.error()
                seen.append(msg.value())
        assert b"from alice" in seen
    finally:
        consumer.close()


@pytest.mark.integration
def test_granted_user_writes_and_reads_with_kfeed_and_no_password_is_logged(
    secure: Secure, topic: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    # librdkafka's own debug output through Python logging too: the worst case.
    debug = {"debug": "security,broker,conf", "logger": logging.getLogger("kfeed.test.librdkafka")}
    with kfeed.Producer(secure.config("alice", **debug), topic, SCHEMA) as producer:
        producer.send(columns(SAMPLES, SAMPLES))
    ids = read_ids(secure.config("alice", **{"group.id": group()}, **debug), topic)
    assert sorted(ids) == list(range(2 * SAMPLES))

    # A refused session logs warnings; they must not carry the password either.
    wrong = secure.config("alice", **{"sasl.password": "not-" + secure.password("alice")})
    exc, _ = timed(lambda: kfeed.Producer(wrong, topic, SCHEMA, connect_timeout_s=CONNECT_TIMEOUT_S))
    assert isinstance(exc, kfeed.ProduceError)

    out, err = capfd.readouterr()
    assert "SASL" in caplog.text
    for user in ("alice", "admin"):
        password = secure.password(user)
        assert password not in caplog.text
        assert password not in out + err
    assert "sasl.password = [redacted]" in caplog.text  # the config dump was there, redacted


# -- a wrong password ------------------------------------------------------------


@pytest.mark.integration
def test_wrong_password_is_refused_by_the_broker(secure: Secure) -> None:
    from confluent_kafka import KafkaError, Producer

    errors: list[Any] = []
    wrong = secure.config("alice", **{"sasl.password": "wrong", "error_cb": errors.append})
    producer = Producer(wrong)
    start = time.monotonic()
    error = wait_for_errors(errors, producer, lambda e: e.code() == KafkaError._AUTHENTICATION)[0]
    assert "Authentication failed" in error.str() and "SCRAM-SHA-512" in error.str()
    assert time.monotonic() - start < 10


@pytest.mark.integration
@pytest.mark.parametrize("client", ["producer", "loader"])
def test_wrong_password_fails_within_connect_timeout(secure: Secure, topic: str, client: str) -> None:
    # What holds today: kfeed does not retry forever; it gives up after
    # connect_timeout_s, with a ProduceError or ConsumeError.
    wrong = secure.config("alice", **{"sasl.password": "wrong", "group.id": group()})
    exc, elapsed = timed(lambda: open_client(client, wrong, topic, CONNECT_TIMEOUT_S))
    assert isinstance(exc, kfeed.ProduceError if client == "producer" else kfeed.ConsumeError), repr(exc)
    assert elapsed < CONNECT_TIMEOUT_S + 5


@pytest.mark.integration
@pytest.mark.parametrize("client", ["producer", "loader"])
def test_wrong_password_is_reported_as_an_authentication_error_at_once(
    secure: Secure, topic: str, client: str
) -> None:
    from confluent_kafka import KafkaError

    timeout = 6.0
    wrong = secure.config("alice", **{"sasl.password": "wrong", "group.id": group()})
    exc, elapsed = timed(lambda: open_client(client, wrong, topic, timeout))
    assert isinstance(exc, kfeed.ProduceError if client == "producer" else kfeed.ConsumeError), repr(exc)
    assert exc.code == KafkaError._AUTHENTICATION, repr(exc)
    assert "authentication" in str(exc).lower()
    # librdkafka knows within a second; waiting for the timeout is the bug.
    assert elapsed < timeout - 2


@pytest.mark.integration
@pytest.mark.parametrize("call", ["create_topic", "group_lag", "dataset"])
@pytest.mark.parametrize("wrong", ["password", "ca"])
def test_an_admin_call_the_brokers_refuse_says_so_at_once(
    secure: Secure, topic: str, tmp_path: Path, call: str, wrong: str
) -> None:
    # The admin calls waited their whole timeout and said "cannot reach the
    # brokers ... Broker transport failure" of brokers that had refused the
    # password or the certificate within a second.
    from kfeed.cluster import _secure

    timeout = 8.0
    if wrong == "password":
        config = secure.config("alice", **{"sasl.password": "wrong"})
        why = "SASL authentication error"
    else:
        other_ca, _ = _secure.make_certificates("some other CA")
        (tmp_path / "ca.pem").write_bytes(other_ca)
        config = secure.config("alice", **{"ssl.ca.location": str(tmp_path / "ca.pem")})
        why = "certificate verify failed"
    calls: dict[str, Callable[[], Any]] = {
        "create_topic": lambda: kfeed.create_topic(config, f"{PREFIX}new", timeout_s=timeout),
        "group_lag": lambda: kfeed.group_lag(config, group(), [topic], timeout_s=timeout),
        # Its workers' check asks for the partitions first (in the parent here).
        "dataset": lambda: kfeed.KafkaIterableDataset(
            {**config, "group.id": group()}, topic, SCHEMA, 64, until="end",
            connect_timeout_s=timeout)._check_group_workers(2),
    }
    exc, elapsed = timed(calls[call])
    assert isinstance(exc, kfeed.KfeedError), repr(exc)
    assert f"the brokers at {secure.bootstrap} refused the connection: " in str(exc), str(exc)
    assert why in str(exc) and "check the security.protocol, sasl.* and ssl.*" in str(exc)
    assert elapsed < timeout - 3, elapsed


def open_client(client: str, config: dict[str, Any], topic: str, connect_timeout_s: float) -> None:
    if client == "producer":
        with kfeed.Producer(config, topic, SCHEMA, connect_timeout_s=connect_timeout_s) as producer:
            producer.send(columns(0, 64))
    else:
        read_ids(config, topic, connect_timeout_s=connect_timeout_s)


# -- a user without the right ACLs ---------------------------------------------


@pytest.mark.integration
def test_reader_without_read_gets_topic_authorization_failed(secure: Secure, topic: str) -> None:
    from confluent_kafka import KafkaError

    exc, elapsed = timed(lambda: read_ids(secure.config("bob", **{"group.id": group()}), topic))
    assert isinstance(exc, kfeed.KfeedError), repr(exc)
    assert exc.code == KafkaError.TOPIC_AUTHORIZATION_FAILED, repr(exc)
    assert "Topic authorization failed" in str(exc)
    assert elapsed < 15


@pytest.mark.integration
def test_stranger_gets_topic_authorization_failed(secure: Secure, topic: str) -> None:
    exc, elapsed = timed(lambda: read_ids(secure.config("mallory", **{"group.id": group()}), topic))
    assert isinstance(exc, kfeed.ConsumeError), repr(exc)
    assert "Topic authorization failed" in str(exc)
    assert elapsed < 15


@pytest.mark.integration
@pytest.mark.parametrize("user", ["bob", "mallory"])
def test_loader_refusal_is_a_consume_error_with_its_code(secure: Secure, topic: str, user: str) -> None:
    from confluent_kafka import KafkaError

    exc, _ = timed(lambda: read_ids(secure.config(user, **{"group.id": group()}), topic))
    assert isinstance(exc, kfeed.ConsumeError), repr(exc)
    assert exc.code == KafkaError.TOPIC_AUTHORIZATION_FAILED, repr(exc)
    assert exc.topic == topic


@pytest.mark.integration
def test_a_group_the_user_may_not_use_is_a_consume_error_at_once(secure: Secure, topic: str) -> None:
    # librdkafka says GROUP_AUTHORIZATION_FAILED once, as an event of the first
    # poll, which the loader threw away: it then waited for ever.
    from confluent_kafka import KafkaError

    config = secure.config("alice", **{"group.id": f"not-granted-{uuid.uuid4().hex}"})
    exc, elapsed = timed(lambda: read_ids(config, topic, connect_timeout_s=CONNECT_TIMEOUT_S))
    assert isinstance(exc, kfeed.ConsumeError), repr(exc)
    assert exc.code == KafkaError.GROUP_AUTHORIZATION_FAILED, repr(exc)
    assert elapsed < 15


@pytest.mark.integration
def test_a_writer_who_may_not_create_topics_finds_an_existing_one(secure: Secure, topic: str) -> None:
    # create_topic (and so kfeed produce) asked to create it, and the broker
    # refused one who may not create topics: "cannot create topic: Authorization failed".
    assert kfeed.create_topic(secure.config("alice"), topic, timeout_s=CONNECT_TIMEOUT_S * 5) is False
    with pytest.raises(kfeed.KfeedError, match="cannot create topic .*Authorization failed"):
        kfeed.create_topic(secure.config("alice"), f"{PREFIX}{uuid.uuid4().hex}", timeout_s=15)


@pytest.mark.integration
def test_writer_without_write_is_refused_by_the_broker(secure: Secure, topic: str) -> None:
    from confluent_kafka import KafkaError, Producer

    reports: list[Any] = []
    # Not idempotent: an idempotent producer fails earlier, on the cluster (see below).
    producer = Producer(secure.config("bob", **{"enable.idempotence": False, "acks": "all"}))
    producer.produce(topic, b"from bob", on_delivery=lambda err, _m: reports.append(err))
    producer.flush(30)
    assert len(reports) == 1 and reports[0] is not None
    assert reports[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, reports[0]


# Run in a child process, so that a hang fails the test instead of stopping
# the run. The idempotent producer's refusal is a fatal librdkafka error; it
# used to escape as a raw KafkaException or SystemError, or to deadlock in
# flush() (about half the runs), so the test runs a few times. The settings
# travel on stdin, never on a command line.
_PRODUCE_AS = """
import json, sys, time, numpy as np, kfeed
config = json.loads(sys.stdin.read())
schema = kfeed.Schema({"x": ("float32", (4,)), "id": ("int64", ())})
start = time.monotonic()
try:
    with kfeed.Producer(config, sys.argv[1], schema, connect_timeout_s=5) as producer:
        producer.send({"x": np.zeros((256, 4), np.float32), "id": np.arange(256)})
    print(json.dumps({"raised": None}))
except BaseException as exc:
    print(json.dumps({"raised": type(exc).__name__, "code": getattr(exc, "code", None), "text": str(exc),
                      "seconds": time.monotonic() - start}, default=str))
"""


@pytest.mark.integration
@pytest.mark.parametrize("run", range(3))
def test_producer_without_write_raises_produce_error(secure: Secure, topic: str, run: int) -> None:
    from confluent_kafka import KafkaError

    config = secure.config("bob")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PRODUCE_AS, topic],
            input=json.dumps(config), capture_output=True, text=True, env=env, timeout=PRODUCER_HANG_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"the producer hung for {PRODUCER_HANG_S:.0f} s")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["raised"] == "ProduceError", result
    codes = {KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED}
    assert int(result["code"]) in codes, result
    assert result["seconds"] < 10, result
    assert secure.password("bob") not in out.stdout + out.stderr


# -- TLS -------------------------------------------------------------------------


@pytest.mark.integration
def test_tls_with_an_untrusted_ca_is_refused(secure: Secure, tmp_path: Path) -> None:
    from confluent_kafka import KafkaError, KafkaException, Producer

    from kfeed.cluster import _secure

    other_ca, _ = _secure.make_certificates("some other CA")
    (tmp_path / "ca.pem").write_bytes(other_ca)
    errors: list[Any] = []
    untrusting = {"ssl.ca.location": str(tmp_path / "ca.pem"), "error_cb": errors.append}
    producer = Producer(secure.config("alice", **untrusting))
    with pytest.raises(KafkaException):
        producer.list_topics(timeout=CONNECT_TIMEOUT_S)
    # librdkafka reports it as _SSL ("SSL handshake failed: ...") or, depending
    # on where the handshake stops, as _TRANSPORT "... (in state SSL_HANDSHAKE)".
    refusals = wait_for_errors(errors, producer, lambda e: "certificate verify failed" in e.str())
    assert all(e.code() in (KafkaError._SSL, KafkaError._TRANSPORT) for e in refusals), refusals
    assert all("SSL handshake" in e.str() or "SSL_HANDSHAKE" in e.str() for e in refusals), refusals


@pytest.mark.integration
def test_plaintext_client_gets_nothing(secure: Secure) -> None:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": secure.bootstrap})
    with pytest.raises(KafkaException):
        admin.list_topics(timeout=CONNECT_TIMEOUT_S)


# -- no password in output, logs or state ----------------------------------------


def files_containing(root: Path, needle: str) -> set[str]:
    found = set()
    for path in root.rglob("*"):
        if path.is_file() and needle.encode() in path.read_bytes():
            found.add(path.relative_to(root).as_posix())
    return found


@pytest.mark.integration
def test_no_password_in_cli_output_logs_or_state(secure: Secure) -> None:
    # Runs last in this module: a restart through the CLI, its output kept.
    for args in (("status",), ("down",), ("up",), ("status",)):
        result = kfeed_cli(*args, "--dir", str(secure.dir))
        assert result.returncode == 0, result.stdout + result.stderr
        secure.outputs.append(result.stdout + result.stderr)
    assert secure.outputs[-1].strip().splitlines()[-1] == secure.bootstrap
    # The restarted cluster still knows its users.
    assert cluster.status(secure.dir)["brokers"] == [1]

    output = "\n".join(secure.outputs)
    # Where each password may be, and why:
    # - secure/users/<name>.properties: the one store of a user's client settings (0600);
    # - node-1/server.properties: the broker's own login (JAAS) for inter-broker
    #   SCRAM and the controller's PLAIN listener (0600).
    # Format received salted passwords only, so data/ holds none.
    expected = {
        "admin": {"secure/users/admin.properties"},
        "broker": {"secure/users/broker.properties", "node-1/server.properties"},
        **{user: {f"secure/users/{user}.properties"} for user in USERS},
    }
    for user, where in expected.items():
        password = cluster.secure_client_config(secure.dir, user)["sasl.password"]
        assert password not in output, user
        assert files_containing(secure.dir, password) == where, user
        for pid in cluster.node_pids(secure.dir).values():
            assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert list((secure.dir / "node-1" / "logs").glob("server.log*"))

    modes = {
        "secure": 0o700,
        "secure/users": 0o700,
        "secure/broker.pem": 0o600,
        "node-1/server.properties": 0o600,
        **{f"secure/users/{user}.properties": 0o600 for user in expected},
    }
    for name, mode in modes.items():
        assert (secure.dir / name).stat().st_mode & 0o777 == mode, name


# -- without a broker --------------------------------------------------------------


def test_certificates_name_127_0_0_1_and_localhost() -> None:
    pytest.importorskip("cryptography")
    import ipaddress

    from cryptography import x509

    from kfeed.cluster import _secure

    ca_pem, keystore = _secure.make_certificates()
    ca = x509.load_pem_x509_certificate(ca_pem)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    blocks = keystore.decode().split("-----END ")
    assert keystore.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, as Kafka's PEM keystore wants
    leaf = x509.load_pem_x509_certificate(keystore[keystore.index(b"-----BEGIN CERTIFICATE-----"):])
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert leaf.issuer == ca.subject
    leaf.verify_directly_issued_by(ca)
    assert len(blocks) == 4  # key, leaf, CA


def test_format_gets_salted_passwords_only(tmp_path: Path) -> None:
    import base64
    import hashlib

    from kfeed.cluster import _layout, _secure

    pytest.importorskip("cryptography")
    layout = _layout.Layout(nodes=1, port=41000, cluster_id="x", secure=True)
    _secure.ensure_material(layout, tmp_path, formatted=False)
    args = _secure.format_args(tmp_path)
    admin = _secure.client_config(tmp_path, "admin")["sasl.password"]
    assert admin not in " ".join(args)
    spec = next(a for a in args if "name=admin" in a)
    fields = dict(part.split("=", 1) for part in spec.removeprefix("SCRAM-SHA-512=[").removesuffix("]").split(","))
    salt = base64.b64decode(fields["salt"].strip('"'))
    expected = hashlib.pbkdf2_hmac("sha512", admin.encode(), salt, int(fields["iterations"]))
    assert base64.b64decode(fields["saltedpassword"].strip('"')) == expected


def test_secure_broker_settings(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    from kfeed.cluster import _layout, _secure

    layout = _layout.Layout(nodes=3, port=41000, cluster_id="x", secure=True)
    _secure.ensure_material(layout, tmp_path, formatted=False)
    props = layout.properties(2, tmp_path, _secure.broker_properties(layout, 2, tmp_path))
    assert props["listeners"] == "SASL_SSL://127.0.0.1:41001,CONTROLLER://127.0.0.1:41101"
    assert props["advertised.listeners"] == "SASL_SSL://127.0.0.1:41001"
    assert props["inter.broker.listener.name"] == "SASL_SSL"
    assert props["listener.security.protocol.map"] == "SASL_SSL:SASL_SSL,CONTROLLER:SASL_PLAINTEXT"
    assert props["authorizer.class.name"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    assert props["super.users"] == "User:admin;User:broker"
    assert props["ssl.keystore.type"] == "PEM" and props["ssl.truststore.type"] == "PEM"
    # Material made once: a second call keeps the passwords the nodes were formatted with.
    before = _secure.client_config(tmp_path, "admin")
    _secure.ensure_material(layout, tmp_path, formatted=True)
    assert _secure.client_config(tmp_path, "admin") == before


def test_incomplete_material_of_a_formatted_cluster_is_refused(tmp_path: Path) -> None:
    from kfeed.cluster import _layout, _secure

    layout = _layout.Layout(nodes=1, port=41000, cluster_id="x", secure=True)
    with pytest.raises(kfeed.ClusterError, match="--wipe"):
        _secure.ensure_material(layout, tmp_path, formatted=True)


def test_secure_and_plaintext_clusters_are_not_switched(tmp_path: Path) -> None:
    from kfeed.cluster import _layout

    _layout.Layout(nodes=1, port=41000, cluster_id="pPSYwmViQ-SqVjGzO3SKXQ").save(tmp_path)
    result = kfeed_cli("up", "--secure", "--dir", str(tmp_path))
    assert result.returncode == 2
    assert "holds a plaintext cluster" in result.stderr and "--wipe" in result.stderr
    with pytest.raises(kfeed.ClusterError, match="not secure"):
        cluster.secure_client_config(tmp_path)


def test_bad_user_names_and_operations_are_config_errors(tmp_path: Path) -> None:
    from kfeed.cluster import _secure

    for name in ("", "a b", "-x", "x" * 65, "../etc"):
        with pytest.raises(kfeed.ConfigError):
            _secure.check_user_name(name)
    with pytest.raises(kfeed.ConfigError, match="operations"):
        _secure.grant(None, "alice", ["FLY"], {"topic": "t"}, False, 1.0)
    with pytest.raises(kfeed.ConfigError, match="one of topic"):
        _secure.grant(None, "alice", ["READ"], {"topic": None}, False, 1.0)
