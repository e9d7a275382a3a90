"""The documents are tests: every example in README.md and docs/*.md runs here.

Sybil's markdown parsers find the examples; each becomes one test, named
``<file>:<line>``, run in document order against the test cluster (the
``bootstrap`` fixture). A document that drifts from the code fails.

What a fence says it holds (``test_every_fence_says_what_it_holds``):

- ```python: run in one namespace per document, in order, so a block sees the
  names the blocks above it made. Run with the document's temporary folder as
  the working directory, so files a block writes (a checkpoint) land there.
- ```shell: commands, one a line (a line ending in ``\\`` goes on on the next;
  blank lines and ``# comment`` lines are not commands, and no ``$`` prompt).
  Each line runs through ``bash -o pipefail -c`` in the document's temporary
  folder, with this venv's bin first on PATH (``kfeed`` and ``python`` are this
  checkout's) and ``KFEED_BOOTSTRAP`` set to the test cluster; a non-zero
  exit fails the block. ``bash``, ``sh`` and ``console`` fences are refused:
  they would look tested and not be.
- ```text (or json, yaml, toml, ini): shown, never run. For a command
  synopsis with ``[optional] | parts``, for output, for layouts. The flags of
  every ``kfeed ...`` line in a text block must exist in ``kfeed``'s parser
  (``test_synopsis_flags_exist``).

A block that cannot run here is preceded by Sybil's skip directive with a
reason, ``<!-- skip: next "why" -->``; pytest shows the reason (``-ra``). A
skip without a reason fails ``test_skips_say_why``.

What the harness changes, and nothing else:

1. The address. Documents write the local cluster's default bootstrap
   servers, the one literal ``127.0.0.1:39092`` (``ADDRESS``); in python and
   shell blocks it is replaced by the test cluster's bootstrap servers. Any
   other ``127.0.0.1:PORT`` or ``localhost:PORT`` in a block fails
   ``test_blocks_use_the_one_address``.
2. ``kfeed cluster up`` with no ``--port`` gets ``--port <a free base>``
   (``make test``'s own cluster holds 29092). Its state folder is the default,
   relative ``.kfeed/cluster``: inside the document's temporary folder. After
   the document, even a failed one, the harness runs ``kfeed cluster down
   --dir <it> --wipe``. ``KFEED_CLUSTER_REGISTRY`` names a temporary folder
   and ``KFEED_CLUSTER_DIR`` is unset, so a document's ``kfeed cluster``
   commands never see the test cluster.

Nothing else is put in a document's namespace: a block uses only the names
the blocks above it define, as a user who copies them has. Keep the
documents' own data small (1,000 samples, 200 documents): all the documents
run in about a minute on the development machine, most of it two ``kfeed
cluster up`` and ``kfeed train``'s imports.

After a document, the harness closes loaders its blocks left open, then
deletes the topics and consumer groups that appeared on the test cluster
while it ran and that the document names, so a second run starts clean. Two
runs at once against one shared cluster would meet on those names (``train``,
``corpus``); ``make test`` starts a cluster of its own.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shlex
import subprocess
import sys
import traceback
import unittest
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sybil import Document, Example, Sybil
from sybil.evaluators.python import pad
from sybil.evaluators.skip import Skipper
from sybil.parsers.markdown import CodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

ROOT = Path(__file__).resolve().parent.parent
ADDRESS = "127.0.0.1:39092"
RUN = ("python", "shell")
SHOWN = ("text", "json", "yaml", "toml", "ini")
# Documents left out for now, each with why; their fence check xfails.
EXCLUDED: dict[str, str] = {}
# Where a document's own `kfeed cluster up` looks for free ports: clear of
# make test's 29092, the fixtures' 39392 and the Makefile's demo/bench/profile.
DOC_CLUSTER_PORT = 39342
BLOCK_TIMEOUT_S = 240
COMMAND_TIMEOUT_S = 200


def documents() -> list[Path]:
    """README.md and docs/*.md, less EXCLUDED."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [p for p in paths if rel(p) not in EXCLUDED]


def rel(path: Path | str) -> str:
    """A document's name as tests and messages give it: relative to the checkout."""
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


# -- evaluation ------------------------------------------------------------------


@dataclass
class DocRun:
    """One document's namespace, working folder and what it left on the cluster."""

    document: Document
    blocks: list[Example]          # code blocks and skip directives, in order
    tmp: Path
    bootstrap: str | None
    done: int = 0
    outcomes: list[BaseException | None] = field(default_factory=list)
    topics_before: set[str] = field(default_factory=set)
    groups_before: set[str] = field(default_factory=set)
    closed: bool = False
    tidy_cluster: bool = True      # delete the topics and groups it made (False: the harness's own tests)

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "KFEED_CLUSTER_DIR"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["KFEED_CLUSTER_REGISTRY"] = str(self.tmp / ".cluster-registry")
        if self.bootstrap is not None:
            env["KFEED_BOOTSTRAP"] = self.bootstrap
        return env

    def substitute(self, source: str) -> str:
        if ADDRESS in source and self.bootstrap is None:
            raise AssertionError(f"{ADDRESS} in a document that was not given the test cluster")
        return source.replace(ADDRESS, self.bootstrap) if self.bootstrap else source

    def start(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        if self.bootstrap is not None and self.tidy_cluster:
            admin = _admin(self.bootstrap)
            self.topics_before = set(admin.list_topics(timeout=30).topics)
            self.groups_before = _groups(admin)

    def run_through(self, index: int) -> None:
        """Evaluate the blocks up to ``index`` not run yet; raise block ``index``'s outcome."""
        if self.done == 0 and not self.outcomes:
            self.start()
        while self.done <= index:
            example = self.blocks[self.done]
            try:
                with _cwd(self.tmp):
                    example.evaluate()
                outcome: BaseException | None = None
            except BaseException as e:  # noqa: BLE001 - kept and raised by the block's own test
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                outcome = e
            self.outcomes.append(outcome)
            self.done += 1
        if self.done == len(self.blocks):
            self.close()
        outcome = self.outcomes[index]
        if outcome is None:
            return
        if isinstance(outcome, (unittest.SkipTest, pytest.skip.Exception)):
            pytest.skip(f"{rel(self.document.path)}:{self.blocks[index].line}: {outcome}")
        failed = [f"{rel(self.document.path)}:{b.line}" for b, o in zip(self.blocks[:index], self.outcomes)
                  if o is not None and not isinstance(o, (unittest.SkipTest, pytest.skip.Exception))]
        if failed and hasattr(outcome, "add_note"):
            outcome.add_note(f"blocks above this one failed first: {', '.join(failed)}")
        raise outcome

    def close(self) -> None:
        """Stop what the document started; runs once, also after a failure."""
        if self.closed:
            return
        self.closed = True
        problems: list[str] = []
        for value in list(self.document.namespace.values()):
            closer = getattr(value, "close", None)
            if (type(value).__module__ or "").startswith("kfeed.") and callable(closer):
                with contextlib.suppress(Exception):
                    closer()
        for state in sorted(self.tmp.rglob("cluster.json")):
            down = subprocess.run([sys.executable, "-m", "kfeed", "cluster", "down", "--dir",
                                   str(state.parent), "--wipe"], env=self.env, cwd=self.tmp,
                                  capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
            if down.returncode != 0:
                problems.append(f"kfeed cluster down --dir {state.parent}: {down.stderr.strip()}")
        if self.bootstrap is not None and self.tidy_cluster:
            problems += self._delete_what_it_made()
        if problems:
            raise AssertionError("cleaning up after " + rel(self.document.path) + ":\n" + "\n".join(problems))

    def _delete_what_it_made(self) -> list[str]:
        admin = _admin(self.bootstrap)
        text = self.document.text

        def named(name: str) -> bool:
            return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", text) is not None

        problems = []
        groups = sorted(g for g in _groups(admin) - self.groups_before if named(g))
        if groups:
            for group, future in admin.delete_consumer_groups(groups, request_timeout=30).items():
                try:
                    future.result(30)
                except Exception as e:  # noqa: BLE001 - reported below, after the rest is cleaned
                    problems.append(f"delete group {group}: {e}")
        topics = sorted(t for t in set(admin.list_topics(timeout=30).topics) - self.topics_before
                        if named(t) or (t.endswith(".dlq") and named(t[:-4])))
        if topics:
            for topic, future in admin.delete_topics(topics, operation_timeout=30).items():
                try:
                    future.result(30)
                except Exception as e:  # noqa: BLE001
                    problems.append(f"delete topic {topic}: {e}")
        return problems


def _admin(bootstrap: str) -> Any:
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap})


def _groups(admin: Any) -> set[str]:
    listed = admin.list_consumer_groups(request_timeout=30).result(30)
    return {g.group_id for g in listed.valid}


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def _run(example: Example) -> DocRun:
    run = getattr(example.document, "kfeed_run", None)
    if run is None:
        raise AssertionError("a block evaluated outside the harness")
    return run


def evaluate_python(example: Example) -> None:
    run = _run(example)
    source = run.substitute(str(example.parsed))  # one literal for another: lines stay put
    code = compile(pad(source, example.line + example.parsed.line_offset), example.path, "exec",
                   dont_inherit=True)
    exec(code, example.namespace)
    example.namespace.pop("__builtins__", None)


def shell_commands(source: str) -> list[tuple[int, str]]:
    """(line offset in the block, command) for each command of a shell block."""
    commands: list[tuple[int, str]] = []
    pending: list[str] = []
    first = 0
    for i, line in enumerate(source.splitlines()):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            first = i
        if stripped.endswith("\\"):
            pending.append(stripped[:-1])
            continue
        pending.append(stripped)
        commands.append((first, " ".join(pending)))
        pending = []
    if pending:
        raise AssertionError(f"a shell block ends inside a continued line: {' '.join(pending)}")
    return commands


def with_free_port(command: str) -> str:
    """``kfeed cluster up`` without ``--port``, given a free base (rule 2)."""
    words = shlex.split(command, comments=True)
    if words[:3] != ["kfeed", "cluster", "up"] or any(w.startswith("--port") for w in words):
        return command
    from kfeed import cluster

    nodes = int(words[words.index("--nodes") + 1]) if "--nodes" in words else 1
    return f"{command.split('#', 1)[0].rstrip()} --port {cluster.free_port_base(nodes, DOC_CLUSTER_PORT)}"


def evaluate_shell(example: Example) -> None:
    run = _run(example)
    for offset, command in shell_commands(str(example.parsed)):
        line = example.line + example.parsed.line_offset + offset + 1
        command = with_free_port(run.substitute(command))
        done = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=run.tmp, env=run.env,
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        if done.returncode != 0:
            raise AssertionError(
                f"{rel(example.path)}:{line}: `{command}` exited {done.returncode}\n"
                f"--- stdout (tail)\n{done.stdout[-3000:]}\n--- stderr (tail)\n{done.stderr[-3000:]}")


def parse(path: Path) -> Document:
    sybil = Sybil(parsers=[CodeBlockParser("python", evaluate_python),
                           CodeBlockParser("shell", evaluate_shell),
                           SkipParser()], path=str(ROOT))
    return sybil.parse(path)


def needs_cluster(document: Document) -> bool:
    return any(_language(b) == "shell" or ADDRESS in str(b.parsed)
               for b in document.examples() if _language(b) in RUN)


def _language(example: Example) -> str | None:
    evaluator = example.region.evaluator
    return {evaluate_python: "python", evaluate_shell: "shell"}.get(evaluator)  # type: ignore[call-overload]


@dataclass(frozen=True)
class Block:
    path: Path
    index: int   # position among the document's examples (skip directives included)
    line: int
    integration: bool


def collect() -> list[Any]:
    params = []
    for path in documents():
        document = parse(path)
        integration = needs_cluster(document)
        for i, example in enumerate(document.examples()):
            if _language(example) is None:
                continue  # a skip directive: it acts when the next block runs
            marks = [pytest.mark.timeout(BLOCK_TIMEOUT_S)]
            if integration:
                marks.append(pytest.mark.integration)
            params.append(pytest.param(Block(path, i, example.line, integration),
                                       id=f"{rel(path)}:{example.line}", marks=marks))
    return params


class DocRuns:
    """The documents being run in this session, one DocRun each."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self._tmp = tmp
        self._runs: dict[Path, DocRun] = {}

    def get(self, block: Block, request: pytest.FixtureRequest) -> DocRun:
        run = self._runs.get(block.path)
        if run is None:
            document = parse(block.path)
            bootstrap = request.getfixturevalue("bootstrap") if block.integration else None
            run = DocRun(document, list(document.examples()),
                         self._tmp.mktemp(block.path.stem.lower()), bootstrap)
            document.kfeed_run = run  # type: ignore[attr-defined]
            self._runs[block.path] = run
        return run

    def close(self) -> None:
        for run in self._runs.values():
            run.close()


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocRuns]:
    runs = DocRuns(tmp_path_factory)
    yield runs
    runs.close()  # documents cut short by -k or -x still stop their clusters


@pytest.mark.parametrize("block", collect())
def test_doc_block(block: Block, doc_runs: DocRuns, request: pytest.FixtureRequest) -> None:
    doc_runs.get(block, request).run_through(block.index)


# -- what the documents may hold -------------------------------------------------

FENCES = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<info>[^\n]*)\n"),
                                 mapping={"info": "info", "source": "source"})


def fences(path: Path) -> list[tuple[int, str, str]]:
    """(line, info string, source) of every fenced block."""
    document = Document(path.read_text(encoding="utf-8"), str(path))
    return [(document.text.count("\n", 0, r.start) + 1, r.lexemes["info"].strip(), str(r.lexemes["source"]))
            for r in FENCES(document)]


ALL_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_IDS = [rel(p) for p in ALL_DOCS]


@pytest.mark.parametrize("path", ALL_DOCS, ids=DOC_IDS)
def test_every_fence_says_what_it_holds(path: Path) -> None:
    if rel(path) in EXCLUDED:
        pytest.xfail(f"{rel(path)} is not run yet: {EXCLUDED[rel(path)]}")
    wrong = [f"{rel(path)}:{line}: ```{info}" for line, info, _ in fences(path)
             if info not in RUN + SHOWN]
    assert not wrong, (f"each fence names {' or '.join(RUN)} (run) or {', '.join(SHOWN)} (shown); "
                       f"these do not:\n" + "\n".join(wrong))


def _literal_text(reason: str | None) -> str:
    try:
        value = ast.literal_eval(reason) if reason else None
    except (ValueError, SyntaxError):
        return ""
    return value.strip() if isinstance(value, str) else ""


@pytest.mark.parametrize("path", ALL_DOCS, ids=DOC_IDS)
def test_skips_say_why(path: Path) -> None:
    document = parse(path)
    examples = list(document.examples())
    bad = []
    for i, example in enumerate(examples):
        if not isinstance(example.region.evaluator, Skipper):
            continue
        action, reason = example.parsed
        where = f"{rel(path)}:{example.line}"
        if action != "next":
            bad.append(f"{where}: skip: {action}; use one 'skip: next \"why\"' per block")
        elif not _literal_text(reason):
            bad.append(f"{where}: a skip needs its reason as a string: skip: next \"why\"")
        elif i + 1 >= len(examples) or _language(examples[i + 1]) is None:
            bad.append(f"{where}: no code block follows this skip")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", ALL_DOCS, ids=DOC_IDS)
def test_blocks_use_the_one_address(path: Path) -> None:
    other = re.compile(r"\b(?:127\.0\.0\.1|localhost):\d+")
    wrong = [f"{rel(path)}:{line}: {m.group(0)}" for line, info, source in fences(path) if info in RUN
             for m in other.finditer(source) if m.group(0) != ADDRESS]
    assert not wrong, f"blocks reach the cluster as {ADDRESS}, which the harness replaces:\n" + "\n".join(wrong)


def synopsis_lines(path: Path) -> list[tuple[int, str]]:
    """The ``kfeed ...`` commands of a document's text blocks, continuation lines joined."""
    out: list[tuple[int, str]] = []
    for line, info, source in fences(path):
        if info != "text":
            continue
        for i, text in enumerate(source.splitlines()):
            code = text.split("#", 1)[0].rstrip()
            if code.startswith("kfeed "):
                out.append((line + 1 + i, code))
            elif code[:1].isspace() and code.strip().startswith(("[", "-")) and out and \
                    out[-1][0] == line + i:
                out[-1] = (line + 1 + i, out[-1][1] + " " + code.strip())
    return out


def _subcommand(parser: Any, words: list[str]) -> tuple[Any, list[str]]:
    import argparse

    path = []
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
        path.append(word)
    return parser, path


@pytest.mark.parametrize("path", ALL_DOCS, ids=DOC_IDS)
def test_synopsis_flags_exist(path: Path) -> None:
    from kfeed.cli import build_parser

    wrong = []
    for line, command in synopsis_lines(path):
        words = command.split()[1:]
        parser, sub = _subcommand(build_parser(), words)
        known = {s for a in parser._actions for s in a.option_strings}
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", command):
            if flag not in known:
                wrong.append(f"{rel(path)}:{line}: kfeed {' '.join(sub)} has no {flag}")
    assert not wrong, "\n".join(wrong)


# -- the harness itself ----------------------------------------------------------


def _run_doc(tmp_path: Path, text: str, bootstrap: str | None = None) -> list[BaseException | None]:
    path = tmp_path / "doc.md"
    path.write_text(text)
    document = parse(path)
    run = DocRun(document, list(document.examples()), tmp_path / "work", bootstrap, tidy_cluster=False)
    document.kfeed_run = run  # type: ignore[attr-defined]
    for i in range(len(run.blocks)):
        with contextlib.suppress(BaseException):
            run.run_through(i)
    return run.outcomes


def test_a_python_block_that_drifts_fails_with_its_line(tmp_path: Path) -> None:
    outcomes = _run_doc(tmp_path, "# t\n\n```python\nimport kfeed\n```\n\n```python\n"
                                  "kfeed.no_such_function()\n```\n")
    assert outcomes[0] is None
    assert isinstance(outcomes[1], AttributeError)
    frames = traceback.extract_tb(outcomes[1].__traceback__)
    assert [(f.filename, f.lineno) for f in frames if f.filename.endswith(".md")] == \
        [(str(tmp_path / "doc.md"), 8)]


def test_python_blocks_share_one_namespace_and_nothing_else(tmp_path: Path) -> None:
    outcomes = _run_doc(tmp_path, "```python\nx = 41\n```\n\n```python\nassert x + 1 == 42\n"
                                  "```\n\n```python\nlm\n```\n")
    assert outcomes[:2] == [None, None] and isinstance(outcomes[2], NameError)


def test_a_failing_command_fails_its_shell_block(tmp_path: Path) -> None:
    outcomes = _run_doc(tmp_path, "```shell\ntrue   # fine\n# a comment\n"
                                  "python -c 'import sys; sys.exit(\"gone\")'\ntouch never\n```\n")
    assert isinstance(outcomes[0], AssertionError)
    assert str(outcomes[0]).startswith(
        "doc.md:4: `python -c 'import sys; sys.exit(\"gone\")'` exited 1\n--- stdout (tail)\n\n"
        "--- stderr (tail)\ngone\n")
    assert not (tmp_path / "work" / "never").exists()


def test_shell_lines_run_in_the_documents_folder_with_the_address_replaced(tmp_path: Path) -> None:
    outcomes = _run_doc(tmp_path, "```shell\necho 127.0.0.1:39092 > out.txt\n"
                                  "test \"$KFEED_BOOTSTRAP\" = 127.0.0.1:9 \\\n  && test -x \"$(command -v kfeed)\"\n```\n",
                        bootstrap="127.0.0.1:9")
    assert outcomes == [None]
    assert (tmp_path / "work" / "out.txt").read_text() == "127.0.0.1:9\n"


def test_a_skip_needs_a_reason_and_shows_it(tmp_path: Path) -> None:
    path = tmp_path / "doc.md"
    path.write_text('<!-- skip: next "needs a GPU" -->\n```python\nraise RuntimeError\n```\n\n'
                    "<!-- skip: next -->\n```shell\nfalse\n```\n")
    outcomes = _run_doc(tmp_path, path.read_text())
    # Without a reason Sybil skips in silence: `false` never ran, and no test
    # would say so. Hence the rule.
    assert [type(o) for o in outcomes] == [type(None), unittest.SkipTest, type(None), type(None)]
    assert str(outcomes[1]) == "needs a GPU"  # its test says: doc.md:2: needs a GPU
    with pytest.raises(AssertionError, match=r"doc.md:6: a skip needs its reason"):
        test_skips_say_why(path)


def test_cluster_up_gets_a_free_port_and_nothing_else_changes() -> None:
    up = with_free_port("kfeed cluster up   # one node")
    assert re.fullmatch(r"kfeed cluster up --port \d+", up), up
    assert int(up.rsplit(" ", 1)[1]) >= DOC_CLUSTER_PORT
    assert with_free_port("kfeed cluster up --port 39500") == "kfeed cluster up --port 39500"
    assert with_free_port("kfeed cluster down --wipe") == "kfeed cluster down --wipe"


def test_shell_commands_join_continued_lines_and_skip_comments() -> None:
    assert shell_commands("# c\nkfeed a \\\n  --b 1\n\nkfeed c  # d\n") == \
        [(1, "kfeed a  --b 1"), (4, "kfeed c  # d")]


def test_every_document_is_run() -> None:
    ran = {rel(b.values[0].path) for b in collect()}
    assert ran == {rel(p) for p in documents() if any(info in RUN for _, info, _ in fences(p))}
