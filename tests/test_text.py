"""Token streams, text side: tokenizers, corpus readers, the tiny LM, and the CLI.

Unit tests need no broker; those marked ``integration`` produce a corpus into
a fresh topic, read it back with plain confluent-kafka, and train from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import kfeed
from kfeed import ConfigError, KfeedError
from kfeed._train import document_mask, lm_logits, lm_loss, tiny_lm
from kfeed.text import (
    BYTE_EOS_ID,
    TOKEN_DTYPES,
    ByteTokenizer,
    CorpusError,
    as_token_arrays,
    check_vocab_fits,
    load_tokenizer,
    locate_document,
    read_corpus,
    synthetic_documents,
    token_schema,
)

TEXTS = ["hello world", "naïve café — 東京", "", "a\nb", "x" * 700]


def docs_of(chunks) -> tuple[list, list]:
    texts, keys = [], []
    for c in chunks:
        texts += c.texts if c.texts is not None else [list(map(int, d)) for d in c.ids]
        keys += c.keys or []
    return texts, keys


# -- tokenizers -------------------------------------------------------------------


def test_byte_tokenizer_round_trip() -> None:
    tok = load_tokenizer("bytes")
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids.tolist() == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    ids = tok.encode_batch(TEXTS)
    assert [tok.decode(np.append(i, BYTE_EOS_ID)) for i in ids] == TEXTS  # EOS dropped
    with pytest.raises(KfeedError, match="0..256"):
        tok.decode([300])


def make_tokenizer_json(tmp_path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(synthetic_documents(0, 200) + TEXTS, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_tokenizer_json_round_trip(tmp_path: Path) -> None:
    path = make_tokenizer_json(tmp_path)
    tok = load_tokenizer(str(path))
    assert tok.eos_id == 1 and 30 < tok.vocab_size <= 300
    assert load_tokenizer(str(tmp_path)).vocab_size == tok.vocab_size  # the folder works too
    texts = synthetic_documents(500, 5)
    ids = tok.encode_batch(texts)
    assert all(i.ndim == 1 and len(i) and i.max() < tok.vocab_size for i in ids)
    # Whitespace pre-tokenization: decoding gives the words back, spaced.
    for t, i in zip(texts, ids):
        assert tok.decode(i).replace(" ", "") == t.replace(" ", "")
    assert 1 not in np.concatenate(ids)  # no special token added


def test_a_special_token_s_text_is_plain_text(tmp_path: Path) -> None:
    # A "</s>" in a document's text became the EOS id: the packer then split
    # the document in two there.
    tok = load_tokenizer(str(make_tokenizer_json(tmp_path)))
    assert tok.eos_id == 1
    docs = ["the river runs", "html says </s> here and goes on", "</s>"]
    ids = tok.encode_batch(docs)
    assert [1 in d.tolist() for d in ids] == [False, False, False]
    assert len(ids[2]) > 1  # the characters of "</s>", not one id


def test_a_tokenizer_json_s_padding_and_truncation_are_not_applied(tmp_path: Path) -> None:
    # A saved file may carry them: the documents were cut to 8 ids, or padded
    # with the pad id, and sent so.
    path = make_tokenizer_json(tmp_path)
    texts = [" ".join(synthetic_documents(600, 4)), "the"]
    want = [ids.tolist() for ids in load_tokenizer(str(path)).encode_batch(texts)]
    assert len(want[0]) > 8 and len(want[1]) < 8
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(path))
    tok.enable_truncation(max_length=8)
    tok.enable_padding(pad_id=0, pad_token="<unk>")
    tok.save(str(path))
    assert [len(e.ids) for e in tok.encode_batch(texts)] == [8, 8]  # as the file says
    got = [ids.tolist() for ids in load_tokenizer(str(path)).encode_batch(texts)]
    assert got == want


def test_a_vocabulary_wider_than_the_token_dtype_is_refused_up_front() -> None:
    # Found only at a document that uses a high id, the topic already held
    # documents of the narrower dtype, and the advice to widen it was refused.
    class Wide:
        name, vocab_size, eos_id = "wide.json", 70_002, None

    with pytest.raises(ConfigError, match=r"^the tokenizer wide.json has 70,002 ids, more than "
                                          r"uint16 holds \(0..65,535\): give --token-dtype "
                                          r"uint32, and the same one for training$"):
        check_vocab_fits(Wide(), "uint16")
    check_vocab_fits(Wide(), "int32")
    Wide.vocab_size = 65_536
    check_vocab_fits(Wide(), "uint16")  # ids 0..65,535
    for dtype in TOKEN_DTYPES:
        check_vocab_fits(ByteTokenizer(), dtype)


def test_an_unreadable_tokenizer_json_is_a_config_error(tmp_path) -> None:
    pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": ')
    with pytest.raises(ConfigError, match="cannot read tokenizer .*: give a tokenizer.json "
                                          "that the tokenizers package wrote"):
        load_tokenizer(str(path))


def test_missing_tokenizers_package_says_what_to_install(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
    with pytest.raises(KfeedError, match="pip install tokenizers"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


def test_missing_tokenizer_file(tmp_path) -> None:
    pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    with pytest.raises(ConfigError, match="no tokenizer file"):  # a usage mistake: exit 2
        load_tokenizer(str(tmp_path / "nope.json"))


def test_token_ids_must_fit_the_dtype() -> None:
    assert as_token_arrays([[1, 2], []], "uint16")[0].dtype == np.uint16
    with pytest.raises(KfeedError, match="70000 do not fit uint16"):
        as_token_arrays([[1], [5, 70000]], "uint16")
    with pytest.raises(KfeedError, match=r"^document 1: token id 300 is outside the "
                                         r"vocabulary of bytes \(257 ids\)"):
        as_token_arrays([[1], [5, 300]], "uint16", vocab=ByteTokenizer())
    # No dtype takes a negative id: widening it (the advice before) cannot help.
    with pytest.raises(KfeedError, match=r"^document 0: token id -1 is negative; token ids "
                                         r"are >= 0$"):
        as_token_arrays([[-1]], "int32")
    with pytest.raises(KfeedError, match=r"^f.txt:9: token id -2 is negative"):
        as_token_arrays([[1], [3, -2]], "int32", place=lambda i: f"f.txt:{8 + i}")
    with pytest.raises(KfeedError, match="1-D int"):
        as_token_arrays([np.ones((2, 2), int)], "int32")
    with pytest.raises(KfeedError, match="token dtype"):
        token_schema("float32")
    assert token_schema("int32").varlen.name == "tokens"


# -- corpus readers ----------------------------------------------------------------


def test_txt_paragraphs_are_documents(tmp_path) -> None:
    path = tmp_path / "c.txt"
    path.write_text("\n\nfirst line\nsecond line\n\n\n\nnext one\n  \nlast\nend", encoding="utf-8")
    want = ["first line\nsecond line", "next one", "last\nend"]
    for chunk_docs in (1, 2, 100):
        texts, keys = docs_of(read_corpus(path, chunk_docs=chunk_docs))
        assert (texts, keys) == (want, [])


def test_txt_byte_order_mark_is_not_text(tmp_path) -> None:
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufefffirst doc\n\nsecond \ufeff doc\n".encode())
    assert docs_of(read_corpus(path))[0] == ["first doc", "second \ufeff doc"]  # only the first
    path.write_bytes("\ufeff\n\nafter a blank\n".encode())
    assert docs_of(read_corpus(path))[0] == ["after a blank"]


def test_txt_not_utf8_names_the_line(tmp_path) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\n\nstill fine\n\xff\xfe oops\n")
    with pytest.raises(CorpusError, match=r"bad.txt:4: not UTF-8"):
        docs_of(read_corpus(path))


def test_jsonl_texts_and_keys(tmp_path) -> None:
    path = tmp_path / "c.jsonl"
    rows = [{"text": t, "src": f"s{i % 2}", "n": i} for i, t in enumerate(TEXTS)]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n"
                    + "\n".join(json.dumps(r) for r in rows[2:]) + "\n", encoding="utf-8")
    for chunk_docs in (1, 3, 100):
        texts, keys = docs_of(read_corpus(path, key_field="src", chunk_docs=chunk_docs))
        assert texts == TEXTS and keys == [r["src"] for r in rows]
    assert docs_of(read_corpus(path, key_field="n"))[1] == list(range(len(TEXTS)))
    chunks = list(read_corpus(path))
    assert chunks[-1].done == chunks[-1].total == path.stat().st_size
    assert chunks[0].keys is None


@pytest.mark.parametrize("line, match", [
    ('{"text": "ok"', r"c.jsonl:3: not valid JSON"),
    ('["text"]', r"c.jsonl:3: expected a JSON object, got list"),
    ('{"body": "x"}', r"c.jsonl:3: no field 'text'"),
    ('{"text": 5}', r"c.jsonl:3: field 'text' must be a string, got int"),
    ('{"text": "x"}', r"c.jsonl:3: key field 'src' must be a string or an int, got nothing"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, line, match) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a", "src": 1}\n{"text": "b", "src": "k"}\n' + line + "\n")
    with pytest.raises(CorpusError, match=match):
        docs_of(read_corpus(path, key_field="src"))


def test_jsonl_lone_surrogate_names_the_line(tmp_path) -> None:
    path = tmp_path / "c.jsonl"
    # A pair is one character; a lone half is no text (UTF-8 cannot encode it).
    path.write_text('{"text": "pair \\ud83d\\ude00"}\n\n{"text": "bad \\ud800 half"}\n')
    with pytest.raises(CorpusError, match=r"c.jsonl:3: field 'text' holds a lone surrogate "
                                          r"\(\\ud800\)"):
        docs_of(read_corpus(path))
    path.write_text('{"text": "a", "k": "\\uDC00"}\n')
    with pytest.raises(CorpusError, match=r"c.jsonl:1: field 'k' holds a lone surrogate"):
        docs_of(read_corpus(path, key_field="k"))
    path.write_text('{"text": "pair \\ud83d\\ude00 and \\\\ud800 escaped"}\n')
    assert docs_of(read_corpus(path))[0] == ["pair \U0001f600 and \\ud800 escaped"]
    # The bytes of a lone surrogate (ED A0 80) are no UTF-8: json.loads took them
    # into a str, and the tokenizer failed on it with no line named.
    path.write_bytes(b'{"text": "ok"}\n{"text": "raw \xed\xa0\x80 half"}\n')
    with pytest.raises(CorpusError, match=r"c.jsonl:2: not UTF-8 \(invalid continuation "
                                          r"byte at byte 14\): convert the file to UTF-8$"):
        docs_of(read_corpus(path))
    path.write_bytes(b'{"text": "a", "k": "\xed\xa0\x80"}\n')
    with pytest.raises(CorpusError, match=r"c.jsonl:1: not UTF-8"):
        docs_of(read_corpus(path, key_field="k"))
    path.write_bytes('\ufeff{"text": "after a byte order mark"}\n'.encode())
    assert docs_of(read_corpus(path))[0] == ["after a byte order mark"]


def test_locate_document_names_its_first_line(tmp_path) -> None:
    txt = tmp_path / "c.txt"
    txt.write_text("\nfirst\nstill first\n\n\nsecond\n\nthird\n")
    assert [locate_document(txt, i) for i in range(3)] == [f"{txt}:2", f"{txt}:6", f"{txt}:8"]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    assert locate_document(jsonl, 1) == f"{jsonl}:3"
    assert locate_document(tmp_path / "c.parquet", 4) == f"{tmp_path / 'c.parquet'}: row 4"


def test_parquet_text_and_token_id_columns(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [[1, 2, 3], [], [50000], [7] * 900]
    table = pa.table({"text": TEXTS[:4], "ids": pa.array(ids, pa.list_(pa.int32())),
                      "key": ["a", "b", "a", "c"]})
    path = tmp_path / "c.parquet"
    pq.write_table(table, path, row_group_size=3)
    for chunk_docs in (1, 3, 100):
        texts, keys = docs_of(read_corpus(path, key_field="key", chunk_docs=chunk_docs))
        assert texts == TEXTS[:4] and keys == ["a", "b", "a", "c"]
        got, _ = docs_of(read_corpus(path, text_field="ids", chunk_docs=chunk_docs))
        assert got == ids
    with pytest.raises(CorpusError, match="no column 'body'"):
        docs_of(read_corpus(path, text_field="body"))
    pq.write_table(pa.table({"text": [1.0, 2.0]}), tmp_path / "f.parquet")
    with pytest.raises(CorpusError, match="must hold strings .* or lists of ints"):
        docs_of(read_corpus(tmp_path / "f.parquet"))
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "n.parquet")
    with pytest.raises(CorpusError, match="n.parquet: row 1: column 'text' is null"):
        docs_of(read_corpus(tmp_path / "n.parquet"))


def test_npy_object_and_flat_with_lengths(tmp_path) -> None:
    docs = [np.array([1, 2, 3]), np.array([], np.int64), np.array([9] * 5)]
    obj = np.empty(len(docs), object)
    obj[:] = docs
    np.save(tmp_path / "o.npy", obj, allow_pickle=True)
    want = [d.tolist() for d in docs]
    assert docs_of(read_corpus(tmp_path / "o.npy", chunk_docs=2))[0] == want
    np.save(tmp_path / "flat.npy", np.concatenate(docs).astype(np.int32))
    np.save(tmp_path / "len.npy", np.array([3, 0, 5]))
    for chunk_docs in (1, 2, 10):
        got, _ = docs_of(read_corpus(tmp_path / "flat.npy", lengths=tmp_path / "len.npy",
                                     chunk_docs=chunk_docs))
        assert got == want
    with pytest.raises(CorpusError, match="needs --lengths"):
        docs_of(read_corpus(tmp_path / "flat.npy"))
    np.save(tmp_path / "bad_len.npy", np.array([3, 1]))
    with pytest.raises(CorpusError, match="lengths add up to 4, .*flat.npy holds 8 ids"):
        docs_of(read_corpus(tmp_path / "flat.npy", lengths=tmp_path / "bad_len.npy"))
    np.save(tmp_path / "f.npy", np.ones(4, np.float32))
    with pytest.raises(CorpusError, match="1-D int array"):
        docs_of(read_corpus(tmp_path / "f.npy", lengths=tmp_path / "len.npy"))
    # A lengths file missing, of objects, or no .npy at all (were numpy's and the OS's errors).
    with pytest.raises(CorpusError, match=r"nosuch.npy: no such file of lengths$"):
        docs_of(read_corpus(tmp_path / "flat.npy", lengths=tmp_path / "nosuch.npy"))
    np.save(tmp_path / "obj_len.npy", obj, allow_pickle=True)
    (tmp_path / "len.txt").write_text("3 0 5\n")
    for name in ("obj_len.npy", "len.txt"):
        with pytest.raises(CorpusError, match=f"{name}: not a .npy file of lengths"):
            docs_of(read_corpus(tmp_path / "flat.npy", lengths=tmp_path / name))


def test_corpus_file_errors(tmp_path) -> None:
    with pytest.raises(CorpusError, match="a corpus is .txt"):
        read_corpus(tmp_path / "c.csv")
    with pytest.raises(CorpusError, match="no such file"):
        read_corpus(tmp_path / "c.jsonl")
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(ConfigError, match="no key field: leave it out"):  # an argument's mistake
        read_corpus(tmp_path / "c.txt", key_field="k")
    with pytest.raises(ConfigError, match="lengths apply to a flat .npy only: leave them out"):
        read_corpus(tmp_path / "c.txt", lengths="l.npy")


def test_skip_docs_leaves_out_exactly_the_first_n_documents(tmp_path) -> None:
    from kfeed.ingest import skip_documents as _skip_documents

    path = tmp_path / "c.jsonl"
    texts, keys = write_jsonl(path, 2500)  # chunks of 1024, 1024 and the rest
    for n in (0, 1, 1023, 1024, 1500, len(texts) - 1, len(texts)):
        chunks = list(_skip_documents(read_corpus(path, key_field="src"), n, ""))
        assert [t for c in chunks for t in c.texts] == texts[n:]
        assert [k for c in chunks for k in c.keys] == keys[n:]
        assert all(len(c) for c in chunks)
    with pytest.raises(KfeedError, match="more documents than there are"):
        list(_skip_documents(read_corpus(path), len(texts) + 1, ""))


def test_synthetic_documents_are_seeded_and_chunk_free() -> None:
    docs = synthetic_documents(0, 400)
    assert synthetic_documents(100, 50) == docs[100:150]
    assert synthetic_documents(0, 400, seed=1) != docs
    sizes = np.array([len(d.encode()) for d in docs])
    assert 400 < np.median(sizes) < 600 and sizes.min() >= 16
    assert (sizes > 1000).mean() > 0.1  # a real tail, not one length
    with pytest.raises(ConfigError, match=r"^seed must be an int >= 0, got -1$"):
        synthetic_documents(0, 1, seed=-1)  # (was numpy's ValueError)


# -- the tiny LM -------------------------------------------------------------------


def packed_batch(docs: list[list[int]], rows: int, seq_len: int) -> dict[str, torch.Tensor]:
    packer = kfeed.Packer(kfeed.Pack(seq_len=seq_len, eos_id=BYTE_EOS_ID, pad_id=0), rows)
    packer.feed(np.concatenate([np.asarray(d, np.int64) for d in docs]), [len(d) for d in docs])
    packer.finish()
    out = packer.empty(like="torch")
    info = packer.next_batch(out)
    assert info is not None and info.rows == rows
    return out


def test_document_mask_is_block_diagonal_causal() -> None:
    doc = torch.tensor([[0, 0, 0, 1, 1, -1, -1], [2, 2, 3, 3, 3, 3, 3]])
    mask = document_mask(doc)
    for b in range(2):
        for i in range(7):
            for j in range(7):
                allowed = i == j or (j < i and doc[b, i] == doc[b, j] and doc[b, i] >= 0)
                assert bool(mask[b, i, j]) is not allowed, (b, i, j)


def test_no_token_sees_another_document() -> None:
    torch.manual_seed(0)
    model = tiny_lm(257, 8).eval()
    # Rows of 8: the second document straddles the rows.
    batch = packed_batch([[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]], 2, 8)
    assert batch["doc_ids"][1, 0] == 1
    other = {k: v.clone() for k, v in batch.items()}
    # Change the second document: the first's logits must not move, the
    # second's must (so the check can fail), the third's must not either.
    doc = batch["doc_ids"]
    other["tokens"][doc == 1] = 100
    with torch.no_grad():
        a, b = lm_logits(model, batch), lm_logits(model, other)
    assert torch.equal(a[doc == 0], b[doc == 0]) and torch.equal(a[doc == 2], b[doc == 2])
    assert not torch.allclose(a[doc == 1], b[doc == 1])


def test_loss_skips_padding_and_the_position_after_eos() -> None:
    torch.manual_seed(0)
    batch = packed_batch([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 2, 8)
    tokens, doc = batch["tokens"], batch["doc_ids"]
    logits = torch.randn(2, 8, 257)
    # The oracle: every (i -> i+1) inside one row and one document.
    terms = [torch.nn.functional.cross_entropy(logits[r, i], tokens[r, i + 1])
             for r in range(2) for i in range(7)
             if doc[r, i] >= 0 and doc[r, i] == doc[r, i + 1]]
    assert len(terms) == 3 + 2 + 4 - 1  # a document of n tokens gives n, less one row split
    assert torch.allclose(lm_loss(logits, tokens, doc), torch.stack(terms).mean())
    # Changing what padding and the EOS-to-next-document positions predict
    # changes nothing.
    skipped = torch.ones(2, 8, dtype=torch.bool)
    skipped[:, :-1] = ~((doc[:, :-1] >= 0) & (doc[:, :-1] == doc[:, 1:]))
    noisy = logits.clone()
    noisy[skipped] = torch.randn(int(skipped.sum()), 257) * 10
    assert torch.allclose(lm_loss(noisy, tokens, doc), lm_loss(logits, tokens, doc))


def test_tiny_lm_learns_from_packed_rows() -> None:
    torch.manual_seed(0)
    tok = ByteTokenizer()
    docs = [d.tolist() for d in tok.encode_batch(synthetic_documents(0, 4))]
    batch = packed_batch(docs, 2, 48)
    model = tiny_lm(257, 48)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    losses = []
    for _ in range(15):
        loss = lm_loss(lm_logits(model, batch), batch["tokens"], batch["doc_ids"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


# -- through Kafka -----------------------------------------------------------------


def kfeed_cmd(*args: str, bootstrap: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "KFEED_BOOTSTRAP": bootstrap}
    return subprocess.run([sys.executable, "-m", "kfeed", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def read_topic(bootstrap: str, topic: str, partitions: int) -> dict[int, list[bytes]]:
    """Every message value per partition, with a plain confluent-kafka consumer."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                         "enable.auto.commit": False})
    try:
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                for p in range(partitions)}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        values: dict[int, list[bytes]] = {p: [] for p in range(partitions)}
        left = sum(ends.values())
        while left:
            for m in consumer.consume(256, timeout=5):
                assert m.error() is None, m.error()
                values[m.partition()].append(m.value())
                left -= 1
        return values
    finally:
        consumer.close()


