"""``kfeed produce`` and ``kfeed train`` as a new user meets them.

Unit tests call ``kfeed.cli.main([...])`` (or run ``python -m kfeed`` where
the imports matter) and need no broker: every mistake is one stderr line
with its exit status, found before any connection. Integration tests run the
command against the test cluster: topic creation, a group already at the
end, --start, and checkpoints on a clean end and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kfeed import cli, ingest
from kfeed.errors import ConfigError
from records import kfeed_cli

CLOSED = "127.0.0.1:1"  # nothing listens there: a test that connected would fail or hang


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    """Exit status, stderr lines and stdout of ``kfeed ARGV``."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, err.splitlines(), out


def kfeed(*args: str, bootstrap: str = CLOSED, timeout: float = 120,
          python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KFEED_BOOTSTRAP": bootstrap}
    return subprocess.run([sys.executable, *python_flags, "-m", "kfeed", *args], check=False,
                          capture_output=True, text=True, timeout=timeout, env=env)


# -- one line per mistake, exit 2, before any connection ------------------------------

PRODUCE = ("produce", "--bootstrap-servers", CLOSED, "--topic", "t")
TRAIN = ("train", "--bootstrap-servers", CLOSED, "--topic", "t", "--group-id", "g")


@pytest.mark.parametrize(("argv", "line"), [
    (TRAIN + ("--batch-size", "0"), "kfeed: --batch-size 0 is out of range: give an integer >= 1"),
    (PRODUCE + ("--synthetic", "-3"), "kfeed: --synthetic -3 is out of range: give an integer >= 1"),
    (PRODUCE + ("--synthetic-text", "0"),
     "kfeed: --synthetic-text 0 is out of range: give an integer >= 1"),
    # (Never the value: a colon typed for "=" left a password in the line.)
    (PRODUCE + ("--synthetic", "5", "-X", "sasl.password:MY-SECRET"),
     "kfeed: -X 'sasl.password:...' is not KEY=VALUE: write it as e.g. "
     "-X fetch.min.bytes=1048576"),
    (PRODUCE + ("--synthetic-text", "5", "--seed", "-1"),
     "kfeed: --seed -1 is out of range: give an integer in 0..18446744073709551615"),
    (TRAIN + ("--task", "lm", "--seed", "-1"),
     "kfeed: --seed -1 is out of range: give an integer in 0..18446744073709551615"),
    (TRAIN + ("--checkpoint", "c.pt", "--checkpoint-every", "0"),
     "kfeed: --checkpoint-every 0 is out of range: give an integer >= 1"),
    (TRAIN + ("--log-every", "0"), "kfeed: --log-every 0 is out of range: give an integer >= 1"),
    (TRAIN + ("--prefetch", "0"),
     "kfeed: --prefetch 0 is out of range: give an integer >= 1 or auto"),
    (TRAIN + ("--prefetch", "fast"),
     "kfeed: --prefetch 'fast' is not a whole number: give an integer >= 1 or auto"),
    (TRAIN + ("--steps", "-1"), "kfeed: --steps -1 is out of range: give an integer >= 0"),
    (PRODUCE + ("--synthetic", "5", "--block-records", "0"),
     "kfeed: --block-records 0 is out of range: give an integer >= 1"),
    (PRODUCE + ("--synthetic", "5", "--partitions", "-1"),
     "kfeed: --partitions -1 is out of range: give an integer >= 1"),
    (TRAIN + ("--task", "lm", "--seq-len", "0"),
     "kfeed: --seq-len 0 is out of range: give an integer >= 2"),
    (TRAIN + ("--task", "lm", "--shuffle", "-1"),
     "kfeed: --shuffle -1 is out of range: give an integer >= 0"),
    (TRAIN + ("--lr", "0"), "kfeed: --lr 0 is out of range: give a number > 0"),
    (TRAIN + ("--lr", "nan"), "kfeed: --lr nan is out of range: give a number > 0"),
    (TRAIN + ("--batch-size", "many"),
     "kfeed: --batch-size 'many' is not a whole number: give an integer >= 1"),
    (PRODUCE + ("--synthetic", "5", "--connect-timeout", "0"),
     "kfeed: --connect-timeout 0 is out of range: give a number > 0"),
    (TRAIN + ("--start", "yesterday"),
     ("kfeed: --start 'yesterday' is not a start: give earliest, latest, committed or an ISO "
     "time such as 2024-05-01T12:00:00+00:00")),
    (TRAIN + ("--task", "gpt"),
     "kfeed: --task 'gpt' is not one of its choices: choose from 'mlp', 'lm'"),
    (("train", "--topic", "t"), "kfeed: missing --group-id: see 'kfeed train --help'"),
    (PRODUCE, ("kfeed: give one of --synthetic, --synthetic-text, --from: see "
              "'kfeed produce --help'")),
    (PRODUCE + ("--synthetic", "5", "--synthetic-text", "5"),
     "kfeed: --synthetic-text and --synthetic exclude each other: give one of them"),
    (TRAIN + ("--bogus",), "kfeed: unknown argument --bogus: see 'kfeed train --help'"),
    # A misspelt flag that a missing argument names was reported as missing.
    (("produce", "--topc", "clicks", "--synthetic", "10"),
     "kfeed: unknown argument --topc: see 'kfeed produce --help'"),
    (PRODUCE + ("--synthtic", "10"),
     "kfeed: unknown argument --synthtic: see 'kfeed produce --help'"),
    (("lag", "--groupid", "g", "-Xacks=all"),
     "kfeed: unknown argument --groupid: see 'kfeed lag --help'"),
    # ...but a value is no flag, and what follows a missing command is the command's.
    (("produce", "--from", "postgresql://h/db", "--query", "-- daily\nSELECT 1 AS label"),
     "kfeed: missing --topic: see 'kfeed produce --help'"),
    (("cluster", "--dir=/tmp/x"), "kfeed: missing a cluster command: see 'kfeed cluster --help'"),
    (("-v", "produce", "--top", "t", "-Xacks=all"),  # (a prefix, a short flag joined)
     "kfeed: give one of --synthetic, --synthetic-text, --from: see 'kfeed produce --help'"),
    (PRODUCE + ("--synthetic",), "kfeed: --synthetic needs a value: see 'kfeed produce --help'"),
    (PRODUCE + ("--synthetic", "5", "--metrics-port", "70000"),
     "kfeed: --metrics-port 70000 is out of range: give an integer in 1..65535"),
    (("train", "--bootstrap-servers", CLOSED, "--topic", "", "--group-id", "g"),
     "kfeed: --topic '': topic name '' is not valid: use up to 249 of a-z A-Z 0-9 . _ -"),
    (("train", "--bootstrap-servers", CLOSED, "--topic", "bad topic!", "--group-id", "g"),
     ("kfeed: --topic 'bad topic!': topic name 'bad topic!' is not valid: use up to 249 of "
      "a-z A-Z 0-9 . _ -")),
    (("lag", "--bootstrap-servers", CLOSED, "--group-id", ""),
     "kfeed: --group-id '' is empty: give a name"),
    (("convert", "--bootstrap-servers", CLOSED, "--from-topic", "a", "--to-topic", "b",
      "--format", "json", "--field", "id=int64", "--group-id", " "),
     "kfeed: --group-id ' ' is empty: give a name"),
    (("convert", "--bootstrap-servers", CLOSED, "--from-topic", "a", "--to-topic", "a",
      "--format", "json", "--field", "id=int64"),
     ("kfeed: the topic converted from and the one converted to are both 'a': convert "
      "writes to another topic")),
    (("convert", "--bootstrap-servers", CLOSED, "--from-topic", "a", "--to-topic", "b",
      "--format", "avro", "--registry", "registry:8081"),
     ("kfeed: --registry registry:8081 is not an http:// or https:// address: give e.g. "
      "--registry http://registry:8081")),
    (("bogus",), ("kfeed: 'bogus' is not a kfeed command: choose from 'cluster', 'produce', "
                  "'train', 'convert', 'lag'")),
    (("cluster", "bogus"), ("kfeed: 'bogus' is not a kfeed cluster command: choose from 'up', "
                            "'status', 'down', 'list', 'jars'")),
    (("produce", "--bootstrap-servers", "http://127.0.0.1:9092", "--topic", "t", "--synthetic",
      "5"), ("kfeed: --bootstrap-servers http://127.0.0.1:9092: 'http://127.0.0.1:9092' is not "
             "HOST:PORT (e.g. 127.0.0.1:9092; several joined by commas)")),
    (("lag", "--bootstrap-servers", "h:1,h:notaport", "--group-id", "g"),
     ("kfeed: --bootstrap-servers h:1,h:notaport: 'h:notaport' is not HOST:PORT (e.g. "
      "127.0.0.1:9092; several joined by commas)")),
    # Found only once the topic was made (and left behind), or an OverflowError
    # there; the brokers' address is closed, so a run that got that far fails
    # otherwise.
    (PRODUCE + ("--synthetic", "5", "-X", "acks=0"),
     ("kfeed: bad Kafka setting: Failed to create producer: `acks` must be set to `all` when "
      "`enable.idempotence` is true: check its name and value (librdkafka's CONFIGURATION.md "
      "lists them)")),
    (PRODUCE + ("--synthetic", "1000", "--block-records", "100000"),
     ("kfeed: --block-records 100000: a block of that many records is 308,800,032 bytes, over "
      "message.max.bytes=1,000,000 less 1024 for the headers: give --block-records 323 or "
      "fewer (or leave it out), or raise -X message.max.bytes")),
    (TRAIN + ("--checkpoint", "/proc/ck.pt"),  # (found only at the first save, after steps)
     ("kfeed: --checkpoint /proc/ck.pt: cannot write in /proc (No such file or directory): "
      "name a file in a folder this user may write to")),
    (PRODUCE + ("--synthetic", "10", "--first-id", str(2**63 - 8)),
     (f"kfeed: --first-id {2**63 - 8}: the ids of --synthetic 10 would pass "
      f"9,223,372,036,854,775,807, the largest int64 id")),
])
def test_bad_numbers_and_usage_are_one_line_exit_2(capsys, argv, line) -> None:
    code, err, out = run_main(capsys, *argv)
    assert (code, err, out) == (2, [line], "")


def test_a_bad_bootstrap_from_the_environment_is_named_so(capsys, monkeypatch) -> None:
    monkeypatch.setenv("KFEED_BOOTSTRAP", "http://127.0.0.1:9092")
    code, err, out = run_main(capsys, "lag", "--group-id", "g")  # (the default read now)
    assert (code, err, out) == (2, ["kfeed: KFEED_BOOTSTRAP=http://127.0.0.1:9092: "
                                    "'http://127.0.0.1:9092' is not HOST:PORT (e.g. "
                                    "127.0.0.1:9092; several joined by commas)"], "")


def test_an_lm_whose_attention_would_not_fit_is_refused(capsys) -> None:
    # Killed by the kernel after 47 s, with no word.
    code, err, out = run_main(capsys, *TRAIN, "--task", "lm", "--seq-len", "100000")
    assert (code, out) == (2, "") and len(err) == 1, err
    assert re.fullmatch(r"kfeed: --seq-len 100000 --batch-size 16: the demo model's attention "
                        r"would take about 7,153 GiB a step \(batch x seq_len squared\), more "
                        r"than the [\d,]+ GiB of cpu: give a smaller --seq-len or --batch-size",
                        err[0]), err


def test_version(capsys) -> None:
    code, err, out = run_main(capsys, "--version")
    assert (code, err, out) == (0, [], f"kfeed {cli.__version__}\n")


def test_a_checkpoint_that_cannot_be_written_is_one_line() -> None:
    # "unexpected RuntimeError: [enforce fail at inline_container.cc:...]" (a
    # full disk, a folder made read-only while the run went on).
    from kfeed import KfeedError
    from kfeed._train import save_checkpoint

    with pytest.raises(KfeedError, match=r"^cannot save the checkpoint to /proc/ck.pt: .*: the "
                                         r"checkpoint before it, if any, stands$"):
        save_checkpoint(Path("/proc/ck.pt"), {"step": 1})


def test_the_train_bar_counts_from_the_first_step_and_draws_the_latest_line(capsys) -> None:
    # On a terminal: the start-up (torch's import, the model, the group's join)
    # was counted as steps (0.3 s of 40 steps read as 2.9 s a step), and the bar
    # drawn under a progress line showed the line before's loss and rate.
    bar = cli._StepBar(40)
    try:
        time.sleep(0.5)
        bar.tick(1)
        bar.tick(10)
        assert bar._bar.format_dict["elapsed"] < 0.4
        capsys.readouterr()
        bar.say("step 10  loss 1.2345  12 steps/s")
        drawn = capsys.readouterr().err.rstrip().rsplit("\r", 1)[-1]
        assert "step 10  loss" not in drawn and "loss 1.2345  12 steps/s" in drawn, drawn
    finally:
        bar.close()


@pytest.mark.parametrize(("argv", "line"), [
    (TRAIN + ("--resume",),
     "kfeed: --resume needs --checkpoint PATH: name the checkpoint to go on from"),
    (TRAIN + ("--checkpoint-every", "5"),
     "kfeed: --checkpoint-every needs --checkpoint PATH: name where to save, or leave it out"),
    (TRAIN + ("--checkpoint", "/no/such/folder/c.pt"),
     ("kfeed: --checkpoint /no/such/folder/c.pt: folder /no/such/folder does not exist: "
     "create it first")),
    (TRAIN + ("--seq-len", "64"),
     "kfeed: --seq-len applies to --task lm, not to --task mlp: leave it out"),
    # Named max_memory_bytes, and said only what the batches need; the least
    # --max-memory-mb that fits was the user's to guess.
    (TRAIN + ("--max-memory-mb", "1"),
     ("kfeed: --max-memory-mb 1 is too small for these settings: they need at least 13 (or a "
      "smaller --batch-size, --prefetch or --shuffle)")),
    # An EOS id no token of the topic can be made a 51 TB embedding.
    (TRAIN + ("--task", "lm", "--eos-id", "99999999999"),
     ("kfeed: --eos-id 99999999999 is no uint16 token id (at most 65535): a smaller id, or a "
      "wider --token-dtype as produced")),
    (TRAIN + ("--task", "lm", "--eos-id", "4000000", "--token-dtype", "uint32"),
     ("kfeed: --eos-id 4000000: the demo model's vocabulary would have 4000001 ids, more than "
      "its 1048576")),
    (TRAIN + ("--token-dtype", "int32"),
     "kfeed: --token-dtype applies to --task lm, not to --task mlp: leave it out"),
    (TRAIN + ("--task", "lm", "--log-ids", "ids.txt"),
     "kfeed: --log-ids applies to --task mlp (samples with ids), not to --task lm: leave it out"),
    (PRODUCE + ("--synthetic", "5", "--field", "features=x"),
     ("kfeed: --field applies to --from samples (files, object stores, databases), not to "
     "--synthetic: leave it out")),
    (PRODUCE + ("--synthetic", "5", "--seed", "3"),
     "kfeed: --seed applies to --synthetic-text, not to --synthetic: leave it out"),
    (PRODUCE + ("--synthetic", "5", "--token-dtype", "int32"),
     ("kfeed: --token-dtype applies to token documents (--synthetic-text, or --from a corpus), "
     "not to --synthetic: leave it out")),
    (PRODUCE + ("--synthetic-text", "5", "--key-field", "src"),
     ("kfeed: --key-field applies to --from a .jsonl or .parquet corpus (synthetic text is "
     "keyed with --keyed), not to --synthetic-text: leave it out")),
    # A .txt corpus has no fields, and only a flat .npy has lengths: these were
    # ignored (--text-field) or refused only after the topic was made.
    (PRODUCE + ("--from", "c.txt", "--text-field", "body"),
     ("kfeed: --text-field applies to --from a .jsonl or .parquet corpus (a .txt one is all "
      "text), not to --from c.txt (a corpus): leave it out")),
    (PRODUCE + ("--from", "ids.npy", "--tokenizer", "bytes", "--text-field", "body"),
     ("kfeed: --text-field applies to --from a .jsonl or .parquet corpus (a .txt one is all "
      "text), not to --from ids.npy (a corpus): leave it out")),
    (PRODUCE + ("--from", "c.txt", "--key-field", "id"),
     ("kfeed: --key-field applies to --from a .jsonl or .parquet corpus (synthetic text is "
      "keyed with --keyed), not to --from c.txt (a corpus): leave it out")),
    (PRODUCE + ("--from", "c.txt", "--lengths", "x.npy"),
     ("kfeed: --lengths applies to --from a flat .npy of token ids, not to --from c.txt (a "
      "corpus): leave it out")),
    # (--lengths made any file a corpus: a Parquet of samples was called one.)
    (PRODUCE + ("--from", "s.parquet", "--lengths", "x.npy"),
     ("kfeed: --lengths applies to --from a flat .npy of token ids, not to --from s.parquet "
      "(samples): leave it out")),
    (PRODUCE + ("--synthetic", "5", "--format", "raw", "--block-records", "8"),
     ("kfeed: --block-records applies to --format block or arrow, not to raw (one record a "
     "message): leave it out")),
    (PRODUCE + ("--synthetic", "5", "-X", "acks"),
     "kfeed: -X 'acks' is not KEY=VALUE: write it as e.g. -X fetch.min.bytes=1048576"),
    (("produce", "--bootstrap-servers", "", "--topic", "t", "--synthetic", "5"),
     "kfeed: no brokers given: pass --bootstrap-servers HOST:PORT or set KFEED_BOOTSTRAP"),
    (TRAIN + ("-X", "group.id=other"),
     "kfeed: -X group.id is set by --group-id: leave it out of -X"),
    (PRODUCE + ("--synthetic", "5", "-X", "group.id=other"),  # (produce has no --group-id)
     "kfeed: -X group.id is set by kfeed produce (a producer is in no consumer group; a "
     "resumable job's progress has a group of its own): leave it out of -X"),
    (PRODUCE + ("--synthetic", "5", "-X", "bootstrap.servers=h:1"),
     "kfeed: -X bootstrap.servers is set by --bootstrap-servers: leave it out of -X"),
    (PRODUCE + ("--synthetic", "5", "-X", "fetch.min.bytes=5", "-X", "linger.ms=5"),
     ("kfeed: -X fetch.min.bytes: a consumer setting, which a producer would ignore: leave "
      "it out")),
    (("lag", "--bootstrap-servers", CLOSED, "--group-id", "g", "-X", "fetch.min.bytes=1"),
     ("kfeed: kfeed lag uses only the brokers' address and login settings (bootstrap., "
      "security., sasl., ssl., client., socket. ...): -X fetch.min.bytes would have no effect")),
    (("lag", "--bootstrap-servers", CLOSED, "--group-id", "g", "-X", "security.protocol=x"),
     "kfeed: bad Kafka setting: Invalid value \"x\" for configuration property "
     "\"security.protocol\": check its name and value (librdkafka's CONFIGURATION.md lists "
     "them)"),
    # librdkafka names an alias by its own name alone: linger.ms was not named.
    (PRODUCE + ("--synthetic", "5", "-X", "linger.ms=abc"),
     "kfeed: bad Kafka setting: linger.ms (librdkafka's queue.buffering.max.ms): Invalid value "
     "for configuration property \"queue.buffering.max.ms\": check its name and value "
     "(librdkafka's CONFIGURATION.md lists them)"),
    (("train", "--bootstrap-servers", CLOSED, "--topic", "t", "--group-id", " "),
     "kfeed: --group-id ' ' is empty: give a name"),
])
def test_flags_that_would_be_ignored_are_errors(capsys, argv, line) -> None:
    code, err, out = run_main(capsys, *argv)
    assert (code, err, out) == (2, [line], "")


def test_checkpoint_and_id_log_paths_are_checked_before_training(capsys, tmp_path) -> None:
    # A folder given as the file trained every step, then failed at the first save.
    for flag, file in (("--checkpoint", "ck.pt"), ("--log-ids", "ids.txt")):
        code, err, _ = run_main(capsys, *TRAIN, flag, str(tmp_path))
        assert (code, err) == (2, [f"kfeed: {flag} {tmp_path} is a folder: name a file in it, "
                                   f"such as {tmp_path / file}"])
        missing = tmp_path / "none" / file
        code, err, _ = run_main(capsys, *TRAIN, flag, str(missing))
        assert (code, err) == (2, [f"kfeed: {flag} {missing}: folder {missing.parent} does not "
                                   f"exist: create it first"])
    # A checkpoint there, without --resume: it was overwritten at the first save.
    there = tmp_path / "ck.pt"
    there.write_bytes(b"a run's checkpoint")
    code, err, _ = run_main(capsys, *TRAIN, "--checkpoint", str(there))
    assert (code, err) == (2, [f"kfeed: --checkpoint {there} exists: pass --resume to go on "
                               f"from it, or name another file (delete it to start over)"])
    assert there.read_bytes() == b"a run's checkpoint"


def test_keyed_corpus_and_from_file_mistakes(capsys, tmp_path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("a document\n")
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(corpus), "--keyed")
    # (It said --keyed applies to synthetic data, which --from samples take too.)
    assert (code, err) == (2, [("kfeed: --keyed keys samples by their id, not a corpus's "
                               "documents: key them with --key-field FIELD")])
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(corpus), "--field", "features=x")
    assert (code, err) == (2, [("kfeed: --field applies to --from samples (files, object "
                               "stores, databases), not to --from c.txt (a corpus): leave it "
                               "out")])
    missing = tmp_path / "none.npz"
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(missing))
    assert (code, err) == (2, [f"kfeed: --from {missing}: no such file: check the path"])
    # A missing file of an unknown suffix is missing (it was told its suffix),
    # and one that is there is told every kind of --from.
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(tmp_path / "d.txt2"))
    assert (code, err) == (2, [f"kfeed: --from {tmp_path / 'd.txt2'}: no such file: check "
                               f"the path"])
    (tmp_path / "d").write_text("x")
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(tmp_path / "d"))
    assert (code, err) == (2, [f"kfeed: --from {tmp_path / 'd'}: samples come from .npz, .npy, "
                               f".parquet, .arrow, .feather, .ipc, .csv, .jsonl, .ndjson files "
                               f"(.jsonl with --field), a folder or a glob of them, not a file "
                               f"with no suffix: convert it, or give a .txt or .jsonl corpus for "
                               f"token documents"])
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(missing), "--field", "features")
    assert (code, err) == (2, [("kfeed: --field 'features' is not FIELD=COLUMN: write it as "
                               "e.g. --field features=COLUMN")])
    np.savez(tmp_path / "d.npz", x=np.zeros((4, 3), np.float32), y=np.arange(4))
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(tmp_path / "d.npz"),
                            "--field", "features=x", "--keyed")
    assert (code, err) == (2, [("kfeed: --keyed keys samples by their id field, and the fields "
                               "read are features: add --field id=COLUMN, or leave --keyed out")])
    # A .ndjson is samples whether or not --field is given (without it, it was
    # taken for a corpus, and told a corpus is not .ndjson).
    (tmp_path / "s.ndjson").write_text('{"id": 1, "label": 2}\n')
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(tmp_path / "s.ndjson"))
    assert (code, err) == (2, ["kfeed: s.ndjson has no column 'features' for field 'features' "
                               "(it has: id, label): map the field with --field "
                               "features=COLUMN"])
    # A float id: refused before the topic is made, naming --keyed (the topic
    # was made, then "keys must be bytes, str or int, got float64").
    import pyarrow as pa
    import pyarrow.parquet as pq

    np.savez(tmp_path / "f.npz", x=np.zeros((4, 3), np.float32), f=np.arange(4.0))
    pq.write_table(pa.table({"f": np.arange(4.0)}), tmp_path / "f.parquet")
    for source in ("f.npz", "f.parquet"):
        code, err, _ = run_main(capsys, *PRODUCE, "--from", str(tmp_path / source),
                                "--field", "id=f", "--dtype", "id=float64", "--keyed")
        assert (code, err) == (2, ["kfeed: --keyed keys samples by their id, and id is float64: "
                                   "give it an integer --dtype id=int64, or leave --keyed out"])


