"""The ``kfeed`` command: the outermost layer.

It uses the cluster tool, the producer and the loader; nothing imports it.
Only this module (and the cluster tool's CLI part) prints.

- ``kfeed cluster up|down|status|jars``: a real local Apache Kafka.
- ``kfeed produce``: samples (synthetic, .npz, .npy, Parquet) into a topic;
  or token documents (a text corpus tokenized by ``kfeed.text``, token ids
  already, or synthetic text) into a token topic.
- ``kfeed train``: an MLP trained from a topic with the Loader, or
  (``--task lm``) a tiny causal transformer trained from a token topic with
  packed ``[batch, seq_len]`` rows; checkpoints (model, optimizer, loader
  state) and resumes exactly.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kfeed import cluster
from kfeed.errors import KfeedError

# The seeds' workload: 768 float32 features, an int64 label and an int64 id.
FEATURES = 768
CLASSES = 10


def synthetic_schema() -> Any:
    from kfeed.schema import Schema

    return Schema({"features": ("float32", (FEATURES,)), "label": ("int64", ()),
                   "id": ("int64", ())})


def synthetic_columns(ids: Any) -> dict[str, Any]:
    """Samples that depend on their id alone, with a label learnable from them."""
    import numpy as np

    ids = np.asarray(ids, dtype=np.int64)
    mixed = (ids[:, None] * 2654435761 + np.arange(FEATURES) * 40503) % 65521
    features = (mixed.astype(np.float32) / 65521.0) - 0.5
    label = features[:, :CLASSES].argmax(axis=1).astype(np.int64)
    return {"features": features, "label": label, "id": ids}


# -- produce -----------------------------------------------------------------


def _kafka_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap-servers", default=os.environ.get("KFEED_BOOTSTRAP"),
                   help="host:port,... (default: $KFEED_BOOTSTRAP)")
    p.add_argument("--topic", required=True)
    p.add_argument("-X", dest="kafka", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra librdkafka setting (repeatable)")


def _kafka_config(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    if not args.bootstrap_servers:
        raise KfeedError("--bootstrap-servers is required (or set KFEED_BOOTSTRAP)")
    config: dict[str, Any] = {"bootstrap.servers": args.bootstrap_servers, **extra}
    for item in args.kafka:
        key, sep, value = item.partition("=")
        if not sep:
            raise KfeedError(f"-X expects KEY=VALUE, got {item!r}")
        config[key] = value
    return config


def _ensure_topic(config: dict[str, Any], topic: str, partitions: int) -> None:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({k: v for k, v in config.items()
                         if k.startswith(("bootstrap.", "security.", "sasl.", "ssl."))})
    if topic in admin.list_topics(timeout=30).topics:
        return
    try:
        admin.create_topics([NewTopic(topic, num_partitions=partitions)])[topic].result(30)
    except KafkaException as e:
        if e.args[0].name() != "TOPIC_ALREADY_EXISTS":
            raise KfeedError(f"cannot create topic {topic}: {e.args[0].str()}") from e


def _load_file(path: Path, fields: dict[str, str]) -> dict[str, Any]:
    """Columns from .npz, .npy or .parquet; ``fields`` maps schema field -> source name."""
    import numpy as np

    suffix = path.suffix.lower()
    if suffix == ".npz":
        with np.load(path) as data:
            return {f: data[src] for f, src in fields.items()}
    if suffix == ".npy":
        if len(fields) != 1:
            raise KfeedError(".npy holds one array: map exactly one field to it")
        return {next(iter(fields)): np.load(path)}
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=sorted(set(fields.values())))
        out = {}
        for f, src in fields.items():
            col = table.column(src).combine_chunks()
            if pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or \
                    pa.types.is_fixed_size_list(col.type):
                lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
                if len(lengths) and (lengths != lengths[0]).any():
                    raise KfeedError(f"column {src!r} holds lists of different lengths; "
                                     "fixed-shape fields need equal lengths")
                width = int(lengths[0]) if len(lengths) else 0
                values = col.flatten().to_numpy(zero_copy_only=False)
                out[f] = values.reshape(len(col), width)
            else:
                out[f] = col.to_numpy(zero_copy_only=False)
        return out
    raise KfeedError(f"--from takes .npz, .npy or .parquet, got {path.name}")


def _progress(done: int, total: int, t0: float, nbytes: int) -> None:
    dt = max(time.monotonic() - t0, 1e-9)
    width = 30
    filled = int(width * done / total) if total else width
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                     f"{done / dt:,.0f} samples/s {nbytes / dt / 1e6:,.1f} MB/s")
    sys.stderr.flush()


def cmd_produce(args: argparse.Namespace) -> int:
    import numpy as np

    from kfeed.producer import Producer
    from kfeed.schema import Schema

    config = _kafka_config(args)
    if args.synthetic_text is not None or _corpus_mode(args):
        return _produce_text(args, config)
    if args.skip_docs:
        raise KfeedError("--skip-docs applies to token documents (a corpus or --synthetic-text)")
    if args.synthetic is not None:
        schema = synthetic_schema()
        total = args.synthetic
        start = args.first_id

        def chunk(i: int, n: int) -> dict[str, Any]:
            return synthetic_columns(np.arange(start + i, start + i + n))
    elif args.source is not None:
        mapping = dict(item.split("=", 1) for item in args.field) if args.field else {}
        data = _load_file(Path(args.source), mapping or {"features": "features",
                                                         "label": "label", "id": "id"})
        schema = Schema({name: (str(col.dtype), col.shape[1:]) for name, col in data.items()})
        total = len(next(iter(data.values())))

        def chunk(i: int, n: int) -> dict[str, Any]:
            return {name: col[i:i + n] for name, col in data.items()}
    else:
        raise KfeedError("give --synthetic N or --from FILE")
    if args.partitions:
        _ensure_topic(config, args.topic, args.partitions)
    t0 = time.monotonic()
    with Producer(config, args.topic, schema, format=args.format,
                  block_records=args.block_records, compression=args.compression) as producer:
        step = 8192
        for i in range(0, total, step):
            cols = chunk(i, min(step, total - i))
            keys = cols["id"] if args.keyed and "id" in cols else None
            producer.send(cols, keys=keys)
            _progress(min(i + step, total), total, t0, producer.bytes)
        producer.flush()
    dt = time.monotonic() - t0
    sys.stderr.write("\n")
    print(f"produced {total} samples in {producer.messages} messages to {args.topic}: "
          f"{total / dt:,.0f} samples/s, {producer.bytes / dt / 1e6:,.1f} MB/s")
    return 0


# -- produce: token documents ---------------------------------------------------


def _corpus_mode(args: argparse.Namespace) -> bool:
    """--from names a corpus (token documents), not columns of fixed-shape samples."""
    if args.source is None:
        return False
    suffix = Path(args.source).suffix.lower()
    return (suffix in (".txt", ".jsonl") or args.tokenizer is not None
            or args.text_field is not None or args.lengths is not None)


def _text_progress(done: int, total: int, t0: float, docs: int, tokens: int,
                   nbytes: int) -> None:
    dt = max(time.monotonic() - t0, 1e-9)
    width = 30
    filled = min(width, int(width * done / total)) if total else width
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {docs} docs "
                     f"{docs / dt:,.0f} docs/s {tokens / dt:,.0f} tokens/s "
                     f"{nbytes / dt / 1e6:,.1f} MB/s")
    sys.stderr.flush()


def _skip_documents(chunks: Iterator[Any], n: int, where: str) -> Iterator[Any]:
    """``chunks`` (``kfeed.text.Chunk``) less their first ``n`` documents."""
    for chunk in chunks:
        if n >= len(chunk):
            n -= len(chunk)
            continue
        if n:
            # Not _replace: Chunk's len() counts documents, which _make trips on.
            sliced = {f: getattr(chunk, f)[n:] for f in ("texts", "ids", "keys")
                      if getattr(chunk, f) is not None}
            chunk = type(chunk)(**{**chunk._asdict(), **sliced})
            n = 0
        yield chunk
    if n:
        raise KfeedError(f"{where}--skip-docs leaves out more documents than there are")


def _token_arrays(chunk: Any, tokenizer: Any, args: argparse.Namespace,
                  where: str) -> list[Any]:
    """One chunk's documents as token id arrays of ``--token-dtype``, checked."""
    from kfeed import text

    if chunk.texts is not None:
        ids = tokenizer.encode_batch(chunk.texts)
    else:
        ids = chunk.ids or []
        top = max((int(d.max()) for d in ids if len(d)), default=-1)
        if top >= tokenizer.vocab_size:
            raise KfeedError(f"{where}token id {top} is outside the vocabulary of "
                             f"{tokenizer.name} ({tokenizer.vocab_size} ids)")
    return text.as_token_arrays(ids, args.token_dtype, where=where)


