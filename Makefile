# kfeed's commands. Each one installs what it needs: the venv, the package with
# its Cython build, and (through `kfeed cluster`) the Kafka jars via Maven.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kfeed-installed
TEST_CLUSTER := .kfeed/test-cluster
DEMO_CLUSTER := .kfeed/demo-cluster
PYTEST_ARGS ?=

DEMO_PORT := 39492
DEMO_SAMPLES ?= 100000

.PHONY: install demo test bench profile clean

$(STAMP): pyproject.toml setup.py $(wildcard ext/*.pyx ext/*.pxd)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

# The whole suite against a real 3-node Apache Kafka; the cluster is stopped
# even when tests fail. pytest's exit 5 (no tests ran) fails like any other.
test: install
	@set -u; \
	$(PY) -m kfeed cluster up --nodes 3 --dir $(TEST_CLUSTER) || { $(PY) -m kfeed cluster down --dir $(TEST_CLUSTER) --wipe; exit 1; }; \
	KFEED_BOOTSTRAP=$$($(PY) -m kfeed cluster status --dir $(TEST_CLUSTER) | tail -n 1) \
	KFEED_CLUSTER_DIR=$(TEST_CLUSTER) \
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS); rc=$$?; \
	$(PY) -m kfeed cluster down --dir $(TEST_CLUSTER) --wipe; \
	exit $$rc

# The main job on a local 1-node Apache Kafka: produce the seeds' synthetic
# workload, train an MLP from it with the Loader, print the figures.
demo: install
	@set -u; \
	$(PY) -m kfeed cluster up --nodes 1 --dir $(DEMO_CLUSTER) --port $(DEMO_PORT) || { $(PY) -m kfeed cluster down --dir $(DEMO_CLUSTER) --wipe; exit 1; }; \
	export KFEED_BOOTSTRAP=$$($(PY) -m kfeed cluster status --dir $(DEMO_CLUSTER) | tail -n 1); \
	$(PY) -m kfeed produce --topic kfeed-demo --partitions 4 --synthetic $(DEMO_SAMPLES) --keyed \
	&& $(PY) -m kfeed train --topic kfeed-demo --group-id kfeed-demo --until-end \
		--checkpoint $(DEMO_CLUSTER)/checkpoint.pt --checkpoint-every 100; rc=$$?; \
	$(PY) -m kfeed cluster down --dir $(DEMO_CLUSTER) --wipe; \
	exit $$rc

clean:
	rm -rf build src/kfeed/*.so ext/*.c
