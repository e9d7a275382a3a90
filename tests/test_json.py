"""JSON topics as other services write them: kfeed's batches against json.loads.

Values come from ``json.dumps`` and from confluent-kafka's ``JSONSerializer``
(Confluent JSON Schema framing); every field of every record kfeed decodes
must equal what ``json.loads`` reads, cast to the field's dtype.
"""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest
from confluent_kafka import Producer as KafkaProducer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from records import check_packed_documents, damage, decode_all, kfeed_cli

import kfeed
from kfeed.loader import memory_loader

SCHEMA = kfeed.Schema({
    "id": ("int64", ()),
    "features": ("float32", (8,)),
    "grid": ("int16", (2, 3)),
    "label": ("int32", ()),
    "score": ("float64", (), {"default": -1.0}),
    "age": ("uint8", (), {"source": "user.age", "default": 0}),
    "vip": ("bool", (), {"source": "user.flags.vip", "default": False}),
})
JSON_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "features": {"type": "array"},
                   "grid": {"type": "array"}, "label": {"type": "integer"},
                   "score": {"type": ["number", "null"]}, "note": {"type": "string"},
                   "user": {"type": ["object", "null"]}},
}


def make(i: int, rng: np.random.Generator) -> dict:
    rec = {
        "note": "quote \" backslash \\ tab \t unicode é " * (i % 3),
        "id": i,
        "features": [float(x) for x in rng.standard_normal(8)],
        "grid": rng.integers(-300, 300, (2, 3)).tolist(),
        "label": int(rng.integers(-2**31, 2**31)),
        "score": None if i % 4 == 0 else float(rng.standard_normal()) * 1e30,
        "extra": {"nested": [1, {"deep": [True, None, "x"]}], "n": -1.5e-7},
    }
    if i % 5:
        rec["user"] = {"age": i % 256, "name": "ü" * (i % 4),
                       "flags": {"vip": bool(i % 2), "other": []}}
    elif i % 10 == 0:
        rec["user"] = None
    return rec


def expected(records: list[dict]) -> dict[str, np.ndarray]:
    cols: dict[str, list] = {f.name: [] for f in SCHEMA.fields}
    for r in records:
        user = r.get("user") or {}
        cols["id"].append(r["id"])
        cols["features"].append(r["features"])
        cols["grid"].append(r["grid"])
        cols["label"].append(r["label"])
        cols["score"].append(-1.0 if r.get("score") is None else r["score"])
        cols["age"].append(user.get("age", 0))
        cols["vip"].append(user.get("flags", {}).get("vip", False))
    return {f.name: np.array(cols[f.name]).astype(f.storage) for f in SCHEMA.fields}


def test_every_field_equals_json_loads_plain_and_framed():
    rng = np.random.default_rng(2)
    records = [make(i, rng) for i in range(10_000)]
    registry = SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})
    framed = JSONSerializer(json.dumps(JSON_SCHEMA), registry)
    ctx = SerializationContext("events", MessageField.VALUE)
    values = [json.dumps(r, indent=1 if i % 7 == 0 else None, ensure_ascii=i % 2 == 0).encode()
              if i % 3 else framed(r, ctx) for i, r in enumerate(records)]
    assert values[0][0] == 0 and values[1][0] == ord("{")
    got, bad = decode_all(kfeed.Json().decoder(SCHEMA), SCHEMA, values)
    assert bad == []
    want = expected([json.loads(v[5:] if v[0] == 0 else v) for v in values])
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(got[f.name], want[f.name], err_msg=f.name)
    assert got["vip"].any() and (got["age"] == 0).any() and (got["score"] == -1).any()


def test_bad_values_are_rejected_whole_with_a_reason():
    good = json.dumps(make(1, np.random.default_rng(0)))
    record = json.loads(good)

    def variant(**changes) -> bytes:
        return json.dumps({**record, **changes}).encode()

    values = [
        good.encode(),
        b"not json",
        good[:-5].encode(),                                  # truncated
        variant(features=[1.0] * 7),                          # 7 of 8
        variant(label=1.5),                                   # a float into int32
        variant(label="7"),                                   # a string into int32
        variant(grid=[[1, 2, 3], [4, 5, 40000]]),             # 40000 into int16
        variant(id=None),                                     # null, no default
        good.encode() + b" {}",                               # after the object
        variant(user=[1]),                                    # an object expected
        variant(features=[1.0] * 7 + [None]),                 # a null element
        b"[1, 2]",                                            # not an object
        b"\x00\x00\x01",                                      # a short frame
        b'{"id": 2, "a": ' + b"[" * 1000 + b"]" * 1000 + b"}",  # nested too deep
        variant(features=[1.0] * 8 + [[2, {"x": [3]}], "a"]),  # 10 of 8, counted
        variant(grid=[[1, 2, 3, 4, 5], [4, 5, 6]]),          # 5 of 3, one level down
        variant(id=2),
    ]
    reasons = {1: "not JSON", 2: "truncated",
               3: "array of 7 items does not match the field's shape at features",
               4: "a value of another kind than the field's at label",
               5: "a value of another kind than the field's at label",
               6: "a number that does not fit the field's dtype at grid",
               7: "field 'id': missing or null, and no default",
               8: "2 bytes left after the object", 9: "not an object at user",
               10: "null element at features", 11: "not JSON",
               12: "too short for the Confluent framing", 13: "nested deeper than 1000",
               14: "array of 10 items does not match the field's shape at features",
               15: "array of 5 items does not match the field's shape at grid"}
    got, bad = decode_all(kfeed.Json().decoder(SCHEMA), SCHEMA, values, rows=4)
    assert [i for i, _ in bad] == sorted(reasons)
    for i, why in bad:
        assert reasons[i] in why, (i, why)
    assert got["id"].tolist() == [1, 2]