def _produce_text(args: argparse.Namespace, config: dict[str, Any]) -> int:
    from kfeed import text
    from kfeed.producer import Producer

    schema = text.token_schema(args.token_dtype)
    tokenizer = text.load_tokenizer(args.tokenizer or "bytes")
    chunks: Iterator[text.Chunk]
    if args.synthetic_text is not None:
        if args.key_field is not None:
            raise KfeedError("--key-field needs --from; key synthetic text by index with --keyed")
        total, first, step = args.synthetic_text, args.first_id, 1024

        def synthetic() -> Iterator[text.Chunk]:
            for i in range(0, total, step):
                n = min(step, total - i)
                ids = list(range(first + i, first + i + n))
                yield text.Chunk(text.synthetic_documents(first + i, n, seed=args.seed), None,
                                 ids if args.keyed else None, i + n, total)

        chunks = synthetic()
    else:
        if args.keyed:
            raise KfeedError("--keyed applies to synthetic data; key corpus documents "
                             "with --key-field FIELD")
        chunks = text.read_corpus(args.source, text_field=args.text_field or "text",
                                  key_field=args.key_field, lengths=args.lengths)
    if args.skip_docs < 0:
        raise KfeedError(f"--skip-docs must be >= 0, got {args.skip_docs}")
    if args.partitions:
        _ensure_topic(config, args.topic, args.partitions)
    docs = tokens = 0
    t0 = time.monotonic()
    with Producer(config, args.topic, schema, format=args.format,
                  block_records=args.block_records, compression=args.compression) as producer:
        where = f"{args.source or 'synthetic text'}: "
        todo = _skip_documents(chunks, args.skip_docs, where)
        while True:
            try:  # reading the corpus, tokenizing, checking
                chunk = next(todo, None)
                if chunk is None:
                    break
                arrays = _token_arrays(chunk, tokenizer, args, where)
            except KfeedError as e:
                if not docs:
                    raise
                # A bad chunk: the ones before it are in Kafka. Say how to go
                # on without sending them twice. (An error from send() itself
                # may come after part of its chunk went out: no such advice.)
                producer.flush()
                sys.stderr.write("\n")
                raise KfeedError(
                    f"{e}\nThe {docs} documents before this chunk were sent (documents "
                    f"{args.skip_docs} to {args.skip_docs + docs - 1} of the corpus). Fix it "
                    f"and run again with --skip-docs {args.skip_docs + docs} to go on without "
                    f"sending them twice.") from None
            producer.send({"tokens": arrays}, keys=chunk.keys)
            docs += len(arrays)
            tokens += int(sum(len(a) for a in arrays))
            _text_progress(chunk.done, chunk.total, t0, docs, tokens, producer.bytes)
        producer.flush()
    dt = max(time.monotonic() - t0, 1e-9)
    sys.stderr.write("\n")
    eos = "none" if tokenizer.eos_id is None else tokenizer.eos_id
    print(f"produced {docs} documents ({tokens} tokens, {args.token_dtype}, tokenizer "
          f"{tokenizer.name}: vocab {tokenizer.vocab_size}, eos {eos}) in {producer.messages} "
          f"messages to {args.topic}: {docs / dt:,.0f} documents/s, {tokens / dt:,.0f} tokens/s, "
          f"{producer.bytes / dt / 1e6:,.1f} MB/s")
    return 0


