"""What every Kafka call site shares: connection settings, topic checks, error shapes.

The producer, the loader's Kafka source, the dead-letter queue and the CLI
all talk to brokers through confluent-kafka. This module holds what they must
do alike, so that a user sees one behaviour whichever side they start from:

- ``client_config``: the connection and security subset of a librdkafka dict,
  for an admin client or a helper producer; ``logged_config``: the same,
  logging through ``ConnectionLog``; ``admin_client``: an admin client made
  from it, whose requests ``answer`` waits for and which says at once when the
  brokers refused it (``refusal``, ``refused_message``);
- ``create_topic``: the public way to create a topic (``kfeed.create_topic``);
- ``unavailable_message`` / ``unreachable_message``: the one-line errors for a
  topic that does not exist and for brokers that do not answer, worded the
  same for the producer and the loader;
- ``ConnectionLog``: librdkafka's log lines with repeated connection trouble
  folded to one line per broker every few seconds;
- the error codes no retry mends (``REFUSED``), the metadata answer for a
  topic (``topic_partitions``), kfeed's callbacks held weakly (``weakly``)
  and chained with a user's (``chain``), and the KafkaError behind an
  exception (``kafka_error``).

It knows nothing of batches, schemas or torch.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from kfeed.errors import (
    ConfigError,
    ConsumeError,
    Interrupted,
    KfeedError,
    ProduceError,
    first_line,
)

__all__ = ["create_topic", "client_config", "logged_config", "admin_client", "refusal", "answer",
           "refused_message", "unavailable_message", "unreachable_message",
           "ConnectionLog", "REFUSED", "GONE_CODES", "GONE_GRACE_S", "TopicUnavailable",
           "topic_partitions", "admin_partitions", "bad_setting", "chain", "kafka_error", "weakly",
           "within", "broker_count"]

log = logging.getLogger(__name__)

_CONNECTION_KEYS = ("bootstrap.", "security.", "sasl.", "ssl.", "client.", "socket.",
                    "broker.address.", "reconnect.", "enable.ssl.", "enable.sasl.")


# confluent-kafka's callback that gives OAUTHBEARER its tokens: a login too.
_CONNECTION_NAMES = ("oauth_cb",)


def client_config(kafka_config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that say where the brokers are and how to log in; nothing else."""
    return {k: v for k, v in kafka_config.items()
            if isinstance(k, str) and (k.startswith(_CONNECTION_KEYS) or k in _CONNECTION_NAMES)}


def logged_config(kafka_config: Mapping[str, Any]) -> dict[str, Any]:
    """``client_config``, with librdkafka's lines going to logging through ``ConnectionLog``:
    ``kafka_config``'s own ``logger`` if it is one (its folding goes on across clients).

    Connection trouble is logged at DEBUG: these short-lived clients' calls
    fail with a line of their own that names the brokers, and a program
    without logging set up got librdkafka's line on stderr as well."""
    given = kafka_config.get("logger")
    return {**client_config(kafka_config),
            "logger": given if isinstance(given, ConnectionLog)
            else ConnectionLog(trouble_level=logging.DEBUG)}


# librdkafka names a setting given by one of its aliases by its own name
# (linger.ms=abc: 'Invalid value for configuration property
# "queue.buffering.max.ms"'): the alias, by the name librdkafka gives.
_ALIASES = {
    "queue.buffering.max.ms": "linger.ms",
    "message.send.max.retries": "retries",
    "request.required.acks": "acks",
    "max.in.flight.requests.per.connection": "max.in.flight",
    "compression.codec": "compression.type",
    "message.timeout.ms": "delivery.timeout.ms",
    "fetch.message.max.bytes": "max.partition.fetch.bytes",
}


def topic_setting(client: Mapping[str, Any], topic: str, name: str) -> str:
    """Setting ``name`` of ``topic`` as the brokers say it ("" if they do not)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import ConfigResource, ResourceType

    resource = ConfigResource(ResourceType.TOPIC, topic)
    try:
        admin = admin_client(client)  # (alive until its future is done)
        found = admin.describe_configs([resource])[resource].result(timeout=10)
    except (KafkaException, ConfigError, TimeoutError, OSError):
        return ""
    entry = found.get(name)
    return str(entry.value) if entry is not None and entry.value is not None else ""


def check_timeout(timeout_s: Any, name: str = "timeout_s") -> None:
    """Refuse a timeout that is not a finite number of seconds > 0 (NaN passes every bound)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) \
            or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ConfigError(f"{name} must be a number of seconds > 0, got {timeout_s!r}")


