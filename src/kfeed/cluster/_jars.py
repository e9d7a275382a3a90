"""What the local cluster runs on: a Java 17+ runtime and the Apache Kafka jars.

The jars come from ``$KAFKA_HOME/libs`` when that names an unpacked Kafka
distribution; otherwise Maven resolves them once from the ``pom.xml`` shipped
beside this module into ``~/.cache/kfeed/kafka-<version>/libs``, so later
starts need neither Maven nor the network.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from kfeed.errors import ClusterError

logger = logging.getLogger("kfeed.cluster")

POM = Path(__file__).with_name("pom.xml")
MIN_JAVA = 17
_INSTALL_JAVA = "install OpenJDK 17 or newer, e.g. apt-get install openjdk-17-jre-headless"
_INSTALL_MAVEN = (
    "Maven (mvn) is needed once to fetch the Kafka jars: install it, e.g. apt-get install maven,"
    " or set KAFKA_HOME to an unpacked Apache Kafka distribution"
)
# groupId:artifactId[:type[:classifier]]:version, as Maven names an artifact.
_COORDINATE = re.compile(r"\b[A-Za-z][\w.\-]*:[A-Za-z][\w.\-]*(?::[\w.\-]+){1,3}")
_MAVEN_TIMEOUT_S = 900


def java() -> str:
    """The ``java`` executable to run Kafka with, checked to be Java 17 or newer."""
    home = os.environ.get("JAVA_HOME")
    exe = str(Path(home, "bin", "java")) if home else shutil.which("java")
    if not exe or not os.access(exe, os.X_OK):
        if not home:
            raise ClusterError(f"java not found on PATH: {_INSTALL_JAVA}")
        # JAVA_HOME wins over PATH, so a stale one hides a good java.
        on_path = shutil.which("java")
        fix = (
            f"fix JAVA_HOME, or unset it to use {on_path} from PATH"
            if on_path
            else f"point JAVA_HOME at a Java {MIN_JAVA}+ installation, or unset it and {_INSTALL_JAVA}"
        )
        raise ClusterError(f"JAVA_HOME={home} has no bin/java: {fix}")
    try:
        out = subprocess.run(
            [exe, "-version"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise ClusterError(f"could not run {exe} -version ({exc}): {_INSTALL_JAVA}") from exc
    text = out.stderr + out.stdout
    major = java_major_version(text)
    if major is None:
        first = text.strip().splitlines()[0] if text.strip() else "no output"
        raise ClusterError(f"could not tell the Java version of {exe} ({first}): {_INSTALL_JAVA}")
    if major < MIN_JAVA:
        raise ClusterError(f"{exe} is Java {major}, Kafka needs {MIN_JAVA}+: {_INSTALL_JAVA}")
    return exe


def java_major_version(version_output: str) -> int | None:
    """The major version in ``java -version`` output: ``"1.8.0_392"`` is 8, ``"17.0.15"`` is 17."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if match is None:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2) is not None:
        return int(match.group(2))
    return major


def kafka_version() -> str:
    """The Kafka version the shipped ``pom.xml`` pins."""
    return pom_property(POM, "kafka.version")


def pom_property(pom: Path, name: str) -> str:
    """The value of property ``name`` in ``pom``."""
    root = ET.parse(pom).getroot()
    for element in root.iter():
        if element.tag.rsplit("}", 1)[-1] == name and element.text:
            return element.text.strip()
    raise ClusterError(f"{pom} names no {name}")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kfeed"


def cached_jars() -> Path | None:
    """The jar folder if it is ready without Maven, else None."""
    home = os.environ.get("KAFKA_HOME")
    if home:
        return _distribution_libs(Path(home))
    libs = cache_root() / f"kafka-{kafka_version()}" / "libs"
    return libs if libs.is_dir() else None


def jars(progress: Callable[[str], None] | None = None) -> Path:
    """The folder of Kafka broker jars, resolving them with Maven on first use.

    ``progress`` receives a note just before Maven starts, since that can take
    a minute.
    """
    libs = cached_jars()
    if libs is not None:
        return libs
    libs = cache_root() / f"kafka-{kafka_version()}" / "libs"
    _resolve(libs, progress)
    return libs


def _distribution_libs(home: Path) -> Path:
    libs = home / "libs"
    if not any(libs.glob("kafka_*.jar")):
        raise ClusterError(f"KAFKA_HOME={home} is not an unpacked Kafka distribution (no libs/kafka_*.jar)")
    return libs


def _resolve(libs: Path, progress: Callable[[str], None] | None) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ClusterError(_INSTALL_MAVEN)
    libs.parent.mkdir(parents=True, exist_ok=True)
    # Maven fills a private folder that becomes the cache in one rename, so an
    # interrupted resolve leaves no half cache behind.
    tmp = Path(tempfile.mkdtemp(prefix=".libs-", dir=libs.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the jars are not secret
        cmd = [
            mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(POM),
            "dependency:copy-dependencies", f"-DoutputDirectory={tmp}", "-DincludeScope=runtime",
        ]  # fmt: skip
        logger.info("resolving the Kafka jars with Maven into %s", libs)
        if progress is not None:
            progress(f"fetching the Kafka jars with Maven into {libs} (once; about a minute)")
        try:
            out = subprocess.run(
                cmd, capture_output=True, text=True, timeout=_MAVEN_TIMEOUT_S, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"Maven did not finish within {_MAVEN_TIMEOUT_S} s") from exc
        except OSError as exc:
            raise ClusterError(f"could not run {mvn}: {exc}") from exc
        if out.returncode != 0:
            raise ClusterError(maven_failure(out.stdout + out.stderr))
        if not any(tmp.glob("kafka_*.jar")):
            raise ClusterError(f"Maven succeeded but copied no kafka_*.jar from {POM}")
        try:
            tmp.rename(libs)
        except OSError:
            # Another resolve finished first; its cache is as good as ours.
            if not libs.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def maven_failure(output: str) -> str:
    """One line naming what Maven could not resolve, from its error output."""
    ours = f"{_pom_group()}:"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    # Error lines first: warnings may name artifacts that resolved fine.
    lines.sort(key=lambda line: "ERROR" not in line)
    for line in lines:
        for coordinate in _COORDINATE.findall(line):
            if not coordinate.startswith(ours):
                return f"Maven could not resolve {coordinate}: check the network and ~/.m2/settings.xml"
    detail = lines[0] if lines else "no output"
    return f"Maven failed to fetch the Kafka jars: {detail}"


def _pom_group() -> str:
    root = ET.parse(POM).getroot()
    for element in root:
        if element.tag.rsplit("}", 1)[-1] == "groupId" and element.text:
            return element.text.strip()
    return ""
