"""The ``kfeed`` command: the outermost layer.

It uses the cluster tool, the producer and the loader; nothing imports it.
Only this module (and the cluster tool's CLI part) prints.

- ``kfeed cluster up|down|status|jars``: a real local Apache Kafka.
- ``kfeed produce``: samples (synthetic, .npz, .npy, Parquet) into a topic.
- ``kfeed train``: an MLP trained from a topic with the Loader; checkpoints
  (model, optimizer, loader state) and resumes exactly.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
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


# -- train -------------------------------------------------------------------


def _save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    import torch

    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a torn checkpoint


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from kfeed.loader import Loader

    torch.manual_seed(0)
    schema = synthetic_schema()
    config = _kafka_config(args, **{"group.id": args.group_id})
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, CLASSES)
    ).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = 0
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    loader = Loader(config, args.topic, schema, args.batch_size, device=device,
                    until="end" if args.until_end else None, format=args.format)
    if args.resume and ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
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
    t_last, s_last, w_last, loss_v = time.monotonic(), 0, 0.0, float("nan")
    with loader:
        for batch in loader:
            logits = model(batch["features"])
            loss = torch.nn.functional.cross_entropy(logits, batch["label"])
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
                _save_checkpoint(ckpt, {"model": model.state_dict(),
                                        "optimizer": optimizer.state_dict(),
                                        "loader": loader.state_dict(), "step": step})
            if step % args.log_every == 0:
                loss_v = loss.item()
                st = loader.stats()
                now = time.monotonic()
                span = max(now - t_last, 1e-9)
                rate = (st["samples"] - s_last) / span
                stall = min(1.0, (st["wait_s"] - w_last) / span)
                t_last, s_last, w_last = now, st["samples"], st["wait_s"]
                print(f"step {step}  loss {loss_v:.4f}  {rate:,.0f} samples/s  "
                      f"stall {100 * stall:.1f}%  lag {sum(st['lag'].values())}", flush=True)
            if args.steps and step >= args.steps:
                break
        st = loader.stats()
    if seen_log is not None:
        seen_log.close()
    print(f"trained {step} steps on {st['samples']} samples: {st['samples_per_s']:,.0f} samples/s, "
          f"startup {st['startup_s']:.1f}s, "
          f"{st['mb_per_s']:,.1f} MB/s, data stall {100 * st['stall_fraction']:.1f}%, "
          f"lag {sum(st['lag'].values())}, bad records {st['bad_records']}, "
          f"final loss {loss.item() if step else float('nan'):.4f}")
    return 0


# -- parser ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kfeed", description="Feed GPU training from Apache Kafka.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)
    cluster.register(sub)

    p = sub.add_parser("produce", help="send samples to a topic")
    _kafka_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", type=int, metavar="N",
                     help="N samples of the seeds' workload (768 float32, label, id)")
    src.add_argument("--from", dest="source", metavar="FILE", help=".npz, .npy or .parquet")
    p.add_argument("--field", action="append", default=[], metavar="FIELD=COLUMN",
                   help="map a schema field to a column/array of --from (repeatable)")
    p.add_argument("--first-id", type=int, default=0, help="first synthetic id (default 0)")
    p.add_argument("--format", choices=["block", "raw"], default="block")
    p.add_argument("--block-records", type=int, default=64)
    p.add_argument("--compression", choices=["none", "gzip", "snappy", "lz4", "zstd"])
    p.add_argument("--partitions", type=int, default=0,
                   help="create the topic with this many partitions if it is missing")
    p.add_argument("--keyed", action="store_true",
                   help="key samples by id (murmur2 partitioning, as Java would)")
    p.set_defaults(func=cmd_produce)

    t = sub.add_parser("train", help="train an MLP on a synthetic topic with the Loader")
    _kafka_args(t)
    t.add_argument("--group-id", required=True)
    t.add_argument("--batch-size", type=int, default=256)
    t.add_argument("--format", choices=["block", "raw"], default="block")
    t.add_argument("--device", help="default: cuda if available, else cpu")
    t.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    t.add_argument("--until-end", action="store_true",
                   help="stop at the end of the topic's current content")
    t.add_argument("--checkpoint", metavar="PATH", help="checkpoint file")
    t.add_argument("--checkpoint-every", type=int, default=50, metavar="K")
    t.add_argument("--resume", action="store_true", help="continue from --checkpoint")
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