def corpus_cases() -> list[tuple[str, Any, tuple[str, ...], str]]:
    """(file name, its content, more arguments, the line) of corpora refused before the topic
    is made."""
    huge = "".join(f"doc {i}\n\n" for i in range(2)) + "x" * 20_000 + "\n"
    three = "one\n\ntwo\n\nthree\n"
    return [
        ("empty.txt", "", (), "no documents in {p}: a corpus holds paragraphs of text "
         "separated by blank lines; check the file"),
        ("blank.txt", "\n  \n\n", (), "no documents in {p}: a corpus holds paragraphs of "
         "text separated by blank lines; check the file"),
        ("empty.jsonl", "\n\n", (), "no documents in {p}: a corpus holds one JSON object a "
         "line; check the file"),
        ("empty-docs.jsonl", '{"text": ""}\n{"text": ""}\n', (),
         "the 2 documents of {p} are all empty: nothing to send"),
        ("latin1.txt", b"caf\xe9\n", (),
         "{p}:1: not UTF-8 (invalid continuation byte at byte 3): convert the file to UTF-8"),
        ("nofield.jsonl", '{"body": "x"}\n', (), "{p}:1: no field 'text' (fields: ['body']): "
         "name the text's field (--text-field FIELD)"),
        ("nonstr.jsonl", '{"text": 5}\n', (), "{p}:1: field 'text' must be a string, got int: "
         "give the text as a JSON string, or name the text's field (--text-field FIELD)"),
        ("surrogate.jsonl", '{"text": "ok"}\n{"text": "a \\ud800"}\n', (),
         "{p}:2: field 'text' holds a lone surrogate (\\ud800), half of a UTF-16 pair, which "
         "is no text UTF-8 can carry: fix the line"),
        ("three.txt", three, ("--skip-docs", "5"),
         "--skip-docs 5 is more than the 3 documents of {p}: give a smaller --skip-docs"),
        ("three.txt", three, ("--skip-docs", "3"),
         "--skip-docs 3 leaves out all 3 documents of {p}: nothing is left to send"),
        ("huge.txt", huge, ("-X", "message.max.bytes=10000"),
         "{p}:5: document of 20,000 tokens (40,000 bytes) is larger than a message "
         "(message.max.bytes 10,000 less 1024 for the headers): split it, or raise -X "
         "message.max.bytes (and the topic's max.message.bytes)"),
        ("three.txt", three, ("--tokenizer", "{d}/bad.json"),  # (... the parser's words)
         "cannot read tokenizer {d}/bad.json: ...: give a tokenizer.json that the tokenizers "
         "package wrote (Tokenizer.save), or --tokenizer bytes"),
        ("nosuch.txt", None, (), "--from {p}: no such file: check the path"),
        ("*.txt", None, (), "--from {p}: a corpus is one file, and its name is not expanded as "
         "a glob: give one file (join the files into one first)"),
        ("folder.txt", "folder", (), "--from {p}: a folder, and a corpus is one file: give the "
         "file (join the files into one first)"),
    ]