# -- train -------------------------------------------------------------------


def _save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    import torch

    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a torn checkpoint


class _MLPTask:
    """The seeds' workload: an MLP on 768 features, 10 classes, from a sample topic."""

    name = "mlp"

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        import torch

        self.schema = synthetic_schema()
        self.model = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, CLASSES)
        ).to(device)
        self.batch_size = args.batch_size or 256
        self._last = 0

    def loader_kwargs(self) -> dict[str, Any]:
        return {}

    def loss(self, batch: Any) -> Any:
        import torch

        return torch.nn.functional.cross_entropy(self.model(batch["features"]), batch["label"])

    def rate(self, st: dict[str, Any], span: float) -> str:
        rate = (st["samples"] - self._last) / span
        self._last = st["samples"]
        return f"{rate:,.0f} samples/s"

    def summary(self, step: int, st: dict[str, Any]) -> str:
        return (f"trained {step} steps on {st['samples']} samples: "
                f"{st['samples_per_s']:,.0f} samples/s")


# A tiny causal transformer, CPU-sized: it shows the token stream's figures
# (tokens/s, packing efficiency, data stall), not a useful language model.
LM_D_MODEL = 128
LM_HEADS = 4
LM_LAYERS = 2


def tiny_lm(vocab_size: int, seq_len: int) -> Any:
    """Token and position embeddings, pre-norm transformer blocks, a vocabulary head."""
    import torch

    nn = torch.nn
    layer = nn.TransformerEncoderLayer(LM_D_MODEL, LM_HEADS, 4 * LM_D_MODEL, dropout=0.0,
                                       batch_first=True, norm_first=True)
    return nn.ModuleDict({
        "embed": nn.Embedding(vocab_size, LM_D_MODEL),
        "pos": nn.Embedding(seq_len, LM_D_MODEL),
        "blocks": nn.TransformerEncoder(layer, LM_LAYERS, enable_nested_tensor=False),
        "norm": nn.LayerNorm(LM_D_MODEL),
        "head": nn.Linear(LM_D_MODEL, vocab_size, bias=False),
    })