def write_jsonl(path: Path, n: int) -> tuple[list[str], list[str]]:
    texts = synthetic_documents(0, n) + ["", "ünïcode ✓"]
    keys = [f"source-{i % 5}" for i in range(len(texts))]
    with open(path, "w", encoding="utf-8") as f:
        for t, k in zip(texts, keys):
            f.write(json.dumps({"text": t, "src": k}) + "\n")
    return texts, keys


@pytest.mark.integration
@pytest.mark.parametrize("keyed", [False, True])
def test_produce_corpus_reads_back_equal(bootstrap, make_topic, tmp_path, keyed) -> None:
    topic = make_topic(partitions=4)
    path = tmp_path / "c.jsonl"
    texts, keys = write_jsonl(path, 1500)  # more than one chunk of 1024
    args = ["produce", "--topic", topic, "--from", str(path), "--token-dtype", "int32"]
    done = kfeed_cmd(*args, *(["--key-field", "src"] if keyed else []), bootstrap=bootstrap)
    assert done.returncode == 0, done.stderr
    # The one empty document has no tokens to send: left out, and said so.
    assert f"produced {len(texts) - 1:,} documents, 1 empty left out (" in done.stdout
    assert "tokens/s" in done.stdout
    schema = token_schema("int32")
    tok = ByteTokenizer()
    got: dict[int, list[bytes]] = {}
    for p, values in read_topic(bootstrap, topic, 4).items():
        docs = schema.decode_documents(values)
        assert docs.bad == []
        bounds = np.cumsum(docs.lengths)[:-1]
        got[p] = [bytes(d.astype(np.uint8)) for d in np.split(docs.tokens, bounds)] \
            if len(docs.lengths) else []
    want = [(t.encode(), k) for t, k in zip(texts, keys) if t]
    assert sorted(d for ds in got.values() for d in ds) == sorted(w for w, _ in want)
    if keyed:
        # One key, one partition (Java's murmur2), file order kept inside it.
        for p, ds in got.items():
            mine = [w for w, k in want if kfeed.partition_for(k.encode(), 4) == p]
            assert ds == mine
    assert tok.decode(np.frombuffer(want[-1][0], np.uint8)) == texts[-1]