@pytest.mark.parametrize(("name", "content", "more", "line"), corpus_cases())
def test_corpus_mistakes_are_found_before_the_topic_is_made(capsys, tmp_path, name, content,
                                                            more, line) -> None:
    # Found after the topic was made (and left behind), with exit 1 or no error at all;
    # here nothing listens at the brokers' address, so a run that got as far as making
    # the topic fails differently.
    path = tmp_path / name
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    if "--tokenizer" in more:
        pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
        (tmp_path / "bad.json").write_text("not json")
    more = tuple(m.format(d=tmp_path) for m in more)
    code, err, out = run_main(capsys, *PRODUCE, "--connect-timeout", "1", "--from", str(path),
                              *more)
    head, _, tail = ("kfeed: " + line.format(p=path, d=tmp_path)).partition("...")
    assert (code, len(err), out) == (2, 1, ""), err
    assert err[0].startswith(head) and err[0].endswith(tail) if tail else err[0] == head


class FakeProducer:
    """What _produce_text sends, without brokers; ``on_send(n)`` runs after the n-th send."""

    def __init__(self, on_send: Any = None) -> None:
        self.sent: list[tuple[list[bytes], Any]] = []
        self.messages = self.bytes = self.flushes = 0
        self.on_send = on_send

    def __enter__(self) -> FakeProducer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.flush()

    def send(self, columns: dict[str, Any], keys: Any = None) -> None:
        self.sent.append(([bytes(np.asarray(d, np.uint8)) for d in columns["tokens"]], keys))
        self.messages += 1
        if self.on_send is not None:
            self.on_send(len(self.sent))

    def flush(self) -> None:
        self.flushes += 1

    def stats(self) -> dict[str, int]:
        return {"queued": 0}


@pytest.fixture
def fake_producer(monkeypatch) -> Any:
    """Sends of ``kfeed produce`` go to a ``FakeProducer``; no topic is made."""
    made: list[FakeProducer] = []

    def use(on_send: Any = None) -> list[FakeProducer]:
        made.append(FakeProducer(on_send))
        monkeypatch.setattr(cli, "_producer", lambda args, config, schema: made[-1])
        monkeypatch.setattr(cli, "_ensure_topic", lambda *a, **k: None)
        monkeypatch.setattr(cli, "_check_partitions", lambda *a: None)
        return made
    return use


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_a_corpus_is_sent_says_the_skip_docs_that_goes_on(
        capsys, tmp_path, fake_producer, sig, code) -> None:
    # It said "a run --from a dataset goes on with --resume", which a corpus run refuses.
    path = tmp_path / "c.txt"
    path.write_text("".join(f"doc {i}\n\n" for i in range(3000)))  # chunks of 1024
    made = fake_producer(lambda n: signal.raise_signal(sig) if n == 2 else None)
    got, err, out = run_main(capsys, *PRODUCE, "--from", str(path), "--skip-docs", "10")
    assert (got, err, out) == (code, [
        "kfeed: interrupted: the 2038 documents before the stop were sent (documents 10 to "
        "2047 of the corpus): run again with --skip-docs 2048 to go on without sending them "
        "twice"], "")
    # The chunk being sent went out whole, and nothing after it.
    assert [len(docs) for docs, _ in made[0].sent] == [1014, 1024]
    assert made[0].sent[1][0][-1] == b"doc 2047" and made[0].flushes


def test_a_signal_while_the_last_documents_are_acknowledged_waits_for_them(
        capsys, tmp_path, fake_producer) -> None:
    # It stopped at once with "kfeed: interrupted" and no --skip-docs: what the
    # brokers had was not known, and a run again sent the corpus twice.
    path = tmp_path / "c.txt"
    path.write_text("".join(f"doc {i}\n\n" for i in range(1500)))
    made = fake_producer()
    acknowledged: list[bool] = []

    def flush() -> None:  # the final flush: a SIGTERM comes while it waits
        if not acknowledged:
            signal.raise_signal(signal.SIGTERM)
            acknowledged.append(True)

    made[0].flush = flush
    code, err, out = run_main(capsys, *PRODUCE, "--from", str(path))
    assert (code, err) == (0, [
        "kfeed produce: every document is sent; stopping once the brokers acknowledge the "
        "last ones (a second signal stops at once)"]), (code, err)
    assert out.startswith("produced 1,500 documents (")
    assert acknowledged and sum(len(docs) for docs, _ in made[0].sent) == 1500


def test_convert_progress_shows_the_rate_since_the_line_before(capsys, monkeypatch) -> None:
    # The rate was the average from the start: an idle --follow showed it
    # sinking for ever (3,764, 1,305, 790 ... records/s) though nothing came.
    import kfeed
    from kfeed.converter import ConvertStats

    def convert(*args: Any, progress: Any, **kwargs: Any) -> ConvertStats:
        for elapsed, records in ((10.0, 30_000), (20.0, 30_000), (30.0, 35_000)):
            st = ConvertStats(records=records, bytes_in=100 * records, partitions=1,
                              elapsed_s=elapsed)
            progress(st)
        return st

    monkeypatch.setattr(kfeed, "convert", convert)
    code, err, out = run_main(capsys, "convert", "--bootstrap-servers", CLOSED, "--from-topic",
                              "t", "--to-topic", "t.b", "--format", "json", "--field",
                              "id=int64", "--progress-every", "0.000001")
    assert code == 0, err
    assert err == [
        "kfeed convert: 30,000 records, 0 bad, 3,000 records/s, 0.3 MB/s in over the last "
        "10.0s, lag 0 messages",
        "kfeed convert: 30,000 records, 0 bad, 0 records/s, 0.0 MB/s in over the last 10.0s, "
        "lag 0 messages",
        "kfeed convert: 35,000 records, 0 bad, 500 records/s, 0.1 MB/s in over the last 10.0s, "
        "lag 0 messages"]
    assert out.startswith("converted 35,000 records (0 bad) from t to t.b in 30.0s: "
                          "1,167 records/s")


def test_an_idle_convert_follow_says_so_once_a_minute(capsys, monkeypatch) -> None:
    # An idle --follow printed the same "0 records/s" line every 5 s for ever.
    import kfeed
    from kfeed.converter import ConvertStats

    monkeypatch.setattr(cli, "_IDLE_EVERY_S", 0.5)

    def convert(*args: Any, progress: Any, **kwargs: Any) -> ConvertStats:
        def at(elapsed: float, records: int) -> ConvertStats:
            st = ConvertStats(records=records, bytes_in=100 * records, partitions=1,
                              elapsed_s=elapsed)
            progress(st)
            return st

        at(10.0, 30_000)
        for k in range(5):  # idle: the first says so, the next four are left out
            at(11.0 + k, 30_000)
        time.sleep(0.6)
        at(20.0, 30_000)  # idle for longer than _IDLE_EVERY_S: said again
        return at(21.0, 31_000)  # records again: said at once

    monkeypatch.setattr(kfeed, "convert", convert)
    code, err, _out = run_main(capsys, "convert", "--bootstrap-servers", CLOSED,
                               "--from-topic", "t", "--to-topic", "t.b", "--format", "json",
                               "--field", "id=int64", "--progress-every", "0.000001")
    assert code == 0, err
    assert [line.split(", lag")[0] for line in err] == [
        "kfeed convert: 30,000 records, 0 bad, 3,000 records/s, 0.3 MB/s in over the last 10.0s",
        "kfeed convert: 30,000 records, 0 bad, 0 records/s, 0.0 MB/s in over the last 1.0s",
        "kfeed convert: 30,000 records, 0 bad, 0 records/s, 0.0 MB/s in over the last 9.0s",
        "kfeed convert: 31,000 records, 0 bad, 1,000 records/s, 0.1 MB/s in over the last 1.0s"]


def test_a_bad_token_id_is_named_at_its_document_in_the_corpus(capsys, tmp_path,
                                                               fake_producer) -> None:
    # The document was counted from its chunk's start less --skip-docs ("document
    # 20" for 1050), and a negative id was told to take a wider --token-dtype.
    docs = np.empty(1100, dtype=object)
    for i in range(1100):
        docs[i] = np.full(5, 7, np.int64)
    docs[1050] = np.array([7, -1, 7])
    docs[1070] = np.array([7, 300])
    path = tmp_path / "ids.npy"
    np.save(path, docs, allow_pickle=True)
    fake_producer()
    got = run_main(capsys, *PRODUCE, "--from", str(path), "--tokenizer", "bytes",
                   "--skip-docs", "1030")
    assert got[:2] == (2, [f"kfeed: {path}: document 1050: token id -1 is negative; token ids "
                           f"are >= 0"]), got
    docs[1050] = np.array([7, 7])
    np.save(path, docs, allow_pickle=True)
    got = run_main(capsys, *PRODUCE, "--from", str(path), "--tokenizer", "bytes",
                   "--skip-docs", "1030")
    assert got[:2] == (2, [f"kfeed: {path}: document 1070: token id 300 is outside the vocabulary "
                           f"of bytes (257 ids): give the --tokenizer the ids were made "
                           f"with"]), got


def test_empty_documents_are_left_out_and_counted_apart(capsys, tmp_path,
                                                        fake_producer) -> None:
    # They were counted as produced, and vanished on the way (no tokens to end).
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a", "k": "x"}\n{"text": "", "k": "y"}\n{"text": "bc", "k": "z"}\n')
    made = fake_producer()
    code, err, out = run_main(capsys, *PRODUCE, "--from", str(path), "--key-field", "k")
    assert (code, err) == (0, [])
    assert out.startswith("produced 2 documents, 1 empty left out (3 tokens, uint16, ")
    assert made[0].sent == [([b"a", b"bc"], ["x", "z"])]


def test_a_document_larger_than_a_message_is_refused_before_its_chunk_is_sent(
        capsys, tmp_path, fake_producer) -> None:
    # librdkafka refused it mid-chunk ("Message size too large"), no file or line named.
    path = tmp_path / "c.txt"
    docs = [f"doc {i}" for i in range(1100)]
    docs[1029] = "y" * 9000
    path.write_text("\n\n".join(docs) + "\n")
    made = fake_producer()
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(path),
                            "-X", "message.max.bytes=10000")
    assert (code, err) == (1, [
        f"kfeed: {path}:2059: document of 9,000 tokens (18,000 bytes) is larger than a message "
        f"(message.max.bytes 10,000 less 1024 for the headers): split it, or raise -X "
        f"message.max.bytes (and the topic's max.message.bytes). The 1024 documents before "
        f"this chunk were sent (documents 0 to 1023 of the corpus): fix it and run again with "
        f"--skip-docs 1024 to go on without sending them twice"])
    assert [len(d) for d, _ in made[0].sent] == [1024]


def test_lag_flags_a_commit_past_the_end(capsys, monkeypatch) -> None:
    from kfeed import lag

    rows = [lag.PartitionLag("t", 0, 100, 8, 0, 0.0, None),
            lag.PartitionLag("t", 1, 3, 8, 5, 12.0, None)]
    monkeypatch.setattr(lag, "group_lag", lambda *a: rows)
    monkeypatch.setattr(lag, "group_exists", lambda *a: True, raising=False)
    code, err, out = run_main(capsys, "lag", "--bootstrap-servers", CLOSED, "--group-id", "g")
    assert (code, err) == (0, [])
    assert out.splitlines() == [
        "TOPIC  PARTITION  COMMITTED  END  LAG  LAG_S  MEMBER",
        "t      0          100*       8    0    0.0    -",
        "t      1          3          8    5    12.0   -",
        "* t[0]: committed 100 is past the end (8): the group resets by auto.offset.reset on "
        "its next start, so its lag is 0 only with 'latest'",
        "group g: lag 5 messages over 2 partitions, oldest unread record 12.0s old"]


def test_lag_of_a_group_the_brokers_do_not_know(capsys, monkeypatch) -> None:
    from kfeed import lag

    rows = [lag.PartitionLag("t", 0, None, 8, 8, 3.0, None)]  # as for any --topic
    for found in ([], rows):
        monkeypatch.setattr(lag, "group_lag", lambda *a, found=found: found)
        monkeypatch.setattr(lag, "group_exists", lambda *a: False)
        code, err, out = run_main(capsys, "lag", "--bootstrap-servers", CLOSED, "--group-id", "g")
        assert (code, err, out) == (1, ["kfeed: no group g on these brokers (no members, no "
                                        "committed offsets): check the name"], "")


# -- files into columns (kfeed.ingest) ------------------------------------------------


def write_parquet(path: Path, **columns: Any) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def test_npz_missing_array_is_named_with_the_ones_it_has(capsys, tmp_path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, features=np.zeros((4, 3), np.float32), label=np.arange(4))
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(path))
    assert (code, err) == (2, [("kfeed: d.npz has no array 'id' for field 'id' (it has: features, "
                               "label): map the field with --field id=ARRAY")])
    np.save(tmp_path / "f.npy", np.zeros((4, 3), np.float32))
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(tmp_path / "f.npy"))
    assert (code, err) == (2, [("kfeed: f.npy holds one array, named 'f' after the file: map it "
                               "to one field with --field FIELD=f (e.g. --field features=f)")])
    got = ingest.read_columns(tmp_path / "f.npy", {"features": "f"})
    assert got["features"].dtype == np.float32 and got["features"].shape == (4, 3)


def test_a_folder_or_glob_of_numpy_files_is_refused_in_one_line(capsys, tmp_path) -> None:
    # A folder said ".npz" was not a format kfeed reads; a glob, "no such file".
    for i in range(2):
        np.savez(tmp_path / f"p{i}.npz", features=np.zeros((4, 3), np.float32))
    line = (": the files are .npz: a run reads one format, one of .parquet, .arrow, .feather, "
            ".ipc, .csv, .jsonl, .ndjson: a numpy file is read on its own, --from FILE.npz "
            "(join the arrays into one file, or write the rows as Parquet files)")
    for source in (str(tmp_path), str(tmp_path / "*.npz")):
        code, err, _ = run_main(capsys, *PRODUCE, "--from", source)
        assert (code, err) == (2, [f"kfeed: --from {source}{line}"]), source


