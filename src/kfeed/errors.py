"""kfeed's exceptions: one root, ``KfeedError``, with a subclass per phase.

Every layer of the data flow raises from here: configuration and schema checks
(``ConfigError``), the codec (``DecodeError``), the producer (``ProduceError``),
the consumer side (``ConsumeError``) and the local cluster tool
(``ClusterError``). Errors carry topic, partition and offset where they have
them, and the original exception as ``__cause__``. ``first_line`` quotes
another library's error inside one of them.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, NoReturn

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


_watch_lock = threading.Lock()


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM that stops a ``kfeed`` command where it is (exit 128 + ``signum``).

    The ``kfeed`` command's signal handlers raise it with ``raise_for``, which
    makes sure it arrives (NOTE [ A signal is never lost ]).
    """

    handler: ClassVar[Callable[[int, Any], None]]  # the signal handler that raises it
    _pending: ClassVar[int | None] = None  # raised by ``raise_for``, not yet ``caught``
    _again: ClassVar[bool] = False  # the next handler run is the watch's, not a signal's

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @staticmethod
    def handles(fn: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
        """A signal handler that runs ``fn``: the form all the command's handlers take.

        When the watch delivers the signal again, it raises the pending
        ``Interrupted`` instead: ``fn`` may have changed its mind since (a
        graceful stop that has begun).
        """
        def handler(signum: int, frame: Any) -> None:
            if not Interrupted._again:
                fn(signum, frame)
                return
            # The watch's: raised again, unless it is on its way up already
            # (being handled, by a ``finally`` that closes a client for
            # instance, which a second one would cut short).
            Interrupted._again = False
            if (pending := Interrupted._pending) is not None and not _handling_one():
                Interrupted.raise_for(pending)
        handler.kfeed = True  # type: ignore[attr-defined]
        return handler

    @staticmethod
    def raise_for(signum: int) -> NoReturn:
        """Raise it for ``signum``, and again until the command ``caught`` it."""
        watching = Interrupted._pending is not None
        Interrupted._pending = signum
        if not watching and threading.current_thread() is threading.main_thread():
            threading.Thread(target=Interrupted._watch, name="kfeed-signal",
                             daemon=True).start()
        raise Interrupted(signum)

    @staticmethod
    def caught() -> int | None:
        """The signal whose ``Interrupted`` was raised, if one was: it is handled
        now, and no longer raised again. The command calls it whatever it
        caught (a lost one may come out as another error)."""
        with _watch_lock:  # no delivery from the watch after this
            signum, Interrupted._pending = Interrupted._pending, None
        return signum

    @staticmethod
    def _watch() -> None:
        while True:
            time.sleep(0.05)
            with _watch_lock:
                signum = Interrupted._pending
                if signum is not None and not getattr(signal.getsignal(signum), "kfeed", False):
                    signum = Interrupted._pending = None  # the command's handlers are gone
                if signum is None:
                    return
                Interrupted._again = True
                _thread.interrupt_main(signum)

    @staticmethod
    def raise_again(exc: BaseException) -> bool:
        """For code that must not let ``exc`` through: whether it is an interrupt
        that will be raised again, once that code has returned.

        ``raise_for``'s are (the watch). Any other KeyboardInterrupt in the main
        thread is signalled once more, from another thread 10 ms later:
        signalled from here, its handler would run still inside that code.
        """
        if not isinstance(exc, KeyboardInterrupt) or (
                threading.current_thread() is not threading.main_thread()):
            return False
        if Interrupted._pending is None:
            again = threading.Timer(0.01, _thread.interrupt_main,
                                    (getattr(exc, "signum", signal.SIGINT),))
            again.daemon = True
            again.start()
        return True

    @staticmethod
    def keep_lost() -> None:
        """Have the interrupts that Python would ignore (raised in a weakref
        callback or a ``__del__``) raised again, without its "Exception
        ignored" lines: for the ``kfeed`` command, which owns its process."""
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            if unraisable.exc_value is None or not Interrupted.raise_again(unraisable.exc_value):
                previous(unraisable)
        sys.unraisablehook = hook


def _handling_one() -> bool:
    """Whether the main thread is handling an interrupt (or an error raised meanwhile)."""
    seen = sys.exc_info()[1]
    for _ in range(16):  # the exceptions raised while handling it chain to it
        if seen is None:
            return False
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


Interrupted.handler = Interrupted.handles(lambda signum, _frame: Interrupted.raise_for(signum))


# NOTE [ A signal is never lost ]
#
# A signal's Python handler runs in the main thread at the next bytecode,
# wherever that is: sometimes inside code that loses what it raises. The
# ``Interrupted`` then never reached the command, which went on as if no
# signal had come: a SIGTERM while ``convert`` imported a module ran the
# handler inside importlib's weakref callback ("Exception ignored", then
# 30 s of waiting for the brokers, then exit 1), once in 100 runs. Others
# were lost without a trace, or came out of C code as a SystemError. So:
# - ``raise_for`` marks the signal pending, and a watch thread delivers it
#   again every 50 ms (``_thread.interrupt_main``) until the command has
#   ``caught`` it. A delivery that finds an ``Interrupted`` already being
#   handled (in a ``finally`` or an ``except`` on its way up) raises
#   nothing, so that the clean-up it runs is not cut short; a second signal
#   from the user still does, at once;
# - the command asks whether a signal is pending however it ended: an error
#   it caught, or a return, is that signal's (one line, exit 128 + signum).
#   Only then are the handlers put back, so the watch's last delivery, if
#   one is under way, meets a handler that knows it for one;
# - Python's "Exception ignored" lines for it (``keep_lost``) and kfeed's
#   librdkafka callbacks (``_kafka._safely``) stay quiet about it.


def first_line(exc: BaseException) -> str:
    """``exc``'s message, its first line alone (its type's name if it has none):
    another library's error, quoted in one of kfeed's one-line errors."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