@pytest.mark.integration
def test_produce_bad_corpus_fails_with_the_line_and_makes_no_topic(bootstrap, tmp_path) -> None:
    from confluent_kafka.admin import AdminClient

    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"\n')
    topic = f"kfeed-test-{uuid.uuid4().hex}"
    done = kfeed_cmd("produce", "--topic", topic, "--from", str(path), bootstrap=bootstrap)
    # Among the first documents, before anything was sent: a mistake to fix, no topic made.
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"kfeed: {path}:2: not valid JSON (Expecting ',' delimiter at "
                           f"column 1)\n")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    assert topic not in admin.list_topics(timeout=30).topics


@pytest.mark.integration
def test_produce_with_a_vocabulary_wider_than_the_dtype_makes_no_topic(bootstrap,
                                                                       tmp_path) -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    from confluent_kafka.admin import AdminClient

    vocab = {f"w{i}": i for i in range(70_002)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "w1 w2"}\n')
    topic = f"kfeed-test-{uuid.uuid4().hex}"
    args = ["produce", "--topic", topic, "--from", str(path), "--tokenizer", str(tmp_path)]
    done = kfeed_cmd(*args, bootstrap=bootstrap)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"kfeed: the tokenizer {tmp_path / 'tokenizer.json'} has 70,002 ids, "
                           f"more than uint16 holds (0..65,535): give --token-dtype uint32, and "
                           f"the same one for training\n")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    assert topic not in admin.list_topics(timeout=30).topics
    done = kfeed_cmd(*args, "--token-dtype", "uint32", bootstrap=bootstrap)
    assert done.returncode == 0, done.stderr
    assert "produced 1 documents (2 tokens, uint32" in done.stdout


