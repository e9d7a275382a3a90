"""What a new user meets first: creating topics, wrong schemas, bad records, clear errors.

Each test pins the exact wording a user reads, so that the message stays one
clear line that says what is wrong and how to fix it.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

import numpy as np
import pytest
import torch
from confluent_kafka import Consumer, Producer as KafkaProducer

import kfeed
from kfeed._kafka import ConnectionLog
from kfeed.badrecords import BadRecordPolicy, BadRecords, describe_schema, reason_kind
from kfeed.schema import Format
from kfeed.sources import MemorySource
from kfeed.synthetic import synthetic_columns, synthetic_schema

SCHEMA = synthetic_schema()
FEATURES_ONLY = kfeed.Schema({"features": ("float32", (768,))})
EXPECTED = "features float32[768], label int64, id int64"


# -- unit: no broker ----------------------------------------------------------


class _Msg:
    def __init__(self, value: bytes, offset: int, headers=None, partition: int = 0) -> None:
        self._value, self._offset, self._headers, self._partition = value, offset, headers, partition

    def value(self) -> bytes:
        return self._value

    def offset(self) -> int:
        return self._offset

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return self._partition

    def headers(self):
        return self._headers

    def key(self) -> None:
        return None


def _block_of(schema: kfeed.Schema, n: int = 4) -> bytes:
    cols = {f.name: np.zeros((n, *f.shape), f.storage) for f in schema.fields}
    return schema.encode_block(cols)


def test_describe_schema_names_every_field_with_dtype_and_shape() -> None:
    assert describe_schema(SCHEMA) == EXPECTED
    assert describe_schema(kfeed.Schema({"tokens": ("uint16", (None,))})) == "tokens uint16[*]"


def test_a_schema_mismatch_says_what_the_loader_expects_and_what_the_topic_holds() -> None:
    from kfeed.badrecords import SCHEMA_HEADER, schema_header

    bad = BadRecords(SCHEMA, Format.BLOCK, BadRecordPolicy.SKIP, None, fail_fast=None)
    value = _block_of(FEATURES_ONLY)
    with_header = _Msg(value, 0, [(SCHEMA_HEADER, schema_header(FEATURES_ONLY))])
    assert bad.explain(with_header, "schema fingerprint mismatch") == (
        f"schema mismatch: the loader expects {EXPECTED}; the message was written with "
        "features float32[768]")
    # Token documents read as samples: the block's flags differ before its fingerprint.
    tokens = kfeed.Schema({"tokens": ("uint16", (None,))})
    documents = _Msg(tokens.encode_blocks({"tokens": [np.arange(3, dtype=np.uint16)]}, 1)[0],
                     0, [(SCHEMA_HEADER, schema_header(tokens))])
    assert bad.explain(documents, "unsupported block flags") == (
        f"schema mismatch: the loader expects {EXPECTED}; the message was written with "
        "tokens uint16[*]")
    # A header that does not hash to the block's fingerprint is not believed.
    lying = _Msg(value, 0, [(SCHEMA_HEADER, schema_header(SCHEMA))])
    fp = FEATURES_ONLY.fingerprint
    assert bad.explain(lying, "schema fingerprint mismatch").endswith(
        f"written with another schema (fingerprint {fp:#018x}; no kfeed.schema header says which)")


def test_a_raw_value_of_the_wrong_size_names_both_sizes() -> None:
    bad = BadRecords(SCHEMA, Format.RAW, BadRecordPolicy.SKIP, None, fail_fast=None)
    assert bad.explain(_Msg(b"\0" * 3072, 0), "raw value size is not the record size") == (
        f"raw value of 3072 bytes, but the schema's record is 3088 bytes ({EXPECTED})")


def test_bad_record_warnings_come_once_per_reason_every_few_seconds(caplog) -> None:
    src = MemorySource([])
    bad = BadRecords(SCHEMA, Format.BLOCK, BadRecordPolicy.DEAD_LETTER, src, fail_fast=None)
    with caplog.at_level(logging.WARNING, logger="kfeed.loader"):
        for i in range(200):
            bad.bad(_Msg(b"junk", i), "bad magic")
        for i in range(200, 250):
            bad.bad(_Msg(b"", i), "empty value (tombstone)")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bad record at t[0]@0, sent to t.dlq: bad magic",
                     "bad record at t[0]@200, sent to t.dlq: empty value (tombstone)"]
    assert bad.count == 250 and len(src.dead_letters) == 250
    assert bad.summary() == "250 bad record(s): 200x bad magic; 50x empty value (tombstone)"
    # At the read's end (or close) the rest of a burst is counted: it was never said.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kfeed.loader"):
        bad.flush()
        bad.flush()
    assert [r.getMessage() for r in caplog.records] == [
        "199 more bad record(s) in the last 0s, sent to t.dlq: bad magic",
        "49 more bad record(s) in the last 0s, sent to t.dlq: empty value (tombstone)"]


def test_a_burst_of_bad_records_is_counted_whole_by_the_end_of_the_read(caplog) -> None:
    good = SCHEMA.encode_blocks(synthetic_columns(np.arange(100)), 10)
    source = MemorySource(good[:5] + [b"x"] * 50 + good[5:])
    with caplog.at_level(logging.WARNING, logger="kfeed.loader"):
        with kfeed.Loader(None, "memory", SCHEMA, 10, device="cpu", until="end",
                          on_bad_record="skip", source=source) as loader:
            assert sum(b.size for b in loader) == 100
    lines = [r.getMessage() for r in caplog.records if "bad record" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("bad record at memory[0]@5, skipped: ")
    why = reason_kind(lines[0].split(", skipped: ", 1)[1])
    assert re.fullmatch(r"49 more bad record\(s\) in the last \d+s, skipped: " + re.escape(why),
                        lines[1]), lines


def test_reasons_that_differ_only_in_their_numbers_count_and_warn_as_one_kind(caplog) -> None:
    # Raw values of 9 to 299 bytes made 291 reasons: 291 metric series, 291 warnings.
    src = MemorySource([])
    bad = BadRecords(SCHEMA, Format.RAW, BadRecordPolicy.DEAD_LETTER, src, fail_fast=None)
    with caplog.at_level(logging.WARNING, logger="kfeed.loader"):
        for i in range(9, 300):
            bad.bad(_Msg(b"x" * i, i), "raw value size is not the record size")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("bad record at t[0]@9, sent to t.dlq: raw "
                                                   "value of 9 bytes, but the schema's record")
    assert list(bad.by_reason) == ["raw value of N bytes, but the schema's record is N bytes "
                                   "(features float32[N], label int64, id int64)"]
    assert len(src.dead_letters) == 291 and src.dead_letters[-1][1].startswith(
        "raw value of 299 bytes")  # the copies keep the whole reason


def test_a_read_whose_first_messages_are_all_bad_raises_one_error_and_routes_nothing() -> None:
    values = [_block_of(FEATURES_ONLY)] * 40
    src = MemorySource(values)
    ld = kfeed.Loader(None, "memory", SCHEMA, 8, device="cpu", source=src, until="end")
    with pytest.raises(kfeed.DecodeError) as e:
        next(ld)
    ld.close()
    assert str(e.value) == (
        "all 32 messages read so far were rejected: schema mismatch: the loader expects "
        f"{EXPECTED}; the message was written with another schema (fingerprint "
        f"{FEATURES_ONLY.fingerprint:#018x}; no kfeed.schema header says which). Nothing was "
        "dead-lettered or committed: fix the schema (or the topic) and read again "
        "(topic=memory, partition=0, offset=0)")
    assert src.dead_letters == [] and src.commits == []  # not even the start positions


def test_a_resumed_read_does_not_take_bad_messages_after_its_state_for_a_wrong_schema() -> None:
    # A checkpoint right before 40 bad messages made every restart from it
    # stop with "all 32 messages read so far were rejected ... fix the
    # schema", though the run that saved it read the topic with this schema.
    rows = kfeed.Schema({"id": ("int64", ())})
    values = ([json.dumps({"id": i}).encode() for i in range(40)] + [b"{bad"] * 40
              + [json.dumps({"id": i}).encode() for i in range(80, 120)])
    with kfeed.Loader(None, "memory", rows, 10, device="cpu", until="end",
                      source=MemorySource(values), format=kfeed.Json()) as ld:
        first = [i for _, b in zip(range(4), ld) for i in b["id"].tolist()]
        state = ld.state_dict()
    src = MemorySource(values)
    with kfeed.Loader(None, "memory", rows, 10, device="cpu", until="end", source=src,
                      format=kfeed.Json()) as ld:
        ld.load_state_dict(state)
        rest = [i for b in ld for i in b["id"].tolist()]
    assert first + rest == [*range(40), *range(80, 120)]
    assert [m.offset() for m, _why in src.dead_letters] == list(range(40, 80))
    # With nothing used of the topic yet, the state proves nothing: the same refusal.
    with kfeed.Loader(None, "memory", rows, 10, device="cpu", until="end",
                      source=MemorySource(values[40:]), format=kfeed.Json()) as ld:
        empty = ld.state_dict()
    with kfeed.Loader(None, "memory", rows, 10, device="cpu", until="end",
                      source=MemorySource(values[40:]), format=kfeed.Json()) as ld:
        ld.load_state_dict(empty)
        with pytest.raises(kfeed.DecodeError, match="^all 32 messages read so far were "
                                                    "rejected: not JSON"):
            next(ld)


@pytest.mark.parametrize("fmt, says", [
    (kfeed.Json, "got <class 'kfeed.jsonformat.Json'> (the class: did you mean kfeed.Json()?)"),
    ("avro", "got 'avro' (say where its schemas come from: kfeed.Avro(registry=...))"),
    ("protobuf", "(say where its schemas come from: kfeed.Protobuf(registry=...))"),
])
def test_a_format_given_as_its_class_or_name_says_what_to_give(fmt, says) -> None:
    with pytest.raises(kfeed.ConfigError, match="^format must be ") as e:
        kfeed.Loader(None, "memory", SCHEMA, 8, device="cpu", source=MemorySource([]),
                     format=fmt)
    assert str(e.value).endswith(says), str(e.value)


@pytest.mark.parametrize("fmt, values, says", [
    ("block", [b'{"features": [0.5], "label": 1, "id": 7}'] * 5, "look like JSON: read them "
     "with format=kfeed.Json() (kfeed train and kfeed convert: --format json)"),
    ("raw", [b' [1, 2, 3]'] * 5, "look like JSON"),
    ("block", [b"\x00\x00\x00\x00\x07\x02\x0ahello"] * 5, "look like the Confluent framing "
     "of a Schema Registry (a zero byte, then a schema id): read them with "
     "format=kfeed.Avro(registry=...) or kfeed.Protobuf(registry=...)"),
    ("block", [b"junk"] * 5, "fix the schema (or the topic) and read again"),
])
def test_a_topic_of_another_writer_read_as_kfeed_blocks_says_which_format(fmt, values,
                                                                           says) -> None:
    # "fix the schema (or the topic)": no schema fixes JSON or Avro read as
    # blocks, and kfeed train's schema cannot be changed at all.
    ld = kfeed.Loader(None, "memory", SCHEMA, 8, device="cpu", source=MemorySource(values),
                      until="end", format=fmt)
    with pytest.raises(kfeed.DecodeError) as e:
        next(ld)
    ld.close()
    assert says in str(e.value), str(e.value)


AVRO_SCHEMA = {"type": "record", "name": "Sample", "fields": [
    {"name": "features", "type": {"type": "array", "items": "float"}},
    {"name": "label", "type": "long"}, {"name": "id", "type": "long"}]}
JSON_VALUE = json.dumps({"features": [0.5] * 768, "label": 1, "id": 7}).encode()
FRAMED = b"\x00\x00\x00\x00\x07" + b"\x02" * 40


@pytest.mark.parametrize("make, values, says", [
    (lambda: kfeed.Avro(schema=AVRO_SCHEMA), [JSON_VALUE] * 5, "look like JSON: read them "
     "with format=kfeed.Json()"),
    (lambda: kfeed.Avro(registry={"url": "http://127.0.0.1:9"}), [JSON_VALUE] * 5,
     "look like JSON"),
    (lambda: kfeed.Arrow(), [JSON_VALUE] * 5, "look like JSON"),
    (lambda: kfeed.Json(), [FRAMED] * 5, "look like the Confluent framing"),
    (lambda: kfeed.Avro(schema=AVRO_SCHEMA), [FRAMED] * 5, "fix the schema"),
])
def test_a_topic_read_in_another_writer_s_format_says_which_it_looks_like(make, values,
                                                                           says) -> None:
    # JSON read as Avro said "magic byte 123, expected 0 (Confluent framing)"
    # or "88 bytes left after the record", then "fix the schema (or the topic)".
    ld = kfeed.Loader(None, "memory", SCHEMA, 8, device="cpu", source=MemorySource(values),
                      until="end", format=make())
    with pytest.raises(kfeed.DecodeError) as e:
        next(ld)
    ld.close()
    assert says in str(e.value), str(e.value)
    # (Unframed Avro may start with a zero byte: such a read is told nothing more.)
    assert ("fix the schema" in str(e.value)) == (says == "fix the schema")


def test_kfeed_blocks_read_as_json_say_to_read_them_as_kfeed_s_own() -> None:
    # They were "not JSON", with "fix the schema (or the topic)": no schema
    # fixes that; the reader's format= does.
    values = SCHEMA.encode_blocks(synthetic_columns(np.arange(40)), 8)
    ld = kfeed.Loader(None, "memory", SCHEMA, 8, device="cpu", source=MemorySource(values),
                      until="end", format=kfeed.Json())
    with pytest.raises(kfeed.DecodeError) as e:
        next(ld)
    ld.close()
    assert str(e.value).startswith("all 5 messages read so far were rejected: not JSON. "
                                   "Nothing was dead-lettered or committed: the messages are "
                                   "kfeed blocks, as kfeed produce writes them: read them "
                                   "without format="), str(e.value)


def test_values_that_are_not_bytes_read_as_json_are_a_decode_error() -> None:
    # The check for kfeed blocks took a str value's first bytes: a TypeError.
    values = ["this is not JSON, and longer than a block's header"] * 5
    ld = kfeed.Loader(None, "memory", SCHEMA, 8, device="cpu", source=MemorySource(values),
                      until="end", format=kfeed.Json())
    with pytest.raises(kfeed.DecodeError, match="^all 5 messages read so far were rejected"):
        next(ld)
    ld.close()


def test_a_capped_loader_s_settings_are_checked_before_any_broker_is_asked(monkeypatch):
    # Counting the brokers waits for them: a setting that needs no broker to
    # be wrong was said only after that wait.
    import kfeed.loader

    def asked(*_a: object, **_k: object) -> int:
        raise AssertionError("a broker was asked")

    monkeypatch.setattr(kfeed.loader, "broker_count", asked)
    with pytest.raises(kfeed.ConfigError, match="kafka_config needs 'group.id'"):
        kfeed.Loader({"bootstrap.servers": "127.0.0.1:1"}, "t", SCHEMA, 8, device="cpu",
                     max_memory_bytes=256 << 20)


def test_a_bounded_read_of_only_a_few_bad_messages_raises_at_its_end() -> None:
    src = MemorySource([b"junk"] * 5)
    ld = kfeed.Loader(None, "memory", SCHEMA, 8, device="cpu", source=src, until="end")
    with pytest.raises(kfeed.DecodeError, match="^all 5 messages read so far were rejected: "
                                                "shorter than the block header"):
        next(ld)
    ld.close()
    assert src.dead_letters == []


def test_bad_messages_before_the_first_good_one_are_dead_lettered_once_it_comes() -> None:
    good = SCHEMA.encode_blocks(synthetic_columns(np.arange(64)), 8)
    src = MemorySource([b"junk"] * 3 + good)
    with kfeed.Loader(None, "memory", SCHEMA, 16, device="cpu", source=src, until="end") as ld:
        ids = np.concatenate([b["id"].numpy() for b in ld])
    assert np.array_equal(np.sort(ids), np.arange(64))
    assert [m.offset() for m, _why in src.dead_letters] == [0, 1, 2]


def test_fail_fast_none_routes_from_the_first_message() -> None:
    src = MemorySource([b"junk"] * 40)
    with kfeed.Loader(None, "memory", SCHEMA, 8, device="cpu", source=src, until="end",
                      fail_fast=None, on_bad_record="skip") as ld:
        assert list(ld) == []
        assert ld.stats()["bad_records"] == 40
    with pytest.raises(kfeed.ConfigError, match="fail_fast must be None or an int >= 1"):
        kfeed.Loader(None, "memory", SCHEMA, 8, device="cpu", source=src, fail_fast=0)


@pytest.mark.parametrize("kwargs, line", [
    # NaN passes every bound (each comparison is False): a commit interval of
    # NaN never committed while the loader ran.
    ({"commit_interval_ms": float("nan")}, "commit_interval_ms must be a number >= 0, got nan"),
    ({"max_wait_ms": float("nan")}, "max_wait_ms must be a number > 0, got nan"),
    ({"connect_timeout_s": float("inf")}, "connect_timeout_s must be a number > 0, got inf"),
    ({"drop_last": "false"}, "drop_last must be True or False, got 'false'"),
    ({"topics": "clicks/2024"}, "topic name 'clicks/2024' is not valid: use up to 249 of "
                                "a-z A-Z 0-9 . _ -"),
    ({"topics": ["a", "b", "a"]},
     "topics ['a', 'b', 'a'] name 'a' more than once: give each topic once"),
    ({"rank": "0", "world_size": 2},
     "need ints 0 <= rank < world_size, got rank='0', world_size=2"),
    # A bare AssertionError for the formats others write (the block format said this).
    *[({"format": fmt, "pack": kfeed.Pack(seq_len=8, eos_id=0)},
       "pack needs a schema with a variable-length token field, e.g. {'tokens': ('int32', "
       "(None,))}") for fmt in (kfeed.Json(), "block")],
    ({"rank": True, "world_size": 2},
     "need ints 0 <= rank < world_size, got rank=True, world_size=2"),
    # It was unused, and its dead-letter producer still made (and connected) each epoch.
    ({"on_bad_record": "skip", "dlq_config": {"sasl.username": "dlq"}},
     "dlq_config sets up the dead-letter producer, and on_bad_record='skip' sends nothing to "
     "it: leave dlq_config out, or on_bad_record='dead_letter'"),
])
def test_loader_settings_of_the_wrong_kind_are_one_line(kwargs, line) -> None:
    with pytest.raises(kfeed.ConfigError) as e:
        kfeed.Loader(None, kwargs.get("topics", "memory"), SCHEMA, 8, device="cpu",
                     source=MemorySource([]),
                     **{k: v for k, v in kwargs.items() if k != "topics"})
    assert str(e.value) == line


@pytest.mark.parametrize("store", [True, "true"])
def test_offsets_stored_as_fetched_are_refused(store) -> None:
    # Accepted without a word: librdkafka stored each record's offset as it was
    # fetched and auto commit committed them, far ahead of the steps; a trainer
    # killed at its third step left 2,140 of 3,000 records committed, never trained.
    config = {"bootstrap.servers": "127.0.0.1:9", "group.id": "g", "enable.auto.commit": True,
              "enable.auto.offset.store": store}
    with pytest.raises(kfeed.ConfigError) as e:
        ld = kfeed.Loader(config, "t", SCHEMA, 8, device="cpu")
        try:
            next(ld)
        finally:
            ld.close()
    assert str(e.value) == (f"enable.auto.offset.store={store!r}: librdkafka would commit "
                            f"records as they are fetched, ahead of the steps that use them; "
                            f"kfeed commits each batch after its step: leave the setting out")


@pytest.mark.parametrize("level", ["read_uncommitted", "READ_UNCOMMITTED"])
def test_reading_uncommitted_records_is_refused(level) -> None:
    # Accepted without a word: the records of an aborted transaction at a
    # topic's end (a killed producer's) were handed out, 150 of 100 written.
    config = {"bootstrap.servers": "127.0.0.1:9", "group.id": "g", "isolation.level": level}
    with pytest.raises(kfeed.ConfigError) as e:
        kfeed.Loader(config, "t", SCHEMA, 8, device="cpu").close()
    assert str(e.value) == (f"isolation.level={level!r}: the records of aborted transactions "
                            f"would be read as written; kfeed reads committed records only: "
                            f"leave the setting out")


@pytest.mark.parametrize("reset", ["latest", "error"])
def test_an_offset_reset_kfeed_would_not_use_is_refused(reset) -> None:
    # Taken and never used: a new group given auto.offset.reset=latest read the
    # whole topic (the loader places each partition's start by start=).
    config = {"bootstrap.servers": "127.0.0.1:9", "group.id": "g", "auto.offset.reset": reset}
    with pytest.raises(kfeed.ConfigError) as e:
        kfeed.Loader(config, "t", SCHEMA, 8, device="cpu")
    assert str(e.value) == (
        f"auto.offset.reset={reset!r}: kfeed places each partition's start itself, by start= "
        f"('committed' by default: the group's commit, else the earliest offset); give "
        f"start='latest' (kfeed train --start latest) to begin at the end, and leave the "
        f"setting out")
    kfeed.Loader({**config, "auto.offset.reset": "earliest"}, "t", SCHEMA, 8,
                 device="cpu").close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_config_error() -> None:
    with pytest.raises(kfeed.ConfigError) as e:
        kfeed.Loader(None, "memory", SCHEMA, 8, device="cuda", source=MemorySource([]))
    assert str(e.value) == ("device='cuda', but torch sees no CUDA device "
                            "(torch.cuda.is_available() is False): pass device='cpu', or leave "
                            "device unset to take cuda only where there is one")


def test_a_dataloader_with_batch_size_set_gets_a_clear_error() -> None:
    # (Batches of another output, numpy ones stacked in silence into [4, 16, ...]
    # tensors, are refused when the dataset is made: test_loader_memory.py.)
    values = SCHEMA.encode_blocks(synthetic_columns(np.arange(100)), 10)
    ds = kfeed.KafkaIterableDataset(None, "memory", SCHEMA, 16, until="end",
                                    source=MemorySource(values))
    with pytest.raises(kfeed.ConfigError, match=r"use DataLoader\(dataset, batch_size=None\)"):
        list(torch.utils.data.DataLoader(ds, batch_size=4))
    # Batches of other sizes in one DataLoader batch (the read's last one) failed
    # with torch's "stack expects each tensor to be equal size", in a worker too.
    for workers in (0, 1):
        ds = kfeed.KafkaIterableDataset(None, "memory", SCHEMA, 16, until="end",
                                        source=MemorySource(values))
        with pytest.raises(Exception, match=r"use DataLoader\(dataset, batch_size=None\)"):
            list(torch.utils.data.DataLoader(
                ds, batch_size=7, num_workers=workers,
                multiprocessing_context="spawn" if workers else None))
    ds = kfeed.KafkaIterableDataset(None, "memory", SCHEMA, 16, until="end",
                                    source=MemorySource(values))
    sizes = [len(b["id"]) for b in torch.utils.data.DataLoader(ds, batch_size=None)]
    assert sizes == [16] * 6 + [4]


def test_connection_trouble_is_logged_once_per_broker_every_few_seconds(caplog) -> None:
    target = logging.getLogger("kfeed.test.conn")
    folded = ConnectionLog(target, every_s=5.0)
    with caplog.at_level(logging.DEBUG, logger="kfeed.test.conn"):
        for _ in range(100):
            for port in (9092, 9093):
                folded.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#consumer-1",
                           f"127.0.0.1:{port}/bootstrap: Connect to ipv4#127.0.0.1:{port} "
                           "failed: Connection refused (after 0ms in state CONNECT)")
        folded.log(logging.INFO, "%s", "something else")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "127.0.0.1:9092/bootstrap" in lines[0] and "127.0.0.1:9093/bootstrap" in lines[1]
    assert lines[2] == "something else"


def test_all_brokers_down_as_librdkafka_says_it_is_folded_too(caplog) -> None:
    # "_ALL_BROKERS_DOWN ... 2/2 brokers are down" escaped the fold: 157 lines in 8 s.
    target = logging.getLogger("kfeed.test.down")
    folded = ConnectionLog(target, every_s=5.0)
    with caplog.at_level(logging.DEBUG, logger="kfeed.test.down"):
        for _ in range(50):
            folded.log(logging.WARNING, "kafka: %s", 'KafkaError{code=_ALL_BROKERS_DOWN,val=-187,'
                       'str="sasl_ssl://127.0.0.1:39700/bootstrap: 2/2 brokers are down"}')
    assert len(caplog.records) == 1


def test_connection_settings_include_the_ssl_and_sasl_switches() -> None:
    # enable.ssl.certificate.verification=false was dropped from the admin and
    # helper clients, which then failed after the timeout ("cannot reach").
    from kfeed._kafka import client_config

    config = {"bootstrap.servers": "b:1", "enable.ssl.certificate.verification": "false",
              "enable.sasl.oauthbearer.unsecure.jwt": "true", "fetch.min.bytes": 1}
    assert client_config(config) == {k: v for k, v in config.items() if k != "fetch.min.bytes"}
    # OAUTHBEARER's token callback too: the dead-letter producer, the admin and
    # lag clients logged in with the mechanism and no token.
    token = {"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER",
             "oauth_cb": lambda _config: ("token", 0.0)}
    assert client_config({**config, **token}) == {
        **{k: v for k, v in config.items() if k != "fetch.min.bytes"}, **token}


def test_a_few_bad_messages_and_then_nothing_say_so_while_the_read_waits(monkeypatch,
                                                                         caplog) -> None:
    # Fewer bad messages than fail_fast, then nothing: a stream (not bounded)
    # held them back and waited in silence, for ever.
    import threading

    from kfeed import badrecords

    monkeypatch.setattr(badrecords, "WARN_EVERY_S", 0.3)
    src = MemorySource([b"junk"] * 5)
    ld = kfeed.Loader(None, "memory", SCHEMA, 8, device="cpu", source=src)
    caught: list[BaseException] = []

    def read() -> None:
        try:
            next(ld)
        except BaseException as e:  # noqa: BLE001 - the close() below ends it
            caught.append(e)

    def held_back() -> list[str]:  # (not the lines of other tests' loaders, collected now)
        return [m for r in caplog.records if "held back" in (m := r.getMessage())]

    with caplog.at_level(logging.WARNING, logger="kfeed.loader"):
        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(held_back()) < 2:
            time.sleep(0.05)
        ld.close()
        reader.join(10)
    lines = held_back()
    assert len(lines) >= 2, lines  # again while it waits, not once
    assert lines[0].startswith("5 message(s) rejected and held back for 0 s, waiting for one "
                               "that decodes (32 rejected first end the read); the first at "
                               "memory[0]@0: shorter than the block header"), lines
    assert isinstance(caught[0], kfeed.LoaderError) and src.dead_letters == []


def test_a_record_larger_than_a_kafka_message_is_refused_by_the_schema() -> None:
    with pytest.raises(kfeed.ConfigError) as e:
        kfeed.Schema({"x": ("float32", (2**40,)), "id": ("int64", ())})
    assert str(e.value) == (
        "a record of these fields takes 4398046511112 bytes; one must fit in a Kafka message, "
        "at most 2147483647 bytes: 'x' float32[1099511627776] 4398046511104, 'id' int64[] 8")


def test_batches_that_cannot_be_allocated_are_a_config_error() -> None:
    # 2**20 records of 2 GB: more than any address space. torch's own
    # RuntimeError (or MemoryError) reached the user from deep in the pool.
    schema = kfeed.Schema({"x": ("uint8", (2**31 - 1,))})
    with pytest.raises(kfeed.ConfigError) as e:
        kfeed.Loader(None, "memory", schema, 2**20, device="cpu", source=MemorySource([]))
    assert str(e.value).startswith(
        "the loader's 4 batches of 1048576 records of 2147483647 bytes do not fit in memory "
        "here: a smaller prefetch or batch_size, or smaller fields ("), str(e.value)


def test_a_prefetch_whose_batches_outgrow_the_memory_is_a_config_error_at_once() -> None:
    # Each batch is small, but a million of them made the loader spend minutes
    # and gigabytes making slots, and the queue would have filled the memory.
    schema = kfeed.Schema({"x": ("float32", (768,))})
    t = time.monotonic()
    with pytest.raises(kfeed.ConfigError) as e:
        kfeed.Loader(None, "memory", schema, 256, device="cpu", prefetch=10**6,
                     source=MemorySource([]))
    assert time.monotonic() - t < 10.0
    assert str(e.value).startswith(
        "the loader's 1000002 batches of 256 records of 3072 bytes do not fit in memory here: "
        "a smaller prefetch or batch_size, or smaller fields (786433572864 bytes, more than the "), str(e.value)


# -- against the cluster ------------------------------------------------------


@pytest.mark.integration
def test_create_topic_makes_a_topic_that_producer_and_loader_use_at_once(bootstrap,
                                                                         group_id) -> None:
    name = f"kfeed-test-{uuid.uuid4().hex}"
    config = {"bootstrap.servers": bootstrap}
    assert kfeed.create_topic(config, name, partitions=3) is True
    assert kfeed.create_topic(config, name, partitions=3) is False  # exist_ok
    with pytest.raises(kfeed.KfeedError, match=f"^topic '{name}' already exists"):
        kfeed.create_topic(config, name, exist_ok=False)
    with kfeed.Producer(config, name, SCHEMA) as p:
        assert p.num_partitions == 3
        p.send(synthetic_columns(np.arange(300)))
    with kfeed.Loader({**config, "group.id": group_id}, name, SCHEMA, 100, device="cpu",
                      until="end") as ld:
        batches = [b["id"].numpy().copy() for b in ld]
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(300))


def test_create_topic_refuses_bad_arguments_before_any_connection() -> None:
    config = {"bootstrap.servers": "127.0.0.1:9"}
    with pytest.raises(kfeed.ConfigError, match=r"^partitions must be an int >= 1, got 0$"):
        kfeed.create_topic(config, "t", partitions=0)
    with pytest.raises(kfeed.ConfigError, match=r"^topic name 'a b' is not valid"):
        kfeed.create_topic(config, "a b")
    with pytest.raises(kfeed.ConfigError, match="needs|with 'bootstrap.servers'"):
        kfeed.create_topic({}, "t")


def test_unreachable_brokers_read_the_same_for_create_topic_producer_and_loader() -> None:
    # Each carries librdkafka's code, as the README says (the loader's and
    # create_topic's had none).
    config = {"bootstrap.servers": "127.0.0.1:9"}
    with pytest.raises(kfeed.KfeedError,
                       match=r"^cannot reach the brokers at 127\.0\.0\.1:9 within 2s: ") as made:
        kfeed.create_topic(config, "t", timeout_s=2)
    with pytest.raises(kfeed.ProduceError,
                       match=r"^cannot reach the brokers at 127\.0\.0\.1:9 within 2s: ") as sent:
        kfeed.Producer(config, "t", SCHEMA, connect_timeout_s=2)
    ld = kfeed.Loader({**config, "group.id": "g"}, "t", SCHEMA, 8, device="cpu",
                      connect_timeout_s=2)
    with pytest.raises(kfeed.ConsumeError,
                       match=r"^cannot reach the brokers at 127\.0\.0\.1:9 within 2s: ") as read:
        next(ld)
    ld.close()
    assert all(isinstance(e.value.code, int) and e.value.code < 0 for e in (made, sent, read)), \
        [e.value.code for e in (made, sent, read)]


def test_brokers_named_without_a_port_are_said_to_be_on_9092() -> None:
    # "--bootstrap-servers localhost" waited out the timeout, then named only
    # "localhost": the port librdkafka tried was not said.
    from kfeed._kafka import unreachable_message

    assert unreachable_message("127.0.0.1:9,h2", 2, "why") == (
        "cannot reach the brokers at 127.0.0.1:9,h2 within 2s (h2: no port given, so "
        "librdkafka's 9092): why")
    assert unreachable_message("SSL://h:9093,[::1]:9092", 2, "why") == (
        "cannot reach the brokers at SSL://h:9093,[::1]:9092 within 2s: why")


def test_an_unreachable_broker_logs_a_few_lines_not_hundreds(caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="kfeed"), pytest.raises(kfeed.ProduceError):
        kfeed.Producer({"bootstrap.servers": "127.0.0.1:9"}, "t", SCHEMA, connect_timeout_s=4)
    # One line when the trouble starts, one at most every 5 s after: the
    # log callback's and the error callback's.
    assert len(caplog.records) <= 6, [r.getMessage() for r in caplog.records]


def test_an_unreachable_broker_is_warned_of_once_not_twice(caplog) -> None:
    # The error callbacks of the producer and the loader warned of each refused
    # connect as "KafkaError{code=_TRANSPORT,...}", and librdkafka's own line of
    # the same connect came beside it, at ERROR: two lines of one trouble.
    config = {"bootstrap.servers": "127.0.0.1:9"}
    with caplog.at_level(logging.WARNING):
        with pytest.raises(kfeed.ProduceError):
            kfeed.Producer(config, "t", SCHEMA, connect_timeout_s=3)
        ld = kfeed.Loader({**config, "group.id": "g"}, "t", SCHEMA, 8, device="cpu",
                          connect_timeout_s=3)
        with pytest.raises(kfeed.ConsumeError):
            next(ld)
        ld.close()
    lines = [(r.name, r.getMessage()) for r in caplog.records]
    said = [(name, text) for name, text in lines if "Connect to ipv4#127.0.0.1:9" in text]
    assert [name for name, _ in said] == ["kfeed.producer", "kfeed.sources"], lines
    assert all(text.startswith("kafka: 127.0.0.1:9/bootstrap: Connect to") for _, text in said)
    assert not any("KafkaError{" in text for _, text in lines), lines
    # Still there for who asks (kfeed's -v): librdkafka's own lines, at DEBUG.
    with caplog.at_level(logging.DEBUG, logger="kfeed.librdkafka"), \
            pytest.raises(kfeed.ProduceError):
        kfeed.Producer(config, "t", SCHEMA, connect_timeout_s=1)
    assert any(r.name == "kfeed.librdkafka" and "Connect to" in r.getMessage()
               for r in caplog.records)


@pytest.mark.integration
def test_a_missing_topic_says_how_to_create_it(bootstrap, group_id) -> None:
    name = f"missing-{uuid.uuid4().hex}"
    how = (f"create it with kfeed.create_topic(config, '{name}', partitions=N) or "
           f"`kfeed produce --topic {name} ...`")
    with pytest.raises(kfeed.ProduceError) as e:
        kfeed.Producer({"bootstrap.servers": bootstrap}, name, SCHEMA, connect_timeout_s=5)
    assert str(e.value).startswith(f"topic '{name}' is not available at {bootstrap}: ")
    assert how in str(e.value)
    ld = kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": group_id}, name, SCHEMA, 8,
                      device="cpu", connect_timeout_s=5)
    with pytest.raises(kfeed.ConsumeError) as e:
        next(ld)
    ld.close()
    assert str(e.value).startswith(f"topic '{name}' is not available at {bootstrap}: ")
    assert how in str(e.value)


@pytest.mark.integration
def test_a_loader_with_the_wrong_schema_names_both_schemas_and_commits_nothing(
        bootstrap, make_topic, group_id) -> None:
    topic = make_topic(partitions=2)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, FEATURES_ONLY,
                        block_records=8) as p:
        p.send({"features": np.zeros((800, 768), np.float32)})
    config = {"bootstrap.servers": bootstrap, "group.id": group_id}
    ld = kfeed.Loader(config, topic, SCHEMA, 64, device="cpu")  # streaming: no until
    with pytest.raises(kfeed.DecodeError) as e:
        next(ld)
    ld.close()
    assert str(e.value).startswith(
        f"all 32 messages read so far were rejected: schema mismatch: the loader expects "
        f"{EXPECTED}; the message was written with features float32[768]. Nothing was "
        "dead-lettered or committed")
    admin_md = KafkaProducer({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
    assert f"{topic}.dlq" not in admin_md.topics
    c = Consumer(config)
    committed = c.committed([kfeed_tp(topic, 0), kfeed_tp(topic, 1)], timeout=10)
    c.close()
    assert all(p.offset < 0 for p in committed)


def kfeed_tp(topic: str, part: int):
    from confluent_kafka import TopicPartition

    return TopicPartition(topic, part)


@pytest.mark.integration
def test_a_bad_message_is_dead_lettered_once_whichever_groups_read_it(bootstrap,
                                                                      make_topic) -> None:
    topic = make_topic(partitions=2)
    good = SCHEMA.encode_blocks(synthetic_columns(np.arange(256)), 32)
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for part in (0, 1):
        for i, v in enumerate(good[:4]):
            p.produce(topic, value=v, partition=part)
            if i in (1, 2):
                p.produce(topic, value=b"junk %d" % i, partition=part)
    assert p.flush(30) == 0
    for _ in range(2):  # two groups read everything
        with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex},
                          topic, SCHEMA, 64, device="cpu", until="end") as ld:
            assert sum(b.size for b in ld) == 256
            assert ld.stats()["bad_records"] == 4
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "auto.offset.reset": "earliest", "enable.partition.eof": True})
    c.subscribe([f"{topic}.dlq"])
    dead, eof, deadline = [], set(), time.monotonic() + 30
    while len(eof) < 2 and time.monotonic() < deadline:
        for m in c.consume(10, 0.5):
            if m.error() is None:
                dead.append(m)
            else:
                eof.add(m.partition())
    c.close()
    where = sorted((m.partition(), int(dict(m.headers())["kfeed.source.offset"])) for m in dead)
    # Partition p's bad messages, at offsets 2 and 4, in dead-letter partition p, once.
    assert where == [(0, 2), (0, 4), (1, 2), (1, 4)]


@pytest.mark.integration
def test_lag_is_known_from_the_first_batch_and_zero_after_a_full_epoch(bootstrap, make_topic,
                                                                       group_id) -> None:
    topic = make_topic(partitions=2)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA) as p:
        p.send(synthetic_columns(np.arange(2000)), keys=np.arange(2000))
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": group_id}, topic, SCHEMA,
                      100, device="cpu", until="end") as ld:
        next(ld)
        first = ld.stats()["lag"]  # well before librdkafka's first statistics
        for _ in ld:
            pass
        last = ld.stats()["lag"]
    assert len(first) == 2 and sum(first.values()) > 0, first
    assert last == {f"{topic}[0]": 0, f"{topic}[1]": 0}


@pytest.mark.integration
def test_a_streams_lag_says_which_partitions_it_does_not_know_yet(bootstrap, make_topic,
                                                                   group_id) -> None:
    # A stream has no ends resolved at the start: a partition not fetched
    # from, before librdkafka's first statistics, was left out of the lag
    # without a word, and the sum read as the whole lag.
    topic = make_topic(partitions=8)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA) as p:
        p.send(synthetic_columns(np.arange(800)), keys=np.arange(800))
    names = {f"{topic}[{p}]" for p in range(8)}
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": group_id}, topic, SCHEMA,
                      10, device="cpu", start="earliest") as ld:
        next(ld)
        st = ld.stats()
        assert set(st["lag"]).isdisjoint(st["lag_unknown"]), st
        assert set(st["lag"]) | set(st["lag_unknown"]) == names, st
        deadline = time.monotonic() + 30  # librdkafka's statistics come once a second
        while ld.stats()["lag_unknown"] and time.monotonic() < deadline:
            time.sleep(0.1)
        st = ld.stats()
    assert st["lag_unknown"] == [] and set(st["lag"]) == names, st


@pytest.mark.integration
def test_lag_names_every_partition_even_one_never_fetched(bootstrap, make_topic,
                                                          group_id) -> None:
    # Partition 1 stays empty: nothing is ever fetched from it, and before
    # librdkafka's first statistics its end was unknown to the lag.
    topic = make_topic(partitions=2)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA,
                        partitioner=lambda key, n: 0) as p:
        p.send(synthetic_columns(np.arange(500)), keys=np.arange(500))
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": group_id}, topic, SCHEMA,
                      100, device="cpu", until="end") as ld:
        next(ld)
        lag = ld.stats()["lag"]
    assert set(lag) == {f"{topic}[0]", f"{topic}[1]"} and lag[f"{topic}[1]"] == 0, lag