def bad_setting(exc: BaseException, config: Mapping[str, Any]) -> ConfigError:
    """librdkafka's refusal of a setting of ``config`` (``kafka_config``, or ``-X``), as
    one line that names the setting as it was given."""
    err = kafka_error(exc)
    why = err.str() if err is not None else str(exc)
    named = re.search(r'property "([^"]+)"', why)
    if named and named.group(1) not in config and _ALIASES.get(named.group(1)) in config:
        why = f"{_ALIASES[named.group(1)]} (librdkafka's {named.group(1)}): {why}"
    return ConfigError(f"bad Kafka setting: {why}: check its name and value (librdkafka's "
                       f"CONFIGURATION.md lists them)")


def admin_client(kafka_config: Mapping[str, Any]) -> Any:
    """An ``AdminClient`` of ``kafka_config``'s brokers, with its connection settings alone.

    librdkafka's lines go to the ``kfeed.librdkafka`` logger, connection
    trouble folded (``ConnectionLog``), not to stderr. The brokers' refusal
    of its credentials or TLS is kept for ``refusal`` and ``answer``.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    refused = _Refusal()
    try:
        admin = AdminClient({**logged_config(kafka_config), "error_cb": refused.seen})
    except KafkaException as e:
        raise bad_setting(e, kafka_config) from None
    admin.kfeed_refusal = refused
    return admin


def broker_count(kafka_config: Mapping[str, Any], timeout_s: float,
                 topics: Sequence[str] = ()) -> int:
    """How many brokers lead the partitions of ``topics`` (all the cluster's, where a
    topic is not there yet), asked once; the bootstrap servers' count, with a
    warning, if none answers within ``timeout_s`` (what fails then fails again, and
    says why, in the client that needs them)."""
    from confluent_kafka import KafkaException

    servers = str(kafka_config.get("bootstrap.servers", ""))
    listed = max(1, len([s for s in servers.split(",") if s.strip()]))
    try:
        md = admin_client(kafka_config).list_topics(timeout=timeout_s)
    except (KafkaException, KfeedError) as e:
        log.warning("max_memory_bytes: no broker said within %.0fs how many brokers there "
                    "are (%s); librdkafka's fetches are sized for the %d bootstrap server(s), "
                    "one fetch in flight each", timeout_s, first_line(e), listed)
        return listed
    leaders = {p.leader for t in topics if t in md.topics
               for p in md.topics[t].partitions.values() if p.leader >= 0}
    if topics and all(t in md.topics for t in topics) and leaders:
        return len(leaders)
    return max(1, len(md.brokers))


class _Refusal:
    """An admin client's ``error_cb``: the first error no retry mends.

    Without it, an admin call to brokers that refuse the client's password
    or certificate waits its whole timeout and ends in a transport error
    that reads as brokers that cannot be reached.
    """

    def __init__(self) -> None:
        self.error: Any = None

    def seen(self, err: Any) -> None:
        # (An untrusted certificate comes as _SSL, or as _TRANSPORT "certificate
        # verify failed", depending on where the handshake stops.)
        if self.error is None and (err.fatal() or err.code() in REFUSED
                                   or "certificate verify failed" in err.str()):
            self.error = err


def refusal(admin: Any) -> Any | None:
    """The KafkaError by which the brokers refused ``admin`` (``admin_client``), if they did."""
    admin.poll(0)  # serves error_cb
    return admin.kfeed_refusal.error


def refused_message(servers: str, err: Any) -> str:
    """Brokers that refused the client: why, and what to check."""
    return (f"the brokers at {servers} refused the connection: {err.str()}: check the "
            f"security.protocol, sasl.* and ssl.* settings")


def answer(admin: Any, future: Any) -> Any:
    """``future.result()`` of an ``admin`` request, looked at in short slices: brokers that
    refused ``admin`` raise that refusal (a KafkaException) at once, not after the
    request's timeout."""
    import concurrent.futures

    from confluent_kafka import KafkaException

    while not concurrent.futures.wait([future], timeout=0.1).done:
        err = refusal(admin)
        if err is not None:
            future.cancel()
            raise KafkaException(err)
    return future.result()