def test_keys_escaped_repeated_and_numbers_as_json_loads_reads_them():
    schema = kfeed.Schema({"id": ("int64", ()), "x": ("float64", (4,)),
                           "é": ("float32", (), {"default": 0.0})})
    values = [
        b'{"\\u0069d": 1, "x": [1e2, -0.5E-3, NaN, -Infinity], "\\u00e9": 2}',
        b'{"id": 1, "id": 2, "x": [0, 1, 2, 3]}',             # the last key wins
        b' \n{"x": [1.7976931348623157e308, 5e-324, 0.1, 3], "id": -9223372036854775808}\t',
        b'{"id": 9223372036854775808, "x": [0, 0, 0, 0]}',    # past int64
        b'{"id": 01, "x": [0, 0, 0, 0]}',                      # a leading zero
    ]
    out = {f.name: np.zeros((5, *f.shape), f.storage) for f in schema.fields}
    res = kfeed.Json().decoder(schema).decode_into(values, schema.bind(out), 0)
    assert [i for i, _ in res.bad] == [3, 4]
    want = [json.loads(v) for v in values[:3]]
    assert out["id"][:3].tolist() == [w["id"] for w in want]
    np.testing.assert_array_equal(out["x"][:3], np.array([w["x"] for w in want]))
    assert out["é"][:3].tolist() == [2.0, 0.0, 0.0]


_IN_LOCALE = """
import json, locale, sys
import numpy as np
import kfeed
locale.setlocale(locale.LC_ALL, "de_DE.UTF-8")
assert locale.localeconv()["decimal_point"] == ","
schema = kfeed.Schema({"x": ("float64", ())})
values = [b'{"x": 0.12345678901234567890123}', b'{"x": 1.5e-30}', b'{"x": 1.5e300}']
out = {"x": np.zeros(3)}
kfeed.Json().decoder(schema).decode_into(values, schema.bind(out), 0)
print(out["x"].tolist() == [json.loads(v)["x"] for v in values], out["x"].tolist())
"""