@pytest.mark.integration
def test_a_bad_line_after_the_first_chunk_says_how_to_go_on(bootstrap, make_topic,
                                                             tmp_path) -> None:
    topic = make_topic(partitions=2)
    path = tmp_path / "c.jsonl"
    texts, _ = write_jsonl(path, 1500)  # chunks of 1024: the bad line is in the second
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    good = lines[1200]
    lines[1200] = '{"text": "broken\n'
    path.write_text("".join(lines), encoding="utf-8")
    args = ["produce", "--topic", topic, "--from", str(path), "--token-dtype", "int32"]
    done = kfeed_cmd(*args, bootstrap=bootstrap)
    assert done.returncode == 1
    assert "c.jsonl:1201: not valid JSON" in done.stderr
    assert "The 1024 documents before this chunk were sent" in done.stderr
    assert "--skip-docs 1024" in done.stderr
    lines[1200] = good  # the user fixes the line and goes on
    path.write_text("".join(lines), encoding="utf-8")
    done = kfeed_cmd(*args, "--skip-docs", "1024", bootstrap=bootstrap)
    assert done.returncode == 0, done.stderr
    assert f"produced {len(texts) - 1024 - 1:,} documents, 1 empty left out" in done.stdout
    schema = token_schema("int32")
    got = []
    for values in read_topic(bootstrap, topic, 2).values():
        docs = schema.decode_documents(values)
        if len(docs.lengths):  # a partition may hold none
            got += [bytes(d.astype(np.uint8))
                    for d in np.split(docs.tokens, np.cumsum(docs.lengths)[:-1])]
    assert sorted(got) == sorted(t.encode() for t in texts if t)  # each document once