def document_mask(doc_ids: Any) -> Any:
    """``[B, L, L]`` bool, True where a query may NOT attend to a key.

    Block-diagonal causal: a token sees the earlier tokens of its own document
    in its row, never another document's. Padding (doc id -1) sees only
    itself, so no row of the softmax is empty.
    """
    import torch

    length = doc_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=doc_ids.device).tril()
    same = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] >= 0)
    itself = torch.eye(length, dtype=torch.bool, device=doc_ids.device)
    return ~((same & causal) | itself)


def lm_logits(model: Any, batch: Any) -> Any:
    """``[B, L, vocab]`` next-token logits of a packed batch."""
    x = model["embed"](batch["tokens"].long()) + model["pos"](batch["position_ids"].long())
    mask = document_mask(batch["doc_ids"]).repeat_interleave(LM_HEADS, dim=0)
    return model["head"](model["norm"](model["blocks"](x, mask=mask)))


def lm_loss(logits: Any, tokens: Any, doc_ids: Any) -> Any:
    """Mean next-token cross entropy over the positions whose next token is of the same document.

    That leaves out padding (doc id -1) and the position after each
    document's EOS (the next document's first token is not predictable).
    """
    import torch

    valid = (doc_ids[:, :-1] >= 0) & (doc_ids[:, :-1] == doc_ids[:, 1:])
    per_token = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1).long(),
        reduction="none")
    return (per_token * valid.reshape(-1)).sum() / valid.sum().clamp(min=1)