def test_numbers_read_the_same_whatever_the_processs_locale(tmp_path) -> None:
    # Numbers past the fast paths went to the C library's strtod, which reads
    # by the locale: with a decimal comma (de_DE) 1.5e-30 read as 1.0.
    import shutil
    import subprocess
    import sys

    made = None
    if shutil.which("localedef"):
        made = subprocess.run(["localedef", "-i", "de_DE", "-f", "UTF-8",
                               str(tmp_path / "de_DE.UTF-8")], capture_output=True, check=False)
    if made is None or not (tmp_path / "de_DE.UTF-8").is_dir():
        pytest.skip("no localedef, or no de_DE locale source, to make a decimal-comma locale")
    done = subprocess.run([sys.executable, "-c", _IN_LOCALE], capture_output=True, text=True,
                          env={**os.environ, "LOCPATH": str(tmp_path)}, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True"), done.stdout


def _json_loads_verdict(value: bytes) -> dict | None:
    try:
        return json.loads(value)
    except ValueError:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
        return None


def test_strings_read_skipped_or_keys_are_checked_as_json_loads_checks_them():
    # A raw control character, a malformed escape or bytes that are not UTF-8
    # make json.loads refuse the record, wherever the string lies: a value
    # read, a value skipped (nested or not), a key. json.loads decodes bytes
    # with "surrogatepass", so an encoded surrogate (ED A0 80) is taken.
    refused = [b"a\x00b", b"\x1f", b"tab\there", b"\n", b"\\x", b"\\u12G4", b"\\U0041",
               b"\x80", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xe2\x82", b"\xf0\x8f\xbf\xbf",
               b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff", b"ok\xed\xa0"]
    taken = [b"plain", b"\x7f", b"caf\xc3\xa9", b"\xe2\x82\xac", b"\xf0\x9f\x98\x80",
             b"\xed\xa0\x80", b"\xf4\x8f\xbf\xbf", b"\\u00e9\\ud83d\\ude00\\n\\/", b"\\ud800",
             b"\\udc00\\ud800", b"\\ud83dA"]
    places = [b'{"id": 1, "note": "%s"}', b'{"id": 1, "%s": 0}',
              b'{"id": 1, "x": [{"y": "%s", "z": 1}]}', b'{"id": 1, "doc": {"text": "%s"}}']
    values = [place % text for place in places for text in refused + taken]
    want = [_json_loads_verdict(v) for v in values]
    assert [w is None for w in want] == [t in refused for _ in places for t in refused + taken]
    rows = kfeed.Schema({"id": ("int64", ())})
    got, bad = decode_all(kfeed.Json().decoder(rows), rows, values)
    assert [i for i, _ in bad] == [i for i, w in enumerate(want) if w is None]
    assert got["id"].tolist() == [1] * (len(values) - len(bad))
    for i, why in bad:
        text = refused[i % len(refused + taken)]
        what = ("a raw control character" if min(text) < 0x20 else
                "a malformed escape" if text.startswith(b"\\") else "invalid UTF-8")
        assert why.startswith(what) and why.endswith("in a string"), (i, why)
    # Read as bytes: the very bytes json.loads's string encodes to. A lone
    # surrogate, raw or escaped, which json.loads takes, has no UTF-8: the
    # record is bad (its bytes went into the document as they were).
    text = kfeed.Schema({"id": ("int64", ()), "text": ("uint8", (None,), {"source": "doc.text",
                                                                          "default": []})})
    docs = kfeed.Json().decoder(text).decode_documents(values)
    read = {i: w.get("doc", {}).get("text", "") for i, w in enumerate(want) if w is not None}
    lone = [i for i, s in read.items() if s.encode("utf-8", "surrogatepass") != s.encode(
        "utf-8", "replace")]
    assert [values[i] for i in lone] == [places[3] % t for t in (b"\xed\xa0\x80", b"\\ud800",
                                                                 b"\\udc00\\ud800", b"\\ud83dA")]
    assert [i for i, _ in docs.bad] == sorted([i for i, _ in bad] + lone)
    assert [why for i, why in docs.bad if i in lone] == [
        "a lone surrogate in a string read as bytes at doc.text (it has no UTF-8)"] * len(lone)
    assert docs.tokens.tobytes() == b"".join(s.encode() for i, s in read.items() if i not in lone)
    # As a value that does not fit: the key's last copy decides, as json.loads's.
    twice = [b'{"id": 1, "doc": {"text": "\\ud800", "text": "ok"}}',
             b'{"id": 1, "doc": {"text": "ok", "text": "\\ud800"}}',
             b'{"id": 1, "doc": {"text": "\\ud800", "text": null}}']
    docs = kfeed.Json().decoder(text).decode_documents(twice)
    assert docs.tokens.tobytes() == b"ok" and docs.lengths.tolist() == [2, 0]
    assert [i for i, _ in docs.bad] == [1]
    # Every lead byte from 0x80, with every second byte from 0x70 and what may follow it.
    sweep = [b'{"id": 2, "s": "' + bytes([lead, second]) + tail + b'"}'
             for lead in range(0x80, 0x100) for second in range(0x70, 0x100)
             for tail in (b"", b"\x80", b"\x80\xbf", b"\xbf\x80\x80", b"A")]
    got, bad = decode_all(kfeed.Json().decoder(rows), rows, sweep, rows=len(sweep))
    assert {i for i, _ in bad} == {i for i, v in enumerate(sweep) if _json_loads_verdict(v) is None}


def test_a_utf8_byte_order_mark_is_skipped_as_json_loads_skips_it():
    # RFC 8259 lets a reader ignore a UTF-8 BOM, and json.loads of bytes does; one
    # anywhere else, or UTF-16 and UTF-32 (which json.loads also reads), is refused.
    bom = b"\xef\xbb\xbf"
    values = [bom + b'{"id": 1}', bom + b' {"id": 2} ', b'{"id": 3}' + bom, bom + bom + b'{"id": 4}',
              b' ' + bom + b'{"id": 5}', bom, b"\xef\xbb", '{"id": 6}'.encode("utf-16"),
              '{"id": 7}'.encode("utf-32")]
    want = [_json_loads_verdict(v) for v in values]
    assert [w is None for w in want] == [False, False, True, True, True, True, True, False, False]
    rows = kfeed.Schema({"id": ("int64", ())})
    got, bad = decode_all(kfeed.Json().decoder(rows), rows, values)
    assert got["id"].tolist() == [1, 2]
    assert [i for i, _ in bad] == [2, 3, 4, 5, 6, 7, 8]


def _nested(levels: int, inner: str = "0") -> str:
    """``inner`` inside ``levels`` objects and arrays, in turn, with members after each
    (none deeper than ``inner``'s levels)."""
    text = inner
    for k in range(levels):
        text = ('{"x": %s, "y": [1, "a"]}' if k % 2 else
                '[%s, {"z": null}, 3]' if k else '[%s, 3]') % text
    return text


def test_unread_values_nested_as_deep_as_json_loads_reads_them_are_skipped():
    # json.loads reads nesting as deep as Python's recursion limit (1000 unless
    # raised, less its caller's frames): a record that deep is read, whatever
    # its unread parts hold. Malformed nesting stays bad, as does nesting past 1000.
    schema = kfeed.Schema({"id": ("int64", ()), "v": ("int32", (2,), {"source": "a.v"})})
    record = '{"id": %d, "skip": %s, "a": {"w": %s, "v": [%d, 2]}}'
    values = [(record % (i, _nested(n - 1), _nested(n - 2), -i)).encode()
              for i, n in enumerate((2, 128, 129, 130, 500, 800))]
    want = [json.loads(v) for v in values]
    malformed = ["1: 2", '{"a" 1}', "{1: 2}", "[1,]", '{"a": 1,}', "[1 2]", '{"a": 1]', "[1}",
                 '"\\q"']
    for inner in malformed:
        bad_value = (record % (9, _nested(300, inner), "0", 9)).encode()
        with pytest.raises(json.JSONDecodeError):
            json.loads(bad_value)
        values.append(bad_value)
    values.append((record % (10, "0", _nested(998), 10)).encode())   # 1000 deep: the limit
    values.append((record % (11, _nested(1000), "0", 11)).encode())  # 1001 deep
    got, bad = decode_all(kfeed.Json().decoder(schema), schema, values)
    assert got["id"].tolist() == [w["id"] for w in want] + [10]
    assert got["v"].tolist() == [w["a"]["v"] for w in want] + [[10, 2]]
    assert [i for i, _ in bad] == list(range(len(want), len(want) + len(malformed))) + [
        len(values) - 1]
    assert [why for _, why in bad] == ["not JSON"] * (len(malformed) - 1) + [
        "a malformed escape in a string", "nested deeper than 1000"]


def _escaped(text: str) -> str:
    """``text`` as a JSON string's inside, every character a \\u escape (a pair past U+FFFF)."""
    units = text.encode("utf-16-be")
    return "".join(f"\\u{units[k]:02x}{units[k + 1]:02x}" for k in range(0, len(units), 2))


def test_escaped_keys_of_any_length_match_as_json_loads_reads_them():
    # A key written with escapes is the name json.loads gives it, whatever its
    # length (around 256 bytes too); one character off, or one more or fewer,
    # is another key.
    names = ["k" * (n - 1) + "a" for n in (1, 2, 252, 253, 254, 255, 256, 257, 300, 1000)]
    names += ["\u00e9" * 200 + "\U0001F600", "x" * 255 + "\u00e9"]
    schema = kfeed.Schema({name: ("int64", (), {"default": -1}) for name in names})
    keys = []
    for name in names:
        keys += [_escaped(name), name[:-1] + _escaped(name[-1]), _escaped(name[:-1] + "b"),
                 _escaped(name + "a"), _escaped(name[:-1])]
    values = [b'{"%s": %d}' % (key.encode(), i) for i, key in enumerate(keys)]
    got, bad = decode_all(kfeed.Json().decoder(schema), schema, values)
    assert bad == []
    want = [json.loads(v) for v in values]
    for name in names:
        assert got[name].tolist() == [w.get(name, -1) for w in want], len(name)
        assert sum(got[name] >= 0) == 2  # all escaped, or the last character only


def test_integers_past_int64_long_numbers_and_a_key_nulled_again_as_json_loads_reads_them():
    # json.loads gives ints of any size: a uint64 field takes one up to
    # 2**64 - 1, a float field any (as numpy casts it), an unread key any; a
    # number literal of any length reads; a key whose last value is null is null.
    schema = kfeed.Schema({"u": ("uint64", ()), "f": ("float64", ()),
                           "g": ("float32", (2,), {"default": [0.0, 0.0]}),
                           "i": ("int64", (), {"default": -1})})
    long_float = "0." + "1" * 300
    values = [
        b'{"u": 18446744073709551615, "f": 10000000000000000000, "g": [1e400, 1]}',
        b'{"u": 1, "f": 123456789012345678901234567890, "other": -99999999999999999999999}',
        ('{"u": 2, "f": %s, "other": %s, "i": 3}' % (long_float, long_float)).encode(),
        b'{"u": 3, "f": 1, "i": 5, "i": null, "g": [1, 2], "g": null}',
        b'{"u": 18446744073709551616, "f": 1}',                # past uint64
        b'{"u": -1, "f": 1}',
        b'{"u": 4, "f": 1, "i": 9223372036854775808}',         # past int64
        b'{"u": 6, "f": 1' + b"0" * 400 + b'}',                # an int past float64
        b'{"u": 7, "f": 1e999999}',                             # a float: inf
    ]
    got, bad = decode_all(kfeed.Json().decoder(schema), schema, values)
    want = [json.loads(v) for v in values[:4] + values[8:]]
    assert got["u"].tolist() == [w["u"] for w in want]
    assert got["f"].tolist() == [float(w["f"]) for w in want]
    assert got["g"].tolist() == [[np.inf, 1.0]] + [[0.0, 0.0]] * 4
    assert got["i"].tolist() == [-1, -1, 3, -1, -1]
    assert [i for i, _ in bad] == [4, 5, 6, 7]
    assert all("does not fit the field's dtype at" in why for _, why in bad), bad


def test_a_value_json_loads_drops_with_a_key_given_again_does_not_make_the_record_bad():
    # json.loads keeps a key's last value: a copy before it that the field
    # cannot take is no part of the record, whatever was wrong with it. The
    # last copy is what counts, bad or good; so is an object's key.
    schema = kfeed.Schema({"small": ("int8", ()), "r": ("int32", (2,), {"source": "c.r"}),
                           "age": ("int16", (), {"source": "user.age", "default": -1})})
    kept = [b'{"small": 1000, "small": 5, "c": {"r": [1, 2]}}',       # out of range, then 5
            b'{"small": "x", "small": 3, "c": {"r": [1, 2]}}',        # a string, then 3
            b'{"small": 1, "c": {"r": [1, 2, 3]}, "c": {"r": [7, 8]}}',  # too long, then 2
            b'{"small": 1, "c": {"r": [null, 2]}, "c": {"r": [7, 8]}}',  # a null element
            b'{"small": 1, "c": {"r": [1.5, 2]}, "c": {"r": [7, 8]}}',  # a float in ints
            b'{"small": 1, "c": {"r": [[1], 2]}, "c": {"r": [7, 8]}}',  # nested too deep
            b'{"small": 1, "c": {"r": [1, 2]}, "user": 5, "user": {"age": 30}}',  # not an object
            b'{"small": 1, "c": {"r": [1, 2]}, "user": {"age": 70000}, "user": null}']
    refused = [b'{"small": 5, "small": 1000, "c": {"r": [1, 2]}}',
               b'{"small": 1, "c": {"r": [7, 8]}, "c": {"r": [1, 2, 3]}}',
               b'{"small": 1, "c": {"r": [1, 2]}, "user": {"age": 30}, "user": 5}',
               b'{"small": 1, "c": {"r": [1, 2]}, "user": {"age": 70000, "age": 3}, '
               b'"user": {"age": 70000}}',
               b'{"small": 1000, "small": 5, "c": {"r": [1, 2]}, "tail": [}']  # not JSON
    got, bad = decode_all(kfeed.Json().decoder(schema), schema, kept + refused)
    n = len(kept)
    assert bad == [(n, "a number that does not fit the field's dtype at small"),
                   (n + 1, "array of 3 items does not match the field's shape at c.r"),
                   (n + 2, "not an object at user"),
                   (n + 3, "a number that does not fit the field's dtype at user.age"),
                   (n + 4, "not JSON")]
    want = [json.loads(v) for v in kept]
    assert got["small"].tolist() == [w["small"] for w in want] == [5, 3, 1, 1, 1, 1, 1, 1]
    assert got["r"].tolist() == [w["c"]["r"] for w in want]
    assert got["age"].tolist() == [(w.get("user") or {}).get("age", -1) for w in want]
    assert got["age"].tolist()[-2:] == [30, -1]


_VALUES = st.one_of(st.sampled_from([1, 5, -3, 127, 128, 1000, 70000, "x", None, 2.5, True]),
                    st.lists(st.sampled_from([1, 2, 1000, None, "s", 1.5]), max_size=3))


def _twice_model(o: dict) -> tuple | None:
    """What ``_TWICE`` reads from json.loads' object ``o``; None: a bad record."""
    def num(v: object, bits: int) -> int | None:  # (a bool is 0 or 1, as numpy casts it)
        ok = isinstance(v, int) and -(1 << bits - 1) <= v < 1 << bits - 1
        return int(v) if ok else None

    small = o.get("small")
    small = 0 if small is None else num(small, 8)
    c, user = o.get("c"), o.get("user")
    r = [0, 0] if c is None else c.get("r") if isinstance(c, dict) else "bad"
    r = [0, 0] if r is None else r
    r = [num(x, 32) for x in r] if isinstance(r, list) and len(r) == 2 else [None]
    age = -1 if user is None else user.get("age") if isinstance(user, dict) else "bad"
    age = -1 if age is None else num(age, 16)
    return None if small is None or None in r or age is None else (small, r, age)


_TWICE = kfeed.Schema({"small": ("int8", (), {"default": 0}),
                       "r": ("int32", (2,), {"source": "c.r", "default": [0, 0]}),
                       "age": ("int16", (), {"source": "user.age", "default": -1})})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["small", "c", "user", "other"]), _VALUES,
                          st.lists(_VALUES, max_size=2), st.booleans()),
                min_size=1, max_size=6))