def _loader_packs() -> bool:
    import inspect

    return "pack" in inspect.signature(kfeed.Loader).parameters


def lm_summary(stdout: str) -> tuple[int, float]:
    """Real tokens and packing efficiency (%) from ``kfeed train --task lm``'s last line."""
    summary = stdout.strip().splitlines()[-1]
    assert "tokens/s" in summary and "data stall" in summary, stdout
    real = int(summary.split(" tokens in ")[0].rsplit(" ", 1)[1].replace(",", ""))
    return real, float(summary.split("packing efficiency ")[1].split("%")[0])


@pytest.mark.integration
def test_train_lm_with_another_token_dtype_says_which_flags(bootstrap, make_topic) -> None:
    # It said "fix the schema (or the topic)": kfeed train's schema is its flags'.
    topic = make_topic(partitions=1)
    done = kfeed_cmd("produce", "--topic", topic, "--synthetic-text", "8", bootstrap=bootstrap)
    assert done.returncode == 0, done.stderr
    done = kfeed_cmd("train", "--task", "lm", "--topic", topic, "--group-id", topic,
                     "--token-dtype", "int32", "--until-end", bootstrap=bootstrap)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert "the loader expects tokens int32[*]; the message was written with tokens " \
        "uint16[*]" in lines[0], lines
    assert ("Nothing was dead-lettered or committed: kfeed train --task lm reads one "
            "variable-length int32 field 'tokens' (--token-dtype): give the flags that match "
            f"the topic, or produce it for these (topic={topic}, partition=0, offset=0)") \
        in lines[0], lines


