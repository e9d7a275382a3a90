"""The demo training jobs behind ``kfeed train``: the last stage of the data flow.

``kfeed.Loader`` batches -> a model's step -> checkpoints of (model,
optimizer, loader state) that resume exactly. Two jobs:

- ``mlp``: the seeds' workload, an MLP on 768 float32 features and 10
  classes, from a sample topic (``kfeed.synthetic``'s schema);
- ``lm``: a tiny causal transformer on packed ``[batch, seq_len]`` rows of a
  token topic, attention kept inside each document.

They show the loader's figures (rates, data stall, lag); they are not
useful models. The CLI parses and prints; this module imports torch, builds
the job, runs its loop and hands the CLI the lines to print. Private: users
import nothing from it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from kfeed.badrecords import FIX_SCHEMA
from kfeed.errors import (
    ConfigError,
    DecodeError,
    Interrupted,
    KfeedError,
    LoaderError,
    first_line,
)
from kfeed.synthetic import CLASSES, FEATURES, synthetic_schema

# A tiny causal transformer, CPU-sized: it shows the token stream's figures
# (tokens/s, packing efficiency, data stall), not a useful language model.
LM_D_MODEL = 128
LM_HEADS = 4
LM_LAYERS = 2


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    import torch

    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)  # a crash mid-write never leaves a torn checkpoint
    except (OSError, RuntimeError) as e:  # (torch's writer raises RuntimeError)
        raise KfeedError(f"cannot save the checkpoint to {path}: {first_line(e)}: the "
                         f"checkpoint before it, if any, stands") from None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint ``save_checkpoint`` wrote; a ``ConfigError`` (a mistake in the command,
    exit status 2) naming the file if it is not one."""
    import torch

    try:
        state = torch.load(path, weights_only=False)
    except Exception as e:  # torch raises many kinds for a file it did not write
        raise ConfigError(f"{path} is not a kfeed train checkpoint ({type(e).__name__}: {e}): "
                         f"give another --checkpoint path") from e
    if not isinstance(state, dict) or not {"model", "optimizer", "loader", "step"} <= set(state):
        raise ConfigError(f"{path} is not a kfeed train checkpoint: give another --checkpoint "
                          f"path")
    return state


def _steps(n: int) -> str:
    """``n`` steps, as a summary says it: "1 step", "12,000 steps"."""
    return f"{n:,} step{'' if n == 1 else 's'}"


class _MLPTask:
    """The seeds' workload: an MLP on 768 features, 10 classes, from a sample topic."""

    name = "mlp"

    def __init__(self, opts: Any, device: str) -> None:
        import torch

        self.schema = synthetic_schema()
        self.model = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, CLASSES)
        ).to(device)
        self.batch_size = opts.batch_size or 256
        self._last = 0

    def loader_kwargs(self) -> dict[str, Any]:
        return {}

    def loss(self, batch: Any) -> Any:
        import torch

        return torch.nn.functional.cross_entropy(self.model(batch["features"]), batch["label"])

    def check(self) -> None:
        """Nothing to check: the features go in as they are."""

    def rate(self, st: dict[str, Any], span: float) -> str:
        rate = (st["samples"] - self._last) / span
        self._last = st["samples"]
        return f"{rate:,.0f} samples/s"

    def summary(self, steps: int, st: dict[str, Any]) -> str:
        """``steps``: this run's, as ``st`` counts this run's samples."""
        return (f"trained {_steps(steps)} on {st['samples']:,} samples: "
                f"{st['samples_per_s']:,.0f} samples/s")

    def expects(self) -> str:
        return "features float32[768], label int64, id int64"


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


# The demo model's largest vocabulary (its embedding: 128 floats an id).
_MAX_VOCAB = 1 << 20
# What its attention takes a step, in bytes for each of the [batch * heads, L,
# L] entries: 7.6 to 10.6 measured on the CPU (a step of [4, 2048] and [8, 1024]
# rows), the mask, the scores and what the backward pass keeps.
_ATTENTION_BYTES = 12