def test_keys_given_again_read_as_json_loads_reads_them(members):
    # Keys, and the keys of the objects they lead to, given again with values
    # of every kind: kfeed keeps or refuses a record as json.loads' last
    # values say, and reads those values.
    inner = {"c": "r", "user": "age"}
    parts = []
    for key, value, again, nested in members:
        if key in inner and nested:  # an object, its key given len(again) + 1 times
            text = ", ".join(f'"{inner[key]}": {json.dumps(v)}' for v in [value, *again])
            parts.append(f'"{key}": {{{text}}}')
        else:
            parts.append(f'"{key}": {json.dumps(value)}')
    value = ("{" + ", ".join(parts) + "}").encode()
    got, bad = decode_all(kfeed.Json().decoder(_TWICE), _TWICE, [value])
    want = _twice_model(json.loads(value))
    if want is None:
        assert len(bad) == 1, (value, got)
    else:
        assert bad == [], value
        assert (int(got["small"][0]), got["r"][0].tolist(), int(got["age"][0])) == want, value


def test_a_document_given_again_drops_the_bad_copy_before_it():
    schema = kfeed.Schema({"tokens": ("int16", (None,))})
    values = [b'{"tokens": [1, 70000, 3], "tokens": [4, 5]}',
              b'{"tokens": [1, null], "tokens": [6]}',
              b'{"tokens": [7], "tokens": [8, 70000]}']
    docs = kfeed.Json().decoder(schema).decode_documents(values)
    assert docs.counts.tolist() == [1, 1, 0]
    assert docs.tokens.tolist() == [4, 5, 6]
    assert docs.bad == [(2, "a number that does not fit the field's dtype at tokens")]