@pytest.mark.integration
@pytest.mark.skipif(not _loader_packs(), reason="kfeed.Loader has no pack= yet")
def test_train_lm_until_end_and_resume(bootstrap, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=2)
    docs = 16
    done = kfeed_cmd("produce", "--topic", topic, "--synthetic-text", str(docs), "--keyed",
                     bootstrap=bootstrap)
    assert done.returncode == 0, done.stderr
    tokens = int(done.stdout.split("(")[1].split()[0].replace(",", ""))
    ckpt = tmp_path / "lm.pt"
    args = ["train", "--task", "lm", "--topic", topic, "--group-id", uuid.uuid4().hex,
            "--until-end", "--device", "cpu", "--batch-size", "4", "--seq-len", "64",
            "--log-every", "5", "--checkpoint", str(ckpt), "--checkpoint-every", "5",
            "--shuffle", "16", "--resume"]
    first = kfeed_cmd(*args, "--steps", "5", bootstrap=bootstrap, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "packing" in first.stdout and "tokens/s" in first.stdout, first.stdout
    real1, eff1 = lm_summary(first.stdout)
    assert (real1, eff1) == (5 * 4 * 64, 100.0)  # full rows before the end
    assert torch.load(ckpt, weights_only=False)["task"] == "lm"
    rest = kfeed_cmd(*args, bootstrap=bootstrap, timeout=400)
    assert rest.returncode == 0, rest.stderr
    assert "resumed from" in rest.stdout and "packing efficiency" in rest.stdout
    real2, eff2 = lm_summary(rest.stdout)
    # Every document and its EOS, once, across the two runs.
    assert real1 + real2 == tokens + docs
    assert 90.0 < eff2 <= 100.0
    mlp = kfeed_cmd(*args, "--task", "mlp", bootstrap=bootstrap)
    assert mlp.returncode == 2 and "checkpoint of --task lm" in mlp.stderr


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_demo_lm_checks_token_ids_without_a_step_waiting_on_the_device(device) -> None:
    # On CUDA the largest id was read (int(tokens.max())) every step: the host
    # waited for the device each step. There it is read where a line is
    # printed or a checkpoint made; on the CPU, where reading it costs
    # nothing, each step. ("cuda" runs the same code on a CPU model here.)
    from types import SimpleNamespace

    from kfeed._train import _LMTask

    opts = SimpleNamespace(tokenizer="bytes", eos_id=None, token_dtype="uint16", seq_len=8,
                           shuffle=0, seed=0, batch_size=2)
    task = _LMTask(opts, "cpu")
    task._eager = device == "cpu"
    docs = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15]]
    task.loss(packed_batch(docs, 2, 8))  # the first batch: checked at once
    task.check()
    past = packed_batch([docs[0] + [task.vocab_size + 7], *docs[1:]], 2, 8)
    if device == "cpu":
        with pytest.raises(kfeed.ConfigError, match=f"token id {task.vocab_size + 7} is past"):
            task.loss(past)
        return
    loss = task.loss(past)  # trained on the last id, for now
    assert torch.isfinite(loss)
    with pytest.raises(kfeed.ConfigError, match=f"token id {task.vocab_size + 7} is past the "
                                                f"model's vocabulary of {task.vocab_size} ids"):
        task.check()