def _memory_of(device: str) -> int:
    """The memory of ``device``: the GPU's, or this machine's."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class _LMTask:
    """A tiny causal transformer on packed ``[batch, seq_len]`` rows of a token topic."""

    name = "lm"

    def __init__(self, opts: Any, device: str) -> None:
        from kfeed.text import load_tokenizer, token_schema

        tokenizer = load_tokenizer(opts.tokenizer)
        eos = opts.eos_id if opts.eos_id is not None else tokenizer.eos_id
        if eos is None:
            raise ConfigError(f"--tokenizer {opts.tokenizer} names no EOS token: pass --eos-id")
        top = int(np.iinfo(opts.token_dtype).max)
        if eos > top:
            raise ConfigError(f"--eos-id {eos} is no {opts.token_dtype} token id (at most {top}): "
                              f"a smaller id, or a wider --token-dtype as produced")
        self.vocab_size = max(tokenizer.vocab_size, eos + 1)
        if self.vocab_size > _MAX_VOCAB:
            raise ConfigError(f"--eos-id {eos}: the demo model's vocabulary would have "
                              f"{self.vocab_size} ids, more than its {_MAX_VOCAB}")
        self.eos_id = eos
        self.tokenizer = opts.tokenizer
        self.seq_len = opts.seq_len
        self.shuffle = opts.shuffle
        self.seed = opts.seed
        self.token_dtype = opts.token_dtype
        self.schema = token_schema(opts.token_dtype)
        self.batch_size = opts.batch_size or 16
        # Its attention is the plain kind, with a [batch * heads, L, L] mask: --seq-len
        # 100000 was killed by the kernel with no word.
        need = self.batch_size * LM_HEADS * self.seq_len ** 2 * _ATTENTION_BYTES
        have = _memory_of(device)
        if need > have:
            raise ConfigError(f"--seq-len {self.seq_len} --batch-size {self.batch_size}: the demo "
                              f"model's attention would take about {need / 2**30:,.0f} GiB a step "
                              f"(batch x seq_len squared), more than the {have / 2**30:,.0f} GiB "
                              f"of {device}: give a smaller --seq-len or --batch-size")
        self.model = tiny_lm(self.vocab_size, self.seq_len).to(device)
        # Real tokens; a tensor on the device when counted from doc_ids, read
        # only when a line is printed.
        self._real: Any = 0
        self._slots = 0
        self._last_real = self._last_slots = 0
        self._top: Any = None  # the largest token id seen, on the device
        self._eager = device == "cpu"
        self._checked_first = False

    def loader_kwargs(self) -> dict[str, Any]:
        from kfeed.tokens import Pack, Shuffle

        kwargs: dict[str, Any] = {"pack": Pack(seq_len=self.seq_len, eos_id=self.eos_id,
                                               pad_id=0)}
        if self.shuffle:
            kwargs["shuffle"] = Shuffle(buffer=self.shuffle, seed=self.seed)
        return kwargs

    def loss(self, batch: Any) -> Any:
        tokens, doc_ids = batch["tokens"], batch["doc_ids"]
        # An id past the embedding is an IndexError on the CPU and a device-side
        # assert on CUDA: a topic produced with another tokenizer. Reading the
        # largest id each step would make the host wait for the device: it is
        # kept there and read by check() (each step on the CPU, where that
        # costs nothing; else at each line printed and before each checkpoint),
        # and ids past the vocabulary are trained as its last id till then.
        top = tokens.max()
        self._top = top if self._top is None else self._top.maximum(top)
        if self._eager or not self._checked_first:  # the first batch says it at once
            self._checked_first = True
            self.check()
        info = getattr(batch, "pack", None)  # the loader's PackInfo: counted on the host
        if info is not None:
            self._real += info.tokens
            self._slots += info.tokens + info.padding
        else:
            self._real += (doc_ids >= 0).sum()
            self._slots += doc_ids.numel()
        tokens = tokens.long().clamp(max=self.vocab_size - 1)
        return lm_loss(lm_logits(self.model, {**batch, "tokens": tokens}), tokens, doc_ids)

    def check(self) -> None:
        """Refuse token ids past the model's vocabulary seen so far."""
        top = int(self._top) if self._top is not None else -1
        if top >= self.vocab_size:
            raise ConfigError(f"token id {top} is past the model's vocabulary of "
                              f"{self.vocab_size} ids (--tokenizer {self.tokenizer}): train "
                              f"with the --tokenizer (and --eos-id) the topic was produced with")

    def rate(self, st: dict[str, Any], span: float) -> str:
        real = int(self._real)
        d_real, d_slots = real - self._last_real, self._slots - self._last_slots
        self._last_real, self._last_slots = real, self._slots
        eff = d_real / d_slots if d_slots else 0.0
        return f"{d_real / span:,.0f} tokens/s  packing {100 * eff:.1f}%"

    def summary(self, steps: int, st: dict[str, Any]) -> str:
        """``steps``: this run's, as its token counts are."""
        real = int(self._real)
        eff = real / self._slots if self._slots else 0.0
        rate = real / st["elapsed_s"] if st["elapsed_s"] > 0 else 0.0
        return (f"trained {_steps(steps)} on {real:,} tokens in "
                f"[{self.batch_size}, {self.seq_len}] "
                f"rows: {rate:,.0f} tokens/s, packing efficiency {100 * eff:.1f}%")

    def expects(self) -> str:
        return f"one variable-length {self.token_dtype} field 'tokens' (--token-dtype)"