def test_a_uint64_into_float32_and_a_long_exponent_read_as_numpy_casts_json_loads_value():
    # An integer past int64 went into float32 through a double: two roundings,
    # the second from a tie, the wrong way (numpy casts the uint64 once). An
    # exponent of 7 digits or more was cut to 6, and with a number of as many
    # digits the cut one looked small: read exactly, and wrongly.
    schema = kfeed.Schema({"f": ("float32", ()), "d": ("float64", (), {"default": 0.0})})
    values = [b'{"f": 9223372586610589697}',
              b'{"f": 1, "d": 1' + b"0" * 100010 + b'e-1000005}',
              b'{"f": 1, "d": 0.' + b"0" * 100010 + b'1e1000005}']
    got, bad = decode_all(kfeed.Json().decoder(schema), schema, values)
    assert bad == []
    want = [json.loads(v) for v in values]
    assert got["f"][0] == np.array([want[0]["f"]]).astype(np.float32)[0] == np.float32(
        9.223373136366404e18)
    assert got["d"].tolist() == [0.0, float(want[1]["d"]), float(want[2]["d"])] == [0.0, 0.0,
                                                                                      np.inf]


def test_configuration_mistakes_get_one_clear_line():
    with pytest.raises(kfeed.ConfigError, match="cannot be both a value and an object"):
        kfeed.Json().decoder(kfeed.Schema({"a": ("int64", ()),
                                           "b": ("int64", (), {"source": "a.b"})}))
    with pytest.raises(kfeed.ConfigError, match="bool, integer, float32 or float64"):
        kfeed.Json().decoder(kfeed.Schema({"a": ("float16", ())}))
    with pytest.raises(kfeed.ConfigError, match="gives one field, 'tokens': leave 'id' out"):
        kfeed.LoaderConfig(("t",), kfeed.Schema({"tokens": ("int32", (None,)), "id": ("int64", ())}),
                           8, format=kfeed.Json(), pack=kfeed.Pack(seq_len=8, eos_id=0))
    with pytest.raises(kfeed.ConfigError, match="variable-length: read it with pack="):
        kfeed.Json().decoder(kfeed.Schema({"tokens": ("int32", (None,))})).decode_into(
            [], None, 0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_values_never_crash_and_read_as_json_loads_reads_them(data):
    good = json.dumps(make(data.draw(st.integers(0, 50)), np.random.default_rng(0)))
    raw = damage(data, bytearray(good.encode()), list(b'{}[],:"\\0123456789.eE-+ntfa \x00\xff'),
                 [b"9" * 25, b"e999", b".5", b"-"], rounds=(1, 4))
    out = {f.name: np.zeros((2, *f.shape), f.storage) for f in SCHEMA.fields}
    res = kfeed.Json().decoder(SCHEMA).decode_into([bytes(raw), good.encode()],
                                                   SCHEMA.bind(out), 0)
    assert res.consumed == 2 and res.rows + len(res.bad) == 2
    if res.bad and res.bad[0][0] == 0:
        return
    # kfeed took it: json.loads takes it too, and reads the same values.
    record = json.loads(bytes(raw[5:] if raw[:1] == b"\x00" else raw))
    if not isinstance(record, dict):
        return
    try:
        want = expected([record])
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
        return  # json.loads gives something numpy cannot cast alike; kfeed took another path
    for f in SCHEMA.fields:
        with np.errstate(over="ignore", invalid="ignore"):
            np.testing.assert_array_equal(out[f.name][0], want[f.name][0], err_msg=f.name)


def _ids(loader: kfeed.Loader, stop: int | None = None) -> list[int]:
    got = []
    for i, batch in enumerate(loader):
        got += batch["id"].tolist()
        if stop is not None and i == stop:
            break
    return got


def test_json_records_shuffle_as_kfeeds_own_and_resume_exactly():
    rng = np.random.default_rng(11)
    n = 3000
    records = [make(i, rng) for i in range(n)]
    bad = {17: b"{oops", 1900: b'{"id": "x"}'}
    values = {p: [bad.get(i, json.dumps(records[i]).encode()) for i in range(p, n, 2)]
              for p in (0, 1)}
    shuffle = kfeed.Shuffle(buffer=500, seed=3)

    def loader(vals: dict, fmt) -> kfeed.Loader:
        return memory_loader(vals, SCHEMA, 64, device="cpu", until="end",
                             shuffle=shuffle, format=fmt)

    got = _ids(loader(values, kfeed.Json()))
    want = sorted(set(range(n)) - set(bad))
    assert sorted(got) == want  # each good record once
    # Shuffled through the buffer: records move by about its size.
    assert np.abs(np.array(got) - np.array(want)).mean() > 500 / 4
    cols = expected(records)
    # Stopped after some batches and resumed from state_dict(): nothing lost or repeated.
    first = loader(values, kfeed.Json())
    before = _ids(first, stop=9)
    state = first.state_dict()
    first.close()
    second = loader(values, kfeed.Json())
    second.load_state_dict(state)
    after = _ids(second)
    assert sorted(before + after) == want
    # Every field is what json.loads reads, whatever the order.
    with loader(values, kfeed.Json()) as again:
        for batch in again:
            ids = batch["id"].numpy()
            for f in SCHEMA.fields:
                np.testing.assert_array_equal(batch[f.name].numpy(), cols[f.name][ids])


def test_token_documents_pack_as_kfeeds_own_and_resume_exactly():
    rng = np.random.default_rng(5)
    n = 1500
    # Token ids other than the pad (0) and the EOS (65535).
    docs = [rng.integers(1, 65535, int(rng.integers(1, 700)), dtype=np.uint16) for _ in range(n)]
    events = [json.dumps({"id": i, "meta": {"lang": "en"}, "doc": {"ids": d.tolist()}}).encode()
              for i, d in enumerate(docs)]
    events[7] = b'{"doc": {"ids": [1, -1]}}'  # -1 is no uint16: rejected whole
    events[8] = b'{"doc": {"ids": null}}'     # the default: [3, 3]
    docs[7], docs[8] = None, np.array([3, 3], np.uint16)
    tokens = kfeed.Schema({"tokens": ("uint16", (None,), {"source": "doc.ids",
                                                          "default": [3, 3]})})
    check_packed_documents(events, tokens, kfeed.Json(), docs,
                           kfeed.Pack(seq_len=256, eos_id=65535, pad_id=0))


def test_strings_as_bytes_beside_other_fields_come_jagged():
    rng = np.random.default_rng(3)
    words = ["plain", "caf\u00e9", "quote\" and \\", "emoji \U0001F600", "", "tab\there"]
    events = [{"id": i, "query": {"text": words[i % len(words)] * int(rng.integers(1, 4))}}
              for i in range(300)]
    values = [json.dumps(e).encode() for e in events]   # non-ASCII as \\u escapes
    values[9] = json.dumps(events[9], ensure_ascii=False).encode()  # or as UTF-8
    schema = kfeed.Schema({"id": ("int64", ()),
                           "query": ("uint8", (None,), {"source": "query.text"})})
    got = {}
    with memory_loader(values, schema, 64, device="cpu", until="end", format=kfeed.Json()) as L:
        for b in L:
            offs, text = b["query_offsets"].tolist(), b["query"].numpy().tobytes()
            for i, rid in enumerate(b["id"].tolist()):
                got[rid] = text[offs[i]:offs[i + 1]]
    assert got == {e["id"]: e["query"]["text"].encode() for e in events}


@pytest.mark.integration
def test_loader_reads_a_topic_of_json_events(bootstrap, make_topic):
    topic = make_topic(partitions=3)
    rng = np.random.default_rng(9)
    records = [make(i, rng) for i in range(10_000)]
    p = KafkaProducer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for r in records:
        p.produce(topic, json.dumps(r).encode())
        p.poll(0)
    p.produce(topic, b"{broken")
    assert p.flush(60) == 0
    config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
    got: dict[str, list] = {f.name: [] for f in SCHEMA.fields}
    with kfeed.Loader(config, topic, SCHEMA, 500, device="cpu", until="end",
                      format=kfeed.Json(), on_bad_record="skip") as loader:
        for batch in loader:
            for name, parts in got.items():
                parts.append(batch[name].numpy().copy())
        assert loader.stats()["bad_records"] == 1
    cols = {k: np.concatenate(v) for k, v in got.items()}
    order = np.argsort(cols["id"])
    np.testing.assert_array_equal(cols["id"][order], np.arange(10_000))
    want = expected(records)
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(cols[f.name][order], want[f.name], err_msg=f.name)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                          st.decimals(allow_nan=False, allow_infinity=False, places=4,
                                      min_value=-10**12, max_value=10**12).map(float),
                          st.integers(-10**15, 10**15).map(lambda i: i / 1000)),
                min_size=16, max_size=16))
