"""The ``kfeed`` command: the outermost layer, argument parsing and output only.

It uses the cluster tool, ``kfeed.ingest`` (sample files into columns),
``kfeed.text`` (corpora into token documents), the producer, and the demo
training jobs of ``kfeed._train`` (which hold every torch import); nothing
imports it. Only this module (and the cluster tool's CLI part) prints.

- ``kfeed cluster up|down|status|jars``: a real local Apache Kafka.
- ``kfeed produce``: samples (synthetic, .npz, .npy, Parquet) into a topic;
  or token documents (a text corpus tokenized by ``kfeed.text``, token ids
  already, or synthetic text) into a token topic.
- ``kfeed train``: an MLP trained from a topic with the Loader, or
  (``--task lm``) a tiny causal transformer trained from a token topic with
  packed ``[batch, seq_len]`` rows; checkpoints (model, optimizer, loader
  state) and resumes exactly.
- ``kfeed convert``: a topic of Avro, Protobuf, JSON or raw records into
  blocks in another topic, exactly once (``kfeed.convert``).
- ``kfeed lag``: a consumer group's lag per partition (``kfeed.lag``).

Every mistake is one line on stderr, ``kfeed: <what is wrong>: <how to
fix>``, checked before any connection where it can be (see ``EXIT_CODES``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Generator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from kfeed import __version__, cluster
from kfeed.errors import ConfigError, DecodeError, Interrupted, KfeedError, ProduceError
from kfeed.ingest import DTYPES, parse_pairs
from kfeed.ingest import skip_documents as _skip_documents
from kfeed.synthetic import CLASSES, FEATURES, synthetic_columns, synthetic_schema

__all__ = [
    "CLASSES",
    "FEATURES",
    "build_parser",
    "main",
    "synthetic_columns",
    "synthetic_schema",
]

log = logging.getLogger(__name__)

# A topic `kfeed produce` creates has this many partitions unless
# --partitions says otherwise: enough for a few trainers in one group.
DEFAULT_PARTITIONS = 4

EXIT_CODES = """\
Exit status: 0 done; 2 a mistake in the command (a bad or missing argument, a
flag that would be ignored, a missing file, field or column, a column type
kfeed will not guess at, a bad line among a corpus's first documents): nothing
was sent or read; 1 a failure while running (brokers unreachable, a topic that
cannot be used, every record of the topic bad, a bad corpus line once documents
were sent, anything unexpected); 130 / 143 stopped by SIGINT / SIGTERM. Each is
reported as one line on stderr, "kfeed: <what is wrong>: <how to fix>"; -v adds
the traceback and kfeed's logging (without -v, kfeed prints only its own lines).
"""


# -- one line per mistake ---------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one ``kfeed: <what>: <how to fix>`` line, exit 2."""

    # The command line being parsed (``main`` sets it). argparse reports a
    # missing argument before an unknown one, which is most often its
    # misspelling: "--topc clicks" said "missing --topic".
    given: list[str] = []

    def error(self, message: str) -> NoReturn:
        m = re.fullmatch(r"the following arguments are required: (.*)|one of the arguments "
                         r".* is required", message)
        # (Not for a missing command: what follows it is the command's.)
        own = m is not None and m.group(1) not in ("command", "cluster_command")
        unknown = self._unknown() if own else []
        if unknown:
            message = f"unrecognized arguments: {' '.join(unknown)}"
        sys.stderr.write(f"kfeed: {_usage_error(message, self.prog)}\n")
        sys.exit(2)

    def _unknown(self) -> list[str]:
        """The flags in ``given`` after this parser's command that it does not take."""
        words, tokens = self.prog.split()[1:], iter(self.given)
        for word in words:  # (the command's own words: options before them are another's)
            if word not in tokens:
                return []
        known = self._option_string_actions
        out = []
        for token in tokens:
            if token == "--":
                break
            flag = token.split("=", 1)[0]
            # Values, as argparse takes them: "-", a negative number, or one with a
            # space (a query that starts with a "--" comment).
            if not flag.startswith("-") or flag == "-" or " " in token \
                    or self._negative_number_matcher.match(flag):
                continue
            if flag.startswith("--"):
                if not any(k.startswith(flag) for k in known):  # (argparse takes prefixes)
                    out.append(flag)
            elif flag[:2] not in known:  # -Xacks=all is -X acks=all
                out.append(flag)
        return out


def _usage_error(message: str, prog: str) -> str:
    see = f"see '{prog} --help'"
    m = re.fullmatch(r"the following arguments are required: (.*)", message)
    if m:
        missing = {"command": "a command", "cluster_command": "a cluster command"}
        return f"missing {missing.get(m.group(1), m.group(1))}: {see}"
    m = re.fullmatch(r"unrecognized arguments: (.*)", message)
    if m:
        return f"unknown argument {m.group(1)}: {see}"
    m = re.fullmatch(r"one of the arguments (.*) is required", message)
    if m:
        return f"give one of {', '.join(m.group(1).split())}: {see}"
    m = re.fullmatch(r"argument ([^:]+): (.*)", message, re.DOTALL)
    if not m:
        return f"{message}: {see}"
    flag, what = m.group(1).split("/")[-1], m.group(2)
    m = re.fullmatch(r"invalid choice: '([^']*)' \(choose from (.*)\)", what)
    if m:
        if flag in ("command", "cluster_command"):
            kind = flag.replace("_", " ")
            return f"{m.group(1)!r} is not a kfeed {kind}: choose from {m.group(2)}"
        return f"{flag} {m.group(1)!r} is not one of its choices: choose from {m.group(2)}"
    m = re.fullmatch(r"not allowed with argument (.*)", what)
    if m:
        return f"{flag} and {m.group(1).split('/')[-1]} exclude each other: give one of them"
    if what.startswith("expected"):
        return f"{flag} needs a value: {see}"
    if what.startswith("invalid "):  # argparse's own type errors
        return f"{flag}: {what}: {see}"
    return f"{flag} {what}"  # the type helpers below: "VALUE ...: how to fix"


def _count(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (and <= ``high``)."""
    span = f">= {low}" if high is None else f"in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number: give an integer {span}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: give an integer {span}")
        return value
    parse.__name__ = "count"
    return parse


def _name(text: str) -> str:
    """An argparse type: a group name, not empty or blank."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty: give a name")
    return text


def _topic(text: str) -> str:
    """An argparse type: a topic name as Kafka allows it."""
    from kfeed._kafka import check_topic_name

    try:
        check_topic_name(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return text


def _prefetch(text: str) -> int | str:
    """An argparse type: a queue depth >= 1, or "auto"."""
    if text == "auto":
        return text
    try:
        return _count(1)(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} or auto") from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: give a number > 0") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text} is out of range: give a number > 0")
    return value


def _start(text: str) -> str | datetime:
    if text in ("earliest", "latest", "committed"):
        return text
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a start: give earliest, latest, committed or an ISO time such "
            f"as 2024-05-01T12:00:00+00:00") from None


def _refuse(flag: str, scope: str, mode: str) -> ConfigError:
    return ConfigError(f"{flag} applies to {scope}, not to {mode}: leave it out")


def _one_line(text: str) -> str:
    return " ".join(text.split("\n"))


# -- shared Kafka arguments ---------------------------------------------------------