def check_settings(kafka_config: Mapping[str, Any], *, transactional: bool = False,
                   producer_only: bool = False) -> None:
    """librdkafka's verdict on every setting of a producer, before anything is made on the
    brokers (a topic created for a run that then fails on a misspelt -X stays behind).

    ``transactional``: checked as a transactional producer's, which refuses
    more (``acks`` other than all, ``enable.idempotence=false``).
    ``producer_only``: the settings go to a producer alone, so a consumer's,
    which librdkafka would only warn of and ignore, is refused too.
    """
    from confluent_kafka import KafkaException, Producer

    lines = _Lines()
    config = {**kafka_config, "logger": lines}
    if transactional:
        config["transactional.id"] = "kfeed-settings-check"
    try:
        producer = Producer(config)
    except KafkaException as e:
        raise bad_setting(e, config) from None
    producer.poll(0)  # serves the warnings librdkafka queued while it read the settings
    ignored = [m.group(1) for m in map(_CONSUMER_ONLY.search, lines.texts) if m]
    if producer_only and ignored:
        what = "a consumer setting" if len(ignored) == 1 else "consumer settings"
        raise ConfigError(f"-X {', -X '.join(ignored)}: {what}, which a producer would "
                          f"ignore: leave {'it' if len(ignored) == 1 else 'them'} out")


_CONSUMER_ONLY = re.compile(r"Configuration property (\S+) is a consumer property")