def test_floats_are_the_doubles_json_loads_gives(xs):
    # The short decimals take the exact fast path, the long ones strtod:
    # both must give json.loads's double, bit for bit.
    schema = kfeed.Schema({"x": ("float64", (16,)), "y": ("float32", (16,))})
    text = json.dumps({"x": xs, "y": xs}).encode()
    out = {"x": np.zeros((1, 16)), "y": np.zeros((1, 16), np.float32)}
    res = kfeed.Json().decoder(schema).decode_into([text], schema.bind(out), 0)
    assert res.rows == 1, res.bad
    want = json.loads(text)["x"]
    assert out["x"][0].tobytes() == np.array(want, np.float64).tobytes()
    with np.errstate(over="ignore"):  # past float32's range: inf, as the C cast gives
        assert out["y"][0].tobytes() == np.array(want).astype(np.float32).tobytes()


def test_the_producer_s_json_reads_back_value_for_value():
    # Producer(format=kfeed.Json()) writes what Loader(format=kfeed.Json()) reads: the same
    # bytes for every value, NaN and infinities included, nested by the fields' sources.
    schema = kfeed.Schema({"id": ("int64", ()), "x": ("float32", (2, 3)),
                           "w": ("float64", (), {"source": "m.w"}),
                           "n": ("uint16", (), {"source": "m.deep.n"}), "ok": ("bool", ())})
    rng = np.random.default_rng(1)
    cols = {"id": np.arange(500) - 250, "x": rng.standard_normal((500, 2, 3)).astype(np.float32),
            "w": rng.standard_normal(500) * 1e300, "n": rng.integers(0, 65536, 500, np.uint16),
            "ok": rng.integers(0, 2, 500).astype(bool)}
    cols["x"][0, 0, 0], cols["w"][1], cols["w"][2] = np.nan, np.inf, -np.inf
    values = kfeed.Json().encode(schema, cols)
    assert json.loads(values[3])["m"]["deep"]["n"] == int(cols["n"][3])
    got, bad = decode_all(kfeed.Json().decoder(schema), schema, values, rows=64)
    assert bad == []
    for f in schema.fields:
        assert got[f.name].tobytes() == cols[f.name].astype(f.storage).tobytes(), f.name
    with pytest.raises(kfeed.ConfigError, match="cannot be both a value and an object"):
        kfeed.Json().encode(kfeed.Schema({"a": ("int64", ()),
                                          "b": ("int64", (), {"source": "a.b"})}), {})


