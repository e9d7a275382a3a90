"""What the loader does with a message the codec rejected.

The decode stage hands every rejected message here, with the codec's reason.
``BadRecords`` then:

- explains it: a schema mismatch names what the loader expects and what the
  message was written with (the producer's ``kfeed.schema`` header, checked
  against the fingerprint in the block header); a raw value of the wrong size
  names both sizes;
- stops a read that cannot work: when the first ``fail_fast`` messages of a
  read are all rejected, for one reason, before any record was good, it
  raises one ``DecodeError`` instead of dripping a warning per message and
  dead-lettering the whole topic; nothing was dead-lettered or committed by
  then;
- warns at a bounded rate: one line per reason every ``WARN_EVERY_S``, with
  the count since the last line;
- routes it as the caller chose: raise, skip (counted), or the dead-letter
  queue (``Source.dead_letter``, which copies a message at most once).

A bad message never becomes part of a batch: the codec rejects it whole
before any of its bytes reach a slot.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from enum import Enum
from typing import Any

from kfeed.errors import DecodeError
from kfeed.schema import Format, Schema

__all__ = ["BadRecordPolicy", "BadRecords", "SCHEMA_HEADER", "FINGERPRINT_HEADER",
           "schema_header", "describe_schema"]

log = logging.getLogger("kfeed.loader")

# The headers kfeed.Producer writes on every message.
SCHEMA_HEADER = "kfeed.schema"
FINGERPRINT_HEADER = "kfeed.fingerprint"

WARN_EVERY_S = 5.0
_FINGERPRINT_REASON = "schema fingerprint mismatch"
# A block of documents read with a fixed-shape schema, or the other way round.
_FLAGS_REASON = "unsupported block flags"
_RAW_SIZE_REASON = "raw value size is not the record size"
_MAGIC = b"KFDB"


class BadRecordPolicy(str, Enum):
    DEAD_LETTER = "dead_letter"
    SKIP = "skip"
    RAISE = "raise"


def _canonical(fields: list[list[Any]]) -> str:
    return json.dumps(fields, separators=(",", ":"))


def schema_header(schema: Schema) -> bytes:
    """The ``kfeed.schema`` header: the fields the schema's fingerprint stands for."""
    return _canonical([[f.name, f.dtype, list(f.shape)] for f in schema.fields]).encode()


def describe_schema(fields: list[list[Any]] | Schema) -> str:
    """``features float32[768], label int64, tokens uint16[*]``."""
    if isinstance(fields, Schema):
        fields = [[f.name, f.dtype, list(f.shape)] for f in fields.fields]
    parts = []
    for name, dtype, shape in fields:
        dims = ",".join("*" if d is None else str(d) for d in shape)
        parts.append(f"{name} {dtype}[{dims}]" if shape else f"{name} {dtype}")
    return ", ".join(parts)


def _header(msg: Any, name: str) -> bytes | None:
    try:
        headers = msg.headers()
    except AttributeError:  # a recorded message (MemorySource) may have none
        return None
    for key, value in headers or ():
        if key == name:
            return value
    return None


_NUMBERS = re.compile(r"\b(?:0x[0-9a-f]+|-?\d+)\b")  # not the 32 of float32


# Where confluent-kafka's serializers put the schema's id (a GUID) when told to
# write it in a header: the value is then the bare Avro, Protobuf or JSON.
_HEADER_SCHEMA_ID = "__value_schema_id"


def _header_schema_id(msg: Any) -> bool:
    """Whether ``msg`` names its schema in the ``_HEADER_SCHEMA_ID`` header."""
    headers = msg.headers() if hasattr(msg, "headers") else None
    return bool(headers) and any(k == _HEADER_SCHEMA_ID for k, _v in headers)


def reason_kind(why: str) -> str:
    """A reason with its numbers as N: "raw value of N bytes, but ...". The
    sizes and counts in reasons are as many as the messages; their kinds few."""
    return _NUMBERS.sub("N", why)


_BYTES_LIKE = (bytes, bytearray, memoryview)


def block_fingerprint(value: Any) -> int | None:
    """The schema fingerprint in a kfeed block's header, or None for no block (or no bytes)."""
    if isinstance(value, _BYTES_LIKE) and len(value) >= 24 \
            and bytes(value[:4]) == _MAGIC:
        return int.from_bytes(bytes(value[16:24]), "little")
    return None


def _written_with(msg: Any) -> str:
    """What the producer of ``msg`` says its schema was, when it says it truthfully."""
    found = block_fingerprint(msg.value())
    text = _header(msg, SCHEMA_HEADER)
    if text is not None:
        try:
            fields = json.loads(text)
            digest = hashlib.blake2b(b"kfeed.schema.v1:" + _canonical(fields).encode(),
                                     digest_size=8).digest()
            if found is None or int.from_bytes(digest, "little") == found:
                return describe_schema(fields)
        except (ValueError, TypeError):
            pass
    if found is not None:
        return f"another schema (fingerprint {found:#018x}; no kfeed.schema header says which)"
    return "another schema"


