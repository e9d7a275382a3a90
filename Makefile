# kfeed's commands. Each one installs what it needs: the venv, the package with
# its Cython build, and (through `kfeed cluster`) the Kafka jars via Maven.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kfeed-installed
TEST_CLUSTER := .kfeed/test-cluster
DEMO_CLUSTER := .kfeed/demo-cluster
PYTEST_ARGS ?=

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

clean:
	rm -rf build src/kfeed/*.so ext/*.c
