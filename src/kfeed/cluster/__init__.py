"""A real local Apache Kafka cluster for tests, demos and benchmarks (no Docker).

It sits beside the data flow, not in it: the CLI (``kfeed cluster``) and the
test fixtures use it, and it knows nothing of torch, the loader or the codec.
Only ``confluent_kafka`` is imported, lazily, to ask the brokers whether they
are ready.

``up`` resolves the broker jars (Maven, once, into ``~/.cache/kfeed``),
formats each node's storage and starts 1 or 3 KRaft nodes (broker and
controller in one JVM) on 127.0.0.1: node ``i`` serves clients on
``port + i - 1`` and its controller on ``port + 100 + i - 1``. The state
folder (default ``.kfeed/cluster``) holds ``cluster.json``, the log4j2
config, one ``node-<i>`` folder per node with its properties, data, logs
and pid file, and ``cluster.lock``, which ``up`` and ``down`` hold so that
they never run at once on one folder. ``down(wipe=True)`` deletes only these.

Each start is also recorded in the user's kfeed cache (``_registry``), so
that ``kfeed cluster status``, ``down`` and ``list`` find the clusters this
user started from any directory.

``up(secure=True)`` (``kfeed cluster up --secure``) serves clients on
SASL_SSL with SCRAM-SHA-512 users and ACLs; its CA, broker key and
passwords live, owner-only, in ``secure/`` (see ``_secure``).
:func:`secure_client_config`, :func:`add_user` and :func:`grant` connect,
create users and allow them what a test needs.

``up --schema-registry`` (:func:`start_schema_registry`) also runs a real
Schema Registry, Apicurio Registry from Maven Central, on 127.0.0.1, for
topics written in Avro or Protobuf (see ``_schema_registry``).
"""

from __future__ import annotations

from kfeed.cluster._cli import register
from kfeed.cluster._jars import jars
from kfeed.cluster._layout import (
    CONTROLLER_PORT_OFFSET,
    DEFAULT_DIR,
    DEFAULT_PORT,
    min_insync_replicas,
    node_properties,
    replication_factor,
)
from kfeed.cluster._tool import (
    add_user,
    bootstrap,
    down,
    free_port_base,
    grant,
    kill_node,
    node_pids,
    secure_client_config,
    start_node,
    start_schema_registry,
    status,
    stop_schema_registry,
    up,
)

__all__ = [
    "DEFAULT_DIR",
    "DEFAULT_PORT",
    "CONTROLLER_PORT_OFFSET",
    "up",
    "down",
    "status",
    "bootstrap",
    "jars",
    "node_pids",
    "kill_node",
    "start_node",
    "start_schema_registry",
    "stop_schema_registry",
    "node_properties",
    "free_port_base",
    "secure_client_config",
    "add_user",
    "grant",
    "replication_factor",
    "min_insync_replicas",
    "register",
]