class _LMTask:
    """A tiny causal transformer on packed ``[batch, seq_len]`` rows of a token topic."""

    name = "lm"

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        from kfeed.text import load_tokenizer, token_schema

        if args.log_ids:
            raise KfeedError("--log-ids applies to --task mlp (samples with ids)")
        tokenizer = load_tokenizer(args.tokenizer)
        eos = args.eos_id if args.eos_id is not None else tokenizer.eos_id
        if eos is None:
            raise KfeedError(f"{tokenizer.name} names no EOS token: pass --eos-id")
        self.vocab_size = max(tokenizer.vocab_size, eos + 1)
        self.eos_id = eos
        self.seq_len = args.seq_len
        self.shuffle = args.shuffle
        self.seed = args.seed
        self.schema = token_schema(args.token_dtype)
        self.model = tiny_lm(self.vocab_size, self.seq_len).to(device)
        self.batch_size = args.batch_size or 16
        # Real tokens; a tensor on the device when counted from doc_ids, read
        # only when a line is printed.
        self._real: Any = 0
        self._slots = 0
        self._last_real = self._last_slots = 0

    def loader_kwargs(self) -> dict[str, Any]:
        from kfeed.tokens import Pack, Shuffle

        kwargs: dict[str, Any] = {"pack": Pack(seq_len=self.seq_len, eos_id=self.eos_id,
                                               pad_id=0)}
        if self.shuffle:
            kwargs["shuffle"] = Shuffle(buffer=self.shuffle, seed=self.seed)
        return kwargs

    def loss(self, batch: Any) -> Any:
        doc_ids = batch["doc_ids"]
        info = getattr(batch, "pack", None)  # the loader's PackInfo: counted on the host
        if info is not None:
            self._real += info.tokens
            self._slots += info.tokens + info.padding
        else:
            self._real += (doc_ids >= 0).sum()
            self._slots += doc_ids.numel()
        return lm_loss(lm_logits(self.model, batch), batch["tokens"], doc_ids)

    def rate(self, st: dict[str, Any], span: float) -> str:
        real = int(self._real)
        d_real, d_slots = real - self._last_real, self._slots - self._last_slots
        self._last_real, self._last_slots = real, self._slots
        eff = d_real / d_slots if d_slots else 0.0
        return f"{d_real / span:,.0f} tokens/s  packing {100 * eff:.1f}%"

    def summary(self, step: int, st: dict[str, Any]) -> str:
        real = int(self._real)
        eff = real / self._slots if self._slots else 0.0
        rate = real / st["elapsed_s"] if st["elapsed_s"] > 0 else 0.0
        return (f"trained {step} steps on {real} tokens in [{self.batch_size}, {self.seq_len}] "
                f"rows: {rate:,.0f} tokens/s, packing efficiency {100 * eff:.1f}%")


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from kfeed.loader import Loader

    torch.manual_seed(0)
    config = _kafka_config(args, **{"group.id": args.group_id})
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    task = _LMTask(args, device) if args.task == "lm" else _MLPTask(args, device)
    model = task.model
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = 0
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    state = None
    if args.resume and ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state.get("task", "mlp") != task.name:
            raise KfeedError(f"{ckpt} is a checkpoint of --task {state.get('task', 'mlp')}, "
                             f"not {task.name}")
    # --resume ties the stream to the checkpoint: with none yet the model is
    # new, so it reads from the start, whatever a killed run committed.
    start = "earliest" if args.resume and state is None else "committed"
    loader = Loader(config, args.topic, task.schema, task.batch_size, device=device,
                    until="end" if args.until_end else None, format=args.format,
                    start=start, **task.loader_kwargs())
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        step = state["step"]
        print(f"resumed from {ckpt} at step {step}")
    seen_log = open(args.log_ids, "a", buffering=1) if args.log_ids else None  # noqa: SIM115
    if seen_log is not None and args.resume:
        # Marks where this run starts, even from scratch, so a log of many
        # killed-and-resumed runs can be accounted for exactly.
        seen_log.write(f"# resumed at step {step}\n")
    # Windows run on the loader's clock, which starts at the first batch, so
    # the first line's rate leaves joining the group out, as the summary does.
    e_last, w_last, loss_v = 0.0, 0.0, float("nan")
    with loader:
        for batch in loader:
            loss = task.loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if seen_log is not None:
                seen_log.write(" ".join(map(str, batch["id"].tolist())) + "\n")
            if ckpt is not None and step % args.checkpoint_every == 0:
                if seen_log is not None:
                    seen_log.write(f"# checkpoint {step}\n")
                    seen_log.flush()
                    os.fsync(seen_log.fileno())
                _save_checkpoint(ckpt, {"task": task.name, "model": model.state_dict(),
                                        "optimizer": optimizer.state_dict(),
                                        "loader": loader.state_dict(), "step": step})
            if step % args.log_every == 0:
                loss_v = loss.item()
                st = loader.stats()
                span = max(st["elapsed_s"] - e_last, 1e-9)
                rate = task.rate(st, span)
                stall = min(1.0, (st["wait_s"] - w_last) / span)
                e_last, w_last = st["elapsed_s"], st["wait_s"]
                print(f"step {step}  loss {loss_v:.4f}  {rate}  "
                      f"stall {100 * stall:.1f}%  lag {sum(st['lag'].values())}", flush=True)
            if args.steps and step >= args.steps:
                break
        st = loader.stats()
    if seen_log is not None:
        seen_log.close()
    print(f"{task.summary(step, st)}, startup {st['startup_s']:.1f}s, "
          f"{st['mb_per_s']:,.1f} MB/s, data stall {100 * st['stall_fraction']:.1f}%, "
          f"lag {sum(st['lag'].values())}, bad records {st['bad_records']}, "
          f"final loss {loss.item() if step else float('nan'):.4f}")
    return 0


