"""format="arrow": Arrow IPC streams in and out, read straight into the batch."""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pytest
from confluent_kafka import Producer as KafkaProducer
from records import check_packed_documents, kfeed_cli

import kfeed
from kfeed.arrowformat import ArrowDecoder, ArrowEncoder
from kfeed.loader import Loader, memory_loader

SCHEMA = kfeed.Schema({"id": ("int64", ()), "x": ("float32", (3,)), "m": ("float16", (2, 2)),
                       "flag": ("bool", ())})
DOCS = kfeed.Schema({"id": ("int32", ()), "tokens": ("int32", (None,))})


def columns(ids: np.ndarray) -> dict[str, np.ndarray]:
    return {"id": ids.astype(np.int64),
            "x": np.stack([ids, -ids, ids * 0.25], 1).astype(np.float32),
            "m": (ids[:, None, None] + np.arange(4).reshape(1, 2, 2) % 500).astype(np.float16),
            "flag": ids % 5 == 0}


def messages(start: int, n: int, rows: int = 64) -> list[bytes]:
    return ArrowEncoder(SCHEMA).encode_blocks(columns(np.arange(start, start + n)), rows, 1 << 30)


def stream(*batches: pa.RecordBatch) -> bytes:
    """An Arrow IPC stream as pyarrow alone writes one."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batches[0].schema) as writer:
        for b in batches:
            writer.write_batch(b)
    return sink.getvalue().to_pybytes()


def collect(loader: Loader) -> dict[str, np.ndarray]:
    got: dict[str, list[np.ndarray]] = {}
    for batch in loader:
        for name, t in batch.items():
            got.setdefault(name, []).append(t.numpy().copy())
    return {k: np.concatenate(v) for k, v in got.items()}


def assert_rows(got: dict[str, np.ndarray], ids: np.ndarray) -> None:
    assert np.array_equal(np.sort(got["id"]), np.sort(ids))
    want = columns(got["id"])
    for name, values in want.items():
        assert np.array_equal(got[name], values), name


@pytest.mark.parametrize("batch_size", [1, 50, 64, 100, 1000])
def test_every_record_once_and_equal_whatever_the_batch_cuts(batch_size: int) -> None:
    values = {0: messages(0, 1500), 1: messages(1500, 700, rows=33), 2: []}
    with memory_loader(values, SCHEMA, batch_size, until="end", device="cpu",
                       format="arrow") as loader:
        got = collect(loader)
    assert_rows(got, np.arange(2200))


@pytest.mark.parametrize("stop_after", [0, 2, 5, 11])
def test_a_resume_inside_a_message_repeats_and_skips_nothing(stop_after: int) -> None:
    values = {0: messages(0, 1000, rows=128), 1: messages(1000, 600, rows=90)}
    first = memory_loader(values, SCHEMA, 100, until="end", device="cpu", format="arrow")
    ids = []
    for i, batch in enumerate(first):
        ids.append(batch["id"].numpy().copy())
        if i == stop_after:
            break
    state = first.state_dict()
    first.close()
    second = memory_loader(values, SCHEMA, 100, until="end", device="cpu", format="arrow")
    second.load_state_dict(state)
    ids.append(collect(second)["id"])
    got = np.concatenate(ids)
    assert len(got) == len(np.unique(got)) == 1600


@pytest.mark.parametrize("partitions", [1, 2])
def test_shuffled_arrow_records_resume_exactly(partitions: int) -> None:
    # On one partition the resumed stream is the uninterrupted one; on two,
    # the records' interleaving depends on the fetches, and each comes once.
    values = {0: messages(0, 900, rows=50), 1: messages(900, 600, rows=70)}
    if partitions == 1:
        values = {0: values[0] + [m for m in values[1]]}
    shuffle = kfeed.Shuffle(buffer=300, seed=3)
    whole = memory_loader(values, SCHEMA, 64, until="end", device="cpu", format="arrow",
                          shuffle=shuffle)
    everything = collect(whole)
    assert_rows(everything, np.arange(1500))
    assert not np.array_equal(everything["id"], np.sort(everything["id"]))
    first = memory_loader(values, SCHEMA, 64, until="end", device="cpu", format="arrow",
                          shuffle=shuffle)
    head = [next(first)["id"].numpy().copy() for _ in range(7)]
    state = first.state_dict()
    first.close()
    second = memory_loader(values, SCHEMA, 64, until="end", device="cpu", format="arrow",
                           shuffle=shuffle)
    second.load_state_dict(state)
    resumed = np.concatenate(head + [collect(second)["id"]])
    if partitions == 1:
        assert np.array_equal(resumed, everything["id"])
    assert np.array_equal(np.sort(resumed), np.arange(1500))


def test_what_pyarrow_alone_writes_reads_dictionaries_structs_and_several_batches() -> None:
    schema = kfeed.Schema({"user": ("int64", ()), "score": ("float64", (), {"source": "meta.score"}),
                           "vec": ("int16", (2,)), "country": ("int32", ())})
    ids = np.arange(10, dtype=np.int64)
    meta = pa.StructArray.from_arrays([pa.array(ids * 0.5), pa.array([str(i) for i in ids])],
                                      names=["score", "note"])
    country = pa.DictionaryArray.from_arrays(pa.array(ids % 3, pa.int8()),
                                             pa.array([44, 1, 81], pa.int32()))
    vec = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 2).astype(np.int16)), 2)
    batch = pa.RecordBatch.from_arrays([pa.array(ids), meta, vec, country, pa.array(ids * 2)],
                                       names=["user", "meta", "vec", "country", "unused"])
    value = stream(batch.slice(0, 4), batch.slice(4))  # two record batches in one message
    with memory_loader([value], schema, 16, until="end", device="cpu", format="arrow") as loader:
        got = collect(loader)
    assert got["user"].tolist() == ids.tolist()
    assert got["score"].tolist() == (ids * 0.5).tolist()
    assert got["vec"].tolist() == np.repeat(ids, 2).reshape(-1, 2).tolist()
    assert got["country"].tolist() == [[44, 1, 81][i % 3] for i in ids]


def test_kfeed_messages_read_back_with_pyarrow_alone() -> None:
    ids = np.arange(200)
    tables = [pa.ipc.open_stream(v).read_all() for v in messages(0, 200, rows=64)]
    assert [t.num_rows for t in tables] == [64, 64, 64, 8]
    table = pa.concat_tables(tables)
    want = columns(ids)
    assert table["id"].to_numpy().tolist() == ids.tolist()
    assert np.array_equal(np.stack(table["x"].to_numpy(zero_copy_only=False)), want["x"])
    assert np.array_equal(table["m"].combine_chunks().to_numpy_ndarray(), want["m"])
    assert table["flag"].to_pylist() == want["flag"].tolist()


@pytest.mark.parametrize("wide", [True, False])
def test_messages_stay_within_the_bytes_the_producer_may_send(wide) -> None:
    # Only the values were counted, not Arrow's own bytes (the schema, each
    # column's buffers and padding, the documents' offsets): 1,028,192-byte
    # messages for 998,976 allowed, which the brokers refused.
    limit = 1_000_000 - 1024
    if wide:
        schema = kfeed.Schema({f"f{i:03d}": ("float32", (20,)) for i in range(200)})
        cols = {n: np.full((200, 20), i, np.float32) for i, n in enumerate(schema.names)}
    else:
        schema = kfeed.Schema({"doc": ("int8", (None,))})
        cols = {"doc": (np.arange(200_000, dtype=np.int8), np.ones(200_000, np.int64))}
    out = kfeed.Arrow().encoder(schema, "t").encode_blocks(cols, 200_000, limit)
    assert all(len(m) <= limit for m in out), [len(m) for m in out]
    assert len(out) <= 4
    table = pa.concat_tables([pa.ipc.open_stream(m).read_all() for m in out])
    assert table.num_rows == 200 if wide else 200_000
    if not wide:
        assert table["doc"].combine_chunks().flatten().to_numpy().tolist() == \
            cols["doc"][0].tolist()


def test_a_dotted_field_name_reads_back_from_kfeeds_own_arrow_messages() -> None:
    # kfeed writes "page.rank" as one column; the reader looked for a struct
    # "page" with a child "rank", and read the default (or rejected every message).
    from kfeed.arrowformat import table_columns

    schema = kfeed.Schema({"score": ("float32", ()),
                           "page.rank": ("float32", (), {"default": -1.0})})
    cols = {"score": np.ones(4, np.float32), "page.rank": np.full(4, 7.0, np.float32)}
    messages = kfeed.Arrow().encoder(schema, "t").encode_blocks(cols, 4, 1 << 20)
    with memory_loader(messages, schema, 4, until="end", device="cpu", format="arrow",
                       output="numpy") as loader:
        assert next(loader)["page.rank"].tolist() == [7.0] * 4
    assert table_columns(schema, pa.table(cols))["page.rank"].tolist() == [7.0] * 4
    # A struct path still reads as one.
    nested = pa.table({"score": cols["score"],
                       "page": pa.StructArray.from_arrays([pa.array(cols["page.rank"])],
                                                          ["rank"])})
    assert table_columns(schema, nested)["page.rank"].tolist() == [7.0] * 4


def test_a_bool_field_of_two_dimensions_is_nested_lists_pyarrow_converts() -> None:
    # It was fixed_shape_tensor<bool>, which pyarrow itself cannot convert
    # ("bool is not valid data type for a tensor").
    schema = kfeed.Schema({"mask": ("bool", (2, 3)), "id": ("int64", ())})
    mask = (np.arange(24).reshape(4, 2, 3) % 3 == 0)
    values = schema.encode_blocks({"mask": mask, "id": np.arange(4)}, 4)
    with memory_loader(values, schema, 4, until="end", device="cpu", output="arrow") as loader:
        batch = next(loader)
    assert batch.schema.field("mask").type == pa.list_(pa.list_(pa.bool_(), 3), 2)
    assert batch["mask"].to_pylist() == mask.tolist()
    # And kfeed's own Arrow messages of it read back.
    messages = kfeed.Arrow().encoder(schema, "t").encode_blocks({"mask": mask,
                                                                "id": np.arange(4)}, 4, 1 << 20)
    with memory_loader(messages, schema, 4, until="end", device="cpu", format="arrow",
                       output="numpy") as loader:
        assert np.array_equal(next(loader)["mask"], mask)


def test_the_arrow_schema_of_the_batches_is_known_before_any_batch() -> None:
    # pa.Table.from_batches(loader) of a read with no records had no schema to
    # take: "Must pass schema, or at least one RecordBatch".
    schema = kfeed.Schema({"x": ("float32", (3,)), "m": ("bool", (2, 2)),
                           "t": ("float32", (2, 2)), "d": ("int32", (None,)),
                           "id": ("int64", ())})
    cols = {"x": np.ones((4, 3), np.float32), "m": np.zeros((4, 2, 2), bool),
            "t": np.ones((4, 2, 2), np.float32),
            "d": [np.arange(i, dtype=np.int32) for i in range(4)], "id": np.arange(4)}
    want = kfeed.Arrow.arrow_schema(schema)
    with memory_loader(schema.encode_blocks(cols, 4), schema, 2, until="end",
                       output="arrow") as loader:
        assert pa.Table.from_batches(loader, schema=want).num_rows == 4
    with memory_loader([], schema, 2, until="end", output="arrow") as loader:
        empty = pa.Table.from_batches(loader, schema=want)
    assert empty.num_rows == 0 and empty.schema == want


def test_bad_messages_are_rejected_whole_with_a_reason() -> None:
    ids = np.arange(4, dtype=np.int64)
    good = {"id": pa.array(ids), "x": pa.FixedSizeListArray.from_arrays(
        pa.array(np.zeros(12, np.float32)), 3),
        "m": pa.ExtensionArray.from_storage(
            pa.fixed_shape_tensor(pa.float16(), [2, 2]),
            pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(16, np.float16)), 4)),
        "flag": pa.array([True, False, True, False])}

    def variant(**changes: pa.Array) -> bytes:
        cols = {**good, **changes}
        cols = {k: v for k, v in cols.items() if v is not None}
        return stream(pa.RecordBatch.from_arrays(list(cols.values()), names=list(cols)))

    values = [
        variant(),
        b"not arrow at all",
        variant()[:-40],                                                  # truncated
        variant(id=pa.array([1, None, 3, 4], pa.int64())),               # a null, no default
        variant(id=pa.array(ids.astype(np.int32))),                       # int32 for int64
        variant(x=None),                                                  # no column
        variant(x=pa.FixedSizeListArray.from_arrays(
            pa.array([0.0] * 11 + [None], pa.float32()), 3)),             # a null item
        variant(m=pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(16, np.float16)), 4)),
        None,                                                             # a tombstone
        variant(),
    ]
    reasons = {1: "not an Arrow IPC stream", 2: "not an Arrow IPC stream",
               3: "column 'id' has 1 null(s) and field 'id' has no default",
               4: "column 'id' is int32, but field 'id' reads int64",
               5: "no column 'x' for field 'x'",
               6: "column 'x' has null items in its lists",
               7: "column 'm' is fixed_size_list<item: halffloat>[4], but field 'm' reads",
               8: "an empty message (no value)"}
    out = SCHEMA.empty(16)
    res = ArrowDecoder(SCHEMA).decode_into(values, SCHEMA.bind(out), 0)
    assert res.rows == 8 and res.consumed == len(values)
    assert [i for i, _ in res.bad] == sorted(reasons)
    for i, why in res.bad:
        assert reasons[i] in why, (i, why)

    source = kfeed.MemorySource(values)
    with Loader(None, "memory", SCHEMA, 3, source=source, until="end", device="cpu",
                format="arrow") as loader:
        got = collect(loader)
        assert loader.stats()["bad_records"] == 8
    assert got["id"].tolist() == [0, 1, 2, 3] * 2  # the good messages, whole
    assert sorted(m.offset() for m, _ in source.dead_letters) == sorted(reasons)


def test_nulls_and_missing_columns_take_the_field_default() -> None:
    schema = kfeed.Schema({"id": ("int64", ()),
                           "w": ("float32", (2,), {"default": -1.0}),
                           "seen": ("int32", (None,), {"default": [7, 7]})})
    w = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(6, dtype=np.float32)), 2)
    w = pa.FixedSizeListArray.from_arrays(w.values, 2, mask=pa.array([False, True, False]))
    seen = pa.array([[1], None, []], pa.list_(pa.int32()))
    value = stream(pa.RecordBatch.from_arrays([pa.array([0, 1, 2]), w, seen],
                                              names=["id", "w", "seen"]))
    no_w = stream(pa.RecordBatch.from_arrays([pa.array([3]), pa.array([[5]], pa.list_(
        pa.int32()))], names=["id", "seen"]))
    with memory_loader([value, no_w], schema, 8, until="end", device="cpu",
                       format="arrow") as loader:
        batch = next(loader)
    assert batch["w"].tolist() == [[0.0, 1.0], [-1.0, -1.0], [4.0, 5.0], [-1.0, -1.0]]
    assert batch["seen"].tolist() == [1, 7, 7, 5]
    assert batch["seen_offsets"].tolist() == [0, 1, 3, 3, 4]


def documents(ids: np.ndarray) -> list[np.ndarray]:
    return [(np.arange(i % 9) + 100 * i).astype(np.int32) for i in ids]


def doc_messages(n: int) -> list[bytes]:
    ids = np.arange(n)
    return ArrowEncoder(DOCS).encode_blocks({"id": ids.astype(np.int32),
                                             "tokens": documents(ids)}, 40, 1 << 30)


def test_list_columns_come_jagged_and_pack() -> None:
    with memory_loader(doc_messages(300), DOCS, 32, until="end", device="cpu",
                       format="arrow") as loader:
        seen = {}
        for b in loader:
            offsets = b["tokens_offsets"].tolist()
            for k, i in enumerate(b["id"].tolist()):
                seen[i] = b["tokens"][offsets[k]:offsets[k + 1]].tolist()
    want = documents(np.arange(300))
    assert sorted(seen) == list(range(300))
    assert all(seen[i] == want[i].tolist() for i in range(300))



def test_token_documents_pack_as_kfeeds_own_and_resume_exactly() -> None:
    rng = np.random.default_rng(4)
    docs = [rng.integers(1, 30000, int(rng.integers(1, 400)), dtype=np.int32)
            for _ in range(1200)]
    tokens = kfeed.Schema({"tokens": ("int32", (None,))})
    values = ArrowEncoder(tokens).encode_blocks({"tokens": docs}, 7, 1 << 30)
    check_packed_documents(values, tokens, "arrow", docs,
                           kfeed.Pack(seq_len=256, eos_id=30001, pad_id=0))


def test_strings_read_into_a_uint8_field() -> None:
    schema = kfeed.Schema({"text": ("uint8", (None,))})
    value = stream(pa.RecordBatch.from_arrays([pa.array(["héllo", "", "kafka"])[0:3]],
                                              names=["text"]))
    with memory_loader([value], schema, 8, until="end", device="cpu", format="arrow") as loader:
        b = next(loader)
    o = b["text_offsets"].tolist()
    assert [bytes(b["text"][o[i]:o[i + 1]].tolist()).decode() for i in range(3)] == \
        ["héllo", "", "kafka"]


def test_configuration_mistakes_get_one_clear_line() -> None:
    with pytest.raises(kfeed.ConfigError, match="bfloat16, which Arrow has no type for"):
        memory_loader([], kfeed.Schema({"h": ("bfloat16", (4,))}), 8, format="arrow")
    with pytest.raises(kfeed.ConfigError, match="'arrow'"):
        memory_loader([], SCHEMA, 8, format="arow")


@pytest.mark.integration
def test_a_table_sent_as_arrow_and_a_topic_pyarrow_wrote_read_back(bootstrap, make_topic):
    topic = make_topic(partitions=3)
    config = {"bootstrap.servers": bootstrap}
    ids = np.arange(5000)
    table = kfeed.arrowformat.record_batch(SCHEMA, columns(ids))
    table = pa.Table.from_batches([table.slice(0, 2000), table.slice(2000)])  # two chunks
    with kfeed.Producer(config, topic, SCHEMA, format="arrow", block_records=300) as p:
        p.send(table, keys=ids)
    raw = KafkaProducer(config)  # pyarrow alone, no kfeed: one message of 100 rows
    raw.produce(topic, stream(kfeed.arrowformat.record_batch(
        SCHEMA, columns(np.arange(5000, 5100)))), partition=0)
    raw.produce(topic, b"broken", partition=1)
    assert raw.flush(30) == 0
    with Loader({**config, "group.id": uuid.uuid4().hex}, topic, SCHEMA, 256, device="cpu",
                until="end", format="arrow", on_bad_record="skip") as loader:
        got = collect(loader)
        assert loader.stats()["bad_records"] == 1
    assert_rows(got, np.arange(5100))


@pytest.mark.integration
def test_a_table_sends_in_the_block_format_too(bootstrap, make_topic):
    topic = make_topic(partitions=2)
    config = {"bootstrap.servers": bootstrap}
    table = pa.Table.from_batches([kfeed.arrowformat.record_batch(SCHEMA, columns(np.arange(700)))])
    with kfeed.Producer(config, topic, SCHEMA) as p:
        p.send(table)
    with Loader({**config, "group.id": uuid.uuid4().hex}, topic, SCHEMA, 128, device="cpu",
                until="end") as loader:
        got = collect(loader)
    assert_rows(got, np.arange(700))


def test_convert_leaves_arrow_topics_to_the_loader() -> None:
    with pytest.raises(kfeed.ConfigError, match="an Arrow topic holds many a message"):
        kfeed.convert({"bootstrap.servers": "127.0.0.1:1"}, "events", "blocks", SCHEMA,
                      format="arrow")


@pytest.mark.integration
def test_produce_and_train_from_the_command_line_in_arrow(bootstrap, make_topic, group_id):
    topic = make_topic(partitions=2)
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--synthetic", "3000",
                     "--format", "arrow", "--block-records", "100")
    assert done.returncode == 0, done.stderr
    assert "3,000 samples in 30 messages" in done.stdout
    done = kfeed_cli(bootstrap, "train", "--topic", topic, "--group-id", group_id, "--until-end",
                     "--device", "cpu", "--format", "arrow")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("trained 12 steps on 3,000 samples")


def test_null_rows_of_every_kind_take_the_default() -> None:
    schema = kfeed.Schema({"id": ("int64", (), {"default": -1}),
                           "v": ("float32", (2,), {"default": 9.0}),
                           "d": ("int32", (), {"default": 7})})
    v = pa.array([[1.0, 2.0], None, [5.0, 6.0]], pa.list_(pa.float32(), 2))  # null items inside
    d = pa.DictionaryArray.from_arrays(pa.array([0, None, 1], pa.int8()),
                                       pa.array([10, 20], pa.int32()))
    value = stream(pa.RecordBatch.from_arrays([pa.array([1, None, 3]), v, d],
                                              names=["id", "v", "d"]))
    with memory_loader([value], schema, 8, until="end", device="cpu", format="arrow") as loader:
        batch = next(loader)
    assert batch["id"].tolist() == [1, -1, 3]
    assert batch["v"].tolist() == [[1.0, 2.0], [9.0, 9.0], [5.0, 6.0]]
    assert batch["d"].tolist() == [10, 7, 20]
    bad = stream(pa.RecordBatch.from_arrays(
        [pa.array([1]), pa.array([[1.0, None]], pa.list_(pa.float32(), 2)), pa.array([4], pa.int32())],
        names=["id", "v", "d"]))  # a null item in a row that is not null
    res = ArrowDecoder(schema).decode_into([bad], schema.bind(schema.empty(4)), 0)
    assert res.rows == 0 and "column 'v' has null items in its lists" in res.bad[0][1]


def test_null_bool_rows_take_the_default_at_every_shape() -> None:
    # A null in a bool column stopped the loader ("Could not convert 0 ... to
    # boolean": no bool scalar 0 to fill it with), default or none.
    schema = kfeed.Schema({"b": ("bool", (), {"default": True}),
                           "v": ("bool", (2,), {"default": True}),
                           "d": ("bool", (), {"default": True})})
    v = pa.array([[True, False], [None, None], [False, True]], pa.list_(pa.bool_(), 2))
    v = pa.FixedSizeListArray.from_arrays(v.values, 2, mask=pa.array([False, True, False]))
    d = pa.DictionaryArray.from_arrays(pa.array([0, None, 1], pa.int8()),
                                       pa.array([False, True], pa.bool_()))
    batch = pa.RecordBatch.from_arrays([pa.array([True, None, False]), v, d], names=["b", "v", "d"])
    with memory_loader([stream(batch)], schema, 8, until="end", device="cpu",
                       format="arrow") as loader:
        got = next(loader)
    assert got["b"].tolist() == [True, True, False]
    assert got["v"].tolist() == [[True, False], [True, True], [False, True]]
    assert got["d"].tolist() == [False, True, True]
    # A producer sends such a table too.
    cols = kfeed.arrowformat.table_columns(schema, pa.Table.from_batches([batch]))
    assert cols["b"].tolist() == [True, True, False]


def test_a_column_pyarrow_cannot_convert_makes_its_message_bad_not_the_read_fail(
        monkeypatch) -> None:
    # As the null bools did: an error of pyarrow's on one message stopped the loader.
    import kfeed.arrowformat as af

    schema = kfeed.Schema({"id": ("int64", (), {"default": -1})})
    real = af._values

    def refuse_the_second(f, col, kind, n):
        if col.to_pylist() == [3, None]:
            raise pa.ArrowInvalid("cannot convert this one\nsecond line")
        return real(f, col, kind, n)

    monkeypatch.setattr(af, "_values", refuse_the_second)
    values = [stream(pa.RecordBatch.from_arrays([pa.array(ids)], names=["id"]))
              for ids in ([1, None], [3, None], [5, None])]
    res = ArrowDecoder(schema).decode_into(values, schema.bind(schema.empty(8)), 0)
    assert res.rows == 4 and res.bad == [(1, "column 'id': cannot convert this one")]


def test_a_permuted_tensor_and_a_start_past_the_end_are_handled() -> None:
    schema = kfeed.Schema({"m": ("float32", (2, 3))})
    permuted = pa.fixed_shape_tensor(pa.float32(), [2, 3], permutation=[1, 0])
    storage = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(6, dtype=np.float32)), 6)
    value = stream(pa.RecordBatch.from_arrays(
        [pa.ExtensionArray.from_storage(permuted, storage)], names=["m"]))
    decoder = ArrowDecoder(schema)
    res = decoder.decode_into([value], schema.bind(schema.empty(4)), 0)
    assert res.rows == 0 and "column 'm' is" in res.bad[0][1]
    good = ArrowEncoder(schema).encode_blocks({"m": np.zeros((3, 2, 3), np.float32)}, 8, 1 << 20)
    res = decoder.decode_into(good, schema.bind(schema.empty(4)), 0, start=5, split=True)
    assert (res.rows, res.consumed, res.bad) == (0, 1, [])  # a position past its 3 records


def test_a_mixture_of_arrow_topics_resumes_exactly() -> None:
    values = {("a", 0): messages(0, 800, rows=50), ("b", 0): messages(10_000, 400, rows=30)}
    mix = kfeed.Mix({"a": 0.7, "b": 0.3}, seed=2, exhausted="renormalize")

    def loader() -> Loader:
        return Loader(None, mix, SCHEMA, 64, source=kfeed.MemorySource(values), device="cpu",
                      until="end", format="arrow")

    whole = collect(loader())["id"]
    assert sorted(whole.tolist()) == list(range(800)) + list(range(10_000, 10_400))
    first = loader()
    head = [next(first)["id"].numpy().copy() for _ in range(5)]
    state = first.state_dict()
    first.close()
    second = loader()
    second.load_state_dict(state)
    assert np.array_equal(np.concatenate(head + [collect(second)["id"]]), whole)


def test_the_c_reader_and_pyarrow_read_the_same_rows() -> None:
    schema = kfeed.Schema({"id": ("int64", ()), "x": ("float32", (3,)),
                           "m": ("float16", (2, 2)), "w": ("int8", (), {"default": -1})})
    ids = np.arange(700)
    cols = {**{k: v for k, v in columns(ids).items() if k != "flag"},
            "w": (ids % 100).astype(np.int8)}
    values = ArrowEncoder(schema).encode_blocks(cols, 45, 1 << 30)
    # A message with a null (the C reader hands it to pyarrow), between good ones.
    nulls = pa.RecordBatch.from_arrays(
        [pa.array([9000, 9001]),
         pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(6, np.float32)), 3),
         pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.float16(), [2, 2]),
                                        pa.FixedSizeListArray.from_arrays(
                                            pa.array(np.zeros(8, np.float16)), 4)),
         pa.array([None, 5], pa.int8())], names=["id", "x", "m", "w"])
    values.insert(5, stream(nulls))
    runs = {}
    for reader in ("c", "pyarrow"):
        decoder = ArrowDecoder(schema)
        out = schema.empty(1000)
        target = schema.bind(out)
        if reader == "pyarrow":  # every message through pyarrow, as without a C plan
            res = decoder._decode_one(values, target, 0, 0, False)
        else:
            res = decoder.decode_into(values, target, 0)
            assert decoder.cplan is not None
        assert (res.rows, res.consumed, res.bad) == (702, len(values), [])
        runs[reader] = {k: v[:res.rows].copy() for k, v in out.items()}
    for name in schema.names:
        assert np.array_equal(runs["c"][name], runs["pyarrow"][name]), name
    got = runs["c"]
    where = {int(i): k for k, i in enumerate(got["id"])}
    assert got["w"][where[9000]] == -1 and got["w"][where[9001]] == 5


def nested_m(inner_mask: list[bool], outer_mask: list[bool] | None = None) -> pa.Array:
    """A (2, 3) float32 column of two rows as nested fixed-size lists, as pyarrow builds one."""
    inner = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(12, dtype=np.float32)), 3,
                                              mask=pa.array(inner_mask))
    mask = None if outer_mask is None else pa.array(outer_mask)
    return pa.FixedSizeListArray.from_arrays(inner, 2, mask=mask)


def test_a_null_inner_list_is_refused_unless_its_row_is_null() -> None:
    plain = kfeed.Schema({"id": ("int64", ()), "m": ("float32", (2, 3))})
    with_default = kfeed.Schema({"id": ("int64", ()), "m": ("float32", (2, 3), {"default": -1.0})})
    inner_null = nested_m([False, True, False, False])  # row 0's second list: None to pyarrow
    assert inner_null.to_pylist()[0] == [[0.0, 1.0, 2.0], None]
    batch = pa.RecordBatch.from_arrays([pa.array([0, 1]), inner_null], names=["id", "m"])
    for schema in (plain, with_default):  # as a null item in a row that is not null
        res = ArrowDecoder(schema).decode_into([stream(batch)], schema.bind(schema.empty(4)), 0)
        assert res.rows == 0 and "column 'm' has null inner lists" in res.bad[0][1]
    with pytest.raises(kfeed.ConfigError, match="column 'm' has null inner lists"):
        kfeed.arrowformat.table_columns(plain, pa.Table.from_batches([batch]))
    # Under a null row, which takes the default, null inner lists are no matter.
    row_null = nested_m([True, True, False, False], [True, False])
    value = stream(pa.RecordBatch.from_arrays([pa.array([0, 1]), row_null], names=["id", "m"]))
    with memory_loader([value], with_default, 8, until="end", device="cpu",
                       format="arrow") as loader:
        got = next(loader)["m"].tolist()
    assert got == [[[-1.0] * 3] * 2, [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]]


def rewritten(value: bytes, old: tuple[int, ...], new: tuple[int, ...]) -> bytes:
    """``value`` with the int32s ``old`` (found once in it) replaced by ``new``."""
    was = np.array(old, "<i4").tobytes()
    assert value.count(was) == 1
    return value.replace(was, np.array(new, "<i4").tobytes())


def dead_letters(values: list[bytes], schema: kfeed.Schema,
                 **kwargs: object) -> tuple[list[dict[str, np.ndarray]], list[tuple[int, str]]]:
    source = kfeed.MemorySource(values)
    with Loader(None, "memory", schema, 3, source=source, until="end", device="cpu",
                format="arrow", **kwargs) as loader:
        batches = [{k: t.numpy().copy() for k, t in b.items()} for b in loader]
    return batches, sorted((m.offset(), why) for m, why in source.dead_letters)


def test_list_and_string_offsets_out_of_order_make_the_message_bad() -> None:
    tokens = kfeed.Schema({"tok": ("int32", (None,))})
    text = kfeed.Schema({"id": ("int64", ()), "s": ("uint8", (None,))})
    lists = stream(pa.RecordBatch.from_arrays(
        [pa.array([[1, 2], [3], [4, 5, 6]], pa.list_(pa.int32()))], names=["tok"]))
    strings = stream(pa.RecordBatch.from_arrays([pa.array([0, 1, 2]), pa.array(["ab", "c", "def"])],
                                                names=["id", "s"]))
    for schema, good in ((tokens, lists), (text, strings)):
        for offsets in ((0, 2, 1, 6), (0, 5, 3, 6), (0, -5, 3, 6)):  # pyarrow's full validation
            bad = rewritten(good, (0, 2, 3, 6), offsets)                 # refuses each
            with pytest.raises(pa.ArrowInvalid):
                pa.ipc.open_stream(bad).read_all().validate(full=True)
            batches, refused = dead_letters([good, bad, good], schema)
            assert [o for o, _ in refused] == [1], offsets
            assert "an invalid record batch" in refused[0][1]
            name = schema.names[-1]
            assert [b[f"{name}_offsets"].tolist() for b in batches] == [[0, 2, 3, 6]] * 2
    bad = rewritten(lists, (0, 2, 3, 6), (0, 2, 1, 6))
    batches, refused = dead_letters([lists, bad, lists], tokens,
                                    pack=kfeed.Pack(seq_len=8, eos_id=None))
    assert [o for o, _ in refused] == [1]
    assert sorted(t for b in batches for t in b["tokens"].ravel().tolist() if t) == \
        sorted([1, 2, 3, 4, 5, 6] * 2)


def test_a_damaged_column_no_field_reads_is_no_matter_first_or_later() -> None:
    # The C reader (a schema's later messages) checks the columns it reads;
    # pyarrow (its first message) checked every column: the same bytes were
    # bad first and read later.
    rb = pa.RecordBatch.from_arrays([pa.array([0, 1, 2]), pa.array(["ab", "c", "def"])],
                                    names=["id", "s"])
    good = stream(rb)
    bad = rewritten(good, (0, 2, 3, 6), (0, 2, 3, 60))  # s's last offset past its data
    ids = kfeed.Schema({"id": ("int64", ())})
    batches, refused = dead_letters([bad, good, bad], ids)
    assert refused == []
    assert [b["id"].tolist() for b in batches] == [[0, 1, 2]] * 3
    both = kfeed.Schema({"id": ("int64", ()), "s": ("uint8", (None,))})
    batches, refused = dead_letters([bad, good, bad], both)
    assert [o for o, _ in refused] == [0, 2]
    assert all("an invalid record batch: column 's': " in why for _, why in refused), refused
    assert [b["id"].tolist() for b in batches] == [[0, 1, 2]]


def test_streams_of_several_batches_empty_or_damaged_are_read_batch_by_batch() -> None:
    schema = kfeed.Schema({"id": ("int64", ()), "tok": ("int32", (None,))})
    rb = pa.RecordBatch.from_arrays([pa.array([0, 1, 2]), pa.array([[1, 2], [3], [4, 5, 6]],
                                                                    pa.list_(pa.int32()))],
                                    names=["id", "tok"])
    good = stream(rb)
    empties = stream(rb.slice(0, 0), rb.slice(0, 0))
    assert pa.ipc.open_stream(empties).read_all().num_rows == 0
    halves = stream(rb.slice(0, 1), rb.slice(1))
    past_the_end = rewritten(stream(rb, rb.slice(0, 1)), (0, 2, 3, 6), (0, 2, 3, 60))
    batches, refused = dead_letters([good, empties, halves, past_the_end, good], schema)
    assert [o for o, _ in refused] == [3]
    assert "an invalid record batch" in refused[0][1]
    assert [b["id"].tolist() for b in batches] == [[0, 1, 2]] * 3
    assert [b["tok_offsets"].tolist() for b in batches] == [[0, 2, 3, 6]] * 3
    assert [b["tok"].tolist() for b in batches] == [[1, 2, 3, 4, 5, 6]] * 3


def test_a_batch_of_no_rows_whose_offsets_buffer_is_empty_reads_as_no_rows() -> None:
    # A zero-length list or string array needs no offsets, and pyarrow writes
    # none: the loader's thread read one from the empty buffer and failed.
    empty = pa.RecordBatch.from_arrays([
        pa.array([], pa.int64()),
        pa.ListArray.from_buffers(pa.list_(pa.int32()), 0, [None, pa.py_buffer(b"")],
                                  children=[pa.array([], pa.int32())]),
        pa.Array.from_buffers(pa.binary(), 0, [None, pa.py_buffer(b""), pa.py_buffer(b"")])],
        names=["id", "t", "s"])
    full = pa.RecordBatch.from_arrays([pa.array([1, 2]),
                                       pa.array([[1], [2, 3]], pa.list_(pa.int32())),
                                       pa.array([b"a", b"bc"])], names=["id", "t", "s"])
    values = [stream(empty), stream(full, empty), stream(empty, full)]
    assert pa.ipc.open_stream(values[0]).read_all().validate(full=True) is None
    for name, dtype, want in (("t", "int32", [[1, 2, 3, 1], [2, 3]]),
                              ("s", "uint8", [list(b"abca"), list(b"bc")])):
        schema = kfeed.Schema({"id": ("int64", ()), name: (dtype, (None,))})
        batches, refused = dead_letters(values, schema)
        assert refused == []
        assert [b["id"].tolist() for b in batches] == [[1, 2, 1], [2]]
        assert [b[name].tolist() for b in batches] == want
    batches, refused = dead_letters(values, kfeed.Schema({"t": ("int32", (None,))}),
                                    pack=kfeed.Pack(seq_len=4, eos_id=None))
    assert refused == [] and sorted(t for b in batches for t in b["tokens"].ravel().tolist()
                                    if t) == [1, 1, 2, 2, 3, 3]


def test_a_null_count_its_validity_bitmap_does_not_give_makes_the_message_bad() -> None:
    # pyarrow's full validation refuses it; the rows took the default where
    # the bitmap said null, whatever the count said.
    schema = kfeed.Schema({"id": ("int64", ()), "p": ("int32", (), {"default": -7})})
    ids = np.arange(10)
    good = pa.array(ids.astype(np.int32), mask=ids % 4 == 1)  # rows 1, 5 and 9 null
    bitmap = pa.py_buffer(np.packbits(ids % 2 == 0, bitorder="little").tobytes())  # 5 null
    wrong = pa.Array.from_buffers(pa.int32(), 10, [bitmap, good.buffers()[1]], null_count=3)
    values = [stream(pa.RecordBatch.from_arrays([pa.array(ids), col], names=["id", "p"]))
              for col in (good, wrong)]
    with pytest.raises(pa.ArrowInvalid, match="null_count"):
        pa.ipc.open_stream(values[1]).read_all().validate(full=True)
    batches, refused = dead_letters(values, schema)
    assert refused == [(1, "an invalid record batch: column 'p': its null count, 3, is not "
                           "its bitmap's, 5")]
    assert np.concatenate([b["p"] for b in batches]).tolist() == [0, -7, 2, 3, 4, -7, 6, 7, 8, -7]


def test_a_dictionary_index_past_the_dictionary_makes_the_message_bad() -> None:
    schema = kfeed.Schema({"p": ("int32", ())})
    d = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0, 1], pa.int8()),
                                       pa.array([10, 20], pa.int32()))
    good = stream(pa.RecordBatch.from_arrays([d], names=["p"]))
    at = good.rindex(bytes([0, 1, 0, 1]))
    for index in (2, 99, 255):  # 255: -1 as int8
        bad = good[:at] + bytes([0, 1, 0, index]) + good[at + 4:]
        with pytest.raises(pa.ArrowInvalid):
            pa.ipc.open_stream(bad).read_all().validate(full=True)
        batches, refused = dead_letters([good, bad, good], schema)
        assert [o for o, _ in refused] == [1], index
        assert "an invalid record batch: column 'p'" in refused[0][1]
        assert np.concatenate([b["p"] for b in batches]).tolist() == [10, 20, 10, 20] * 2


def test_a_column_name_that_is_not_utf8_makes_the_message_bad() -> None:
    schema = kfeed.Schema({"id": ("int64", ()), "score": ("float64", (), {"source": "meta.score"})})
    meta = pa.StructArray.from_arrays([pa.array([0.5, 1.5])], names=["score"])
    good = stream(pa.RecordBatch.from_arrays([pa.array([7, 8]), meta], names=["id", "meta"]))
    for name in (b"id", b"score"):  # a top-level column's name, and a struct field's
        at = good.index(name)
        bad = good[:at] + b"\xc1" + good[at + 1:]
        with pytest.raises(UnicodeDecodeError):
            pa.ipc.open_stream(bad).schema.names if name == b"id" else \
                pa.ipc.open_stream(bad).schema.field(1).type.field(0).name
        batches, refused = dead_letters([good, bad, good], schema)
        assert [o for o, _ in refused] == [1], name
        assert "not UTF-8" in refused[0][1]
        assert np.concatenate([b["id"] for b in batches]).tolist() == [7, 8] * 2


def test_nulls_pyarrow_reads_under_a_null_row_or_in_a_dictionary_take_the_default() -> None:
    schema = kfeed.Schema({"tok": ("int32", (None,), {"default": [0]}),
                           "p": ("int64", (), {"default": -1})})
    tok = pa.ListArray.from_arrays(pa.array([0, 1, 2, 3], pa.int32()),
                                   pa.array([1, None, 2], pa.int32()),
                                   mask=pa.array([False, True, False]))  # None over [None]
    p = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0], pa.int8()),
                                       pa.array([5, None], pa.int64()))  # a null value
    batch = pa.RecordBatch.from_arrays([tok, p], names=["tok", "p"])
    assert batch.to_pydict() == {"tok": [[1], None, [2]], "p": [5, None, 5]}
    batches, refused = dead_letters([stream(batch)], schema)
    assert refused == []
    assert batches[0]["tok"].tolist() == [1, 0, 2]
    assert batches[0]["tok_offsets"].tolist() == [0, 1, 2, 3]
    assert batches[0]["p"].tolist() == [5, -1, 5]
    # A null item in a row that is not null, or a null without a default: bad.
    no_default = kfeed.Schema({"p": ("int64", ())})
    item = pa.array([[1], [None], [2]], pa.list_(pa.int32()))
    _, refused = dead_letters([stream(pa.RecordBatch.from_arrays([item, p], names=["tok", "p"]))],
                              schema, fail_fast=None)
    assert "column 'tok' has null items in its lists" in refused[0][1]
    _, refused = dead_letters([stream(pa.RecordBatch.from_arrays([p], names=["p"]))], no_default,
                              fail_fast=None)
    assert "column 'p' has 1 null(s) and field 'p' has no default" in refused[0][1]