# What a read whose every message was rejected says to do when nothing more is known.
FIX_SCHEMA = "fix the schema (or the topic) and read again"

# Reasons kfeed's own codec gives a message that is no kfeed block or raw record.
_NOT_KFEED = re.compile(r"^(bad magic|shorter than the block header|raw value of )").match


def _foreign(value: Any, reading: Any = None) -> str | None:
    """What to do about a message of another writer read as kfeed's own, or as
    ``reading`` (another writer's format), where its first bytes say what it is; None
    where they do not, or where they say it is what was read."""
    if not isinstance(value, _BYTES_LIKE):
        return None
    head = bytes(value[:64]).lstrip()
    if head[:1] in (b"{", b"[") and getattr(reading, "value", None) != "json":
        return ("the messages look like JSON: read them with format=kfeed.Json() "
                "(kfeed train and kfeed convert: --format json)")
    # (Not for unframed Avro, whose records may start with a zero byte: an empty
    # array, a long 0, a union's first branch.)
    if len(value) >= 5 and value[0] == 0 and not getattr(reading, "framed", False) \
            and getattr(reading, "value", None) != "avro":
        return ("the messages look like the Confluent framing of a Schema Registry (a zero "
                "byte, then a schema id): read them with format=kfeed.Avro(registry=...) or "
                "kfeed.Protobuf(registry=...) (kfeed train and kfeed convert: --format avro "
                "or protobuf, --registry URL)")
    return None