# -- stopping at a step boundary ----------------------------------------------------


class _Stopped(Exception):
    """Raised by ``StopGuard`` inside ``next(loader)`` while it only waits for data."""


@dataclass
class StopGuard:
    """SIGINT/SIGTERM handling for the training loop.

    A signal sets ``signum``; the loop checks it at each step boundary, saves
    the checkpoint, closes the loader (which commits) and returns. A step is
    never cut in half. When the signal comes while ``next(loader)`` waits for
    data (a stream with nothing new), waiting for a boundary could last
    forever: then the wait itself stops, at its next look at the signal
    (``watch``, within the loader's POLL_S). That is the one loader wait
    inside which an exception leaves nothing half done: ``Loader._take``
    waiting for a batch not handed out yet, so the loader's state (what a
    checkpoint saves) still ends at the last batch trained. Before the loader
    handed out its first batch (brokers that do not answer), the handler
    raises wherever ``next()`` is: nothing was read, so nothing can be cut
    in half.
    """

    signum: int | None = None
    waiting: bool = False
    started: bool = False  # the loader handed out a batch
    # The loader exists (watch): before, nothing is begun that a stop could
    # cut in half (torch loading, the model being made), and a signal stops
    # the command at once instead of after all that.
    armed: bool = False
    _previous: dict[int, Any] = field(default_factory=dict)

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, Interrupted.handles(self._handle))

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            # A second signal: the user will not wait for the checkpoint. The
            # exit status is the second signal's (143 for a SIGTERM).
            self.restore()
            Interrupted.raise_for(signum)
        if not self.armed:
            self.restore()
            Interrupted.raise_for(signum)
        self.signum = signum
        if self.waiting and not self.started:
            raise _Stopped

    def watch(self, loader: Any) -> None:
        """Have ``loader``'s wait for data stop for a signal noted while ``next()`` waits:
        the handler raises nowhere inside ``next()`` once a batch was handed out (it
        could cut a commit or a hand-over in half), and the wait, on a stream with
        nothing new, would last for ever."""
        def check() -> None:
            if self.signum is not None and self.waiting:
                raise _Stopped
        loader._on_wait = check
        self.armed = True


# -- the job ---------------------------------------------------------------------


@dataclass
class Outcome:
    """What a run did, for the CLI to report."""

    task: Any
    step: int = 0
    first_step: int = 0            # the step the run started at (a resumed checkpoint's)
    stats: dict[str, Any] = field(default_factory=dict)
    loss: float = float("nan")
    resumed_from: Path | None = None
    saved_step: int | None = None  # the step of the last checkpoint this run saved
    signum: int | None = None      # the signal that stopped the run
    unclosed: str | None = None    # why the loader's final commit did not go through, then
    positions: dict[str, Any] = field(default_factory=dict)  # the loader's, at the end
    start_to_first_step_s: float = 0.0


def resolve_device(spec: str | None) -> str:
    """``--device``, checked; by default cuda when there is one."""
    import torch

    if spec is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {spec}: not a torch device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {spec}: torch sees no CUDA device here: use --device cpu")
    return spec


