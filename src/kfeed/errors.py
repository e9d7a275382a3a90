"""kfeed's exceptions: one root, ``KfeedError``, with a subclass per phase.

Every layer of the data flow raises from here: configuration and schema checks
(``ConfigError``), the codec (``DecodeError``), the producer (``ProduceError``),
the consumer side (``ConsumeError``) and the local cluster tool
(``ClusterError``). Errors carry topic, partition and offset where they have
them, and the original exception as ``__cause__``. ``first_line`` quotes
another library's error inside one of them.
"""

from __future__ import annotations

__all__ = [
    "KfeedError",
    "ConfigError",
    "DecodeError",
    "ProduceError",
    "ConsumeError",
    "ClusterError",
    "LoaderError",
]


class KfeedError(Exception):
    """Root of every error kfeed raises.

    ``topic``, ``partition`` and ``offset`` are set when the error concerns one
    Kafka message; ``code`` holds a librdkafka error code when there is one.
    """

    def __init__(
        self,
        message: str,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
        code: object | None = None,
    ) -> None:
        super().__init__(message)
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.code = code

    def __str__(self) -> str:
        text = super().__str__()
        where = []
        if self.topic is not None:
            where.append(f"topic={self.topic}")
        if self.partition is not None:
            where.append(f"partition={self.partition}")
        if self.offset is not None:
            where.append(f"offset={self.offset}")
        return f"{text} ({', '.join(where)})" if where else text


class ConfigError(KfeedError, ValueError):
    """A bad argument, schema or configuration, found before any I/O."""


class DecodeError(KfeedError):
    """A message value that does not match the schema or the wire format."""


class ProduceError(KfeedError):
    """Messages that Kafka did not acknowledge."""


class ConsumeError(KfeedError):
    """The consumer could not read: broker unreachable, topic missing, access denied."""


class LoaderError(KfeedError):
    """An error raised in the loader's background thread, re-raised in the caller."""


class ClusterError(KfeedError):
    """The local Apache Kafka cluster tool could not do what was asked."""


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM that stops a ``kfeed`` command where it is (exit 128 + ``signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @staticmethod
    def handler(signum: int, _frame: object) -> None:
        """A signal handler that raises it."""
        raise Interrupted(signum)


def first_line(exc: BaseException) -> str:
    """``exc``'s message, its first line alone (its type's name if it has none):
    another library's error, quoted in one of kfeed's one-line errors."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