def test_a_json_list_column_is_cast_by_its_dtype(tmp_path) -> None:
    # --dtype features=float32, as the refusal without it says to pass, became
    # the JSON reader's type of the whole column, a number: "changed from number
    # to array in row 0", and the run stopped.
    import json

    path = tmp_path / "arr.jsonl"
    path.write_text("".join(json.dumps({"features": [0.5 * i, 1.0, 2.0], "label": i % 3,
                                        "id": i}) + "\n" for i in range(50)))
    fields = {"features": "features", "label": "label", "id": "id"}
    with pytest.raises(ConfigError, match="pass --dtype features=float32 to cast it"):
        ingest.read_columns(path, fields)
    got = ingest.read_columns(path, fields, dtypes={"features": "float32"})
    assert got["features"].dtype == np.float32 and got["features"].shape == (50, 3)
    assert got["features"][7].tolist() == [3.5, 1.0, 2.0]
    assert got["label"].tolist() == [i % 3 for i in range(50)]


def test_a_column_type_guessed_wrong_is_a_mistake_in_the_command(tmp_path) -> None:
    # A KfeedError, so exit 1 "a failure while running" where it stopped the
    # first batch, before anything was sent (cli._send_stream adds the rows
    # sent where some were, and exits 1 then).
    path = tmp_path / "late.csv"
    path.write_text("x,label,id\n" + "".join(f"{i},{i % 3},{i}\n" for i in range(200_000))
                    + "2.5,0,200000\n")  # (past pyarrow's first block, where it guesses)
    rows = ingest.open_rows(str(path))
    try:
        with pytest.raises(ConfigError, match=r"^late\.csv: .*'2\.5' \(a column's type is "
                                              r"guessed from the file's first rows: give the "
                                              r"field's with --dtype FIELD=DTYPE\)$"):
            for _batch in rows.batches(["x", "label", "id"]):
                pass
    finally:
        rows.close()


@pytest.mark.parametrize("name, text", [
    ("early.csv", "x\n1\n2.5\n"), ("late.csv", "x\n" + "1\n" * 200_000 + "2.5\n"),
    ("early.jsonl", '{"x": 1}\n{"x": 2.5}\n')])
def test_a_value_its_dtype_does_not_take_asks_for_a_fix_not_a_dtype(tmp_path, name,
                                                                     text) -> None:
    # With --dtype x=int64 given, 2.5 was answered "give the field's with
    # --dtype"; in a CSV's first block it was "not a csv file (...): check
    # the file".
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        rows = ingest.open_rows(str(path), column_types={"x": "int64"})
        try:
            for _batch in rows.batches(["x"]):
                pass
        finally:
            rows.close()
    assert str(e.value).startswith(f"{name}: ") and "2.5" in str(e.value), str(e.value)
    assert str(e.value).endswith("(a value that the field's --dtype, read as int64, does not "
                                 "take: fix that value in the file, or give the field a --dtype "
                                 "that takes it)"), str(e.value)
    assert "Could not open" not in str(e.value)


@pytest.mark.parametrize("name, late", [("text.csv", "abc,0,200000\n"),
                                        ("text.jsonl", '{"x": "abc", "label": 0, "id": 1}\n'),
                                        ("list.jsonl", '{"x": [1.5], "label": 0, "id": 1}\n')])
def test_text_where_numbers_came_before_asks_for_a_fix_not_a_dtype(tmp_path, name,
                                                                     late) -> None:
    # No --dtype reads 'abc' (or a list in a column of numbers): the line says
    # to fix the value, where a number of another type says --dtype.
    path = tmp_path / name
    rows_text = ("x,label,id\n" + "".join(f"{i / 2},{i % 3},{i}\n" for i in range(200_000))
                 if name.endswith(".csv") else
                 "".join(f'{{"x": {i / 2}, "label": {i % 3}, "id": {i}}}\n'
                         for i in range(200_000)))
    path.write_text(rows_text + late)
    rows = ingest.open_rows(str(path))
    try:
        with pytest.raises(ConfigError) as err:
            for _batch in rows.batches(["x", "label", "id"]):
                pass
    finally:
        rows.close()
    assert str(err.value).endswith("(a field holds numbers, or lists of them, in every row: "
                                   "fix that value in the file, or leave its column out)"), err
    assert "--dtype" not in str(err.value)


def test_a_checkpoint_that_is_not_one_is_a_mistake_in_the_command(capsys, tmp_path) -> None:
    # It was a failure while running (exit 1), though nothing had run.
    bad = tmp_path / "ck.pt"
    bad.write_text("garbage\n")
    code, err, out = run_main(capsys, *TRAIN, "--checkpoint", str(bad), "--resume",
                              "--device", "cpu")
    assert code == 2 and len(err) == 1 and out == "", err
    assert err[0].startswith(f"kfeed: {bad} is not a kfeed train checkpoint (") and \
        err[0].endswith("): give another --checkpoint path"), err


def test_fields_are_in_the_order_kfeed_train_reads_whatever_the_flags_order(tmp_path) -> None:
    # --field id=i --field label=y --field features=x wrote records id, label,
    # features: kfeed train (features, label, id) refused every one of them.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kfeed.ingest import DatasetRows

    x, y, i = np.zeros((4, 3), np.float32), np.arange(4), np.arange(4) + 10
    np.savez(tmp_path / "w.npz", x=x, y=y, i=i)
    flags = {"id": "i", "extra": "y", "label": "y", "features": "x"}
    got = ingest.read_columns(tmp_path / "w.npz", flags)
    assert list(got) == ["features", "label", "id", "extra"]
    assert list(ingest.schema_for(got).names) == ["features", "label", "id", "extra"]
    pq.write_table(pa.table({"i": i, "y": y, "x": pa.FixedSizeListArray.from_arrays(
        pa.array(x.ravel()), 3)}), tmp_path / "w.parquet")
    rows = DatasetRows(str(tmp_path / "w.parquet"))
    assert list(ingest.stream_fields(rows, flags, {}, {})) == ["features", "label", "id",
                                                               "extra"]


def test_numpy_files_not_what_their_names_say_get_one_clear_line(capsys, tmp_path) -> None:
    import os

    np.save(tmp_path / "one.npy", np.zeros((4, 3), np.float32))
    os.replace(tmp_path / "one.npy", tmp_path / "one.npz")
    np.savez(tmp_path / "many.npz", features=np.zeros((4, 3), np.float32))
    os.replace(tmp_path / "many.npz", tmp_path / "many.npy")
    (tmp_path / "cut.npz").write_bytes((tmp_path / "many.npy").read_bytes()[:40])
    cases = [
        (["--from", str(tmp_path / "one.npz")], "kfeed: one.npz: one .npy array, not an .npz "
         "archive: name it one.npy and map it with --field FIELD=one"),
        (["--from", str(tmp_path / "many.npy"), "--field", "features=many"],
         "kfeed: many.npy: an .npz archive, not one .npy array: name it many.npz"),
        (["--from", str(tmp_path / "cut.npz")],
         "kfeed: cut.npz: not a numpy .npz file (File is not a zip file): check the file"),
    ]
    for argv, line in cases:
        code, err, _ = run_main(capsys, *PRODUCE, *argv)
        assert (code, err) == (2, [line]), argv


def test_a_float_cast_to_int64_is_checked_exactly(tmp_path) -> None:
    # 2**63 - 1 is 2**63 as a float: a float check let 2**63 through, sent as -2**63.
    path = write_parquet(tmp_path / "d.parquet", features=[[0.5]] * 2, id=[1, 2],
                         label=[2.0 ** 63, 0.0])
    fields = {"label": "label", "id": "id"}
    with pytest.raises(ConfigError, match=r"holds values 0\.\.9223372036854775808, outside int64"):
        ingest.read_columns(path, fields, dtypes={"label": "int64"})
    path = write_parquet(tmp_path / "e.parquet", features=[[0.5]] * 2, id=[1, 2],
                         label=[-(2.0 ** 63), 2.0 ** 62])
    got = ingest.read_columns(path, fields, dtypes={"label": "int64"})
    assert got["label"].tolist() == [-(2 ** 63), 2 ** 62]


def test_parquet_missing_column_names_the_columns(capsys, tmp_path) -> None:
    path = write_parquet(tmp_path / "d.parquet", x=[1, 2], y=[3, 4])
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(path), "--field", "label=z")
    assert (code, err) == (2, [("kfeed: d.parquet has no column 'z' for field 'label' (it has: "
                               "x, y): map the field with --field label=COLUMN")])


def test_parquet_types_map_by_the_rules(tmp_path) -> None:
    import pyarrow as pa

    features = pa.array([[0.5, 1.5, 2.5]] * 3, type=pa.list_(pa.float32()))
    path = write_parquet(tmp_path / "d.parquet", features=features, label=[1, 2, 3],
                         id=[7, 8, 9], score=[0.5, 1.0, 1.5])
    got = ingest.read_columns(path, {"features": "features", "label": "label", "id": "id",
                                     "score": "score"})
    assert {k: (v.dtype.name, v.shape) for k, v in got.items()} == {
        "features": ("float32", (3, 3)), "label": ("int64", (3,)), "id": ("int64", (3,)),
        "score": ("float64", (3,))}
    assert ingest.schema_for(got) == ingest.schema_for(
        {"features": np.zeros((1, 3), np.float32), "label": np.zeros(1, np.int64),
         "id": np.zeros(1, np.int64), "score": np.zeros(1)})


def test_list_of_double_features_are_refused_unless_a_dtype_is_given(capsys, tmp_path) -> None:
    import pyarrow as pa

    path = write_parquet(tmp_path / "d.parquet",
                         features=pa.array([[0.25, 1.0]] * 2, type=pa.list_(pa.float64())),
                         label=[1, 2], id=[3, 4])
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(path))
    assert (code, err) == (2, [
        ("kfeed: 'features' of d.parquet (field 'features') is float64[2] but kfeed train reads "
        "features as float32: pass --dtype features=float32 to cast it, or --dtype "
        "features=float64 to keep float64")])
    cast = ingest.read_columns(path, dtypes={"features": "float32"})
    assert cast["features"].dtype == np.float32
    assert cast["features"].tolist() == [[0.25, 1.0]] * 2
    kept = ingest.read_columns(path, dtypes={"features": "float64"})
    assert kept["features"].dtype == np.float64


def test_nulls_are_refused_with_their_count_unless_filled(capsys, tmp_path) -> None:
    path = write_parquet(tmp_path / "d.parquet", features=[[1.0]] * 3, label=[1, None, 3],
                         id=[1, 2, 3])
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(path), "--dtype", "features=float32")
    assert (code, err) == (2, [("kfeed: column 'label' of d.parquet (field 'label') has 1 null "
                               "value(s): give --fill label=VALUE to replace them, or drop "
                               "those rows")])
    got = ingest.read_columns(path, dtypes={"features": "float32"}, fills={"label": "-1"})
    assert got["label"].dtype == np.int64 and got["label"].tolist() == [1, -1, 3]
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(path), "--dtype", "features=float32",
                            "--fill", "label=0.5")
    assert (code, err) == (2, [("kfeed: --fill label=0.5: not a value of the column's type "
                               "int64: give one (a whole number for an int column)")])


def test_a_csv_s_nulls_say_what_a_null_is(tmp_path) -> None:
    # pyarrow reads an empty cell, NA, NULL and nan as nulls: a float column of
    # NaNs was refused as holding nulls, with no word of why.
    path = tmp_path / "n.csv"
    path.write_text("id,x\n1,1.5\n2,nan\n3,\n4,NULL\n")
    with pytest.raises(ConfigError, match=r"^column 'x' of n.csv \(field 'x'\) has 3 null "
                                          r"value\(s\) \(an empty cell, NA, NULL or nan\): "
                                          r"give --fill x=VALUE"):
        ingest.read_columns(path, {"id": "id", "x": "x"})
    got = ingest.read_columns(path, {"id": "id", "x": "x"}, fills={"x": "0"})["x"]
    assert got.tolist() == [1.5, 0.0, 0.0, 0.0]


def test_a_column_of_only_nulls_is_filled_as_its_fill_reads(tmp_path) -> None:
    # An empty CSV column reads as pyarrow's null type: counted as nulls, filled
    # with the --fill value in its own type, which --dtype may cast.
    import pyarrow as pa

    batch = pa.record_batch([pa.array([1, 2]), pa.nulls(2), pa.array([[None, None], None],
                                                                      pa.list_(pa.null())),
                             pa.nulls(2, pa.list_(pa.null()))], ["id", "x", "l", "e"])
    fields = {"id": "id", "x": "x"}
    with pytest.raises(ConfigError, match=r"^column 'x' of b.csv \(field 'x'\) has 2 "
                       r"null value\(s\) \(an empty cell, NA, NULL or nan\): give --fill x=VALUE"):
        ingest.batch_columns("b.csv", batch, fields, {}, {})
    got = ingest.batch_columns("b.csv", batch, fields, {}, {"x": "5"})
    assert got["x"].dtype == np.int64 and got["x"].tolist() == [5, 5]
    got = ingest.batch_columns("b.csv", batch, fields, {"x": "float32"}, {"x": "5"})
    assert got["x"].dtype == np.float32 and got["x"].tolist() == [5.0, 5.0]
    assert ingest.batch_columns("b.csv", batch, fields, {}, {"x": "0.5"})["x"].tolist() == [0.5] * 2
    assert ingest.batch_columns("b.csv", batch, fields, {}, {"x": "true"})["x"].tolist() == [True] * 2
    with pytest.raises(ConfigError, match=r"^--fill x=abc: not a number, and the column "
                       "holds only nulls"):
        ingest.batch_columns("b.csv", batch, fields, {}, {"x": "abc"})
    got = ingest.batch_columns("b.csv", batch, {"l": "l"}, {}, {"l": "-1"})
    assert got["l"].tolist() == [[-1, -1], [-1, -1]]
    with pytest.raises(ConfigError, match=r"^column 'e' of b.csv \(field 'e'\) holds only "
                       "null lists: their length, which the field needs, is unknown"):
        ingest.batch_columns("b.csv", batch, {"e": "e"}, {}, {"e": "1"})
    # After a first batch, nulls alone take its fields' dtypes and shapes: a later
    # file's null lists were filled as a number (its rows () where the first gave
    # (2,)), or refused as of unknown length.
    first = ingest.schema_for({"e": np.zeros((1, 2), np.float32), "x": np.zeros(1, np.uint8)})
    got = ingest.batch_columns("b.csv", batch, {"e": "e", "x": "x"}, {},
                               {"e": "-1", "x": "7"}, first)
    assert ingest.schema_for(got) == first
    assert got["e"].tolist() == [[-1.0, -1.0]] * 2 and got["x"].tolist() == [7, 7]
    with pytest.raises(ConfigError, match=r"^--fill x=-1: not a value of the column's type "
                                          r"uint8"):
        ingest.batch_columns("b.csv", batch, {"x": "x"}, {}, {"x": "-1"}, first)
    with pytest.raises(ConfigError, match=r"^column 'x' of b.csv \(field 'x'\) has 2 null"):
        ingest.batch_columns("b.csv", batch, {"x": "x"}, {}, {}, first)  # no --fill: refused