class BadRecords:
    """Explains, counts, rate-limits and routes the messages the codec rejected."""

    def __init__(self, schema: Schema, fmt: Any, policy: BadRecordPolicy, source: Any,
                 *, fail_fast: int | None, topics: Sequence[str] | None = None) -> None:
        self.schema = schema
        self.fmt = fmt  # Format.BLOCK or RAW (kfeed's own), or another writer's RecordFormat
        self.policy = policy
        self.source = source
        self.fail_fast = fail_fast
        self.count = 0
        # By kind of reason (``reason_kind``): a few keys, however many sizes and
        # counts the messages show, for the metrics' label and the warnings' pace.
        self.by_reason: Counter[str] = Counter()
        self.good_seen = False
        # A mixture's topics (``topics``), each judged alone: one's good
        # records say nothing of another's schema. Those with none yet.
        self.unproven: set[str] | None = set(topics) if topics is not None else None
        # Before the first good record: rejected messages held back, so that
        # a read that is wrong from the start dead-letters nothing.
        self._held: list[tuple[Any, str]] = []
        self._held_since: float | None = None  # when the first was held back
        self._held_said: float | None = None  # when waiting() last said so
        self._warned: dict[str, tuple[float, int]] = {}  # reason -> (last line, since then)
        self._dests: dict[str, str] = {}  # reason -> where its last record went

    def explain(self, msg: Any, reason: str) -> str:
        if _header_schema_id(msg):
            return (f"{reason} (its writer put the schema id in the {_HEADER_SCHEMA_ID} "
                    f"header, as confluent-kafka's header_schema_id_serializer does, which "
                    f"kfeed does not read: have it write the id into the value, the "
                    f"serializers' default)")
        if reason in (_FINGERPRINT_REASON, _FLAGS_REASON):
            return (f"schema mismatch: the loader expects {describe_schema(self.schema)}; "
                    f"the message was written with {_written_with(msg)}")
        if reason == _RAW_SIZE_REASON and self.schema.varlen is None:
            value = msg.value()
            return (f"raw value of {len(value)} bytes, but the schema's record is "
                    f"{self.schema.record_size} bytes ({describe_schema(self.schema)})")
        return reason

    @property
    def holding(self) -> bool:
        """Whether rejected messages are held back (no good record yet): their
        positions must not move on before they are routed."""
        return bool(self._held)

    @property
    def per_topic(self) -> bool:
        """Whether ``good`` wants the topics of the good records (a mixture's first ones)."""
        return self.unproven is not None and not self.good_seen

    def good(self, topics: Iterable[str] | None = None) -> None:
        """Records decoded well (of ``topics``, with a mixture): the held messages (of
        those topics) were stray ones, route them now."""
        if self.good_seen:
            return
        if self.unproven is not None and topics is not None:
            self.unproven.difference_update(topics)
            self.good_seen = not self.unproven
            held = [(m, why) for m, why in self._held if m.topic() not in self.unproven]
            self._held = [(m, why) for m, why in self._held if m.topic() in self.unproven]
            if not self._held:
                self._held_since = None
        else:
            self.good_seen = True
            held, self._held = self._held, []
        for msg, reason in held:
            self._route(msg, reason)

    def bad(self, msg: Any, reason: str) -> None:
        self.count += 1
        why = self.explain(msg, reason)
        self.by_reason[reason_kind(why)] += 1
        tp = (msg.topic(), msg.partition())
        if self.policy is BadRecordPolicy.RAISE:
            raise DecodeError(f"bad record: {why}", topic=tp[0], partition=tp[1],
                              offset=msg.offset())
        if self.good_seen or self.fail_fast is None or (
                self.unproven is not None and tp[0] not in self.unproven):
            self._route(msg, why)
            return
        self._held.append((msg, why))
        if len(self._held) >= self.fail_fast:
            self._give_up()
        if self._held_since is None:
            self._held_since = time.monotonic()
        self.waiting()

    def waiting(self) -> None:
        """The read waits for more messages: once in a while, say what it holds back.

        Not at once: a read whose first ``fail_fast`` messages, or whose
        bounded window, are all bad ends with one error that says it. A
        topic with fewer bad messages and nothing after them would wait in
        silence.
        """
        if self.good_seen or not self._held:
            return
        now = time.monotonic()
        assert self._held_since is not None
        if now - self._held_since < WARN_EVERY_S or (
                self._held_said is not None and now - self._held_said < WARN_EVERY_S):
            return
        self._held_said = now
        msg, why = self._held[0]
        log.warning("%d message(s) rejected and held back for %.0f s, waiting for one that "
                    "decodes (%d rejected first end the read); the first at %s[%d]@%d: %s",
                    len(self._held), now - self._held_since, self.fail_fast, msg.topic(),
                    msg.partition(), msg.offset(), why)

    def forget(self, gone: Callable[[Any], bool]) -> None:
        """Drop the held messages that ``gone`` picks (their partition was taken
        away: its next owner reads them again)."""
        self._held = [(m, why) for m, why in self._held if not gone(m)]
        if not self._held:
            self._held_since = None

    def end_of_read(self) -> None:
        """A bounded read is over: if it held only bad messages, that is the error."""
        if not self.good_seen and self._held:
            self._give_up()

    def _give_up(self) -> None:
        reasons = Counter(why for _m, why in self._held)
        first = self._held[0][0]
        n = len(self._held)
        of = ""
        if self.unproven is not None:  # a mixture whose other topics decode
            topics = sorted({m.topic() for m, _why in self._held})
            of = f" of {', '.join(topics)} (in the mixture)"
        if len(reasons) == 1:
            why = next(iter(reasons))
            what = f"all {n} messages{of} read so far were rejected: {why}"
        else:
            top = "; ".join(f"{c}x {w}" for w, c in reasons.most_common(3))
            what = f"all {n} messages{of} read so far were rejected ({top})"
        fix = FIX_SCHEMA
        if all(_NOT_KFEED(why) for why in reasons):
            fix = _foreign(first.value()) or fix
        elif self.fmt not in (Format.BLOCK, Format.RAW) \
                and block_fingerprint(first.value()) is not None:
            # (Another writer's format read; a block's magic says it is kfeed's.)
            fix = ("the messages are kfeed blocks, as kfeed produce writes them: read "
                   "them without format= (kfeed train: without --format; they need no "
                   "kfeed convert)")
        elif self.fmt not in (Format.BLOCK, Format.RAW):
            fix = _foreign(first.value(), self.fmt) or fix
        nothing = "None of them was" if of else "Nothing was"
        raise DecodeError(f"{what}. {nothing} dead-lettered or committed: {fix}",
                          topic=first.topic(), partition=first.partition(), offset=first.offset())

    def _route(self, msg: Any, why: str) -> None:
        dest = "skipped"
        if self.policy is BadRecordPolicy.DEAD_LETTER:
            dest = (f"sent to {msg.topic()}.dlq" if self.source.dead_letter(msg, why)
                    else f"in {msg.topic()}.dlq already (another reader copied it)")
        self._warn(msg, why, dest)

    def _warn(self, msg: Any, why: str, dest: str) -> None:
        now = time.monotonic()
        kind = reason_kind(why)
        last, since = self._warned.get(kind, (None, 0))
        self._dests[kind] = dest
        if last is not None and now - last < WARN_EVERY_S:
            self._warned[kind] = (last, since + 1)
            return
        self._warned[kind] = (now, 0)
        where = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
        more = f" (and {since} more in the last {now - last:.0f}s)" if since else ""
        log.warning("bad record at %s, %s: %s%s", where, dest, why, more)

    def flush(self) -> None:
        """Say how many rejects each kind's warning window still holds back unsaid:
        at the end of a read and at close, so a burst is counted whole."""
        now = time.monotonic()
        for kind, (last, since) in self._warned.items():
            if since:
                log.warning("%d more bad record(s) in the last %.0fs, %s: %s", since,
                            now - last, self._dests[kind], kind)
                self._warned[kind] = (last, 0)

    def summary(self) -> str | None:
        """One line on everything rejected so far, or None."""
        if not self.count:
            return None
        top = "; ".join(f"{c}x {w}" for w, c in self.by_reason.most_common(3))
        return f"{self.count} bad record(s): {top}"