class _Lines:
    """A librdkafka logger that keeps the lines."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def log(self, level: int, fmt: str, *args: Any) -> None:
        self.texts.append(fmt % args if args else fmt)


_ASK_SLICE_S = 0.5  # the longest one blocking call may hold Ctrl-C back


def asked_until(call: Callable[[float], Any], deadline: float,
                refused: Callable[[Any], Any]) -> Any:
    """``call(timeout)``, asked again until ``deadline`` (monotonic) while it raises a
    KafkaException: a leader that just died is elected again within seconds.

    In slices of ``_ASK_SLICE_S``, so that Ctrl-C is heard between; a call
    that failed at once is asked again 0.2 s later, not in a spin.
    ``refused(error)`` gives the refusal (credentials, authorization) behind a
    failure, raised at once, as no retry mends it; None to ask again.
    """
    from confluent_kafka import KafkaException

    while True:
        began = time.monotonic()
        try:
            return call(min(_ASK_SLICE_S, max(0.05, deadline - began)))
        except KafkaException as e:
            err = refused(e.args[0])
            if err is not None:
                raise KafkaException(err) from None
            if time.monotonic() >= deadline:
                raise
        time.sleep(max(0.0, min(began + 0.2, deadline) - time.monotonic()))


def newest_values(kafka_config: Mapping[str, Any], topic: str, timeout_s: float
                  ) -> dict[int, bytes | None]:
    """The value of each partition's newest committed message, of the partitions that hold any.

    Read with the connection settings alone, in no group (nothing is
    committed), read-committed, from a few offsets before the end and then,
    where nothing was there, from further and further back: a transaction's
    last offset is its marker, which is no message, and an aborted one (a
    killed producer's) may end a partition with many records never seen.
    What has not come within ``timeout_s`` is left out.
    """
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    consumer = Consumer({**logged_config(kafka_config), "group.id": "kfeed-peek",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    deadline = time.monotonic() + timeout_s

    def asked(call: Callable[[float], Any]) -> Any:
        return asked_until(call, deadline, lambda err: err if err.code() in REFUSED else None)

    try:
        try:
            md = asked(lambda s: consumer.list_topics(topic, timeout=s))
            lows, ends = {}, {}
            for p in sorted(md.topics[topic].partitions):
                low, high = asked(lambda s, p=p: consumer.get_watermark_offsets(
                    TopicPartition(topic, p), timeout=s))
                if high > low:
                    lows[p], ends[p] = low, high
        except KafkaException as e:  # (a partition whose leader is gone, say)
            err = e.args[0]
            if err.code() in REFUSED:
                raise ProduceError(f"cannot read the newest messages of {topic}, to check "
                                   f"what it holds: {err.str()}; nothing was sent",
                                   topic=topic, code=err.code()) from None
            raise ProduceError(f"cannot read the newest messages of {topic} within "
                               f"{timeout_s:g}s, to check what it holds ({err.str()}): "
                               f"its partitions' leaders do not answer; nothing was sent",
                               topic=topic, code=err.code()) from None
        got: dict[int, bytes | None] = {}
        span = 4
        while ends and time.monotonic() < deadline:
            starts = {p: max(lows[p], end - span) for p, end in ends.items()}
            consumer.assign([TopicPartition(topic, p, o) for p, o in starts.items()])
            left = dict(ends)
            while left and time.monotonic() < deadline:
                for msg in consumer.consume(64, timeout=0.1):
                    p = msg.partition()
                    if msg.error() is None and msg.offset() < ends.get(p, 0):
                        got[p] = msg.value()
                for tp in consumer.position([TopicPartition(topic, p) for p in left]):
                    if tp.offset >= left[tp.partition]:
                        del left[tp.partition]
            # Found, or read back to the start: done; else the span before.
            ends = {p: starts[p] for p in ends if p not in got and starts[p] > lows[p]}
            span *= 16
        return got
    finally:
        consumer.close()


def create_topic(
    kafka_config: Mapping[str, Any],
    name: str,
    *,
    partitions: int = 1,
    replication: int | None = None,
    config: Mapping[str, Any] | None = None,
    exist_ok: bool = True,
    timeout_s: float = 30.0,
) -> bool:
    """Create topic ``name``; True if this call created it, False if it existed.

    ``replication=None`` takes the brokers' ``default.replication.factor``
    (``kfeed cluster up`` sets it to the node count, at most 3). ``config``
    holds topic settings such as ``{"retention.ms": 86400000}``. The call
    returns once the topic's partitions all have a leader, so a producer or
    loader made right after finds it.

    >>> kfeed.create_topic({"bootstrap.servers": "127.0.0.1:39092"}, "train", partitions=4)
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import NewTopic

    if not isinstance(kafka_config, Mapping) or "bootstrap.servers" not in kafka_config:
        raise ConfigError("kafka_config must be a dict of librdkafka settings "
                          "with 'bootstrap.servers'")
    check_topic_name(name)
    if not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1:
        raise ConfigError(f"partitions must be an int >= 1, got {partitions!r}")
    if replication is not None and (not isinstance(replication, int)
                                    or isinstance(replication, bool) or replication < 1):
        raise ConfigError(f"replication must be None or an int >= 1, got {replication!r}")
    check_timeout(timeout_s)
    servers = kafka_config["bootstrap.servers"]
    admin = admin_client(kafka_config)
    deadline = time.monotonic() + timeout_s
    while True:  # in short slices: a Ctrl-C is taken between them, not after the timeout
        try:
            known = admin.list_topics(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            break
        except KafkaException as e:
            if (err := refusal(admin)) is not None:
                raise KfeedError(refused_message(servers, err), topic=name,
                                 code=err.code()) from e
            if time.monotonic() >= deadline:
                raise KfeedError(unreachable_message(servers, timeout_s, e.args[0].str()),
                                 topic=name, code=e.args[0].code()) from e
            time.sleep(0.05)
    there = known.topics.get(name)
    if exist_ok and there is not None and there.error is None:
        # Not asked to make it: a user who may write to it but not create
        # topics would be refused (TOPIC_AUTHORIZATION_FAILED), though it exists.
        _wait_for_leaders(admin, name, deadline)
        return False
    topic = NewTopic(name, num_partitions=partitions,
                     replication_factor=-1 if replication is None else replication,
                     config={k: str(v) for k, v in (config or {}).items()})
    created = True
    try:
        answer(admin, admin.create_topics([topic], operation_timeout=timeout_s,
                                          request_timeout=timeout_s)[name])
    except KafkaException as e:
        err = e.args[0]
        if err.name() != "TOPIC_ALREADY_EXISTS":
            raise KfeedError(f"cannot create topic {name!r}: {err.str()}", topic=name,
                             code=err.code()) from e
        if not exist_ok:
            raise KfeedError(f"topic {name!r} already exists", topic=name,
                             code=err.code()) from e
        created = False
    _wait_for_leaders(admin, name, deadline)
    if created:
        log.info("created topic %s with %d partition(s)", name, partitions)
    return created


def _wait_for_leaders(admin: Any, name: str, deadline: float) -> None:
    # CreateTopics returns before every broker's metadata names the leaders;
    # a client made right away would see "unknown topic" for a moment.
    while True:
        meta = admin.list_topics(topic=name, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        tmd = meta.topics.get(name)
        if tmd is not None and tmd.error is None and tmd.partitions and \
                all(p.leader >= 0 for p in tmd.partitions.values()):
            return
        if time.monotonic() >= deadline:
            raise KfeedError(f"topic {name!r} has no leader for every partition yet", topic=name)
        time.sleep(0.1)


def check_topic_name(name: Any) -> None:
    """Kafka's rule for a topic name: up to 249 of a-z A-Z 0-9 . _ -, not "." or ".."."""
    if not isinstance(name, str) or not name or len(name) > 249 or \
            not re.fullmatch(r"[A-Za-z0-9._-]+", name) or name in (".", ".."):
        raise ConfigError(f"topic name {name!r} is not valid: use up to 249 of "
                          "a-z A-Z 0-9 . _ -")


def unavailable_message(topic: str, servers: str, why: str) -> str:
    """A topic the brokers do not have: what happened and how to create it."""
    return (f"topic {topic!r} is not available at {servers}: {why}; create it with "
            f"kfeed.create_topic(config, {topic!r}, partitions=N) or "
            f"`kfeed produce --topic {topic} ...` (brokers here do not create topics "
            f"on first use)")


def unreachable_message(servers: str, seconds: float, why: str) -> str:
    """Brokers that did not answer: the same words for the producer and the loader."""
    bare = [s for s in str(servers).split(",") if s.strip() and not _HAS_PORT.search(s.strip())]
    port = (f" ({', '.join(s.strip() for s in bare)}: no port given, so librdkafka's 9092)"
            if bare else "")
    return f"cannot reach the brokers at {servers} within {seconds:g}s{port}: {why}"


# host:port, [v6]:port, or a protocol prefix's host:port (SSL://host:9093).
_HAS_PORT = re.compile(r":\d+$")


# -- error codes, topic metadata, callbacks ---------------------------------------

# Broker refusals that no retry mends (librdkafka error codes): bad
# credentials, TLS, and every authorization failure.
REFUSED = frozenset({
    -169,  # _AUTHENTICATION
    -181,  # _SSL
    29,    # TOPIC_AUTHORIZATION_FAILED
    30,    # GROUP_AUTHORIZATION_FAILED
    31,    # CLUSTER_AUTHORIZATION_FAILED
    53,    # TRANSACTIONAL_ID_AUTHORIZATION_FAILED
})
# Answers of brokers that are starting, or moving a leader or a group's
# coordinator (right after a restart, say): asked again, they go within
# seconds (``passing``).
PASSING = frozenset({
    5,   # LEADER_NOT_AVAILABLE
    6,   # NOT_LEADER_FOR_PARTITION
    14,  # COORDINATOR_LOAD_IN_PROGRESS
    15,  # COORDINATOR_NOT_AVAILABLE
    16,  # NOT_COORDINATOR
})


def passing(call: Callable[[], Any], timeout_s: float) -> Any:
    """``call()``, asked again while it raises a KafkaException whose code is in
    ``PASSING``, for up to ``timeout_s``; then its error stands."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - only a passing KafkaError is asked again
            err = kafka_error(e)
            if err is None or err.code() not in PASSING or time.monotonic() >= deadline:
                raise
        time.sleep(0.25)


def within(call: Callable[[], None], name: str, limit: float) -> bool:
    """``call()`` on a daemon thread ``name``, given ``limit`` seconds: False if it still
    runs then (it goes on in the background); what it raised is raised here."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - raised below, on the caller's thread
            failed.append(e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        return False
    if failed:
        raise failed[0]
    return True


# A topic that stays unknown this long after the stream began was deleted
# (a new topic can look unknown for a moment while metadata spreads: on a
# busy 3-broker cluster a producer made right after create_topic asked a
# broker that still did not know the topic after 5 s).
GONE_CODES = {3, -188, -190}  # UNKNOWN_TOPIC_OR_PART, _UNKNOWN_TOPIC, _UNKNOWN_PARTITION
GONE_GRACE_S = 10.0
LEADER_NOT_AVAILABLE = 5


class TopicUnavailable(NamedTuple):
    """Why a topic cannot be read or written, and the Kafka error code if any."""

    why: str
    code: int | None


def topic_partitions(md: Any, topic: str, since: float,
                     deadline: float) -> list[int] | TopicUnavailable | None:
    """``topic``'s partition ids in ``md``, a confluent-kafka ``list_topics`` answer.

    None means ask again: the broker asked does not know the topic (or its
    leaders) yet, and less than ``GONE_GRACE_S`` passed since the first
    question (``since``, a ``time.monotonic()`` value), and ``deadline`` has
    not passed. A topic created a moment ago looks like that while its
    metadata spreads to every broker.
    """
    until = min(deadline, since + GONE_GRACE_S)
    tmd = md.topics.get(topic)
    if tmd is not None and tmd.error is None and tmd.partitions:
        return sorted(tmd.partitions)
    err = tmd.error if tmd is not None else None
    code = err.code() if err is not None else None
    if (code is None or code in GONE_CODES or code == LEADER_NOT_AVAILABLE) and \
            time.monotonic() < until:
        return None
    return TopicUnavailable(err.str() if err is not None else "no partitions", code)


def wait_partitions(ask: Callable[[float], Any], topic: str, servers: str, timeout_s: float,
                    error: type[KfeedError],
                    check: Callable[[BaseException], None] = lambda e: None) -> list[int]:
    """``topic``'s partition ids, asked with ``ask(timeout)`` (a client's ``list_topics``)
    in slices of half a second, so that what ``check`` raises for a failed ask (bad
    credentials, a fatal error) is raised at once, not after ``timeout_s``.

    Asked again while the topic is new to the broker asked (``topic_partitions``).
    An ``error`` (ConsumeError or ProduceError) names why not: brokers that never
    answered, or a topic they do not have. Brokers that answered were reached,
    even when the last ask, cut short by the deadline (a slice of milliseconds on
    a loaded machine), timed out: what is missing then is the topic.
    """
    from confluent_kafka import KafkaException

    since = time.monotonic()
    deadline = since + timeout_s
    md = None
    while True:
        try:
            md = ask(min(0.5, max(0.01, deadline - time.monotonic())))
        except (KafkaException, SystemError) as e:
            check(e)
            if time.monotonic() < deadline:
                continue
            if md is None:
                err = kafka_error(e)
                raise error(unreachable_message(servers, timeout_s,
                                                err.str() if err is not None else repr(e)),
                            topic=topic, code=err.code() if err is not None else None) from e
            found = topic_partitions(md, topic, since, since)  # the last answer, made final
        else:
            found = topic_partitions(md, topic, since, deadline)
        if isinstance(found, TopicUnavailable):
            raise error(unavailable_message(topic, servers, found.why), topic=topic,
                        code=found.code)
        if found is not None:
            return found
        time.sleep(0.1)


def admin_partitions(admin: Any, topic: str, servers: str, timeout_s: float) -> list[int]:
    """``topic``'s partition ids, asked of an ``AdminClient``; ConsumeError naming why not."""
    def refused(e: BaseException) -> None:
        if (err := refusal(admin)) is not None:
            raise ConsumeError(refused_message(servers, err), topic=topic,
                               code=err.code()) from e

    return wait_partitions(lambda timeout: admin.list_topics(topic, timeout=timeout), topic,
                           servers, timeout_s, ConsumeError, refused)


def weakly(method: Callable[..., None]) -> Callable[..., None]:
    """A client's callback that calls ``method`` without keeping its object alive.

    ``method`` belongs to the object that owns the client, and a client keeps
    its callbacks until it is freed: held strongly, owner and client would be
    a reference cycle, and the client (its threads and connections) would
    outlive its owner until the cyclic collector's next full pass. What it
    raises is logged, never passed on (``_safely``).
    """
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            _safely(bound, args)
    return call


def chain(ours: Callable[..., None], theirs: Callable[..., None] | None) -> Callable[..., None]:
    """A librdkafka callback that runs kfeed's (a method, held ``weakly``), then the user's own."""
    ours = weakly(ours)
    if theirs is None:
        return ours

    def both(*args: Any) -> None:
        ours(*args)
        _safely(theirs, args)
    return both


def _safely(callback: Callable[..., None], args: tuple[Any, ...]) -> None:
    # A callback runs inside confluent-kafka's poll, consume or flush: an
    # exception raised into it breaks librdkafka's dispatch (NOTE [ Callbacks
    # never raise ] in kfeed/producer.py).
    # A KeyboardInterrupt its signal's handler raised here is raised again
    # once the callback returned (NOTE [ A signal is never lost ]).
    try:
        callback(*args)
    except BaseException as e:  # noqa: BLE001 - logged, never into librdkafka's dispatch
        if Interrupted.raise_again(e):
            return
        log.exception("a Kafka client callback failed (%s)",
                      getattr(callback, "__qualname__", callback))


def kafka_error(exc: BaseException) -> Any | None:
    """The KafkaError behind ``exc``: a KafkaException's, or that of the one that caused it."""
    from confluent_kafka import KafkaException

    seen: BaseException | None = exc
    for _ in range(8):  # a cause chain can loop
        if seen is None:
            break
        if isinstance(seen, KafkaException) and seen.args and hasattr(seen.args[0], "code"):
            return seen.args[0]
        seen = seen.__cause__ or seen.__context__
    return None


# -- connection trouble in librdkafka's log ------------------------------------

# librdkafka logs every refused connect (twice: the socket error and the
# broker state change), about 1,000 lines a client in 30 s while brokers are
# down. These are the messages that say so.
_CONNECT_TROUBLE = re.compile(
    r"(Connect to .* failed|Connection refused|Disconnected|all.brokers.down|brokers are down|"
    r"Failed to resolve|timed out|Receive failed|Send failed)", re.IGNORECASE)
_BROKER = re.compile(r"(?:ssl|sasl_ssl|sasl_plaintext|plaintext)?:?/{0,2}"
                     r"([A-Za-z0-9_.\-]+:\d+)(?:/\S*)?")


class ConnectionLog(logging.Handler):
    """librdkafka's logger: connection trouble at most once per broker every ``every_s``.

    confluent-kafka calls ``logger.log`` for each librdkafka line. Lines about
    a broker that cannot be reached are folded: the first is logged, the
    next ones within ``every_s`` only counted, and the count goes with the
    next line that passes. Everything else is passed on unchanged to
    ``target`` (the ``kfeed.librdkafka`` logger by default), marked as
    connection lines (the record's ``connection`` attribute), which ``kfeed``
    commands show only with ``-v``: a failure that matters is an error of its own.

    ``trouble_level``, if given, is the level of the connection lines: DEBUG
    for the logger of a client whose error callback warns of the same
    trouble (the loader's consumer, the producer), so that a program's log
    says it once, not twice, every ``every_s``.
    """

    def __init__(self, target: logging.Logger | None = None, every_s: float = 5.0,
                 trouble_level: int | None = None) -> None:
        super().__init__()
        self.target = target or logging.getLogger("kfeed.librdkafka")
        self.every_s = every_s
        self.trouble_level = trouble_level
        self._last: dict[str, tuple[float, int]] = {}

    # confluent-kafka takes any object with a ``log(level, fmt, *args)`` method.
    def log(self, level: int, fmt: str, *args: Any) -> None:
        text = fmt % args if args else fmt
        if _CONNECT_TROUBLE.search(text):
            m = _BROKER.search(text)
            broker = m.group(1) if m else "?"
            now = time.monotonic()
            last, held = self._last.get(broker, (-1e18, 0))
            if now - last < self.every_s:
                self._last[broker] = (last, held + 1)
                return
            self._last[broker] = (now, 0)
            if held:
                text = f"{text} ({held} more like it in the last {now - last:.0f}s)"
            if self.trouble_level is not None:
                level = self.trouble_level
        self.target.log(level, "%s", text, extra={"connection": True})

    def emit(self, record: logging.LogRecord) -> None:  # as a plain logging.Handler
        self.log(record.levelno, record.getMessage())