def test_a_later_file_of_null_lists_is_filled_to_the_first_s_width(capsys, tmp_path) -> None:
    folder = tmp_path / "jn"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"f": [1, 2], "id": 1}\n{"f": [3, 4], "id": 2}\n')
    (folder / "b.jsonl").write_text('{"f": null, "id": 3}\n')
    rows = ingest.open_rows(str(folder))
    try:
        fields = ingest.stream_fields(rows, {"f": "f", "id": "id"}, {}, {"f": "0"})
        got: list[dict[str, np.ndarray]] = []
        for batch in rows.batches(["f", "id"]):
            first = ingest.schema_for(got[0]) if got else None
            got.append(ingest.batch_columns("jn", batch, fields, {}, {"f": "0"}, first))
    finally:
        rows.close()
    assert [c["f"].tolist() for c in got] == [[[1, 2], [3, 4]], [[0, 0]]]


def test_unsendable_columns_are_named_with_their_type(capsys, tmp_path) -> None:
    path = write_parquet(tmp_path / "d.parquet", name=["a", "b"], ragged=[[1.0], [1.0, 2.0]])
    code, err, _ = run_main(capsys, *PRODUCE, "--from", str(path), "--field", "label=name")
    assert (code, err) == (2, [("kfeed: column 'name' of d.parquet is string: kfeed produce "
                               "sends numbers and fixed-length lists of numbers; leave the "
                               "column out (--field picks the columns) or convert it to "
                               "numbers first")])
    with pytest.raises(ConfigError, match=r"^column 'ragged' of d.parquet \(field 'x'\) holds "
                                          r"lists of different lengths \(1 to 2\)"):
        ingest.read_columns(path, {"x": "ragged"})
    np.save(tmp_path / "features.npy", np.zeros((5, 0), np.float32))  # named no file before
    with pytest.raises(ConfigError, match=r"^'features' of features.npy \(field 'features'\) "
                                          r"has rows of shape \(0,\), which hold no value"):
        ingest.read_columns(tmp_path / "features.npy", {"features": "features"})
    np.savez(tmp_path / "s.npz", features=np.array(["a", "b"]))
    with pytest.raises(ConfigError, match=r"^'features' of s.npz \(field 'features'\) has dtype "
                                          r"<U1, which kfeed cannot send"):
        ingest.read_columns(tmp_path / "s.npz", {"features": "features"})


def test_casts_check_the_values(tmp_path) -> None:
    np.savez(tmp_path / "d.npz", y=np.array([1.0, 2.5]), big=np.array([300]))
    with pytest.raises(ConfigError, match=r"^--dtype label=int64: 'y' of d.npz holds 1 value\(s\) "
                                          r"that are not whole numbers"):
        ingest.read_columns(tmp_path / "d.npz", {"label": "y"}, dtypes={"label": "int64"})
    with pytest.raises(ConfigError, match=r"^--dtype x=uint8: 'big' of d.npz holds values "
                                          r"300..300, outside uint8"):
        ingest.read_columns(tmp_path / "d.npz", {"x": "big"}, dtypes={"x": "uint8"})
    with pytest.raises(ConfigError, match=r"^--dtype z=int64: no field 'z' is read"):
        ingest.read_columns(tmp_path / "d.npz", {"label": "y"}, dtypes={"z": "int64"})
    # Casts that would lose values: bools past 0 and 1, floats past the target's
    # range, integers a float cannot hold exactly. Each one line, no numpy warning.
    np.savez(tmp_path / "e.npz", flag=np.array([0, 1, 2]), huge=np.array([1.0, 1e300, -1e300]),
             ids=np.array([3, 2**24 + 1, 2**53 + 1]), ok=np.array([0.0, 1.0]),
             least=np.array([-2**63, 5]))
    cases = [
        ("flag", "bool", r"^--dtype x=bool: 'flag' of e.npz holds values 0..2, outside bool "
                         r"\(0 or 1\)"),
        ("huge", "float32", r"^--dtype x=float32: 'huge' of e.npz holds 2 value\(s\) past "
                            r"float32's range \(up to 3.40282e\+38\)"),
        ("ids", "float32", r"^--dtype x=float32: 'ids' of e.npz holds 2 value\(s\) that "
                           r"float32 cannot hold exactly \(integers past 2\*\*24\)"),
        ("ids", "float64", r"^--dtype x=float64: 'ids' of e.npz holds 1 value\(s\) that "
                           r"float64 cannot hold exactly \(integers past 2\*\*53\)"),
        ("huge", "int32", r"^--dtype x=int32: 'huge' of e.npz holds values -1e\+300..1e\+300, "
                          r"outside int32"),
        # abs() of int64's least overflowed, with numpy's warning on stderr
        ("least", "int32", r"^--dtype x=int32: 'least' of e.npz holds values "
                           r"-9223372036854775808..5, outside int32"),
    ]
    import warnings

    for src, cast, line in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ConfigError, match=line):
                ingest.read_columns(tmp_path / "e.npz", {"x": src}, dtypes={"x": cast})
    got = ingest.read_columns(tmp_path / "e.npz", {"x": "ok"}, dtypes={"x": "bool"})
    assert got["x"].tolist() == [False, True]
    got = ingest.read_columns(tmp_path / "e.npz", {"x": "flag"}, dtypes={"x": "float32"})
    assert got["x"].tolist() == [0.0, 1.0, 2.0]


# -- failures while running: exit 1, one line ---------------------------------------


@pytest.mark.parametrize("fmt", ["avro", "protobuf"])
def test_a_registry_that_cannot_be_reached_stops_produce_before_a_topic_is_made(capsys,
                                                                               fmt) -> None:
    # The topic was made first, then the schema's registration failed. Here
    # the brokers cannot be reached either: the registry is asked first.
    # A password in the url is not shown (it was, in this line and in every
    # warning of a reader asking the registry again).
    proto = ("--proto", "google.protobuf.timestamp_pb2:Timestamp") if fmt == "protobuf" else ()
    code, err, out = run_main(capsys, *PRODUCE, "--synthetic", "5", "--format", fmt, *proto,
                              "--registry", "http://sr-user:s3cret@127.0.0.1:9",
                              "--connect-timeout", "2")
    assert code == 1 and len(err) == 1 and out == "", err
    assert err[0].startswith("kfeed: cannot reach the registry at "
                             "http://sr-user:***@127.0.0.1:9: "), err
    code, err, _ = run_main(capsys, *PRODUCE, "--synthetic", "5", "--format", fmt, *proto,
                            "--registry", "ftp://sr-user:s3cret@127.0.0.1:9")
    assert code == 2 and err == ["kfeed: --registry ftp://sr-user:***@127.0.0.1:9 is not an "
                                 "http:// or https:// address: give e.g. --registry "
                                 "http://registry:8081"], err


def test_protobuf_written_without_a_message_class_is_refused_before_a_topic_is_made(
        capsys) -> None:
    # With --registry alone the topic was made, then the producer refused:
    # "writing Protobuf needs message=", the Python argument, not the flag.
    code, err, _ = run_main(capsys, *PRODUCE, "--synthetic", "5", "--format", "protobuf",
                            "--registry", "http://127.0.0.1:9")
    assert (code, err) == (2, ["kfeed: --format protobuf writes messages of a generated "
                               "class: give --proto MODULE:MESSAGE (e.g. --proto "
                               "clicks_pb2:Click), with --registry URL to register its "
                               "schema"]), err


def test_kfeeds_warnings_show_without_v_one_line_each_and_nothing_else(capsys,
                                                                      monkeypatch) -> None:
    # Without -v every log line was hidden: a topic of another schema read by
    # `kfeed train` waited in silence, its bad records' warnings unseen.
    import logging

    def train(args):
        logging.getLogger("kfeed.loader").warning("bad record at t[0]@0, skipped: %s", "why")
        logging.getLogger("kfeed.sources").warning("kafka: %s", "down",
                                                   extra={"connection": True})
        logging.getLogger("kfeed.librdkafka").warning("FAIL %s", "rdkafka")
        logging.getLogger("kfeed.loader").info("assigned")
        logging.getLogger("urllib3").warning("another library")
        return 0

    monkeypatch.setattr(cli, "cmd_train", train)
    code, err, out = run_main(capsys, *TRAIN)
    assert (code, err) == (0, ["kfeed: warning: bad record at t[0]@0, skipped: why"])
    # Undone on return: the program's own logging is as it was.
    assert logging.getLogger("kfeed").handlers == [] and logging.getLogger("kfeed").propagate


def test_unexpected_exceptions_are_one_line_and_v_shows_the_traceback(capsys, monkeypatch) -> None:
    def boom(args: Any) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "cmd_produce", boom)
    code, err, _ = run_main(capsys, *PRODUCE, "--synthetic", "5")
    assert (code, err) == (1, [("kfeed: unexpected RuntimeError: boom: rerun with -v for the "
                               "traceback")])
    code, err, _ = run_main(capsys, *PRODUCE, "--synthetic", "5", "-v")
    assert code == 1 and err[0] == "Traceback (most recent call last):"
    assert err[-1] == "kfeed: unexpected RuntimeError: boom: the traceback is above"


def test_unreachable_brokers_are_one_line_naming_the_address(capsys) -> None:
    code, err, _ = run_main(capsys, *PRODUCE, "--synthetic", "5", "--partitions", "2",
                            "--connect-timeout", "1")
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"kfeed: cannot reach the brokers at {CLOSED} within 1s: "), err


def fake_run(stats: dict[str, Any], positions: dict[str, Any], first_step: int = 0,
             step: int = 0, resumed_from: Any = None, signum: int | None = None) -> Any:
    task = SimpleNamespace(summary=lambda step, st: f"trained {step} steps",
                           expects=lambda: "features float32[768], label int64, id int64")

    def run(opts: Any, config: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(task=task, step=step, first_step=first_step, stats=stats,
                               loss=float("nan"), resumed_from=resumed_from, saved_step=None,
                               signum=signum, positions=positions, start_to_first_step_s=0.0)
    return run


STATS = {"startup_s": 0.0, "mb_per_s": 0.0, "stall_fraction": 0.0, "lag": {}, "lag_unknown": [],
         "bad_records": 0, "samples": 0}


def test_the_summaries_say_one_step_and_separate_thousands() -> None:
    from kfeed._train import _LMTask, _MLPTask

    mlp = _MLPTask.__new__(_MLPTask)
    assert mlp.summary(1, {"samples": 1000, "samples_per_s": 12345.6}).startswith(
        "trained 1 step on 1,000 samples: 12,346 samples/s")
    assert mlp.summary(12000, {"samples": 1_200_000, "samples_per_s": 1.0}).startswith(
        "trained 12,000 steps on 1,200,000 samples")
    lm = _LMTask.__new__(_LMTask)
    lm._real, lm._slots, lm.batch_size, lm.seq_len = 40_960, 65_536, 8, 2048
    assert lm.summary(1, {"elapsed_s": 2.0}).startswith(
        "trained 1 step on 40,960 tokens in [8, 2048] rows: 20,480 tokens/s, packing "
        "efficiency 62.5%")


def test_train_every_record_bad_exits_1_naming_the_dead_letter_topic(capsys, monkeypatch) -> None:
    from kfeed import _train

    monkeypatch.setattr(_train, "run", fake_run({**STATS, "bad_records": 12}, {}))
    code, err, out = run_main(capsys, *TRAIN, "--until-end")
    assert code == 1
    assert err == [("kfeed: all 12 records read from t were bad and went to the dead-letter "
                   "topic t.dlq: they do not match what --task mlp reads (features "
                   "float32[768], label int64, id int64); produce the topic for it, or check "
                   "its dtype (e.g. --token-dtype)")]
    assert out == ("trained 0 steps, startup 0.0s, read 0.0 MB/s, data stall 0.0%, lag n/a, "
                   "bad records 12, final loss nan\n")


def test_train_says_why_nothing_was_read(capsys, monkeypatch) -> None:
    from kfeed import _train

    at_end = {"t": {"0": [40, 0], "1": [2, 0]}}
    monkeypatch.setattr(_train, "run", fake_run(STATS, at_end))
    assert run_main(capsys, *TRAIN, "--until-end")[:2] == (0, [
        ("kfeed: group g has already read t to its end (committed offsets at the end): use "
        "--start earliest to read it again, or a new --group-id")])
    monkeypatch.setattr(_train, "run", fake_run(STATS, {"t": {"0": [0, 0]}}))
    assert run_main(capsys, *TRAIN, "--until-end")[:2] == (0, [
        "kfeed: topic t is empty: produce to it first (kfeed produce --topic t)"])
    monkeypatch.setattr(_train, "run", fake_run(STATS, at_end))
    assert run_main(capsys, *TRAIN, "--until-end", "--start", "latest")[:2] == (0, [
        "kfeed: t has no records after --start latest: give an earlier --start"])


# -- progress: the bar and the final line on one clock --------------------------------


def test_only_acknowledged_bytes_count_as_done() -> None:
    def producer(acked: int, sent: int) -> SimpleNamespace:
        return SimpleNamespace(acked_bytes=acked, bytes=sent)

    assert cli._acknowledged(producer(10, 40)) == 0.25  # 30 bytes still queued
    assert cli._acknowledged(producer(40, 40)) == 1.0
    assert cli._acknowledged(producer(0, 0)) == 0.0


@pytest.mark.integration
def test_produces_progress_counts_only_go_up_and_stay_in_range(bootstrap, make_topic) -> None:
    # The count was librdkafka's queue length (more than the messages, at
    # times) against samples counted a chunk at a time: it went negative
    # ("-2,688/200,000 samples (-1%)") and fell from line to line.
    topic = make_topic(partitions=1)
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--synthetic", "200000",
                     "--progress-every", "0.05")
    assert done.returncode == 0, done.stderr
    counts = [float(m.group(1).replace(",", "")) for m in re.finditer(
        r"^kfeed produce: (-?[\d,]+)/200,000 samples", done.stderr, re.M)]
    assert len(counts) >= 3, done.stderr
    assert all(0 <= a <= b <= 200_000 for a, b in zip(counts, counts[1:])), counts