@pytest.mark.integration
def test_produce_and_train_from_the_command_line_in_json(bootstrap, make_topic, group_id):
    topic = make_topic(partitions=2)
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--synthetic", "300",
                     "--format", "json")
    assert done.returncode == 0, done.stderr
    done = kfeed_cli(bootstrap, "train", "--topic", topic, "--group-id", group_id, "--until-end",
                     "--device", "cpu", "--format", "json")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("trained 2 steps on 300 samples")
    refused = kfeed_cli(bootstrap, "produce", "--topic", topic, "--synthetic", "3",
                        "--format", "json", "--block-records", "8")
    assert refused.returncode == 2
    assert "--block-records applies to --format block or arrow, not to json" in refused.stderr


@pytest.mark.integration
def test_a_keyed_json_topic_reads_back_whole(bootstrap, make_topic):
    topic = make_topic(partitions=3)
    rng = np.random.default_rng(4)
    cols = {"id": np.arange(2000), "features": rng.standard_normal((2000, 8)).astype(np.float32),
            "grid": rng.integers(-9, 9, (2000, 2, 3)).astype(np.int16),
            "label": rng.integers(0, 9, 2000).astype(np.int32), "score": rng.standard_normal(2000),
            "age": rng.integers(0, 99, 2000).astype(np.uint8),
            "vip": rng.integers(0, 2, 2000).astype(bool)}
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA,
                        format=kfeed.Json()) as p:
        p.send(cols, keys=cols["id"])
    config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
    got: dict[str, list] = {f.name: [] for f in SCHEMA.fields}
    with kfeed.Loader(config, topic, SCHEMA, 256, device="cpu", until="end",
                      format=kfeed.Json()) as loader:
        for batch in loader:
            for name, parts in got.items():
                parts.append(batch[name].numpy().copy())
    order = np.argsort(np.concatenate(got["id"]))
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(np.concatenate(got[f.name])[order],
                                      cols[f.name].astype(f.storage), err_msg=f.name)


def test_a_key_with_a_dot_in_its_name_is_named_with_the_dot_escaped() -> None:
    # Kafka Connect's Flatten writes {"user.age": 30}: no source could name
    # that key, and with a default every record silently took the default.
    values = [json.dumps({"id": i, "user.age": 30 + i, "user": {"age": i / 2}}).encode()
              for i in range(3)]
    schema = kfeed.Schema({"id": ("int64", ()),
                           "age": ("float32", (), {"source": "user\\.age"}),
                           "nested": ("float32", (), {"source": "user.age", "default": -1.0})})
    with kfeed.Loader(None, "memory", schema, 3, device="cpu", until="end",
                      source=kfeed.MemorySource(values), format=kfeed.Json()) as ld:
        (batch,) = list(ld)
    assert batch["age"].tolist() == [30.0, 31.0, 32.0]
    assert batch["nested"].tolist() == [0.0, 0.5, 1.0]
    from kfeed.cli import _convert_schema

    (field,) = _convert_schema(["age=float32@user\\.age"]).fields
    assert field.path == ("user.age",)
