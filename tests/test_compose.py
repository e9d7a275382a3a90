"""docker-compose.yml describes the same 3-node cluster as ``kfeed cluster up --nodes 3``.

Docker cannot run here, so the file is checked against the cluster tool: the
same node ids, host ports, replication and test settings. Only what must
differ inside containers (listener names and hosts, the quorum's host names,
the data path) is left out of the comparison.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest

from kfeed import cluster
from kfeed.cluster import _jars

yaml = pytest.importorskip("yaml")

COMPOSE = Path(__file__).resolve().parents[1] / "docker-compose.yml"
NODES = 3
TOPOLOGY_KEYS = {
    "listeners",
    "advertised.listeners",
    "listener.security.protocol.map",
    "inter.broker.listener.name",
    "controller.quorum.voters",
    "log.dirs",
}
# KAFKA_* variables that the image's start script uses itself.
NOT_PROPERTIES = {"KAFKA_HEAP_OPTS"}


def property_name(env_key: str) -> str:
    """The broker property an ``apache/kafka`` image makes of a ``KAFKA_*`` variable."""
    key = re.sub(r"(?<!_)_(?!_)", ".", env_key.removeprefix("KAFKA_"))
    return key.replace("___", "-").replace("__", "_").lower()


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


@pytest.fixture(scope="module")
def nodes(services: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Node id -> its service name, environment, broker properties and published host ports."""
    by_id = {}
    for name, service in services.items():
        env = {key: str(value) for key, value in service["environment"].items()}
        props = {
            property_name(key): value
            for key, value in env.items()
            if key.startswith("KAFKA_") and key not in NOT_PROPERTIES
        }
        host_ports = [int(str(mapping).split(":")[-2]) for mapping in service.get("ports", [])]
        by_id[int(props["node.id"])] = {
            "properties": props,
            "host_ports": host_ports,
            "name": name,
            "env": env,
        }
    return by_id


def test_property_name_follows_the_image_rules() -> None:
    assert property_name("KAFKA_MIN_INSYNC_REPLICAS") == "min.insync.replicas"
    assert property_name("KAFKA_LISTENER_NAME_INTERNAL_SSL__CLIENT___AUTH") == "listener.name.internal.ssl_client-auth"


def test_three_nodes_with_ids_one_to_three(nodes: dict[int, dict[str, Any]]) -> None:
    assert sorted(nodes) == [1, 2, 3]


def test_image_runs_the_kafka_version_the_pom_pins(services: dict[str, Any]) -> None:
    assert {s["image"] for s in services.values()} == {f"apache/kafka:{_jars.kafka_version()}"}


def test_one_valid_cluster_id(nodes: dict[int, dict[str, Any]]) -> None:
    ids = {node["env"]["CLUSTER_ID"] for node in nodes.values()}
    assert len(ids) == 1
    (cluster_id,) = ids
    assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16


def test_host_ports_and_advertised_listeners_match(nodes: dict[int, dict[str, Any]]) -> None:
    for node_id, node in nodes.items():
        tool = cluster.node_properties(node_id, NODES)
        port = cluster.DEFAULT_PORT + node_id - 1
        assert node["host_ports"] == [port], node["name"]
        assert tool["advertised.listeners"] in node["properties"]["advertised.listeners"].split(","), node["name"]


def test_settings_match_the_cluster_tool(nodes: dict[int, dict[str, Any]]) -> None:
    for node_id, node in nodes.items():
        tool = {k: v for k, v in cluster.node_properties(node_id, NODES).items() if k not in TOPOLOGY_KEYS}
        compose = {k: v for k, v in node["properties"].items() if k not in TOPOLOGY_KEYS}
        assert compose == tool, node["name"]


def test_replication_three_and_min_isr_two(nodes: dict[int, dict[str, Any]]) -> None:
    for node in nodes.values():
        props = node["properties"]
        for key in (
            "default.replication.factor",
            "offsets.topic.replication.factor",
            "transaction.state.log.replication.factor",
        ):
            assert props[key] == "3", key
        assert props["min.insync.replicas"] == "2"
        assert props["transaction.state.log.min.isr"] == "2"
        assert props["group.initial.rebalance.delay.ms"] == "0"
        assert props["auto.create.topics.enable"] == "false"


def test_every_node_votes_in_the_same_quorum(nodes: dict[int, dict[str, Any]]) -> None:
    tool_voters = {v.split("@")[0] for v in cluster.node_properties(1, NODES)["controller.quorum.voters"].split(",")}
    for node in nodes.values():
        voters = {v.split("@")[0] for v in node["properties"]["controller.quorum.voters"].split(",")}
        assert voters == tool_voters == {"1", "2", "3"}