# -- parser ------------------------------------------------------------------

PRODUCE_HELP = """\
Send samples, or token documents, to a topic.

Samples: --synthetic N, or --from FILE.npz|.npy|.parquet with fixed-shape columns.

Token documents (a topic with one variable-length field, "tokens"):
  --synthetic-text N            seeded synthetic text, tokenized
  --from corpus.txt             UTF-8 text; documents are separated by blank lines
                                (each paragraph is one document, its line breaks kept)
  --from corpus.jsonl           one JSON object per line, the text in --text-field
  --from corpus.parquet         with --tokenizer or --text-field: a string column
                                (text) or a list<int> column (token ids already)
  --from ids.npy --tokenizer T  token ids already: an object array of 1-D int arrays,
                                or a flat 1-D int array with --lengths FILE.npy
The tokenizer adds no EOS: the loader's packer appends one after each document
(256 for --tokenizer bytes). The corpus is read in chunks of 1024 documents. A bad
line stops the run; once earlier chunks were sent, the error names the --skip-docs N
that goes on after them without sending them twice.
"""



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kfeed", description="Feed GPU training from Apache Kafka.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)
    cluster.register(sub)

    p = sub.add_parser(
        "produce", help="send samples or token documents to a topic",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=PRODUCE_HELP)
    _kafka_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", type=int, metavar="N",
                     help="N samples of the seeds' workload (768 float32, label, id)")
    src.add_argument("--synthetic-text", type=int, metavar="N",
                     help="N seeded synthetic text documents (log-normal lengths, median "
                          "~500 bytes), tokenized into a token topic")
    src.add_argument("--from", dest="source", metavar="FILE",
                     help="samples: .npz, .npy or .parquet; a corpus: .txt, .jsonl, or "
                          ".parquet/.npy with --tokenizer (see above)")
    p.add_argument("--field", action="append", default=[], metavar="FIELD=COLUMN",
                   help="map a schema field to a column/array of --from (repeatable)")
    p.add_argument("--first-id", type=int, default=0,
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
    p.add_argument("--token-dtype", choices=["uint16", "int32", "uint32"], default="uint16",
                   help="the token field's dtype on the wire (default uint16; train with the "
                        "same)")
    p.add_argument("--seed", type=int, default=0, help="seed of --synthetic-text (default 0)")
    p.add_argument("--skip-docs", type=int, default=0, metavar="N",
                   help="token documents: leave out the first N documents (to go on after "
                        "an error that names N)")
    p.add_argument("--format", choices=["block", "raw"], default="block")
    p.add_argument("--block-records", type=int, default=64)
    p.add_argument("--compression", choices=["none", "gzip", "snappy", "lz4", "zstd"])
    p.add_argument("--partitions", type=int, default=0,
                   help="create the topic with this many partitions if it is missing")
    p.add_argument("--keyed", action="store_true",
                   help="key samples by id (murmur2 partitioning, as Java would)")
    p.set_defaults(func=cmd_produce)

    t = sub.add_parser(
        "train", help="train an MLP (or, --task lm, a tiny transformer) with the Loader",
        description="Train from a topic with the Loader. --task mlp (default): an MLP on "
                    "the seeds' synthetic samples. --task lm: a tiny causal transformer (2 "
                    "layers, d_model 128, 4 heads) on a token topic, its documents packed "
                    "into [batch, seq_len] rows with an EOS after each; attention is "
                    "block-diagonal causal (no token sees another document) and the loss "
                    "skips padding and the position after each EOS. tokens/s counts real "
                    "tokens (EOS included, padding not); packing efficiency is real tokens "
                    "over all row positions.")
    _kafka_args(t)
    t.add_argument("--group-id", required=True)
    t.add_argument("--task", choices=["mlp", "lm"], default="mlp")
    t.add_argument("--batch-size", type=int, default=0,
                   help="samples, or rows of --seq-len tokens (default: 256 mlp, 16 lm)")
    t.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (default 1e-3)")
    t.add_argument("--seq-len", type=int, default=256, help="lm: tokens per row (default 256)")
    t.add_argument("--tokenizer", default="bytes", metavar="bytes|PATH",
                   help="lm: the tokenizer the topic was produced with, for its vocabulary "
                        "size and EOS id (default bytes: vocab 257, eos 256)")
    t.add_argument("--eos-id", type=int, help="lm: the EOS id (default: the tokenizer's)")
    t.add_argument("--token-dtype", choices=["uint16", "int32", "uint32"], default="uint16",
                   help="lm: the token field's dtype, as produced (default uint16)")
    t.add_argument("--shuffle", type=int, default=0, metavar="N",
                   help="lm: shuffle documents through a seeded buffer of N (default 0: off)")
    t.add_argument("--seed", type=int, default=0, help="lm: the shuffle's seed (default 0)")
    t.add_argument("--format", choices=["block", "raw"], default="block")
    t.add_argument("--device", help="default: cuda if available, else cpu")
    t.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    t.add_argument("--until-end", action="store_true",
                   help="stop at the end of the topic's current content")
    t.add_argument("--checkpoint", metavar="PATH", help="checkpoint file")
    t.add_argument("--checkpoint-every", type=int, default=50, metavar="K")
    t.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint (with none yet: a new model, read from "
                        "the earliest offsets)")
    t.add_argument("--log-every", type=int, default=100, metavar="STEPS")
    t.add_argument("--log-ids", metavar="PATH", help="append every trained id to this file")
    t.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # librdkafka reports transient start-up trouble (a coordinator still
        # loading, a broker restarting) that it retries by itself.
        logging.getLogger("kfeed.librdkafka").setLevel(logging.ERROR)
    try:
        return int(args.func(args) or 0)
    except KfeedError as e:
        print(f"kfeed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
