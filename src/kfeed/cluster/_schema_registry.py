"""A real Schema Registry beside the local cluster: Apicurio Registry, on 127.0.0.1.

Topics that other services write in Avro or Protobuf carry a schema id that a
Schema Registry resolves. ``kfeed cluster up --schema-registry`` runs one
next to the brokers, so that the whole path (serializers registering, kfeed
fetching by id) runs locally as in production: Apicurio Registry 3.0.9, whose
Confluent-compatible API is at ``http://127.0.0.1:PORT/apis/ccompat/v7``,
with its schemas in memory (a restart starts empty).

Maven unpacks Apicurio's released server (``registry-pom.xml`` beside this
module) once into ``~/.cache/kfeed/apicurio-registry-<version>``. The server
is a detached JVM whose pid and port live in ``<state>/schema-registry``; like
a node, its pid is signalled only after ``/proc/<pid>/cmdline`` shows that
JVM running that runner jar on that port.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kfeed.cluster import _jars
from kfeed.errors import ClusterError

logger = logging.getLogger("kfeed.cluster")

POM = Path(__file__).with_name("registry-pom.xml")
DEFAULT_PORT = 38081
# Inside the state folder: pid, port and log of the registry.
FOLDER = "schema-registry"
API = "/apis/ccompat/v7"
HEAP = "192m"
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 15.0


def version() -> str:
    return _jars.pom_property(POM, "apicurio.version")


def home(progress: Callable[[str], None] | None = None) -> Path:
    """The unpacked server, fetched with Maven on first use."""
    folder = _jars.cache_root() / f"apicurio-registry-{version()}"
    if _runner(folder) is not None:
        return folder
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ClusterError("Maven (mvn) is needed once to fetch the Schema Registry: install it, "
                           "e.g. apt-get install maven")
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Maven works in a private folder (the POM copied there, so nothing is
    # written beside kfeed's own files) that becomes the cache in one rename.
    tmp = Path(tempfile.mkdtemp(prefix=".registry-", dir=folder.parent))
    try:
        shutil.copy(POM, tmp / "pom.xml")
        out = tmp / "out"
        if progress is not None:
            progress(f"fetching the Schema Registry with Maven into {folder} (once; ~110 MB)")
        try:
            done = subprocess.run(
                [mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(tmp / "pom.xml"), "package",
                 f"-DoutputDirectory={out}"],
                capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
                check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ClusterError(f"could not run {mvn}: {exc}") from exc
        if done.returncode != 0:
            raise ClusterError(_jars.maven_failure(done.stdout + done.stderr))
        if _runner(out) is None:
            raise ClusterError(f"Maven succeeded but unpacked no runner jar from {POM}")
        try:
            out.rename(folder)
        except OSError:
            if _runner(folder) is None:  # not another fetch that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _runner(folder: Path) -> Path | None:
    jars = sorted(folder.glob("apicurio-registry-app-*-runner.jar")) if folder.is_dir() else []
    return jars[0] if jars else None


def _folder(state_dir: Path) -> Path:
    return state_dir / FOLDER


def url(state_dir: Path) -> str | None:
    """The Confluent-compatible URL of the registry started in ``state_dir``, if it runs."""
    port = running_port(state_dir)
    return None if port is None else f"http://127.0.0.1:{port}{API}"


def running_port(state_dir: Path) -> int | None:
    """The port of the registry started in ``state_dir``, if it runs."""
    return _port(state_dir) if running_pid(state_dir) is not None else None


def _port(state_dir: Path) -> int | None:
    try:
        return int((_folder(state_dir) / "port").read_text())
    except (OSError, ValueError):
        return None


def running_pid(state_dir: Path) -> int | None:
    """The registry's pid, if its pid file names its live JVM."""
    try:
        pid = int((_folder(state_dir) / "pid").read_text())
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    port = _port(state_dir)
    if not args or not os.path.basename(args[0]).startswith(b"java"):
        return None
    if not any(a.endswith(b"-runner.jar") and b"apicurio-registry-app" in a for a in args):
        return None
    return pid if f"-Dquarkus.http.port={port}".encode() in args else None


def start(state_dir: Path, port: int = DEFAULT_PORT, timeout: float = START_TIMEOUT_S,
          progress: Callable[[str], None] | None = None) -> str:
    """Start the registry for ``state_dir`` on ``port`` (if not running); its URL once it answers."""
    running = url(state_dir)
    if running is not None:
        return running
    runner = _runner(home(progress))
    assert runner is not None
    folder = _folder(state_dir)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "registry.log"
    cmd = [_jars.java(), f"-Xmx{HEAP}", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
           "-Djava.awt.headless=true", "-Dquarkus.http.host=127.0.0.1",
           f"-Dquarkus.http.port={port}", "-Dquarkus.http.access-log.enabled=false",
           "-jar", str(runner)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=str(folder))
    (folder / "port").write_text(str(port))
    (folder / "pid").write_text(str(proc.pid))
    address = f"http://127.0.0.1:{port}{API}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(f"the Schema Registry exited with status {proc.returncode} while "
                               f"starting; the end of {log}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"{address}/subjects", timeout=2) as answer:
                if answer.status == 200:
                    logger.info("Schema Registry up at %s (pid %d)", address, proc.pid)
                    return address
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    stop(state_dir)
    raise ClusterError(f"the Schema Registry did not answer at {address} within {timeout:.0f} s; "
                       f"the end of {log}:\n{_tail(log)}")


def stop(state_dir: Path) -> int | None:
    """Stop the registry of ``state_dir``; the pid it stopped, or None if none ran."""
    pid = running_pid(state_dir)
    if pid is None:
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while running_pid(state_dir) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    if running_pid(state_dir) is not None:
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)  # only if it is our child; otherwise init reaps it
    return pid


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