def _kafka_args(p: argparse.ArgumentParser, *aliases: str) -> None:
    p.add_argument("--bootstrap-servers", default=os.environ.get("KFEED_BOOTSTRAP"),
                   help="host:port,... (default: $KFEED_BOOTSTRAP)")
    p.add_argument(*aliases, "--topic", dest="topic", required=True, type=_topic)
    p.add_argument("-X", dest="kafka", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra librdkafka setting (repeatable)")
    p.add_argument("--connect-timeout", type=_positive_float, default=30.0, metavar="SECONDS",
                   help="how long to wait for the brokers before giving up (default 30)")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log at DEBUG level and show tracebacks")


# One broker address of --bootstrap-servers as librdkafka reads it:
# [PROTOCOL://]HOST[:PORT] (9092 without one), the host a name, an IPv4
# address or an IPv6 one in brackets.
_BROKER = re.compile(r"(?:(?:plaintext|ssl|sasl_plaintext|sasl_ssl)://)?"
                     r"(?:\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(?::(\d{1,5}))?", re.IGNORECASE)


def _check_bootstrap(servers: str) -> None:
    """Refuse a broker list librdkafka would only fail to reach, after the whole timeout."""
    # Named as the user gave it: a bad $KFEED_BOOTSTRAP was blamed on a flag never typed.
    given = any(t.startswith("--bo") for t in _Parser.given)
    named = f"--bootstrap-servers {servers}" if given else f"KFEED_BOOTSTRAP={servers}"
    for entry in servers.split(","):
        m = _BROKER.fullmatch(entry.strip())
        if m is None or not 1 <= int(m.group(1) or 9092) <= 65535:
            raise ConfigError(f"{named}: {entry.strip()!r} is not HOST:PORT (e.g. "
                              f"127.0.0.1:9092; several joined by commas)")


def _kafka_config(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    if not args.bootstrap_servers:
        raise ConfigError("no brokers given: pass --bootstrap-servers HOST:PORT or set "
                          "KFEED_BOOTSTRAP")
    _check_bootstrap(args.bootstrap_servers)
    config: dict[str, Any] = {"bootstrap.servers": args.bootstrap_servers, **extra}
    flags = {"bootstrap.servers": "--bootstrap-servers",
             "group.id": "--group-id" if hasattr(args, "group_id") else
             "kfeed produce (a producer is in no consumer group; a resumable job's progress "
             "has a group of its own)",
             "transactional.id": "kfeed convert (kfeed-convert.FROM.TO, the job's own id)"
             if getattr(args, "command", None) == "convert" else
             "kfeed produce (a job's own id, for --resume)"}
    for item in args.kafka:
        key, sep, value = item.partition("=")
        if not sep or not key:
            # Only what comes before a separator: the rest may be a password.
            head = re.split(r"[=:\s]", item, maxsplit=1)[0]
            shown = item if head == item else f"{head}{item[len(head)]}..."
            raise ConfigError(f"-X {shown!r} is not KEY=VALUE: write it as e.g. "
                              f"-X fetch.min.bytes=1048576")
        if key in flags:
            raise ConfigError(f"-X {key} is set by {flags[key]}: leave it out of -X")
        config[key] = value
    return config


# -- progress -------------------------------------------------------------------


def _rates(count: float, nbytes: float, elapsed: float, unit: str) -> str:
    """``N unit/s, M MB/s``: the bar and the final line both say it with this."""
    dt = max(elapsed, 1e-9)
    return f"{count / dt:,.0f} {unit}/s, {nbytes / dt / 1e6:,.1f} MB/s"


def _acknowledged(producer: Any) -> float:
    """The share of the bytes ``producer`` was given that the brokers acknowledged, 0..1.

    Messages handed to librdkafka wait in its queue until acknowledged; a bar
    that counted them as done ran far ahead of the brokers (and of the final
    line, which includes the flush).
    """
    return min(1.0, producer.acked_bytes / producer.bytes) if producer.bytes else 0.0


def _tqdm(**kwargs: Any) -> Any:
    """A tqdm bar on stderr, sized to the terminal.

    A terminal that reports no size (a bare pty) gets 100 x 24: at 0 rows
    tqdm would draw nothing.
    """
    from tqdm import tqdm

    try:
        sized = os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except OSError:
        sized = False
    return tqdm(file=sys.stderr, dynamic_ncols=sized, ncols=None if sized else 100,
                nrows=None if sized else 24, leave=True, **kwargs)


class _AckWatch:
    """A producer's progress line says when acknowledgements stop coming for
    ``_STALLED_S`` while messages wait: a count that stalls without a word
    read as a slow source, with every broker gone.

    Only time in which the producer was served counts: acknowledgements come
    in its poll and flush calls, which a slow source (a tokenizer, a query
    that pauses) puts off.
    """

    def __init__(self, producer: Any) -> None:
        self._producer = producer
        self._acked = -1
        self._since = time.monotonic()

    def word(self) -> str:
        """``""`` while acknowledgements come, or nothing waits; else ``", the brokers..."``."""
        p = self._producer
        waiting = p.stats()["queued"]
        if p.acked_bytes != self._acked or not waiting:
            self._acked, self._since = p.acked_bytes, time.monotonic()
            return ""
        quiet = p.polled_at - self._since  # served all along, and nothing came
        if quiet < _STALLED_S:
            return ""
        said = p.last_error
        why = f"; the last error: {said[1]}" if said is not None and said[0] >= self._since \
            else ""
        return (f", the brokers acknowledged nothing for {quiet:.0f}s, {waiting:,} message(s) "
                f"waiting{why}")


_STALLED_S = 5.0


class _Progress:
    """Live progress on stderr while a command runs, from a thread that asks ``status``.

    ``status()`` gives ``(done, total, extra)`` in ``unit``. On a terminal:
    a tqdm bar (done of total, the rate, the ETA) with ``extra`` after it;
    otherwise, so that logs stay readable, a plain line every ``every_s``:
    ``kfeed produce: 50,000/100,000 samples (50%), 4,167 samples/s, ETA 12s,
    12.4 MB/s``. The thread keeps asking through the flush at the end, when
    only acknowledgements move.
    """

    def __init__(self, what: str, unit: str, status: Callable[[], tuple[float, float, str]],
                 t0: float, every_s: float | None = None, before: float = 0.0,
                 producer: Any = None) -> None:
        # ``before``: done by an earlier run (--resume), in ``done`` but not in the rate.
        # ``producer``: its stalls are said after ``extra`` (``_AckWatch``).
        self._what, self._unit, self._status, self._t0 = what, unit, status, t0
        self._before = before
        self._acks = _AckWatch(producer) if producer is not None else None
        self._stop = threading.Event()
        self._bar: Any = None
        tty = sys.stderr.isatty()
        self._every_s = every_s if every_s is not None else (0.25 if tty else 10.0)
        if tty:
            self._bar = _tqdm(unit=unit, unit_scale=unit != "%", desc=what, mininterval=0.1,
                              initial=before)
        self._thread = threading.Thread(target=self._run, name="kfeed-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self._draw()

    def _draw(self) -> None:
        done, total, extra = self._status()
        if self._acks is not None:
            extra += self._acks.word()
        if self._bar is not None:
            self._bar.total = total or None
            self._bar.n = done
            self._bar.set_postfix_str(extra, refresh=False)
            self._bar.refresh()
            return
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        rate = (done - self._before) / elapsed
        if self._unit == "%":
            parts = [f"{done:.0f}% read"]
        elif total:
            parts = [f"{done:,.0f}/{total:,.0f} {self._unit} ({100 * done / total:.0f}%)",
                     f"{rate:,.0f} {self._unit}/s"]
        else:
            parts = [f"{done:,.0f} {self._unit}", f"{rate:,.0f} {self._unit}/s"]
        if total and rate > 0:
            parts.append(f"ETA {max(0.0, (total - done) / rate):.0f}s")
        if extra:
            parts.append(extra)
        print(f"{self._what}: {', '.join(parts)}", file=sys.stderr, flush=True)

    def close(self, final: bool = False) -> None:
        """Stop; with ``final``, draw the end state first (on a terminal)."""
        self._stop.set()
        self._thread.join()
        if self._bar is not None:
            if final:
                self._draw()
            self._bar.close()


# -- produce -----------------------------------------------------------------------


def _corpus_mode(args: argparse.Namespace) -> bool:
    """--from names a corpus (token documents), not columns of fixed-shape samples."""
    if args.source is None or args.query is not None:
        return False
    suffix = Path(args.source).suffix.lower()
    return (suffix == ".txt" or (suffix == ".jsonl" and not args.field)
            or args.tokenizer is not None
            or args.text_field is not None or (args.lengths is not None and suffix == ".npy"))


def _check_produce(args: argparse.Namespace) -> str:
    """Refuse flags this run would ignore; the run's kind: samples, stream, text or corpus."""
    from kfeed import ingest

    if args.synthetic is not None:
        kind, mode = "samples", "--synthetic"
    elif args.synthetic_text is not None:
        kind, mode = "text", "--synthetic-text"
    elif _corpus_mode(args):
        kind, mode = "corpus", f"--from {Path(ingest.shown(args.source)).name} (a corpus)"
    elif ingest.is_stream(args.source, args.query, bool(args.field)):
        kind, mode = "stream", f"--from {Path(ingest.shown(args.source)).name} (samples)"
    else:
        raise ingest.not_samples(args.source)
    file_only = "--from samples (files, object stores, databases)"
    streamed = ("--from samples streamed through pyarrow or ADBC (Parquet, Arrow, CSV, "
                "JSON Lines; folders, globs, URIs, postgresql://)")
    tokens = "token documents (--synthetic-text, or --from a corpus)"
    suffix = Path(args.source).suffix.lower() if args.source is not None else ""
    fields = suffix in (".jsonl", ".parquet")  # a corpus whose documents have fields
    checks = [
        ("--field", bool(args.field), kind == "stream", file_only),
        ("--dtype", bool(args.dtype), kind == "stream", file_only),
        ("--fill", bool(args.fill), kind == "stream", file_only),
        ("--query", args.query is not None, kind == "stream", streamed),
        ("--resume", args.resume, kind == "stream", streamed),
        ("--resend", args.resend, kind == "stream", streamed),
        ("--transaction-mb", args.transaction_mb is not None, kind == "stream", streamed),
        ("--first-id", args.first_id is not None, kind in ("samples", "text"),
         "--synthetic and --synthetic-text"),
        ("--seed", args.seed is not None, kind == "text", "--synthetic-text"),
        ("--token-dtype", args.token_dtype is not None, kind in ("text", "corpus"), tokens),
        ("--skip-docs", args.skip_docs is not None, kind in ("text", "corpus"), tokens),
        ("--tokenizer", args.tokenizer is not None, kind in ("text", "corpus"), tokens),
        ("--key-field", args.key_field is not None, kind == "corpus" and fields,
         "--from a .jsonl or .parquet corpus (synthetic text is keyed with --keyed)"),
        ("--text-field", args.text_field is not None, kind == "corpus" and fields,
         "--from a .jsonl or .parquet corpus (a .txt one is all text)"),
        ("--lengths", args.lengths is not None, kind == "corpus" and suffix == ".npy",
         "--from a flat .npy of token ids"),
    ]
    for flag, given, applies, scope in checks:
        if given and not applies:
            raise _refuse(flag, scope, mode)
    if args.resume and args.resend:
        raise ConfigError("--resume goes on after the rows sent before and --resend sends "
                          "them again: give one of them")
    if args.keyed and kind == "corpus":
        raise ConfigError("--keyed keys samples by their id, not a corpus's documents: key "
                          "them with --key-field FIELD")
    _wire_format(args)
    if args.format in ("avro", "protobuf", "json") and kind in ("text", "corpus"):
        raise ConfigError(f"--format {args.format} writes fixed-shape samples, not token "
                          f"documents: leave --format out")
    if args.block_records is not None and args.format not in ("block", "arrow"):
        raise ConfigError(f"--block-records applies to --format block or arrow, not to "
                          f"{args.format} (one record a message): leave it out")
    if args.first_id is not None and kind == "samples" and \
            args.first_id + args.synthetic > _INT64_MAX + 1:
        raise ConfigError(f"--first-id {args.first_id}: the ids of --synthetic "
                          f"{args.synthetic} would pass {_INT64_MAX:,}, the largest int64 id")
    return kind


_INT64_MAX = 2**63 - 1


class _StepBar:
    """``kfeed train`` on a terminal: a tqdm bar of steps (of ``--steps`` when given, with
    its ETA), the latest progress line's loss, rate, stall and lag beside it."""

    def __init__(self, steps: int) -> None:
        self._bar = _tqdm(total=steps or None, unit="step", desc="kfeed train", mininterval=0.25)
        self._started = False

    def tick(self, step: int) -> None:
        if not self._started:
            # The clock from the first step on: torch's import, the model and
            # the group's join are not steps (they made 0.3 s of steps read as
            # 2.9 s a step, and the ETA of a minute and a half).
            self._started = True
            self._bar.reset(total=self._bar.total)
        self._bar.update(step - self._bar.n)

    def say(self, line: str) -> None:
        if line.startswith("step "):  # (before the write, which draws the bar again)
            self._bar.set_postfix_str(line.split("  ", 1)[-1], refresh=False)
        self._bar.write(line)

    def close(self) -> None:
        self._bar.close()


def _step_bar(steps: int) -> _StepBar | None:
    return _StepBar(steps) if sys.stderr.isatty() and sys.stdout.isatty() else None


def _metrics_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=_count(1, 65535), metavar="PORT",
                   help="serve Prometheus metrics on 127.0.0.1:PORT/metrics while running "
                        "(needs pip install 'kfeed[metrics]')")


def _serve_metrics(args: argparse.Namespace) -> None:
    if args.metrics_port is not None:
        from kfeed import metrics

        metrics.serve(args.metrics_port)


def cmd_produce(args: argparse.Namespace) -> int:
    kind = _check_produce(args)
    config = _kafka_config(args)
    _serve_metrics(args)
    if kind in ("text", "corpus"):
        return _produce_text(args, config)
    if kind == "stream":
        return _produce_stream(args, config)
    first = args.first_id or 0
    schema = synthetic_schema()
    _ensure_topic(args, config, schema)
    return _send_samples(args, config, schema, args.synthetic,
                         lambda i, n: synthetic_columns(range(first + i, first + i + n)))


def _ensure_topic(args: argparse.Namespace, config: dict[str, Any], schema: Any, *,
                  transactional: bool = False) -> None:
    """Create the topic if it is missing, and say so in one line; an existing one must
    hold messages of the same format, blocks of ``schema`` (``_check_blocks``)."""
    import kfeed
    from kfeed._kafka import check_settings

    from kfeed.producer import PRODUCER_DEFAULTS, message_max_bytes, record_fits

    # A bad -X is a usage mistake, with no topic left behind (checked as the
    # Producer will be made: over its defaults, acks=all with idempotence);
    # so is a record, or a --block-records block, larger than a message (the
    # topic made for it would not take it either).
    producer_config = {**PRODUCER_DEFAULTS, **config}
    check_settings(producer_config, transactional=transactional, producer_only=True)
    fit = record_fits(schema, config, args.format)
    block = getattr(args, "block_records", None)
    if args.format == "block" and fit and block is not None and block > fit:
        raise ConfigError(f"--block-records {block}: a block of that many records is "
                          f"{schema.block_nbytes(block):,} bytes, over message.max.bytes="
                          f"{message_max_bytes(producer_config):,} less 1024 "
                          f"for the headers: give --block-records {fit} or fewer (or leave it "
                          f"out), or raise -X message.max.bytes")
    _reach_registry(args)
    partitions = args.partitions or DEFAULT_PARTITIONS
    # A -X message.max.bytes past the brokers' default (1 MiB) is for messages
    # that large: the topic made here takes them too.
    try:  # (as librdkafka reads it: 0x... too; a value it read otherwise is left alone)
        size = int(str(config.get("message.max.bytes", 0)), 0)
    except ValueError:
        size = 0
    topic_config = {"max.message.bytes": str(size)} if size > _BROKER_MESSAGE_MAX else None
    created = kfeed.create_topic(config, args.topic, partitions=partitions, replication=None,
                                 config=topic_config, exist_ok=True,
                                 timeout_s=args.connect_timeout)
    if created:
        print(f"created topic {args.topic} with {partitions} partition"
              f"{'s' if partitions > 1 else ''} (replication: the brokers' default"
              f"{f'; max.message.bytes {size}' if topic_config else ''})", file=sys.stderr)
    else:
        _check_blocks(args, config, schema)


# Kafka's default message.max.bytes (a record batch's largest size) on the brokers.
_BROKER_MESSAGE_MAX = 1_048_588


def _reach_registry(args: argparse.Namespace) -> None:
    """The --registry that the producer registers its schema with, asked first: one it
    cannot reach stops the run before a topic is made."""
    if not getattr(args, "registry", None) or args.format not in ("avro", "protobuf"):
        return
    from kfeed import ingest
    from kfeed.formats import registry_client

    client = registry_client({"url": args.registry}, f"--format {args.format}")
    try:
        client.get_subjects()
    except Exception as e:  # noqa: BLE001 - the registry client raises errors of many kinds
        raise ProduceError(f"cannot reach the registry at {ingest.no_password(args.registry)}: "
                           f"{e}") from e


def _check_blocks(args: argparse.Namespace, config: dict[str, Any], schema: Any) -> None:
    """Refuse to write blocks beside blocks of another schema or beside messages that
    are no kfeed blocks, and messages of another format beside blocks: a loader of
    either would reject the others as bad.

    Only each partition's newest messages are read (``_kafka.newest_values``).
    """
    from kfeed._kafka import newest_values
    from kfeed.badrecords import block_fingerprint, describe_schema

    fmt = args.format or "block"
    for part, value in sorted(newest_values(config, args.topic, args.connect_timeout).items()):
        if value is None:
            continue  # a tombstone says nothing of the schema
        fingerprint = block_fingerprint(value)
        block = fingerprint is not None and len(value) >= 32
        if fmt != "block":
            if block:
                raise ConfigError(
                    f"topic {args.topic} holds kfeed blocks (the newest of partition {part}): "
                    f"--format {fmt} messages written beside them would not read as one "
                    f"topic; write to another --topic")
            continue
        if not block:
            raise ConfigError(
                f"topic {args.topic} holds messages that are not kfeed blocks (the newest of "
                f"partition {part}): blocks written beside them would not read as one topic; "
                f"write to another --topic")
        if fingerprint != schema.fingerprint:
            fields = describe_schema(schema)
            raise ConfigError(
                f"topic {args.topic} holds kfeed blocks of another schema (fingerprint "
                f"{fingerprint:#018x}, the newest of partition {part}) than this run writes "
                f"({fields}; {schema.fingerprint:#018x}): a loader of either schema would "
                f"reject the other's blocks as bad records; write to another --topic")


def _check_partitions(args: argparse.Namespace, producer: Any) -> None:
    if args.partitions and producer.num_partitions != args.partitions:
        raise ConfigError(
            f"--partitions {args.partitions}: topic {args.topic} exists with "
            f"{producer.num_partitions} partitions: leave --partitions out, or pick a new --topic")


def _producer(args: argparse.Namespace, config: dict[str, Any], schema: Any) -> Any:
    from kfeed.producer import Producer

    return Producer(config, args.topic, schema, format=_wire_format(args),
                    block_records=args.block_records, compression=args.compression,
                    connect_timeout_s=args.connect_timeout)


def _send_samples(args: argparse.Namespace, config: dict[str, Any], schema: Any, total: int,
                  chunk: Callable[[int, int], dict[str, Any]]) -> int:
    producer = None
    try:
        with _producer(args, config, schema) as producer:
            _check_partitions(args, producer)
            t0 = time.monotonic()

            def status() -> tuple[float, float, str]:
                done, acked = producer.acknowledged()
                mb_s = acked / max(time.monotonic() - t0, 1e-9) / 1e6
                return done, total, f"{mb_s:,.1f} MB/s"

            progress = _Progress("kfeed produce", "samples", status, t0, args.progress_every,
                                 producer=producer)
            try:
                step = 8192
                for i in range(0, total, step):
                    cols = chunk(i, min(step, total - i))
                    producer.send(cols, keys=cols["id"] if args.keyed else None)
                producer.flush()
            except BaseException:
                progress.close()
                raise
            elapsed = time.monotonic() - t0
            progress.close(final=True)
    except KeyboardInterrupt as e:
        if producer is not None:  # (after its __exit__: what the flush delivered counts)
            e.add_note(f"about {producer.acknowledged()[0]:,.0f} of the {total:,} samples "
                       f"were acknowledged by the brokers")
        raise
    print(f"produced {total:,} samples in {producer.messages:,} messages to {args.topic} in "
          f"{elapsed:.1f}s: {_rates(total, producer.bytes, elapsed, 'samples')}")
    return 0


# -- produce: rows streamed from files, object stores and databases ------------------


# A transaction of streamed rows ends at a source batch's end once it holds this
# many MB (--transaction-mb): fewer commits, while a crash re-sends at most this much.
_TRANSACTION_MB = 64.0


def _produce_stream(args: argparse.Namespace, config: dict[str, Any]) -> int:
    """``--from`` rows through pyarrow or ADBC, in transactions that record the progress.

    The first batch is read and checked before Kafka is asked anything, so a
    column kfeed cannot send stops the run at once. The progress is read
    only once the transactional producer is up: its ``init_transactions``
    fences an earlier run of the same job, whose open transaction the
    brokers abort, so nothing that run still sends can land after it.
    """
    from kfeed import ingest
    from kfeed.producer import Producer
    from kfeed.resume import IngestProgress, job_id, other_sources

    dtypes = parse_pairs(args.dtype, "--dtype", "DTYPE")
    fills = parse_pairs(args.fill, "--fill", "VALUE")
    given = parse_pairs(args.field, "--field", "COLUMN")
    rows = ingest.open_rows(args.source, args.query,
                            {given.get(f, f): d for f, d in dtypes.items()})
    batches: Generator[dict[str, Any], None, None] | ingest.ReadAhead = (b for b in ())
    try:
        fields = ingest.stream_fields(rows, given or None, dtypes, fills)
        if args.keyed and "id" not in fields:
            raise ConfigError(f"--keyed keys samples by their id field, and the fields read are "
                              f"{', '.join(fields)}: add --field id=COLUMN, or leave --keyed out")
        columns = sorted(set(fields.values()))

        first_schema: list[Any] = []  # the first batch's, which every batch must give

        def read(skip: int) -> Iterator[dict[str, Any]]:
            for batch in rows.batches(columns, skip):
                where = rows.where or rows.name
                cols = ingest.batch_columns(where, batch, fields, dtypes, fills,
                                            first_schema[0] if first_schema else None)
                if first_schema:
                    ingest.same_schema(first_schema[0], cols, where)
                yield cols

        batches = read(0)
        first = next(batches, None)
        if first is None:
            print(f"nothing to send: {rows.name} holds no rows")
            return 0
        schema = ingest.schema_for(first)
        _check_keyed(args, schema)
        first_schema.append(schema)
        where = ingest.source_key(args.source)
        job = job_id(args.topic, where, args.query)
        progress = IngestProgress(config, args.topic, job, where, args.connect_timeout,
                                  marker=rows.mark)
        try:
            _ensure_topic(args, config, schema, transactional=True)
            with Producer(config, args.topic, schema, format=_wire_format(args),
                          block_records=args.block_records, compression=args.compression,
                          transactional_id=job, connect_timeout_s=args.connect_timeout
                          ) as producer:
                _check_partitions(args, producer)
                done = 0 if args.resend else progress.done()
                if done and not args.resume:
                    # Sending from the first row again would put every row sent
                    # before into the topic twice: only on the user's word.
                    if rows.total == done:
                        raise ConfigError(
                            f"all {done:,} rows of {where} were already sent to {args.topic} "
                            f"by an earlier run: --resend sends them again")
                    raise ConfigError(
                        f"{done:,} rows of {where} were already sent to {args.topic} by an "
                        f"earlier run: --resume sends the rest, --resend sends them all again")
                if args.resume and not done:
                    others = other_sources(config, args.topic, job, args.connect_timeout)
                    if others:
                        # The same files named another way would be sent twice.
                        named = "; ".join(f"{rows:,} rows of {source}"
                                          for source, rows in others)
                        raise ConfigError(
                            f"--resume: no rows of {where} are recorded as sent to "
                            f"{args.topic}, but {named} are: if that is the same data, resume "
                            f"with --from naming it as before; if not, leave --resume out")
                    print(f"kfeed produce: no rows of {where} recorded as sent to {args.topic}: "
                          f"sending from the first", file=sys.stderr)
                if done:
                    rows.check_mark(progress.mark, done)
                    batches.close()
                    batches = read(done)
                    first = next(batches, None)
                    if first is None:
                        print(f"nothing to send: {rows.name} holds no rows after the "
                              f"{done:,} sent before")
                        return 0
                # The next batch read while this is sent.
                batches = ingest.ReadAhead(batches, cancel=rows.cancel)
                return _send_stream(args, producer, schema, rows.name, rows.total, first,
                                    batches, progress, done, _transaction_age_s(config))
        finally:
            progress.close()
    finally:
        batches.close()  # the read-ahead, or the generator under it
        if not getattr(batches, "stuck", False):  # (else its thread still reads them)
            rows.close()


def _check_keyed(args: argparse.Namespace, schema: Any) -> None:
    """--keyed keys each sample by its id, which must be an integer (before the topic is made)."""
    if args.keyed and schema["id"].dtype not in _INT_DTYPES:
        raise ConfigError(f"--keyed keys samples by their id, and id is {schema['id'].dtype}: "
                          f"give it an integer --dtype id=int64, or leave --keyed out")


_INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def _transaction_age_s(config: dict[str, Any]) -> float:
    """How long a transaction of streamed rows stays open: a third of the
    producer's ``transaction.timeout.ms`` (60 s by default), after which the
    brokers abort it, so that its commit has the rest (librdkafka has checked
    the setting by the time the producer is up)."""
    return float(config.get("transaction.timeout.ms", 60_000)) / 3000


def _rows_a_send(cols: dict[str, Any], limit: float) -> int:
    """Rows a ``Producer.send`` of streamed rows takes: 8192, or fewer where they would
    weigh more than 8 MB or a quarter of a transaction's ``limit`` bytes."""
    row = sum(v[:1].nbytes for v in cols.values()) or 1
    return int(max(1, min(8192, min(8 << 20, limit / 4) // row)))


# What _send_stream holds in place of the next batch when the source was too slow to
# give it within the transaction's age: it is waited for after the commit.
_LATER = object()
# What a run stopped by a bad row says of --resume: it skips the rows sent,
# so the files they came from and the fields' types must stay as they were.
_AFTER_THE_FIX = ("after the fix, run again with --resume to send the rest; a fix that edits "
                  "a file they came from, or gives a field another --dtype, cannot go on "
                  "after them: send it all with --resend to a new topic instead")


def _send_stream(args: argparse.Namespace, producer: Any, schema: Any, name: str,
                 total: int | None, first: dict[str, Any], batches: Any,
                 progress: Any, done: int, age_s: float) -> int:
    """The batches (an ``ingest.ReadAhead``) sent in transactions of about
    ``--transaction-mb`` or ``age_s`` seconds, each recording the rows sent so
    far (NOTE [ Ingestion progress ] in ``kfeed.resume``).

    A transaction waits for the next batch only while it is younger than
    ``age_s``: a source slower than that (a query that stops for a while)
    is waited for after the commit, with no transaction open for the
    brokers to abort.
    """
    cols: Any = first
    sent = done
    limit = (args.transaction_mb or _TRANSACTION_MB) * 1e6
    t0 = time.monotonic()
    before = producer.messages, producer.bytes

    def status() -> tuple[float, float, str]:
        # What the brokers acknowledged, as --synthetic shows: rows handed to
        # librdkafka showed 100% for as long as its brokers were gone.
        mb_s = producer.acked_bytes / max(time.monotonic() - t0, 1e-9) / 1e6
        return (done + (sent - done) * _acknowledged(producer), total or 0,
                f"{mb_s:,.1f} MB/s")

    # A batch the source could not give (a bad value, a file that cannot be
    # read): the rows before it are good, and are committed with the open
    # transaction before the error is raised, so a --resume goes on at it.
    unread: list[KfeedError] = []

    def following(timeout: float | None) -> Any:
        try:
            return batches.take(timeout)  # (checked as read: _produce_stream's read)
        except StopIteration:
            return None
        except TimeoutError:
            return _LATER
        except KfeedError as e:
            unread.append(e)
            return None

    progress_bar = _Progress("kfeed produce", "samples", status, t0, args.progress_every,
                             before=done, producer=producer)
    committed = done
    try:
        while cols is not None:
            with producer.transaction():
                opened, start_bytes = time.monotonic(), producer.bytes

                def full() -> bool:
                    return (producer.bytes - start_bytes >= limit
                            or time.monotonic() - opened >= age_s)

                while True:
                    n = len(next(iter(cols.values())))
                    # A send at a time (encoding beside sending), the limits
                    # looked at after each: a source batch of large rows would
                    # otherwise outlive the transaction, which the brokers
                    # abort for its age, at every resume again.
                    step = _rows_a_send(cols, limit)
                    i = 0
                    while i < n and not (i and full()):
                        part = {k: v[i:i + step] for k, v in cols.items()}
                        producer.send(part, keys=part["id"] if args.keyed else None)
                        i += step
                    i = min(i, n)
                    sent += i
                    if i < n:  # full inside the batch: its rest goes in the next one
                        cols = {k: v[i:] for k, v in cols.items()}
                        break
                    if full():
                        cols = _LATER
                        break
                    cols = following(age_s - (time.monotonic() - opened))
                    if cols is None or cols is _LATER:
                        break
                progress.record(producer, sent)
            committed = sent
            if cols is _LATER:
                cols = following(None)
        if unread:
            raise unread[0]
    except KfeedError as e:
        progress_bar.close()
        if committed == done:
            raise  # nothing sent (a ConfigError: a mistake in the command, exit 2)
        # Rows before the bad one (a bad value, a file that cannot be read, a
        # broker's refusal) were sent: a failure while running (exit 1), and a
        # rerun must go on after them.
        raise KfeedError(f"{e} ({committed - done:,} rows before it were sent and recorded: "
                         f"{_AFTER_THE_FIX})") from e
    except BaseException:
        progress_bar.close()
        raise
    elapsed = time.monotonic() - t0
    progress_bar.close(final=True)
    new, nbytes = sent - done, producer.bytes - before[1]
    after = f", after the {done:,} sent before" if done else ""
    print(f"produced {new:,} samples in {producer.messages - before[0]:,} messages to {args.topic} "
          f"in {elapsed:.1f}s{after}: {_rates(new, nbytes, elapsed, 'samples')}")
    return 0


# -- produce: token documents -------------------------------------------------------


def _token_arrays(chunk: Any, tokenizer: Any, token_dtype: str,
                  place: Callable[[int], str]) -> list[Any]:
    """One chunk's documents as token id arrays of ``token_dtype``, checked; ``place(i)``
    names its document ``i``."""
    from kfeed import text

    if chunk.texts is not None:
        return text.as_token_arrays(tokenizer.encode_batch(chunk.texts), token_dtype,
                                    place=place)
    return text.as_token_arrays(chunk.ids or [], token_dtype, vocab=tokenizer, place=place)


def _corpus_file(source: str) -> None:
    """A corpus is one file: refuse a glob, a folder, or a path with nothing there."""
    path = Path(source)
    if path.is_file():
        return
    if any(c in source for c in "*?["):
        raise ConfigError(f"--from {source}: a corpus is one file, and its name is not "
                          f"expanded as a glob: give one file (join the files into one first)")
    if path.is_dir():
        raise ConfigError(f"--from {source}: a folder, and a corpus is one file: give the "
                          f"file (join the files into one first)")
    raise ConfigError(f"--from {source}: no such file: check the path")


def _no_documents(source: str) -> ConfigError:
    holds = {".txt": "paragraphs of text separated by blank lines",
             ".jsonl": "one JSON object a line"}.get(Path(source).suffix.lower(), "documents")
    return ConfigError(f"no documents in {source}: a corpus holds {holds}; check the file")


def _produce_text(args: argparse.Namespace, config: dict[str, Any]) -> int:
    """Token documents: read, tokenized and checked a chunk at a time, each chunk checked
    whole before any of it is sent. The first documents to send are read before the topic
    is made, so that a mistake in the command or at the corpus's start leaves nothing
    behind; a mistake further on, or a signal, says the --skip-docs N that goes on."""
    from kfeed import text
    from kfeed.producer import PRODUCER_DEFAULTS, message_max_bytes, too_large, value_max_bytes

    token_dtype = args.token_dtype or "uint16"
    skip = args.skip_docs or 0
    schema = text.token_schema(token_dtype)
    tokenizer = text.load_tokenizer(args.tokenizer or "bytes")
    text.check_vocab_fits(tokenizer, token_dtype)
    source = args.source or "synthetic text"
    where = f"{source}: "
    chunks: Iterator[text.Chunk]
    if args.synthetic_text is not None:
        total, first, step, seed = args.synthetic_text, args.first_id or 0, 1024, args.seed or 0

        def synthetic() -> Iterator[text.Chunk]:
            for i in range(0, total, step):
                n = min(step, total - i)
                ids = list(range(first + i, first + i + n))
                yield text.Chunk(text.synthetic_documents(first + i, n, seed=seed), None,
                                 ids if args.keyed else None, i + n, total)

        def place(i: int) -> str:
            return f"synthetic text: document {first + i}"

        chunks = synthetic()
    else:
        _corpus_file(args.source)

        def place(i: int) -> str:
            return text.locate_document(args.source, i)

    # A document gets a block of its own when it is larger than the producer's
    # blocks (message.max.bytes less 1024): one larger than that fits no message.
    message_max = message_max_bytes({**PRODUCER_DEFAULTS, **config})
    block_max = value_max_bytes(message_max)

    def prepare(chunk: text.Chunk, at: int) -> tuple[list[Any], list[Any] | None]:
        """The documents of ``chunk`` (the first is document ``at`` of the corpus) to send,
        and their keys: tokenized, checked, the empty ones left out."""
        arrays = _token_arrays(chunk, tokenizer, token_dtype, lambda i: place(at + i))
        i = too_large([len(a) for a in arrays], block_max, lambda n: schema.block_nbytes(1, n))
        if i is not None:
            big = arrays[i]
            raise KfeedError(
                f"{place(at + i)}: document of {len(big):,} tokens ({big.nbytes:,} bytes) is "
                f"larger than a message (message.max.bytes {message_max:,} less 1024 for the "
                f"headers): split it, or raise -X message.max.bytes (and the topic's "
                f"max.message.bytes)")
        # An empty document has no tokens for the packer to end with an EOS: it
        # would vanish on the way. Left out here, and counted apart.
        keep = [i for i, a in enumerate(arrays) if len(a)]
        if len(keep) == len(arrays):
            return arrays, chunk.keys
        return [arrays[i] for i in keep], None if chunk.keys is None else [chunk.keys[i]
                                                                           for i in keep]

    seen = [0, 0]  # documents read from the corpus; 1 once it ended

    def counted(chunks: Iterator[text.Chunk]) -> Iterator[text.Chunk]:
        for c in chunks:
            seen[0] += len(c)
            yield c
        seen[1] = 1

    docs = sent = empty = tokens = 0  # docs: past --skip-docs, sent or empty
    pending: tuple[list[Any], list[Any] | None, text.Chunk] | None = None
    try:
        if args.synthetic_text is None:
            chunks = text.read_corpus(args.source, text_field=args.text_field or "text",
                                      key_field=args.key_field, lengths=args.lengths)
        todo = _skip_documents(counted(chunks), skip, where)
        while pending is None:
            chunk = next(todo, None)
            if chunk is None:
                break
            arrays, keys = prepare(chunk, skip + docs)
            if arrays:
                pending = (arrays, keys, chunk)
            else:
                docs += len(chunk)
                empty += len(chunk)
    except ConfigError:
        raise
    except KfeedError as e:
        if seen[1] and seen[0] < skip:
            raise ConfigError(f"--skip-docs {skip} is more than the {seen[0]:,} documents of "
                              f"{source}: give a smaller --skip-docs") from None
        raise ConfigError(_one_line(str(e))) from None  # nothing sent: the topic not made
    if pending is None:
        if not seen[0]:
            raise _no_documents(source)
        if seen[0] <= skip:
            raise ConfigError(f"--skip-docs {skip} leaves out all {seen[0]:,} documents of "
                              f"{source}: nothing is left to send")
        raise ConfigError(f"the {docs:,} documents of {source}"
                          f"{f' after --skip-docs {skip}' if skip else ''} are all empty: "
                          f"nothing to send")
    _ensure_topic(args, config, schema)
    done = [0, 1]  # how far the corpus is read: done, total
    # The first SIGINT or SIGTERM while sending stops between chunks (a chunk is
    # never half sent), so that the run can say the --skip-docs N that goes on;
    # a second one, or one outside the sending, stops at once.
    stopped: list[int] = []
    sending = [False]
    ended = [False]  # the corpus is read to its end, every document handed over

    def on_signal(signum: int, frame: Any) -> None:
        if stopped or not sending[0]:
            Interrupted.raise_for(signum)
        stopped.append(signum)
        if ended[0]:  # every document is handed over: the wait for the brokers goes on
            print("kfeed produce: every document is sent; stopping once the brokers "
                  "acknowledge the last ones (a second signal stops at once)",
                  file=sys.stderr, flush=True)

    previous = ({sig: signal.signal(sig, Interrupted.handles(on_signal))
                 for sig in (signal.SIGINT, signal.SIGTERM)}
                if threading.current_thread() is threading.main_thread() else {})
    try:
        with _producer(args, config, schema) as producer:
            _check_partitions(args, producer)
            t0 = time.monotonic()

            def status() -> tuple[float, float, str]:
                share = _acknowledged(producer)
                dt = max(time.monotonic() - t0, 1e-9)
                # The corpus read, in percent (of its bytes or rows).
                return 100 * done[0] / max(done[1], 1), 100.0, (
                    f"{sent * share:,.0f} docs, {tokens * share / dt:,.0f} tokens/s")

            progress = _Progress("kfeed produce", "%", status, t0, args.progress_every,
                                 producer=producer)
            try:
                sending[0] = True
                while pending is not None and not stopped:
                    arrays, keys, chunk = pending
                    producer.send({"tokens": arrays}, keys=keys)
                    docs += len(chunk)
                    sent += len(arrays)
                    empty += len(chunk) - len(arrays)
                    tokens += int(sum(len(a) for a in arrays))
                    done[:] = [chunk.done, chunk.total]
                    pending = None
                    while pending is None and not stopped:
                        try:  # reading the corpus, tokenizing, checking
                            chunk = next(todo, None)
                            if chunk is None:
                                ended[0] = True
                                break
                            arrays, keys = prepare(chunk, skip + docs)
                        except KfeedError as e:
                            # A bad chunk: the ones before it are in Kafka. Say how
                            # to go on without sending them twice. (An error from
                            # send() itself may come after part of its chunk went
                            # out: no such advice.)
                            sending[0] = False
                            producer.flush()
                            # (Exit 1, as any failure once something was sent.)
                            cls = KfeedError if isinstance(e, ConfigError) else type(e)
                            before = _sent_before(skip, docs, empty, "this chunk")
                            raise cls(f"{_one_line(str(e))}. {before[0].upper()}{before[1:]}: "
                                      f"fix it and run again with --skip-docs {skip + docs} to "
                                      f"go on without sending them twice") from None
                        if arrays:
                            pending = (arrays, keys, chunk)
                        else:
                            docs += len(chunk)
                            empty += len(chunk)
                # A signal while the last documents are acknowledged waits for
                # them: then nothing is left to send, and no --skip-docs to give.
                producer.flush()
                sending[0] = False
            except BaseException:
                progress.close()
                raise
            elapsed = max(time.monotonic() - t0, 1e-9)
            progress.close(final=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopped and not ended[0]:
        raise _StoppedAt(stopped[0], f": {_sent_before(skip, docs, empty, 'the stop')}: run "
                                     f"again with --skip-docs {skip + docs} to go on without "
                                     f"sending them twice")
    eos = "none" if tokenizer.eos_id is None else tokenizer.eos_id
    left_out = f", {empty:,} empty left out" if empty else ""
    print(f"produced {sent:,} documents{left_out} ({tokens:,} tokens, {token_dtype}, tokenizer "
          f"{tokenizer.name}: vocab {tokenizer.vocab_size:,}, eos {eos}) in {producer.messages:,} "
          f"messages to {args.topic}: {sent / elapsed:,.0f} documents/s, "
          f"{tokens / elapsed:,.0f} tokens/s, {producer.bytes / elapsed / 1e6:,.1f} MB/s")
    return 0


class _StoppedAt(Interrupted):
    """A signal that stopped a command where it can say how to go on (``after``)."""

    def __init__(self, signum: int, after: str) -> None:
        super().__init__(signum)
        self.after = after


def _sent_before(skip: int, docs: int, empty: int, what: str) -> str:
    empties = f", {empty} of them empty and left out" if empty else ""
    return (f"the {docs} documents before {what} were sent (documents {skip} to "
            f"{skip + docs - 1} of the corpus{empties})")


# -- train -------------------------------------------------------------------------


def _check_train(args: argparse.Namespace) -> None:
    """The checks that need no torch and no broker."""
    if args.resume and not args.checkpoint:
        raise ConfigError("--resume needs --checkpoint PATH: name the checkpoint to go on from")
    if args.checkpoint_every is not None and not args.checkpoint:
        raise ConfigError("--checkpoint-every needs --checkpoint PATH: name where to save, or "
                          "leave it out")
    for flag, path in (("--checkpoint", args.checkpoint), ("--log-ids", args.log_ids)):
        if not path:
            continue
        folder = Path(path).parent
        if not folder.is_dir():
            raise ConfigError(f"{flag} {path}: folder {folder} does not exist: create it first")
        if Path(path).is_dir():
            raise ConfigError(f"{flag} {path} is a folder: name a file in it, such as "
                              f"{Path(path) / ('ck.pt' if flag == '--checkpoint' else 'ids.txt')}")
        probe = Path(f"{path}.kfeed-probe")  # (found at the first save, after the steps)
        try:
            probe.touch()
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"{flag} {path}: cannot write in {folder} ({e.strerror}): name "
                              f"a file in a folder this user may write to") from None
    if args.checkpoint and not args.resume and Path(args.checkpoint).exists():
        # It was overwritten in silence at the first save: a run's training gone.
        raise ConfigError(f"--checkpoint {args.checkpoint} exists: pass --resume to go on from "
                          f"it, or name another file (delete it to start over)")


def _check_task_flags(args: argparse.Namespace) -> None:
    if args.task == "mlp":
        for flag, value in (("--seq-len", args.seq_len), ("--tokenizer", args.tokenizer),
                            ("--eos-id", args.eos_id), ("--token-dtype", args.token_dtype),
                            ("--shuffle", args.shuffle), ("--seed", args.seed)):
            if value is not None:
                raise _refuse(flag, "--task lm", "--task mlp")
    elif args.log_ids:
        raise _refuse("--log-ids", "--task mlp (samples with ids)", "--task lm")


def _lm_defaults(args: argparse.Namespace) -> None:
    defaults = {"seq_len": 256, "tokenizer": "bytes", "token_dtype": "uint16", "shuffle": 0,
                "seed": 0}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def cmd_train(args: argparse.Namespace) -> int:
    from kfeed import _train

    from kfeed._kafka import check_settings

    _check_train(args)
    config = _kafka_config(args, **{"group.id": args.group_id})
    check_settings(config)  # a misspelt -X said before torch is loaded (seconds)
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    state = None
    if args.resume and ckpt is not None and ckpt.exists():
        # Before the task's own flags: with a checkpoint of the other task,
        # --task is the mistake, not the flags that go with it.
        state = _train.load_checkpoint(ckpt)
        if state.get("task", "mlp") != args.task:
            raise ConfigError(f"{ckpt} is a checkpoint of --task {state.get('task', 'mlp')}, "
                              f"not {args.task}: pass --task {state.get('task', 'mlp')}, or "
                              f"another --checkpoint")
    _check_task_flags(args)
    _lm_defaults(args)
    args.format = _wire_format(args)
    _serve_metrics(args)
    args.checkpoint_every = args.checkpoint_every or 50
    # --resume ties the stream to the checkpoint: with none yet the model is
    # new, so it reads from the start, whatever a killed run committed.
    start = args.start or ("earliest" if args.resume and state is None else "committed")
    guard = _train.StopGuard()
    guard.install()
    bar = _step_bar(args.steps)
    try:
        if bar is None:  # plain lines, every --log-every steps
            out = _train.run(args, config, start=start, state=state, guard=guard,
                             say=lambda line: print(line, flush=True), t0=args.t0)
        else:
            out = _train.run(args, config, start=start, state=state, guard=guard,
                             say=bar.say, tick=bar.tick, t0=args.t0)
    finally:
        guard.restore()
        if bar is not None:
            bar.close()
    st = out.stats
    log.info("first step %.2fs after the command started", out.start_to_first_step_s)
    # This run's steps, as the samples and rates are this run's; a resumed
    # run says where the checkpoint's count stands now. MB/s is what the
    # loader read, its prefetch included (on a run of a few steps, more than
    # the samples trained on).
    at = f", now at step {out.step:,}" if out.first_step else ""
    print(f"{out.task.summary(out.step - out.first_step, st)}{at}, startup {st['startup_s']:.1f}s, "
          f"read {st['mb_per_s']:,.1f} MB/s, data stall {100 * st['stall_fraction']:.1f}%, "
          f"{_train.lag_text(st['lag'], st['lag_unknown'])}, bad records {st['bad_records']:,}, "
          f"final loss {out.loss:.4f}", flush=True)
    if out.signum is not None:
        name = signal.Signals(out.signum).name
        if out.step == out.first_step:
            saved = "nothing was trained in this run, and nothing committed"
        elif ckpt is not None:
            saved = f"checkpoint saved to {ckpt} at step {out.step}: --resume goes on from there"
        else:
            saved = "offsets committed; no --checkpoint, so the model is not saved"
        if out.unclosed is not None:  # (the brokers went away: the stop did not wait)
            saved = saved.replace("offsets committed; ", "") + f"; but {out.unclosed}"
        print(f"kfeed: stopped by {name} at step {out.step}: {saved}", file=sys.stderr)
        return 128 + out.signum
    if st["bad_records"] and not st["samples"]:
        raise KfeedError(
            f"all {st['bad_records']} records read from {args.topic} were bad and went to the "
            f"dead-letter topic {args.topic}.dlq: they do not match what --task {args.task} "
            f"reads ({out.task.expects()}); produce the topic for it, or check its dtype "
            f"(e.g. --token-dtype)")
    if out.step == out.first_step and args.until_end:
        print(f"kfeed: {_nothing_read(args, out, start)}", file=sys.stderr)
    return 0


def _nothing_read(args: argparse.Namespace, out: Any, start: Any) -> str:
    """Why a bounded run trained nothing, and what to do."""
    offsets = [pos[0] for parts in out.positions.values() for pos in parts.values()]
    if out.resumed_from is not None:
        return (f"{out.resumed_from} is already at the end of {args.topic}: nothing new to "
                f"train; produce more, or start over with another --checkpoint")
    if start == "committed" and any(offsets):
        return (f"group {args.group_id} has already read {args.topic} to its end (committed "
                f"offsets at the end): use --start earliest to read it again, or a new "
                f"--group-id")
    if not any(offsets):
        return f"topic {args.topic} is empty: produce to it first (kfeed produce --topic {args.topic})"
    where = start.isoformat() if isinstance(start, datetime) else start
    return f"{args.topic} has no records after --start {where}: give an earlier --start"


# -- parser --------------------------------------------------------------------------

PRODUCE_HELP = f"""\
Send samples, or token documents, to a topic. A missing topic is created with
{DEFAULT_PARTITIONS} partitions (--partitions N for another count) and the brokers' default
replication; the run says so in one line.

Samples: --synthetic N (what kfeed train reads), or --from SOURCE:
  FILE.npz|.npy (one file), or FILE.parquet|.arrow|.feather|.csv, or
  .jsonl|.ndjson with --field, a folder of such files or a glob of them
  (data/*.parquet), locally or at s3://bucket/path
  (gs://, hdfs:// where pyarrow has them; endpoint, region and credentials as
  pyarrow takes them: s3://b/p?endpoint_override=host:port&scheme=http, and the
  AWS_* environment)             streamed a batch at a time (through pyarrow;
                                an .npy memory-mapped, an .npz array read whole)
  postgresql://user@host/db --query "SELECT ..."   streamed through ADBC
  Streamed sources are sent in transactions that also record, in Kafka, how many
  rows are sent: after a crash, the same command with --resume goes on after
  them, sending nothing twice and skipping nothing (a query needs an ORDER BY on
  a unique key for that); without --resume it is refused, and --resend sends
  every row again.
  Without --field, the columns/arrays named features, label and id are read.
  With --field FIELD=COLUMN (repeatable), the fields named are read, each from
  its column (a .npy holds one array, named after the file: --field
  features=STEM), and only those; features, label and id come first in each
  record, in that order (as kfeed train reads them), the others in the order
  given. Columns become fields by these rules:
    int8..int64, uint8..uint64, float16/32/64, bool  -> the same dtype, one a sample
    fixed-length list<T> (every row W long)          -> T[W] (list<float> -> float32[W])
    strings, timestamps, decimals, structs, nested or ragged lists: refused, naming
    the column and its type
    nulls: refused, naming the column and their count, unless --fill FIELD=VALUE
    --dtype FIELD=DTYPE casts a field, refusing any cast that would change a value
      (a fraction or an int out of range into an int, past 0/1 into bool, past a
      narrower float's range, an int a float cannot hold exactly; CSV and JSON
      numbers given a float dtype are read as float64, and rounded as floats are)
  kfeed train reads features float32[W], label int64, id int64. A column of
  another dtype under one of those names (say list<double> features, or a float64
  label) is refused unless --dtype says what to do: --dtype features=float32 casts
  it, --dtype features=float64 keeps float64 on purpose (kfeed train would then
  reject every record).

Token documents (a topic with one variable-length field, "tokens"):
  --synthetic-text N            seeded synthetic text, tokenized
  --from corpus.txt             UTF-8 text; documents are separated by blank lines
                                (each paragraph is one document, its line breaks kept;
                                a line of only spaces is blank too: documents that hold
                                blank lines, as code does, go in .jsonl)
  --from corpus.jsonl           one JSON object per line, the text in --text-field
  --from corpus.parquet         with --tokenizer or --text-field: a string column
                                (text) or a list<int> column (token ids already)
  --from ids.npy --tokenizer T  token ids already: an object array of 1-D int arrays,
                                or a flat 1-D int array with --lengths FILE.npy
A corpus is one file (no globs or folders). The tokenizer adds no EOS: the
loader's packer appends one after each document (256 for --tokenizer bytes), and
a special token's text in a document (say "</s>") is encoded as plain text, never
as its id. An empty document (no tokens) is left out, and counted apart in the
last line. The corpus is read in chunks of 1024 documents, each checked whole
before any of it is sent; a document larger than a message (message.max.bytes)
is refused. A bad line among the first documents stops the run before the topic
is made; once earlier chunks were sent, the error names the --skip-docs N that
goes on after them without sending them twice, and so does Ctrl-C (or SIGTERM),
which stops after the chunk being sent.

A flag that does not apply to the run (--field with --synthetic, --seed without
--synthetic-text, ...) is an error rather than ignored.
"""

TRAIN_HELP = """\
Train from a topic with the Loader. --task mlp (default): an MLP on the seeds'
synthetic samples (features float32[768], label int64, id int64). --task lm: a
tiny causal transformer (2 layers, d_model 128, 4 heads) on a token topic, its
documents packed into [batch, seq_len] rows with an EOS after each; attention is
block-diagonal causal (no token sees another document) and the loss skips padding
and the position after each EOS. tokens/s counts real tokens (EOS included,
padding not); packing efficiency is real tokens over all row positions.

Where reading starts: --start committed (default: the group's committed offsets,
the earliest where it has none), earliest, latest, or an ISO time (the first
record at or after it; local time unless it names an offset). With --resume and
an existing checkpoint, the checkpoint's positions win over --start; with
--resume and no checkpoint yet, reading starts at the earliest offsets (or at
--start when given).

Checkpoints (with --checkpoint): every --checkpoint-every steps, at the end of a
clean run, and on SIGINT/SIGTERM, which stop the run at the next step boundary,
save, commit the offsets and exit 130/143. A resume repeats no sample and skips
none. Records that do not match the task's schema go to the dead-letter topic
TOPIC.dlq. A run whose first 32 records are all bad (with --until-end: every
record) exits 1; fewer bad records and then nothing are held back while it waits
for a good one, with a warning every 5 s.
"""


# -- convert -----------------------------------------------------------------------

CONVERT_HELP = """\
Re-encode a topic of one record per message (Avro, Protobuf, JSON, or kfeed raw)
into kfeed's block format in another topic, once, so that every later epoch
reads it at block speed. Exactly once: each round of records, its dead-letter
copies and the source offsets are one Kafka transaction, so a convert that is
killed and started again writes every record once. Progress goes to stderr
every few seconds (once a minute while a --follow has nothing new); --follow
keeps converting new records until SIGINT/SIGTERM, which stop it after the
round in hand.

  --field NAME=DTYPE[SHAPE][@SOURCE][=DEFAULT] names a field of the blocks, e.g.
  --field features=float32[768] --field label=int64 --field age=float32@user.age
  (SOURCE: the record's field, dotted for nested ones; default NAME); =DEFAULT is
  what a record without it (null, missing, or written before a schema added it)
  reads, where without one such a record is bad: --field score=float32=0. One field
  may be variable-length, an array of any length: --field tokens=int32[None]. Without
  --field: features=float32[768], label=int64, id=int64, what kfeed train reads.
  Avro: --registry URL (Confluent framing) or --avro-schema FILE.avsc (none);
  --timestamps us reads every timestamp in one unit (ms, us or ns).
  Protobuf: --proto MODULE:MESSAGE, a generated class on the Python path
  (--registry URL says the values carry the Confluent framing), or
  --registry URL alone: each writer schema read from the registry.
"""

_FIELD = re.compile(r"([A-Za-z_]\w*)=(\w+)(?:\[((?:\d+|None)(?:,\d+)*)\])?(?:@([\w.\\]+))?"
                    r"(?:=(.+))?")


def _convert_schema(specs: list[str]) -> Any:
    from kfeed.schema import Schema

    if not specs:
        return synthetic_schema()
    fields: dict[str, Any] = {}
    for spec in specs:
        m = _FIELD.fullmatch(spec)
        if m is None:
            raise ConfigError(f"--field {spec!r} is not NAME=DTYPE[SHAPE][@SOURCE][=DEFAULT]: "
                              f"write it as e.g. --field features=float32[768] or "
                              f"--field age=float32@user.age=0")
        name, dtype, dims, source, default = m.groups()
        if name in fields:
            raise ConfigError(f"--field {name} is given twice")
        shape = tuple(None if d == "None" else int(d) for d in dims.split(",")) if dims else ()
        options: dict[str, Any] = {"source": source} if source else {}
        if default is not None:
            try:
                options["default"] = json.loads(default)
            except ValueError:
                raise ConfigError(f"--field {spec!r}: its default {default!r} is not a "
                                  f"number, true, false or a JSON list such as []") from None
        fields[name] = (dtype, shape, options) if options else (dtype, shape)
    return Schema(fields)


def _wire_format(args: argparse.Namespace) -> Any:
    """``--format`` with ``--registry``, ``--avro-schema``, ``--timestamps`` and ``--proto``,
    as kfeed takes it."""
    import importlib

    import kfeed
    from kfeed import ingest
    from kfeed.formats import registry_url_ok

    registry = {"url": args.registry} if args.registry else None
    if args.registry and not registry_url_ok(args.registry):
        raise ConfigError(f"--registry {ingest.no_password(args.registry)} is not an http:// "
                          f"or https:// address: "
                          f"give e.g. --registry http://registry:8081")
    avro_schema = getattr(args, "avro_schema", None)
    timestamps = getattr(args, "timestamps", None)
    proto = getattr(args, "proto", None)
    if timestamps and args.format != "avro":
        raise ConfigError(f"--timestamps applies to --format avro, not {args.format}")
    if args.format == "avro":
        if proto:
            raise ConfigError("--proto applies to --format protobuf, not avro")
        if registry is None and avro_schema is None:
            how = " (Confluent framing) or --avro-schema FILE.avsc (no framing)" \
                if hasattr(args, "avro_schema") else ", the Schema Registry of its schema"
            raise ConfigError(f"--format avro needs --registry URL{how}")
        if registry is not None and avro_schema is not None:
            raise ConfigError("--registry and --avro-schema: give one of them")
        return kfeed.Avro(schema=avro_schema, registry=registry, timestamps=timestamps)
    if avro_schema:
        raise ConfigError(f"--avro-schema applies to --format avro, not {args.format}")
    if args.format == "protobuf":
        if not proto and getattr(args, "command", None) == "produce":
            # (Checked before the topic is made: the producer would refuse it after.)
            raise ConfigError("--format protobuf writes messages of a generated class: give "
                              "--proto MODULE:MESSAGE (e.g. --proto clicks_pb2:Click), with "
                              "--registry URL to register its schema")
        if not proto and registry is not None:
            return kfeed.Protobuf(registry=registry)  # the writer schemas read from it
        if not proto:
            raise ConfigError("--format protobuf needs --proto MODULE:MESSAGE, the generated "
                              "message class (e.g. --proto clicks_pb2:Click), or --registry "
                              "URL to read the schemas from")
        module, sep, name = proto.partition(":")
        if not sep or not module or not name:
            raise ConfigError(f"--proto {proto!r} is not MODULE:MESSAGE: name the generated "
                              f"module and its message class (e.g. --proto clicks_pb2:Click)")
        try:
            found = importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"--proto {proto}: {e}: put the generated module on "
                              f"PYTHONPATH") from None
        cls = getattr(found, name, None)
        if cls is None:
            messages = sorted(k for k, v in vars(found).items()
                              if isinstance(v, type) and hasattr(v, "DESCRIPTOR"))
            raise ConfigError(f"--proto {proto}: module {module} has no {name!r} (its message "
                              f"classes: {', '.join(messages) or 'none'}): name one of them")
        return kfeed.Protobuf(message=cls, registry=registry)
    if proto:
        raise ConfigError(f"--proto applies to --format protobuf, not {args.format}")
    if registry is not None:
        why = " (kfeed skips a JSON value's Confluent frame without it)" \
            if args.format == "json" else ""
        raise ConfigError(f"--registry applies to avro and protobuf, not {args.format}{why}")
    return args.format  # block, raw, or json


def cmd_convert(args: argparse.Namespace) -> int:
    import kfeed

    schema = _convert_schema(args.field)
    fmt = _wire_format(args)
    config = _kafka_config(args)
    stop = threading.Event()
    stopped: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        # A second signal, or one before the rounds began (still waiting for the
        # brokers: no transaction open), does not wait for the round to end.
        if stopped or not _inside(frame, "kfeed.converter", "run"):
            Interrupted.raise_for(signum)
        stopped.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, Interrupted.handles(on_signal))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    last = [0.0]
    shown = [(0.0, 0, 0)]  # elapsed_s, records and bytes in at the last progress line
    idle_said = [False]  # the last line was of a --follow with nothing new
    group = args.group_id or f"kfeed-convert.{args.to_topic}"
    session_ms = float(config.get("session.timeout.ms", 45000))  # librdkafka's default

    def progress(st: Any) -> None:
        now = time.monotonic()
        if now - last[0] >= args.progress_every and (not st.partitions or (
                st.partitions < st.source_partitions and st.lag == 0)):
            last[0] = now
            # No lag to show: it counts the partitions assigned. A stopped
            # convert of the same group holds them (or some) until its
            # session ends; a read to the end waits for them.
            print(f"kfeed convert: waiting for group {group} to assign it partitions of "
                  f"{args.topic} (those a stopped convert held come free when its session "
                  f"ends, within session.timeout.ms: {session_ms / 1000:g} s)",
                  file=sys.stderr, flush=True)
        elif now - last[0] >= args.progress_every:
            t, records, nbytes = shown[0]
            # A --follow with nothing new: one line says its rate fell to 0,
            # then one every _IDLE_EVERY_S (not 17,000 a day at 5 s).
            idle = st.bytes_in == nbytes and st.lag == 0
            if idle and idle_said[0] and now - last[0] < max(args.progress_every, _IDLE_EVERY_S):
                return
            idle_said[0] = idle
            last[0] = now
            # The rate since the line before: an average from the start sinks
            # for ever while a --follow idles, and hides a slowdown.
            shown[0] = (st.elapsed_s, st.records, st.bytes_in)
            dt = st.elapsed_s - t
            print(f"kfeed convert: {st.records:,} records, {st.bad:,} bad, "
                  f"{_rates(st.records - records, st.bytes_in - nbytes, dt, 'records')} in "
                  f"over the last {dt:.1f}s, lag {st.lag:,} messages", file=sys.stderr,
                  flush=True)

    try:
        st = kfeed.convert(config, args.topic, args.to_topic, schema, format=fmt,
                           group_id=args.group_id, block_records=args.block_records,
                           round_messages=args.round_messages,
                           follow=args.follow, on_bad_record=args.on_bad_record,
                           progress=progress, stop=stop, connect_timeout_s=args.connect_timeout)
    except DecodeError as e:
        if args.on_bad_record == "raise" and e.args[0].startswith("bad record: "):
            # It said only the record: the rounds before it stand, and the
            # same command stops at it again.
            raise DecodeError(f"{e.args[0]}: the rounds before it are committed, and the "
                              f"same command stops at it again; --on-bad-record dead_letter "
                              f"(or skip) goes past it", topic=e.topic, partition=e.partition,
                              offset=e.offset, code=e.code) from None
        if args.field:
            raise
        from kfeed.badrecords import describe_schema

        raise DecodeError(f"{e.args[0]} (no --field was given, so the fields are those kfeed "
                          f"train reads, {describe_schema(schema)}: name the topic's with "
                          f"--field NAME=DTYPE[SHAPE][@SOURCE])", topic=e.topic,
                          partition=e.partition, offset=e.offset, code=e.code) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"converted {st.records:,} records ({st.bad:,} bad) from {args.topic} to "
          f"{args.to_topic} in {st.elapsed_s:.1f}s: "
          f"{_rates(st.records, st.bytes_in, st.elapsed_s, 'records')} in, "
          f"{st.bytes_out / max(st.bytes_in, 1):.2f}x the bytes out; {st.blocks:,} blocks "
          f"in {st.transactions:,} transaction{'' if st.transactions == 1 else 's'}")
    if stopped:
        # As kfeed train says where it stopped: the round under way was
        # finished and committed, and the same command goes on after it.
        print(f"kfeed: stopped by {signal.Signals(stopped[0]).name}: the rounds committed "
              f"stand; the same command goes on after them (group {group})", file=sys.stderr)
        return 128 + stopped[0]
    return 0


# An idle convert --follow's progress line, once it said so: this often.
_IDLE_EVERY_S = 60.0


def _inside(frame: Any, module: str, function: str) -> bool:
    """Whether ``frame`` (a signal handler's) is inside ``function`` of ``module``."""
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False


# -- lag ---------------------------------------------------------------------------


def cmd_lag(args: argparse.Namespace) -> int:
    from kfeed.lag import group_exists, group_lag

    from kfeed._kafka import client_config

    config = _kafka_config(args)
    unused = sorted(set(config) - set(client_config(config)))
    if unused:
        raise ConfigError(f"kfeed lag uses only the brokers' address and login settings "
                          f"(bootstrap., security., sasl., ssl., client., socket. ...): -X "
                          f"{', '.join(unused)} would have no effect")
    rows = group_lag(config, args.group_id, args.topic or None, args.connect_timeout)
    if all(r.committed is None and r.member is None for r in rows) and \
            not group_exists(config, args.group_id, args.connect_timeout):
        raise KfeedError(f"no group {args.group_id} on these brokers (no members, no committed "
                         f"offsets): check the name")
    if not rows:
        raise KfeedError(f"group {args.group_id} committed no offsets: name its topics with "
                         f"--topic T")
    past = [r for r in rows if r.committed is not None and r.committed > r.end]
    table = [("TOPIC", "PARTITION", "COMMITTED", "END", "LAG", "LAG_S", "MEMBER")]
    for r in rows:
        committed = "-" if r.committed is None else f"{r.committed}{'*' if r in past else ''}"
        table.append((r.topic, str(r.partition), committed,
                      str(r.end), str(r.lag), "?" if r.lag_s is None else f"{r.lag_s:.1f}",
                      r.member or "-"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False))
              + "  " + row[-1])
    for r in past:
        print(f"* {r.topic}[{r.partition}]: committed {r.committed} is past the end ({r.end}): "
              f"the group resets by auto.offset.reset on its next start, so its lag is 0 only "
              f"with 'latest'")
    total = sum(r.lag for r in rows)
    oldest = max((r.lag_s for r in rows if r.lag_s is not None), default=0.0)
    print(f"group {args.group_id}: lag {total:,} messages over {len(rows)} partitions, "
          f"oldest unread record {oldest:.1f}s old")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kfeed", description="Feed GPU training from Apache Kafka.",
                     epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at DEBUG level and show tracebacks")
    parser.add_argument("--version", action="version", version=f"kfeed {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    cluster.register(sub)

    p = sub.add_parser(
        "produce", help="send samples or token documents to a topic",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=PRODUCE_HELP, epilog=EXIT_CODES)
    _kafka_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", type=_count(1), metavar="N",
                     help="N samples of the seeds' workload (768 float32, label, id)")
    src.add_argument("--synthetic-text", type=_count(1), metavar="N",
                     help="N seeded synthetic text documents (log-normal lengths, median "
                          "~500 bytes), tokenized into a token topic")
    src.add_argument("--from", dest="source", metavar="SOURCE",
                     help="samples: .npz, .npy, .parquet, .arrow, .feather, .csv, .jsonl "
                          "with --field, a folder or glob of them, s3:// or another URI, or "
                          "postgresql://... with --query; a corpus: .txt, .jsonl, or "
                          ".parquet/.npy with --tokenizer (see above)")
    p.add_argument("--query", metavar="SQL",
                   help="with --from postgresql://...: the rows to send (ORDER BY a unique "
                        "key, for --resume)")
    p.add_argument("--resume", action="store_true",
                   help="streamed --from: go on after the rows an earlier run of the same "
                        "source into the same topic recorded as sent")
    p.add_argument("--resend", action="store_true",
                   help="streamed --from: send every row again, from the first, although an "
                        "earlier run of the same source into the same topic recorded rows as "
                        "sent (without --resume or --resend such a run is refused)")
    p.add_argument("--transaction-mb", type=_positive_float, metavar="MB",
                   help="streamed --from: the bytes a transaction holds before it commits at "
                        "a batch's end (default 64): a crash sends at most this much again")
    p.add_argument("--field", action="append", default=[], metavar="FIELD=COLUMN",
                   help="map a field to a column/array of --from samples (repeatable)")
    p.add_argument("--dtype", action="append", default=[], metavar="FIELD=DTYPE",
                   help=f"cast a field of --from samples ({', '.join(DTYPES)}; repeatable)")
    p.add_argument("--fill", action="append", default=[], metavar="FIELD=VALUE",
                   help="replace the nulls of a Parquet column with VALUE (repeatable)")
    p.add_argument("--first-id", type=_count(0), metavar="N",
                   help="first synthetic id or document index (default 0)")
    p.add_argument("--tokenizer", metavar="bytes|PATH",
                   help="'bytes' (UTF-8 bytes 0..255, eos 256, vocab 257; the default for a "
                        "corpus) or a tokenizer.json (needs the tokenizers package)")
    p.add_argument("--text-field", metavar="FIELD",
                   help="the .jsonl field or .parquet column of each document (default: text); "
                        "a .parquet list<int> column holds token ids already")
    p.add_argument("--key-field", metavar="FIELD",
                   help="key each document by this .jsonl field or .parquet column, so "
                        "documents with one key share a partition")
    p.add_argument("--lengths", metavar="FILE.npy",
                   help="document lengths for a flat 1-D .npy of token ids")
    p.add_argument("--token-dtype", choices=["uint16", "int32", "uint32"],
                   help="the token field's dtype on the wire (default uint16; train with the "
                        "same)")
    p.add_argument("--seed", type=_count(0, 2**64 - 1),
                   help="seed of --synthetic-text (default 0)")
    p.add_argument("--skip-docs", type=_count(0), metavar="N",
                   help="token documents: leave out the first N documents (to go on after "
                        "an error that names N)")
    p.add_argument("--format", choices=["block", "raw", "json", "arrow", "avro", "protobuf"],
                   default="block",
                   help="block (default), raw (one record a message), or for other "
                        "consumers arrow (Arrow IPC streams, --block-records rows a message) "
                        "or one record a message in json, avro (with --registry) or "
                        "protobuf (with --proto); kfeed reads them all")
    p.add_argument("--registry", metavar="URL",
                   help="avro, protobuf: the Schema Registry to register the schema with "
                        "(values in the Confluent framing)")
    p.add_argument("--proto", metavar="MODULE:MESSAGE",
                   help="protobuf: the generated message class (on PYTHONPATH)")
    p.add_argument("--block-records", type=_count(1), metavar="N",
                   help="records per block message (default 64)")
    p.add_argument("--compression", choices=["none", "gzip", "snappy", "lz4", "zstd"])
    p.add_argument("--partitions", type=_count(1), metavar="N",
                   help=f"partitions of the topic if it is created (default "
                        f"{DEFAULT_PARTITIONS}); an existing topic must have that many")
    p.add_argument("--keyed", action="store_true",
                   help="key samples by id (murmur2 partitioning, as Java would)")
    _metrics_arg(p)
    p.add_argument("--progress-every", type=_positive_float, metavar="SECONDS",
                   help="how often progress is drawn (default: a bar on a terminal, a plain "
                        "line every 10 s otherwise)")
    p.set_defaults(func=cmd_produce)

    t = sub.add_parser(
        "train", help="train an MLP (or, --task lm, a tiny transformer) with the Loader",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=TRAIN_HELP, epilog=EXIT_CODES)
    _kafka_args(t)
    t.add_argument("--group-id", required=True, type=_name)
    t.add_argument("--task", choices=["mlp", "lm"], default="mlp")
    t.add_argument("--batch-size", type=_count(1), metavar="N",
                   help="samples, or rows of --seq-len tokens (default: 256 mlp, 16 lm)")
    t.add_argument("--lr", type=_positive_float, default=1e-3,
                   help="Adam's learning rate (default 1e-3)")
    t.add_argument("--seq-len", type=_count(2), metavar="N",
                   help="lm: tokens per row (default 256)")
    t.add_argument("--tokenizer", metavar="bytes|PATH",
                   help="lm: the tokenizer the topic was produced with, for its vocabulary "
                        "size and EOS id (default bytes: vocab 257, eos 256)")
    t.add_argument("--eos-id", type=_count(0), metavar="ID",
                   help="lm: the EOS id (default: the tokenizer's)")
    t.add_argument("--token-dtype", choices=["uint16", "int32", "uint32"],
                   help="lm: the token field's dtype, as produced (default uint16)")
    t.add_argument("--shuffle", type=_count(0), metavar="N",
                   help="lm: shuffle documents through a seeded buffer of N (default 0: off)")
    t.add_argument("--seed", type=_count(0, 2**64 - 1),
                   help="lm: the shuffle's seed (default 0)")
    t.add_argument("--format", choices=["block", "raw", "json", "arrow", "avro", "protobuf"],
                   default="block")
    t.add_argument("--registry", metavar="URL", help="avro, protobuf: the Schema Registry")
    t.add_argument("--proto", metavar="MODULE:MESSAGE",
                   help="protobuf: the generated message class (on PYTHONPATH)")
    t.add_argument("--device", help="default: cuda if available, else cpu")
    t.add_argument("--steps", type=_count(0), default=0, metavar="N",
                   help="stop after this many steps of this run (with --resume: N more "
                        "than the checkpoint's; default 0: no limit)")
    t.add_argument("--until-end", action="store_true",
                   help="stop at the end of the topic's current content")
    t.add_argument("--start", type=_start, metavar="earliest|latest|committed|ISO-TIME",
                   help="where to start reading (default committed; see above)")
    t.add_argument("--checkpoint", metavar="PATH", help="checkpoint file")
    t.add_argument("--checkpoint-every", type=_count(1), metavar="K",
                   help="save the checkpoint every K steps (default 50)")
    t.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint (with none yet: a new model, read from "
                        "the earliest offsets)")
    t.add_argument("--log-every", type=_count(1), default=100, metavar="STEPS",
                   help="print a progress line every STEPS steps (default 100)")
    t.add_argument("--log-ids", metavar="PATH", help="append every trained id to this file")
    t.add_argument("--prefetch", type=_prefetch, default=2, metavar="N|auto",
                   help="batches read ahead (default 2); auto deepens the queue while "
                        "training waits in bursts")
    t.add_argument("--max-memory-mb", type=_count(1), metavar="MIB",
                   help="cap on the loader's memory: librdkafka's buffers and the batches "
                        "read ahead")
    _metrics_arg(t)
    t.set_defaults(func=cmd_train)

    c = sub.add_parser(
        "convert", help="re-encode an Avro, Protobuf, JSON or raw topic into blocks, once",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=CONVERT_HELP, epilog=EXIT_CODES)
    _kafka_args(c, "--from-topic")
    c.add_argument("--to-topic", required=True, type=_topic,
                   help="the block topic (made with the source's partitions if missing)")
    c.add_argument("--format", choices=["avro", "protobuf", "json", "raw"], required=True)
    c.add_argument("--field", action="append", default=[], metavar="NAME=DTYPE[SHAPE][@SOURCE][=DEFAULT]",
                   help="a field of the blocks (repeatable; see above)")
    c.add_argument("--registry", metavar="URL", help="the Schema Registry (Confluent framing)")
    c.add_argument("--avro-schema", metavar="FILE.avsc", help="avro: the writer schema")
    c.add_argument("--timestamps", choices=["ms", "us", "ns"],
                   help="avro: read every timestamp in this unit, whatever its writer's "
                        "(default: as written)")
    c.add_argument("--proto", metavar="MODULE:MESSAGE", help="protobuf: the message class")
    c.add_argument("--group-id", type=_name, help="the consumer group (default kfeed-convert.TO_TOPIC)")
    c.add_argument("--block-records", type=_count(1), default=None, metavar="N",
                   help="records per block message (default: 64, fewer for records too "
                        "large for 64 a message)")
    c.add_argument("--round-messages", type=_count(1, 1_000_000), default=10_000, metavar="N",
                   help="source messages per transaction at most (default 10000)")
    c.add_argument("--on-bad-record", choices=["dead_letter", "skip", "raise"],
                   default="dead_letter",
                   help="dead_letter (default: to FROM_TOPIC.dlq, in the transaction), skip, "
                        "or raise")
    c.add_argument("--follow", action="store_true",
                   help="keep converting new records until SIGINT/SIGTERM")
    c.add_argument("--progress-every", type=_positive_float, default=5.0, metavar="SECONDS",
                   help="a progress line on stderr every SECONDS (default 5)")
    c.set_defaults(func=cmd_convert)

    g = sub.add_parser(
        "lag", help="a consumer group's lag per partition, in messages and seconds",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Per partition: the group's committed offset, the end offset, the lag in "
                    "messages and in seconds (the age of the next unread record), and the "
                    "member that owns it; then one summary line.", epilog=EXIT_CODES)
    g.add_argument("--bootstrap-servers", default=os.environ.get("KFEED_BOOTSTRAP"),
                   help="host:port,... (default: $KFEED_BOOTSTRAP)")
    g.add_argument("--group-id", required=True, type=_name)
    g.add_argument("--topic", action="append", default=[], type=_topic,
                   help="a topic to report (repeatable; default: those the group committed on)")
    g.add_argument("-X", dest="kafka", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra librdkafka setting (repeatable)")
    g.add_argument("--connect-timeout", type=_positive_float, default=10.0, metavar="SECONDS",
                   help="how long to wait for the brokers (default 10)")
    g.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log at DEBUG level and show tracebacks")
    g.set_defaults(func=cmd_lag)
    return parser


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    parser = build_parser()
    _Parser.given = list(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            # Named after the subcommand, whose --help lists what it takes.
            prog = " ".join(["kfeed"] + [str(getattr(args, k)) for k in
                                         ("command", "cluster_command") if getattr(args, k, None)])
            sys.stderr.write(f"kfeed: unknown argument {' '.join(extra)}: see '{prog} --help'\n")
            return 2
    except SystemExit as e:  # --help, or a usage error already reported in one line
        return int(e.code or 0)
    args.t0 = t0
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.CRITICAL,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Without -v, kfeed's own warnings still show (bad records, a commit that
    # failed, a registry asked again), one line each; nothing from other
    # libraries, nor librdkafka's and the connection's lines (a failure that
    # matters is an error of its own). Undone on return: a program may call
    # main() more than once.
    kfeed_log = logging.getLogger("kfeed")
    warnings_shown = logging.StreamHandler()
    warnings_shown.setFormatter(logging.Formatter("kfeed: warning: %(message)s"))
    warnings_shown.addFilter(lambda record: not (getattr(record, "connection", False)
                                                 or record.name.endswith(".librdkafka")))
    level = kfeed_log.level
    if not args.verbose:
        kfeed_log.addHandler(warnings_shown)
        kfeed_log.setLevel(logging.WARNING)
        kfeed_log.propagate = False
    # SIGTERM as SIGINT: one line and 143, not a silent end (train and convert
    # set their own, which stop at a step or round).
    # SIGINT too: Python's own KeyboardInterrupt raised inside confluent-kafka's
    # flush came out as a bare SystemError, read as messages not delivered.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, Interrupted.handler)
                for sig in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    try:
        code = int(args.func(args) or 0)
        # (NOTE [ A signal is never lost ] in kfeed/errors.py: one lost on its
        # way up, and the command ended all the same.)
        if (signum := Interrupted.caught()) is not None:
            raise Interrupted(signum)
        return code
    except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - the one place that reports
        # An error caught while a signal is pending is that signal's doing.
        signum = Interrupted.caught()
        if not isinstance(e, KeyboardInterrupt) and signum is None:
            return _failed(args, e)
        # A command that knows how to go on says so (a corpus: --skip-docs N).
        after = e.after if isinstance(e, _StoppedAt) else _after_interrupt(args)
        # (What an interrupted producer had not delivered: Producer.__exit__.)
        notes = "".join(f"; {note}" for note in getattr(e, "__notes__", ()))
        print(f"kfeed: interrupted{after}{notes}", file=sys.stderr)
        return 128 + getattr(e, "signum", signum or signal.SIGINT)
    finally:
        Interrupted.caught()  # (before the handlers go: see the NOTE)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        kfeed_log.removeHandler(warnings_shown)
        kfeed_log.setLevel(level)
        kfeed_log.propagate = True


def _failed(args: argparse.Namespace, e: Exception) -> int:
    """Report the error that ended the command in one line: its exit status."""
    if isinstance(e, BrokenPipeError):
        # The reader of its output went away (`kfeed cluster status | head -1`):
        # as a shell tool ends on SIGPIPE, without a word; what is left unsaid
        # must not fail again when Python flushes at exit.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    if isinstance(e, ConfigError):
        return _report(args, e, 2)
    if isinstance(e, KfeedError):
        return _report(args, e, 1)
    if args.verbose:
        traceback.print_exception(e)
    hint = "the traceback is above" if args.verbose else "rerun with -v for the traceback"
    print(f"kfeed: unexpected {type(e).__name__}: {_one_line(str(e))}: {hint}", file=sys.stderr)
    return 1


def _after_interrupt(args: argparse.Namespace) -> str:
    if args.command == "produce":
        if args.source is None or _corpus_mode(args):
            return ": what was sent before stands"
        return ": what was sent before stands (the same command with --resume goes on after it)"
    return {"train": ": the last checkpoint (if any) stands",
            "convert": ": the rounds committed before stand"}.get(args.command, "")


def _report(args: argparse.Namespace, e: KfeedError, code: int) -> int:
    if args.verbose:
        traceback.print_exc()
    print(f"kfeed: {_one_line(str(e))}", file=sys.stderr)
    return code