@pytest.mark.integration
def test_a_ctrl_c_while_produce_waits_for_its_messages_is_an_interrupt(bootstrap,
                                                                       make_topic) -> None:
    # Python's KeyboardInterrupt inside confluent-kafka's flush came out as a
    # bare SystemError: "kfeed: 2824 message(s) not delivered" and exit 1, of
    # messages the topic held, so a run again would write them twice.
    topic = make_topic(partitions=1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kfeed", "produce", "--topic", topic, "--synthetic", "40000",
         "--block-records", "1", "--progress-every", "0.02", "-X", "max.in.flight=1",
         "-X", "linger.ms=0", "-X", "batch.num.messages=1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "KFEED_BOOTSTRAP": bootstrap},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # acknowledged so far: all 40,000 were queued in a moment
        lines.append(line)
        m = re.match(r"kfeed produce: ([\d,]+)/40,000 samples", line)
        if m and int(m.group(1).replace(",", "")) >= 4000:
            break
    assert proc.poll() is None, lines
    proc.send_signal(signal.SIGINT)  # it waits for the acknowledgements
    t0 = time.monotonic()
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    # (--synthetic has no --resume: it said a run --from a dataset goes on with one.)
    # It waited for every acknowledgement (36,000 messages, 39 s): it waits 2 s
    # and says what it left, in the same line.
    assert time.monotonic() - t0 < 15
    last = err.splitlines()[-1]
    m = re.fullmatch(r"kfeed: interrupted: what was sent before stands(; [\d,]+ message\(s\) "
                     rf"to {topic} not acknowledged 2s after the interrupt: they may be "
                     r"missing from the topic)?; about ([\d,]+) of the 40,000 samples were "
                     r"acknowledged by the brokers", last)
    assert m, err
    assert "warning" not in err, err
    # One sample a message: those said acknowledged are in the topic.
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex})
    try:
        _low, high = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
    finally:
        c.close()
    assert 4000 <= int(m.group(2).replace(",", "")) <= high, (err, high)


@pytest.mark.integration
def test_a_slow_source_is_not_taken_for_brokers_that_acknowledge_nothing(
        capsys, monkeypatch, tmp_path, bootstrap, make_topic) -> None:
    # Acknowledgements arrive only while the producer is served (poll, flush): a
    # corpus read that paused 7 s had its lines say "the brokers acknowledged
    # nothing for 5s", of brokers that had acknowledged everything.
    from kfeed import text

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"document {i} " * 40 + "\n\n" for i in range(3000)))
    read_corpus = text.read_corpus

    def slow(*args: Any, **kwargs: Any) -> Any:
        for i, chunk in enumerate(read_corpus(*args, **kwargs)):
            if i == 1:
                time.sleep(7)
            yield chunk

    monkeypatch.setattr(text, "read_corpus", slow)
    topic = make_topic(partitions=1)
    code, err, out = run_main(capsys, "produce", "--bootstrap-servers", bootstrap, "--topic",
                              topic, "--from", str(corpus), "--progress-every", "0.5")
    assert code == 0, err
    assert out.startswith("produced 3,000 documents"), out
    progress = [line for line in err if line.startswith("kfeed produce:")]
    assert len(progress) >= 10, err  # (lines through the pause)
    assert not [line for line in err if "acknowledged nothing" in line], err


def test_an_interrupted_produce_names_resume_only_where_there_is_one(tmp_path) -> None:
    parser = cli.build_parser()
    cases = [(["--synthetic", "5"], ""), (["--from", str(tmp_path / "c.txt")], ""),
             (["--from", str(tmp_path / "d.parquet")],
              " (the same command with --resume goes on after it)")]
    for argv, more in cases:
        args = parser.parse_args(["produce", "--topic", "t", *argv])
        assert cli._after_interrupt(args) == ": what was sent before stands" + more, argv


def test_progress_off_a_terminal_is_plain_lines_with_the_eta(capsys) -> None:
    import time

    t0 = time.monotonic() - 10.0  # 10 s in
    state = [50_000.0]
    progress = cli._Progress("kfeed produce", "samples",
                             lambda: (state[0], 100_000.0, "12.4 MB/s"), t0, every_s=0.05)
    time.sleep(0.3)
    state[0] = 100_000.0
    progress.close(final=True)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) >= 2 and "\r" not in "".join(lines)
    first = lines[0]
    assert first.startswith("kfeed produce: 50,000/100,000 samples (50%), ")
    rate = int(first.split(", ")[1].split()[0].replace(",", ""))
    assert 4_500 <= rate <= 5_000  # 50,000 in about 10 s
    assert ", ETA 10s, 12.4 MB/s" in first or ", ETA 11s, 12.4 MB/s" in first


def test_a_resumed_runs_progress_counts_its_own_rate(capsys) -> None:
    # --resume: 40,000 rows were sent by the run before; this one sent 10,000
    # in its 10 s. The rate counted all 50,000 (5,000/s), the ETA 10 s.
    import time

    progress = cli._Progress("kfeed produce", "samples",
                             lambda: (50_000.0, 100_000.0, ""), time.monotonic() - 10.0,
                             every_s=3600, before=40_000)
    progress._draw()
    progress.close()
    line = capsys.readouterr().err.strip()
    assert line.startswith("kfeed produce: 50,000/100,000 samples (50%), "), line
    rate = int(line.split(", ")[1].split()[0].replace(",", ""))
    eta = int(line.split("ETA ")[1].rstrip("s"))
    assert 900 <= rate <= 1_000 and 50 <= eta <= 56, line


def test_lag_is_na_until_the_loader_knows_it() -> None:
    from kfeed._train import lag_text

    assert lag_text({}) == "lag n/a"
    assert lag_text({"t[0]": 0, "t[1]": 0}) == "lag 0"
    assert lag_text({"t[0]": 3, "t[1]": 4}) == "lag 7"
    # A partition whose lag is not known yet: the sum would be short ("lag 9" of 56 left).
    assert lag_text({"t[0]": 9}, ["t[1]"]) == "lag n/a"


def test_a_second_signal_stops_training_with_its_own_exit_status() -> None:
    # A second SIGTERM exited 130, as if it were a SIGINT.
    from kfeed import _train
    from kfeed.errors import Interrupted

    for first, second in ((signal.SIGINT, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)):
        guard = _train.StopGuard(armed=True)
        guard.install()
        try:
            guard._handle(first, None)  # the first: noted, the step goes on
            assert guard.signum == first
            with pytest.raises(Interrupted) as stopped:
                guard._handle(second, None)
            assert stopped.value.signum == second
            assert Interrupted.caught() == second
        finally:
            guard.restore()