def run(opts: Any, config: dict[str, Any], *, start: Any, state: dict[str, Any] | None,
        say: Callable[[str], None], guard: StopGuard, t0: float,
        tick: Callable[[int], None] | None = None) -> Outcome:
    """Train ``opts.task`` from ``opts.topic``; ``say`` gets each progress line.

    ``tick``, if given, gets this run's step count after every step (a live bar).

    ``opts.steps`` counts this run's steps: after a resume from step S the
    run stops at step S + ``opts.steps``.

    ``state``: a loaded checkpoint to resume from (its loader positions win
    over ``start``). ``t0``: when the command started, for the time to the
    first step.
    """
    import torch

    from kfeed.loader import Loader, LoaderConfig
    from kfeed.loader.tuning import CapTooSmall

    torch.manual_seed(0)
    device = resolve_device(opts.device)
    task = _LMTask(opts, device) if opts.task == "lm" else _MLPTask(opts, device)
    out = Outcome(task=task)
    model = task.model
    optimizer = torch.optim.Adam(model.parameters(), lr=opts.lr)
    ckpt = Path(opts.checkpoint) if opts.checkpoint else None
    # The same checked settings as Loader(...) and KafkaIterableDataset take.
    settings = LoaderConfig(opts.topic, task.schema, task.batch_size, device=device,
                            until="end" if opts.until_end else None, format=opts.format,
                            start=start, connect_timeout_s=opts.connect_timeout,
                            prefetch=getattr(opts, "prefetch", 2),
                            max_memory_bytes=(opts.max_memory_mb << 20
                                              if getattr(opts, "max_memory_mb", None) else None),
                            **task.loader_kwargs())
    try:
        loader = Loader.from_config(config, settings)
    except CapTooSmall as e:
        raise ConfigError(f"--max-memory-mb {opts.max_memory_mb} is too small for these "
                          f"settings: they need at least {e.least >> 20} (or a smaller "
                          f"--batch-size, --prefetch or --shuffle)") from None
    guard.watch(loader)
    _say_while_waiting(loader, opts.topic, out, say)
    if state is not None:
        # The loader's state first: it names the settings that differ from the
        # checkpoint's (--seq-len, --eos-id), which the model's shapes follow.
        try:
            loader.load_state_dict(state["loader"])
        except ConfigError as e:
            raise ConfigError(f"--resume {ckpt}: {e}: resume with the flags it was saved with "
                              f"(--topic, --format, --seq-len, --eos-id, --shuffle, --seed), "
                              f"or another --checkpoint") from None
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as e:  # torch's first line only says there were errors
            why = next((line.strip().rstrip(".") for line in str(e).splitlines()[1:]
                        if line.strip()), first_line(e))
            raise ConfigError(f"--resume {ckpt}: its model does not fit these flags ({why}): "
                              f"resume with the flags it was saved with (--tokenizer, "
                              f"--seq-len, --eos-id)") from None
        optimizer.load_state_dict(state["optimizer"])
        out.step = out.first_step = int(state["step"])
        out.resumed_from = ckpt
        say(f"resumed from {ckpt} at step {out.step}")
    seen_log = open(opts.log_ids, "a", buffering=1) if opts.log_ids else None  # noqa: SIM115
    if seen_log is not None and opts.resume:
        # Marks where this run starts, even from scratch, so a log of many
        # killed-and-resumed runs can be accounted for exactly.
        seen_log.write(f"# resumed at step {out.step}\n")

    def checkpoint() -> None:
        if ckpt is None or out.step in (out.saved_step, out.first_step):
            return
        task.check()  # (no checkpoint of steps trained on ids the model lacks)
        if seen_log is not None:
            seen_log.write(f"# checkpoint {out.step}\n")
            seen_log.flush()
            os.fsync(seen_log.fileno())
        save_checkpoint(ckpt, {"task": task.name, "model": model.state_dict(),
                               "optimizer": optimizer.state_dict(),
                               "loader": loader.state_dict(), "step": out.step})
        out.saved_step = out.step

    # Windows run on the loader's clock, which starts at the first batch, so
    # the first line's rate leaves joining the group out, as the summary does.
    e_last, w_last = 0.0, 0.0
    loss = None
    try:
        with _closing(loader, guard, out):
            while guard.signum is None:
                guard.waiting = True
                try:
                    batch = next(loader)
                    guard.started = True
                except (StopIteration, _Stopped):
                    break
                except DecodeError as e:
                    if FIX_SCHEMA not in e.args[0]:
                        raise
                    # Its schema is the task's and the flags': no schema can be fixed.
                    fix = (f"kfeed train --task {task.name} reads {task.expects()}: give the "
                           f"flags that match the topic, or produce it for these")
                    raise DecodeError(e.args[0].replace(FIX_SCHEMA, fix), topic=e.topic,
                                      partition=e.partition, offset=e.offset) from None
                finally:
                    guard.waiting = False
                loss = task.loss(batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                out.step += 1
                if tick is not None:
                    tick(out.step - out.first_step)
                if out.step == out.first_step + 1:
                    out.start_to_first_step_s = time.monotonic() - t0
                if seen_log is not None:
                    seen_log.write(" ".join(map(str, batch["id"].tolist())) + "\n")
                if ckpt is not None and out.step % opts.checkpoint_every == 0:
                    checkpoint()
                if out.step % opts.log_every == 0:
                    task.check()
                    st = loader.stats()
                    span = max(st["elapsed_s"] - e_last, 1e-9)
                    rate = task.rate(st, span)
                    stall = min(1.0, (st["wait_s"] - w_last) / span)
                    e_last, w_last = st["elapsed_s"], st["wait_s"]
                    say(f"step {out.step}  loss {loss.item():.4f}  {rate}  "
                        f"stall {100 * stall:.1f}%  "
                        f"{lag_text(st['lag'], st['lag_unknown'])}")
                if opts.steps and out.step - out.first_step >= opts.steps:
                    break
            # The last steps since a periodic checkpoint, on a clean end and
            # on a signal alike: a resume then repeats nothing.
            task.check()
            checkpoint()
            out.stats = loader.stats()
            if guard.started or guard.signum is None:  # (else the loader may not be up)
                out.positions = loader.state_dict().get("positions", {})
    finally:
        out.signum = guard.signum
        if seen_log is not None:
            seen_log.close()
    out.loss = loss.item() if loss is not None else float("nan")
    return out


# A step that waits this long for its batch says so, and again as often.
WAIT_NOTICE_S = 15.0


def _say_while_waiting(loader: Any, topic: str, out: Outcome,
                       say: Callable[[str], None]) -> None:
    """Have ``loader``'s wait for a batch say, every ``WAIT_NOTICE_S``, that the run
    waits: on a topic with nothing (more) to read, a run printed nothing for as long as
    it waited."""
    check = loader._on_wait
    waits = {"step": -1, "since": 0.0, "said": 0.0}

    def on_wait() -> None:
        if check is not None:
            check()
        now = time.monotonic()
        if waits["step"] != out.step:  # a new wait
            waits.update(step=out.step, since=now, said=now)
        elif now - waits["said"] >= WAIT_NOTICE_S:
            waits["said"] = now
            which = "a first batch" if out.step == out.first_step else f"step {out.step + 1}"
            # (Read from the loader's thread: whether its set is empty, what it does.)
            if not loader._fetcher.assigned:
                why = ("the group gave this run no partition yet (more members than "
                       "partitions, or one that stopped without leaving holds them until its "
                       "session.timeout.ms)")
            elif loader._status.doing == "decoding":
                why = (f"the loader's thread is decoding what it read from {topic} (a schema "
                       f"registry slow to answer holds it up)")
            else:
                why = (f"nothing new to read from {topic} (produce to it, or check --topic "
                       f"and --start)")
            say(f"waiting {now - waits['since']:.0f}s for {which}: {why}; Ctrl-C stops")

    loader._on_wait = on_wait


# A run stopped by a signal gives the loader's final commit and close this
# long each: the user asked to stop, and a broker that does not answer would
# hold the command for the connect timeout (the checkpoint is saved by then).
STOP_CLOSE_S = 2.0


@contextlib.contextmanager
def _closing(loader: Any, guard: StopGuard, out: Outcome) -> Iterator[Any]:
    """``with loader:``, but a run a signal stopped closes it within ``STOP_CLOSE_S``, and a
    final commit that does not go through then is said with the stop (``out.unclosed``)."""
    try:
        yield loader
    except BaseException:
        loader.close(commit_current=False,
                     timeout_s=STOP_CLOSE_S if guard.signum is not None else None)
        raise
    try:
        loader.close(timeout_s=STOP_CLOSE_S if guard.signum is not None else None)
    except LoaderError as e:
        if guard.signum is None:
            raise
        out.unclosed = first_line(e)


def lag_text(lag: dict[str, int], unknown: Sequence[str] = ()) -> str:
    """``lag N`` summed over partitions; ``lag n/a`` while the loader does not know
    every partition's (a sum over some would be short)."""
    return f"lag {sum(lag.values())}" if lag and not unknown else "lag n/a"