def _until_raised(seconds: float = 2.0) -> None:
    """Run bytecode for up to ``seconds``: where a pending signal's handler runs."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.001)


@pytest.mark.parametrize("where", ["weakref", "client callback"])
def test_a_signal_raised_where_python_or_a_callback_drops_it_is_raised_again(where) -> None:
    # A SIGTERM whose handler ran inside importlib's weakref callback was
    # ignored, and convert waited 30 s for the brokers, then exited 1. In a
    # librdkafka callback it was logged as a failed callback, then forgotten.
    import weakref

    from kfeed._kafka import chain
    from kfeed.errors import Interrupted

    class Owner:
        def on_error(self, err: int) -> None:
            signal.raise_signal(signal.SIGTERM)  # the handler runs inside the callback

    previous_handler = signal.signal(signal.SIGTERM, Interrupted.handler)
    previous_hook = sys.unraisablehook
    try:
        Interrupted.keep_lost()
        with pytest.raises(Interrupted) as stopped:
            if where == "weakref":
                owner = Owner()
                ref = weakref.ref(owner, lambda _: signal.raise_signal(signal.SIGTERM))  # noqa: F841
                del owner
            else:
                owner = Owner()
                chain(owner.on_error, None)(0)
            _until_raised()
        assert stopped.value.signum == signal.SIGTERM
        assert Interrupted.caught() == signal.SIGTERM
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGTERM, previous_handler)


def test_a_signal_lost_as_the_command_ends_is_its_exit_status(capsys, monkeypatch) -> None:
    # Lost in a client callback just before the command returned: it exited
    # 0 without a word, and the signal, still pending, ended the next main().
    from kfeed._kafka import chain
    from kfeed.errors import Interrupted

    class Owner:
        def on_error(self, err: int) -> None:
            signal.raise_signal(signal.SIGTERM)

    owner = Owner()

    def lost(args: Any) -> int:
        chain(owner.on_error, None)(0)
        return 0

    monkeypatch.setattr(cli, "cmd_lag", lost)
    code, err, _ = run_main(capsys, "lag", "--bootstrap-servers", CLOSED, "--group-id", "g")
    assert (code, err) == (143, ["kfeed: interrupted"])
    monkeypatch.setattr(cli, "cmd_lag", lambda args: _until_raised(0.3))
    assert run_main(capsys, "lag", "--bootstrap-servers", CLOSED, "--group-id", "g")[:2] == (
        0, [])
    assert Interrupted.caught() is None


def test_a_second_signal_cuts_the_clean_up_of_the_first_short(capsys, monkeypatch) -> None:
    # The watch's deliveries leave a clean-up on its way up alone; a second
    # signal of the user's was ignored too, and the clean-up (a producer's
    # flush, up to its timeout) ran to its end.
    def slow_to_stop(args: Any) -> int:
        try:
            signal.raise_signal(signal.SIGINT)
        finally:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 10:  # the clean-up
                time.sleep(0.01)
                if 0.3 < time.monotonic() - t0 < 0.35:
                    signal.raise_signal(signal.SIGTERM)
        return 0

    monkeypatch.setattr(cli, "cmd_lag", slow_to_stop)
    t0 = time.monotonic()
    code, err, _ = run_main(capsys, "lag", "--bootstrap-servers", CLOSED, "--group-id", "g")
    assert (code, err) == (143, ["kfeed: interrupted"])
    assert time.monotonic() - t0 < 5


def test_a_signal_while_the_loader_waits_for_data_stops_the_wait() -> None:
    from kfeed import _train
    from kfeed.loader import memory_loader

    guard = _train.StopGuard()
    loader = memory_loader([], synthetic_schema_(), 4, device="cpu")  # a stream with nothing
    guard.watch(loader)
    guard.started = True  # a batch was handed out: the handler itself raises nowhere
    look = loader._on_wait
    signalled = []

    def signal_at_the_first_look() -> None:  # the main thread is in the loader's wait
        if not signalled:
            signalled.append(True)
            signal.raise_signal(signal.SIGINT)  # its handler runs here, in this thread
        assert look is not None
        look()

    loader._on_wait = signal_at_the_first_look
    before = signal.getsignal(signal.SIGINT)  # (SIG_IGN when started in the background)
    guard.install()
    try:
        guard.waiting = True
        with pytest.raises(_train._Stopped):
            next(loader)
    finally:
        guard.restore()
        loader.close()
    assert guard.signum == signal.SIGINT and signalled
    assert signal.getsignal(signal.SIGINT) is before


def test_a_step_that_waits_long_for_its_batch_says_so(monkeypatch) -> None:
    # On a topic with nothing to read, kfeed train printed nothing for as long
    # as it waited.
    from kfeed import _train
    from kfeed.loader import memory_loader

    monkeypatch.setattr(_train, "WAIT_NOTICE_S", 0.3)
    loader = memory_loader([], synthetic_schema_(), 4, device="cpu")  # a stream with nothing
    out = _train.Outcome(task=None, step=7, first_step=7)
    lines: list[str] = []
    _train._say_while_waiting(loader, "clicks", out, lines.append)
    said = loader._on_wait

    class Enough(Exception):
        pass

    def look() -> None:
        assert said is not None
        said()
        if len(lines) == 2:
            raise Enough

    loader._on_wait = look
    t0 = time.monotonic()
    try:
        with pytest.raises(Enough):
            next(loader)
    finally:
        loader.close()
    assert 0.5 < time.monotonic() - t0 < 5
    for line in lines:
        assert re.fullmatch(r"waiting \d+s for a first batch: nothing new to read from clicks "
                            r"\(produce to it, or check --topic and --start\); Ctrl-C stops",
                            line), lines


def test_a_wait_with_no_partition_says_the_group_gave_none(monkeypatch) -> None:
    # (A member killed without leaving holds the group's partitions until its
    # session ends: "nothing new to read" pointed at the topic.)
    from types import SimpleNamespace

    from kfeed import _train

    clock = iter([0.0, 20.0, 40.0])
    monkeypatch.setattr(_train.time, "monotonic", lambda: next(clock))
    loader = SimpleNamespace(_on_wait=None, _fetcher=SimpleNamespace(assigned=set()),
                             _status=SimpleNamespace(doing="fetching messages"))
    lines: list[str] = []
    _train._say_while_waiting(loader, "clicks", _train.Outcome(task=None, step=3), lines.append)
    loader._on_wait()
    loader._on_wait()
    loader._fetcher.assigned, loader._status.doing = {("clicks", 0)}, "decoding"
    loader._on_wait()  # (a registry that hangs holds the thread in its decoding)
    assert lines == ["waiting 20s for step 4: the group gave this run no partition yet (more "
                     "members than partitions, or one that stopped without leaving holds them "
                     "until its session.timeout.ms); Ctrl-C stops",
                     "waiting 40s for step 4: the loader's thread is decoding what it read "
                     "from clicks (a schema registry slow to answer holds it up); Ctrl-C stops"]


def test_a_signal_before_the_loader_is_made_stops_training_at_once() -> None:
    # It was only noted: the run went on loading torch and making the model
    # and the loader (seconds), and only then stopped.
    from kfeed import _train
    from kfeed.errors import Interrupted

    guard = _train.StopGuard()
    before = signal.getsignal(signal.SIGTERM)
    guard.install()
    try:
        with pytest.raises(Interrupted) as stopped:
            guard._handle(signal.SIGTERM, None)
        assert stopped.value.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is before  # (a second one: the default)
    finally:
        guard.restore()


def test_a_signal_noted_while_next_committed_stops_the_wait_that_follows() -> None:
    # The handler ran where next() was committing (not its wait): it noted
    # the signal, could not raise there, and the wait that followed, on a
    # stream with nothing new, went on for ever.
    import threading

    from kfeed import _train
    from kfeed.loader import memory_loader

    guard = _train.StopGuard()
    loader = memory_loader([], synthetic_schema_(), 4, device="cpu")  # a stream with nothing
    guard.watch(loader)
    guard.started = guard.waiting = True
    guard._handle(signal.SIGINT, None)  # noted outside the loader's wait: not raised
    assert guard.signum == signal.SIGINT
    watchdog = threading.Timer(10, loader.close)  # (before the fix: a LoaderError at 10 s)
    watchdog.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(_train._Stopped):
            next(loader)
        assert time.monotonic() - t0 < 5
    finally:
        watchdog.cancel()
        loader.close()


def test_streamed_rows_show_what_the_brokers_acknowledged_not_what_was_handed_over(
        monkeypatch) -> None:
    # With the brokers gone, "30,000/30,000 samples (100%)" for 85 s while
    # nothing was in the topic: the lines counted rows handed to librdkafka.
    import argparse
    import contextlib

    import numpy as np

    shown: list[tuple[float, float, str]] = []

    class Unanswered:  # a producer whose brokers acknowledge nothing
        messages = bytes = acked_bytes = 0
        polled_at = 0.0
        last_error = None

        def transaction(self) -> Any:
            return contextlib.nullcontext()

        def send(self, part, keys=None) -> None:
            self.messages += 1
            self.bytes += 8 * len(part["id"])

        def stats(self) -> dict[str, int]:
            return {"queued": self.messages}

    class Bar:
        def __init__(self, what, unit, status, t0, every_s=None, before=0.0,
                     producer=None) -> None:
            self.status = status

        def close(self, final: bool = False) -> None:
            shown.append(self.status())

    class Progress:  # what the transaction records: the status is read then too
        def record(self, producer, rows) -> None:
            shown.append(bar[0].status())

    bar: list[Any] = []
    monkeypatch.setattr(cli, "_Progress", lambda *a, **k: bar.append(Bar(*a, **k)) or bar[0])

    class Done:
        def take(self, timeout):
            raise StopIteration

    args = argparse.Namespace(transaction_mb=None, keyed=False, progress_every=None, topic="t")
    producer = Unanswered()
    cli._send_stream(args, producer, None, "rows", 1000, {"id": np.arange(1000)}, Done(),
                     Progress(), 0, 60.0)
    assert shown and all(done == 0 for done, _total, _extra in shown), shown
    producer.acked_bytes = producer.bytes // 2  # half of it acknowledged
    assert bar[0].status()[0] == 500


def synthetic_schema_() -> Any:
    return cli.synthetic_schema()


# -- start-up: produce never imports torch; train reports mistakes before it ----------


def test_produce_help_and_train_mistakes_never_import_torch() -> None:
    done = kfeed("produce", "--help", python_flags=("-X", "importtime"))
    assert done.returncode == 0 and "Exit status" in done.stdout
    assert "torch" not in done.stderr
    done = kfeed(*TRAIN, "--batch-size", "0", python_flags=("-X", "importtime"))
    assert done.returncode == 2 and "torch" not in done.stderr
    assert done.stderr.splitlines()[-1] == ("kfeed: --batch-size 0 is out of range: give an "
                                            "integer >= 1")
    # A misspelt -X came once torch was loaded, seconds later than any other mistake.
    done = kfeed(*TRAIN, "-X", "auto.ofset.reset=earliest", python_flags=("-X", "importtime"))
    assert done.returncode == 2 and "torch" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        'kfeed: bad Kafka setting: No such configuration property: "auto.ofset.reset"')


def interrupted(argv: list[str], sig: signal.Signals, after_s: float) -> tuple[int, list[str],
                                                                         float]:
    """``kfeed ARGV`` sent ``sig`` after ``after_s``: exit status, stderr lines, seconds it
    took to end after the signal."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kfeed", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "KFEED_BOOTSTRAP": CLOSED},
        # (a shell's background job starts with SIGINT ignored: give it back)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    time.sleep(after_s)
    # Not before kfeed catches it: on a loaded machine Python's start alone
    # can take longer than after_s, and the signal's default action is not kfeed's.
    deadline = time.monotonic() + 30
    while not _catches(proc.pid, sig) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(sig)
    t0 = time.monotonic()
    _out, err = proc.communicate(timeout=120)
    return proc.returncode, err.splitlines(), time.monotonic() - t0


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask, on Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return True  # no /proc: the sleep alone
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.parametrize("command", [
    ["produce", "--topic", "t", "--synthetic", "10"],
    ["train", "--topic", "t", "--group-id", "g"],
    ["convert", "--from-topic", "t", "--to-topic", "t.b", "--format", "json", "--field",
     "id=int64"],
    ["lag", "--group-id", "g"],
])
def test_a_signal_while_the_brokers_do_not_answer_ends_at_once_in_one_line(command) -> None:
    # Each waited out its 30 s connect timeout first (convert then exited 1).
    # (train's signal comes once torch is loaded and it waits for the brokers)
    wait = 4.0 if command[0] == "train" else 1.5
    for sig, after_s in ((signal.SIGINT, wait), (signal.SIGTERM, wait), (signal.SIGTERM, 0.05)):
        code, err, took = interrupted(command, sig, after_s)
        assert code == 128 + sig and len(err) == 1 and err[0].startswith("kfeed: "), \
            (sig, after_s, code, err)
        assert took < 10, (sig, after_s, took)
        if command[0] == "train" and after_s > 1:  # nothing was read: nothing to say was saved
            # (or, on a machine slow to load torch, stopped before the loader was made)
            assert "nothing was trained in this run" in err[0] or \
                err[0] == "kfeed: interrupted: the last checkpoint (if any) stands", err


# -- against the cluster --------------------------------------------------------------


def topic_partitions(bootstrap: str, topic: str) -> int:
    from confluent_kafka.admin import AdminClient

    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic=topic, timeout=30)
    return len(md.topics[topic].partitions)


def delete_topics(bootstrap: str, *topics: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})  # alive until the futures are done
    for future in admin.delete_topics(list(topics), operation_timeout=30).values():
        future.result(timeout=30)


@pytest.mark.integration
def test_produce_creates_a_missing_topic_and_says_so(bootstrap) -> None:
    first, second = (f"kfeed-test-{uuid.uuid4().hex}" for _ in range(2))
    try:
        done = kfeed("produce", "--topic", first, "--synthetic", "10", bootstrap=bootstrap,
                     python_flags=("-X", "importtime"))
        assert done.returncode == 0, done.stderr
        assert "torch" not in done.stderr  # a real produce run, not only --help
        lines = [x for x in done.stderr.splitlines() if not x.startswith("import time:")]
        assert lines == [(f"created topic {first} with 4 partitions (replication: the brokers' "
                         f"default)")]
        assert topic_partitions(bootstrap, first) == 4
        done = kfeed("produce", "--topic", second, "--synthetic", "10", "--partitions", "2",
                     bootstrap=bootstrap)
        assert done.returncode == 0, done.stderr
        assert done.stderr.splitlines() == [
            f"created topic {second} with 2 partitions (replication: the brokers' default)"]
        assert topic_partitions(bootstrap, second) == 2
        done = kfeed("produce", "--topic", second, "--synthetic", "10", "--partitions", "3",
                     bootstrap=bootstrap)
        assert (done.returncode, done.stderr.splitlines()) == (2, [
            (f"kfeed: --partitions 3: topic {second} exists with 2 partitions: leave "
            f"--partitions out, or pick a new --topic")])
    finally:
        delete_topics(bootstrap, first, second)


@pytest.mark.integration
def test_produce_with_a_larger_message_max_bytes_makes_a_topic_that_takes_them(
        bootstrap, tmp_path) -> None:
    # The brokers refused the records -X message.max.bytes was raised for
    # ("Broker: Message size too large", exit 1): the topic kfeed made kept the
    # brokers' 1 MiB.
    n, width = 3, 300_000  # 1.2 MB a record
    np.savez(tmp_path / "big.npz", features=np.ones((n, width), np.float32),
             label=np.arange(n), id=np.arange(n))
    topic = f"kfeed-test-{uuid.uuid4().hex}"
    try:
        done = kfeed("produce", "--topic", topic, "--from", str(tmp_path / "big.npz"),
                     "-X", "message.max.bytes=3000000", bootstrap=bootstrap)
        assert done.returncode == 0, done.stderr
        assert done.stderr.splitlines()[0] == (
            f"created topic {topic} with 4 partitions (replication: the brokers' default; "
            f"max.message.bytes 3000000)"), done.stderr
        assert done.stdout.startswith(f"produced {n:,} samples"), done.stdout
    finally:
        delete_topics(bootstrap, topic)


@pytest.mark.integration
def test_produce_refuses_blocks_of_another_schema_beside_a_topic_s_blocks(bootstrap,
                                                                         make_topic) -> None:
    from kfeed.synthetic import synthetic_schema
    from kfeed.text import token_schema

    samples, tokens = synthetic_schema().fingerprint, token_schema("uint16").fingerprint
    topic = make_topic(partitions=2)
    done = kfeed("produce", "--topic", topic, "--synthetic", "100", bootstrap=bootstrap)
    assert done.returncode == 0, done.stderr
    again = kfeed("produce", "--topic", topic, "--synthetic", "100", "--first-id", "100",
                  bootstrap=bootstrap)  # the same schema: more of the same
    assert again.returncode == 0, again.stderr
    other = kfeed("produce", "--topic", topic, "--synthetic-text", "10", bootstrap=bootstrap)
    assert other.returncode == 2, (other.stdout, other.stderr)
    part = other.stderr.split("the newest of partition ")[-1][0]  # where the first went
    assert other.stderr.splitlines() == [
        f"kfeed: topic {topic} holds kfeed blocks of another schema (fingerprint {samples:#018x},"
        f" the newest of partition {part}) than this run writes (tokens uint16[*]; "
        f"{tokens:#018x}): a loader of either schema would reject the other's blocks as bad "
        f"records; write to another --topic"]
    raw = make_topic(partitions=1)
    done = kfeed("produce", "--topic", raw, "--synthetic", "10", "--format", "raw",
                 bootstrap=bootstrap)
    assert done.returncode == 0, done.stderr
    blocks = kfeed("produce", "--topic", raw, "--synthetic", "10", bootstrap=bootstrap)
    assert (blocks.returncode, blocks.stderr.splitlines()) == (2, [
        f"kfeed: topic {raw} holds messages that are not kfeed blocks (the newest of partition "
        f"0): blocks written beside them would not read as one topic; write to another --topic"])
    arrow = kfeed("produce", "--topic", topic, "--synthetic", "10", "--format", "arrow",
                  bootstrap=bootstrap)
    assert arrow.returncode == 2 and arrow.stderr.splitlines()[0].startswith(
        f"kfeed: topic {topic} holds kfeed blocks (the newest of partition "), arrow.stderr
    assert arrow.stderr.splitlines()[0].endswith(
        "--format arrow messages written beside them would not read as one topic; write to "
        "another --topic")
    import kfeed as kf

    with kf.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}, topic,
                   synthetic_schema(), 64, device="cpu", until="end") as loader:
        assert sorted(i for b in loader for i in b["id"].tolist()) == list(range(200))
    # The committed blocks are found behind an aborted transaction of many records too
    # (a killed ingestion's), whose records and marker end the partition.
    tail = make_topic(partitions=1)
    schema = kf.Schema({"id": ("int64", ())})
    with kf.Producer({"bootstrap.servers": bootstrap}, tail, schema, block_records=1,
                     transactional_id=f"kfeed-test-{tail}") as p:
        with p.transaction():
            p.send({"id": np.arange(3)})
        with pytest.raises(RuntimeError), p.transaction():
            p.send({"id": np.arange(3, 203)})
            p.flush()
            raise RuntimeError("killed")
    other = kfeed("produce", "--topic", tail, "--synthetic", "10", bootstrap=bootstrap)
    assert other.returncode == 2 and "holds kfeed blocks of another schema (fingerprint " \
        f"{schema.fingerprint:#018x}, the newest of partition 0)" in other.stderr, other.stderr


@pytest.mark.integration
def test_every_record_bad_fails_in_one_line(bootstrap, make_topic, group_id) -> None:
    topic = make_topic(partitions=1)
    done = kfeed("produce", "--topic", topic, "--synthetic-text", "20", "--token-dtype", "int32",
                 bootstrap=bootstrap)
    assert done.returncode == 0, done.stderr
    done = kfeed("train", "--task", "lm", "--topic", topic, "--group-id", group_id,
                 "--until-end", "--device", "cpu", bootstrap=bootstrap)
    assert done.returncode == 1
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("kfeed: all ") and "int32" in done.stderr, done.stderr


@pytest.mark.integration
def test_lm_ids_past_the_vocabulary_and_a_checkpoint_of_other_flags_fail_in_one_line(
        bootstrap, make_topic, group_id, tmp_path) -> None:
    import torch

    import kfeed as kf
    from kfeed.text import token_schema

    topic = make_topic(partitions=1)
    assert kfeed("produce", "--topic", topic, "--synthetic-text", "40",
                 bootstrap=bootstrap).returncode == 0
    ckpt = tmp_path / "lm.pt"
    args = ("train", "--task", "lm", "--topic", topic, "--device", "cpu", "--until-end",
            "--batch-size", "2", "--checkpoint", str(ckpt), "--resume")
    done = kfeed(*args, "--group-id", group_id, "--steps", "2", bootstrap=bootstrap)
    assert done.returncode == 0, done.stderr
    # Other --seq-len: the loader's state says so (the model's shapes raised
    # torch's "Error(s) in loading state_dict" first).
    other = kfeed(*args, "--group-id", group_id, "--seq-len", "128", bootstrap=bootstrap)
    assert other.returncode == 2 and len(other.stderr.splitlines()) == 1, other.stderr
    # ... naming the checkpoint and the flags to give (it gave the loader's line alone).
    assert other.stderr.startswith(f"kfeed: --resume {ckpt}: the state was saved with pack "), \
        other.stderr
    assert other.stderr.rstrip().endswith(
        "resume with the flags it was saved with (--topic, --format, --seq-len, --eos-id, "
        "--shuffle, --seed), or another --checkpoint"), other.stderr
    # A checkpoint of the other --task is a mistake in the command: exit 2 (it was 1).
    mlp = kfeed(*args[:2], "mlp", *args[3:], "--group-id", group_id, bootstrap=bootstrap)
    assert mlp.returncode == 2 and mlp.stderr.startswith(
        f"kfeed: {ckpt} is a checkpoint of --task lm, not mlp: "), mlp.stderr
    # A model of other shapes with the same loader state: torch's line that says which.
    state = torch.load(ckpt, weights_only=False)
    state["model"]["embed.weight"] = torch.zeros(300, state["model"]["embed.weight"].shape[1])
    torch.save(state, ckpt)
    other = kfeed(*args, "--group-id", group_id, bootstrap=bootstrap)
    assert other.returncode == 2, other.stderr
    assert other.stderr.startswith(f"kfeed: --resume {ckpt}: its model does not fit these "
                                   f"flags (size mismatch for embed.weight"), other.stderr
    # Ids of another tokenizer (999; the bytes vocabulary has 257):
    # torch's IndexError, or a device-side assert on CUDA.
    wide = make_topic(partitions=1)
    schema = token_schema("uint16")
    with kf.Producer({"bootstrap.servers": bootstrap}, wide, schema) as p:
        p.send({"tokens": [np.full(k + 1, 999, np.uint16) for k in range(40)]})
    done = kfeed("train", "--task", "lm", "--topic", wide, "--group-id", group_id,
                 "--until-end", "--device", "cpu", "--batch-size", "2", bootstrap=bootstrap)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "kfeed: token id 999 is past the model's vocabulary of 257 ids (--tokenizer bytes): "
        "train with the --tokenizer (and --eos-id) the topic was produced with"], done.stderr


def summary(stdout: str) -> str:
    return stdout.strip().splitlines()[-1]


@pytest.mark.integration
def test_group_at_the_end_and_start(bootstrap, make_topic, group_id, tmp_path) -> None:
    topic = make_topic(partitions=2)
    assert kfeed("produce", "--topic", topic, "--synthetic", "300",
                 bootstrap=bootstrap).returncode == 0
    args = ("train", "--topic", topic, "--group-id", group_id, "--until-end", "--device", "cpu")
    done = kfeed(*args, bootstrap=bootstrap)
    assert done.returncode == 0, done.stderr
    assert summary(done.stdout).startswith("trained 2 steps on 300 samples")
    again = kfeed(*args, bootstrap=bootstrap)
    assert again.returncode == 0
    assert summary(again.stdout).startswith("trained 0 steps on 0 samples")
    assert again.stderr.splitlines() == [
        (f"kfeed: group {group_id} has already read {topic} to its end (committed offsets at "
        f"the end): use --start earliest to read it again, or a new --group-id")]
    earliest = kfeed(*args, "--start", "earliest", bootstrap=bootstrap)
    assert earliest.returncode == 0 and earliest.stderr == ""
    assert summary(earliest.stdout).startswith("trained 2 steps on 300 samples")
    latest = kfeed(*args, "--start", "latest", "--group-id", uuid.uuid4().hex,
                   bootstrap=bootstrap)
    assert latest.stderr.splitlines() == [
        f"kfeed: {topic} has no records after --start latest: give an earlier --start"]


@pytest.mark.integration
def test_a_clean_end_saves_the_last_steps(bootstrap, make_topic, group_id, tmp_path) -> None:
    import torch

    topic = make_topic(partitions=2)
    assert kfeed("produce", "--topic", topic, "--synthetic", "2000",
                 bootstrap=bootstrap).returncode == 0
    ckpt = tmp_path / "c.pt"
    args = ("train", "--topic", topic, "--group-id", group_id, "--device", "cpu",
            "--batch-size", "100", "--checkpoint", str(ckpt), "--resume")
    done = kfeed(*args, "--steps", "7", "--checkpoint-every", "5", bootstrap=bootstrap)
    assert done.returncode == 0, done.stderr
    assert torch.load(ckpt, weights_only=False)["step"] == 7
    assert summary(done.stdout).startswith("trained 7 steps on 700 samples: "), done.stdout
    assert "now at step" not in summary(done.stdout)
    # With --resume, --steps counts this run's steps: 3 more than the
    # checkpoint's 7 (it stopped after 1 step, comparing 8 with 3).
    more = kfeed(*args, "--steps", "3", bootstrap=bootstrap)
    assert more.returncode == 0, more.stderr
    assert torch.load(ckpt, weights_only=False)["step"] == 10
    # This run's steps beside this run's samples, and the total apart.
    assert summary(more.stdout).startswith("trained 3 steps on 300 samples: "), more.stdout
    assert ", now at step 10, " in summary(more.stdout), more.stdout
    rest = kfeed(*args, "--until-end", bootstrap=bootstrap)
    assert rest.returncode == 0, rest.stderr
    # 1000 samples before, 1000 after: none repeated, none skipped.
    assert summary(rest.stdout).startswith("trained 10 steps on 1,000 samples: "), rest.stdout
    assert ", now at step 20, " in summary(rest.stdout), rest.stdout


def stop_after_step(proc: subprocess.Popen[str], sig: int, step_line: str) -> tuple[str, str]:
    """Send ``sig`` once the run printed ``step_line``; its stdout and stderr."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(step_line):
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=120)
    return "".join(seen) + out, err


@pytest.mark.integration
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_a_checkpoint_and_exits(bootstrap, make_topic, group_id, tmp_path,
                                               sig, code) -> None:
    import torch

    topic = make_topic(partitions=2)
    total = 6000
    assert kfeed("produce", "--topic", topic, "--synthetic", str(total),
                 bootstrap=bootstrap).returncode == 0
    ckpt = tmp_path / "c.pt"
    args = ["train", "--topic", topic, "--group-id", group_id, "--device", "cpu",
            "--batch-size", "100", "--checkpoint", str(ckpt), "--resume", "--until-end"]
    proc = subprocess.Popen([sys.executable, "-m", "kfeed", *args, "--log-every", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "KFEED_BOOTSTRAP": bootstrap})
    out, err = stop_after_step(proc, sig, "step 1 ")
    assert proc.returncode == code, err
    step = torch.load(ckpt, weights_only=False)["step"]
    assert 1 <= step < total // 100
    assert err.splitlines() == [
        (f"kfeed: stopped by {signal.Signals(sig).name} at step {step}: checkpoint saved to "
        f"{ckpt} at step {step}: --resume goes on from there")]
    assert summary(out).startswith(f"trained {step} step{'' if step == 1 else 's'} on ")
    first = samples_of(out)
    rest = kfeed(*args, bootstrap=bootstrap)
    assert rest.returncode == 0, rest.stderr
    assert f"resumed from {ckpt} at step {step}" in rest.stdout
    # Every sample once across the two runs.
    assert first + samples_of(rest.stdout) == total, (out, rest.stdout)


def samples_of(stdout: str) -> int:
    return int(summary(stdout).split(" samples")[0].rsplit(" ", 1)[1].replace(",", ""))


def on_a_terminal(args: list[str], stdout: Any = subprocess.PIPE) -> tuple[str, str, int]:
    """Run ``kfeed args`` with stderr (and, with ``stdout=None``, stdout) on a pty."""
    import pty
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kfeed", *args],
                            stdout=slave if stdout is None else stdout, stderr=slave,
                            stdin=subprocess.DEVNULL)
    os.close(slave)
    drawn = b""
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the other end closed
                break
            if not chunk:
                break
            drawn += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    out = proc.communicate(timeout=120)[0]
    return drawn.decode(errors="replace"), (out or b"").decode(), proc.returncode


@pytest.mark.integration
def test_on_a_terminal_produce_and_train_draw_bars(bootstrap, make_topic, group_id) -> None:
    topic = make_topic(partitions=1)
    text, out, rc = on_a_terminal(["produce", "--bootstrap-servers", bootstrap, "--topic",
                                   topic, "--synthetic", "30000", "--progress-every", "0.05"])
    assert rc == 0
    # tqdm's bar: the description, the count of the total, the rate.
    assert "kfeed produce: 100%|" in text and "30.0k/30.0k" in text, text[-2000:]
    assert "samples/s" in text and "MB/s" in text
    assert out.startswith("produced 30,000 samples")
    text, _, rc = on_a_terminal(["train", "--bootstrap-servers", bootstrap, "--topic", topic,
                                 "--group-id", group_id, "--steps", "6", "--log-every", "3",
                                 "--device", "cpu", "--prefetch", "auto",
                                 "--max-memory-mb", "256"], stdout=None)
    assert rc == 0, text[-2000:]
    assert "kfeed train: 100%|" in text and "6/6" in text, text[-2000:]
    assert "step 3  loss" in text and "trained 6 steps" in text


def test_convert_fields_take_a_default() -> None:
    # A field a newer writer schema added could not be given one: every
    # record written before it was dead-lettered by kfeed convert.
    schema = cli._convert_schema(["added=int32=7", "age=float32@user.age=0.5",
                              "tokens=int32[None]=[]", "ok=bool=true", "id=int64"])
    assert [(f.name, f.source, f.default) for f in schema.fields] == [
        ("added", None, 7), ("age", "user.age", 0.5), ("tokens", None, ()),
        ("ok", None, True), ("id", None, None)]
    with pytest.raises(ConfigError, match=r"^--field 'added=int32=seven': its default "
                       r"'seven' is not a number"):
        cli._convert_schema(["added=int32=seven"])
    with pytest.raises(ConfigError, match="does not fit int8"):
        cli._convert_schema(["small=int8=300"])


def test_a_training_run_a_signal_stopped_does_not_wait_for_brokers_gone_away() -> None:
    # The final commit waited for its brokers for the connect timeout: 36 s,
    # then "the consumer did not close within 35s", exit 1, for a run whose
    # checkpoint was saved.
    import threading

    import numpy as np

    import kfeed
    from kfeed import _train

    class Gone(kfeed.MemorySource):
        def commit(self, positions, asynchronous):
            if not asynchronous:  # the final commit: no broker answers
                threading.Event().wait(60)
            return super().commit(positions, asynchronous)

    ids = kfeed.Schema({"id": ("int64", ())})
    guard = _train.StopGuard()
    out = _train.Outcome(task=None)
    loader = kfeed.Loader(None, "memory", ids, 4, device="cpu", until="end",
                          source=Gone(ids.encode_blocks({"id": np.arange(64)}, 8)))
    t0 = time.monotonic()
    with _train._closing(loader, guard, out):
        next(iter(loader))
        guard.signum = signal.SIGINT  # (what the handler notes)
    assert time.monotonic() - t0 < 3 * _train.STOP_CLOSE_S + 2
    assert out.unclosed is not None and out.unclosed.startswith(
        "the consumer did not close within 2s: it is stuck"), out.unclosed


@pytest.mark.integration
def test_a_reader_that_goes_away_ends_the_command_quietly(cluster_dir) -> None:
    # `kfeed cluster status | head -1`: "kfeed: unexpected BrokenPipeError ...
    # rerun with -v", exit 1, though the command had done its work.
    if cluster_dir is None:
        pytest.skip("an external cluster: no state folder to show")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        done = subprocess.run([sys.executable, "-m", "kfeed", "cluster", "status", "--dir",
                               str(cluster_dir)], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=60, check=False)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (128 + signal.SIGPIPE, "")
