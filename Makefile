# kfeed's commands. Each one installs what it needs: the venv, the package with
# its Cython build, and (through `kfeed cluster`) the Kafka jars via Maven.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kfeed-installed
TEST_CLUSTER := .kfeed/test-cluster
# Below the kernel's ephemeral ports (32768-60999), where a client's outgoing
# connection can take a killed node's port before a fault test restarts it.
TEST_PORT := 29092
CRASH_LOG := .kfeed/crash.log
DEMO_CLUSTER := .kfeed/demo-cluster
# Beside the cluster's folder, which a wipe leaves to the tool's own files.
DEMO_CHECKPOINT := .kfeed/demo-checkpoint
PYTEST_ARGS ?=

DEMO_PORT := 39492
DEMO_SAMPLES ?= 100000

.PHONY: install demo demo-lm test fuzz-debug bench profile clean

$(STAMP): pyproject.toml setup.py $(wildcard ext/*.pyx ext/*.pxd ext/*.pxi)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

# The whole suite against a real 3-node Apache Kafka; the cluster is stopped
# even when tests fail. pytest's exit 5 (no tests ran) fails like any other.
test: install
	@set -u; \
	$(PY) -m kfeed cluster up --nodes 3 --dir $(TEST_CLUSTER) --port $(TEST_PORT) || { $(PY) -m kfeed cluster down --dir $(TEST_CLUSTER) --wipe; exit 1; }; \
	KFEED_BOOTSTRAP=$$($(PY) -m kfeed cluster status --dir $(TEST_CLUSTER) | tail -n 1) \
	KFEED_CLUSTER_DIR=$(TEST_CLUSTER) KFEED_CRASH_LOG=$(CRASH_LOG) \
	$(PY) -m pytest -p no:faulthandler -m "not slow" --durations=25 $(PYTEST_ARGS); rc=$$?; \
	$(PY) -m kfeed cluster down --dir $(TEST_CLUSTER) --wipe; \
	if grep -q "^Fatal Python error" $(CRASH_LOG) 2>/dev/null; then \
		echo "pytest crashed; the test and the crashing thread (all threads: $(CRASH_LOG)):"; \
		sed -n '1,2p' $(CRASH_LOG); sed -n '/^Current thread/,+30p' $(CRASH_LOG); fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	$(MAKE) --no-print-directory fuzz-debug

# The fuzz tests against a build with Cython's bounds and wrap-around checks on
# (KFEED_DEBUG=1), built into .kfeed/debug beside the installed optimized
# build; KFEED_EXPECT_DEBUG=1 makes the tests check they import the debug
# build and that it really has the checks.
DEBUG_BUILD := .kfeed/debug

fuzz-debug: install
	$(PY) -m pip install -q "Cython>=3.0" "setuptools>=77"  # build_ext runs outside pip's isolation
	rm -rf $(DEBUG_BUILD) $(DEBUG_BUILD)-tmp
	mkdir -p $(DEBUG_BUILD)
	cp -r src/kfeed $(DEBUG_BUILD)/
	find $(DEBUG_BUILD) -name __pycache__ -prune -exec rm -rf {} +
	rm -f $(DEBUG_BUILD)/kfeed/*.so
	KFEED_DEBUG=1 $(PY) setup.py -q build_ext --build-lib $(DEBUG_BUILD) --build-temp $(DEBUG_BUILD)-tmp
	PYTHONPATH=$(CURDIR)/$(DEBUG_BUILD) KFEED_EXPECT_DEBUG=1 \
		$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests/test_fuzz.py

# The main job on a local 1-node Apache Kafka: produce the seeds' synthetic
# workload, train an MLP from it with the Loader, print the figures.
demo: install
	@set -u; rm -f $(DEMO_CHECKPOINT)*.pt; \
	$(PY) -m kfeed cluster up --nodes 1 --dir $(DEMO_CLUSTER) --port $(DEMO_PORT) || { $(PY) -m kfeed cluster down --dir $(DEMO_CLUSTER) --wipe; exit 1; }; \
	export KFEED_BOOTSTRAP=$$($(PY) -m kfeed cluster status --dir $(DEMO_CLUSTER) | tail -n 1); \
	$(PY) -m kfeed produce --topic kfeed-demo --partitions 4 --synthetic $(DEMO_SAMPLES) --keyed \
	&& $(PY) -m kfeed train --topic kfeed-demo --group-id kfeed-demo --until-end \
		--checkpoint $(DEMO_CHECKPOINT).pt --checkpoint-every 100; rc=$$?; \
	$(PY) -m kfeed cluster down --dir $(DEMO_CLUSTER) --wipe; rm -f $(DEMO_CHECKPOINT)*.pt; \
	exit $$rc

# The LLM side of the demo: generated documents as a token topic, then a tiny
# causal transformer trained on packed, shuffled [8, 128] token batches.
demo-lm: install
	@set -u; rm -f $(DEMO_CHECKPOINT)*.pt; \
	$(PY) -m kfeed cluster up --nodes 1 --dir $(DEMO_CLUSTER) --port $(DEMO_PORT) || { $(PY) -m kfeed cluster down --dir $(DEMO_CLUSTER) --wipe; exit 1; }; \
	export KFEED_BOOTSTRAP=$$($(PY) -m kfeed cluster status --dir $(DEMO_CLUSTER) | tail -n 1); \
	$(PY) -m kfeed produce --topic kfeed-demo-text --partitions 2 --synthetic-text 200 \
	&& $(PY) -m kfeed train --task lm --topic kfeed-demo-text --group-id kfeed-demo-lm \
		--batch-size 8 --seq-len 128 --shuffle 128 --until-end --log-every 20 \
		--checkpoint $(DEMO_CHECKPOINT)-lm.pt --checkpoint-every 50; rc=$$?; \
	$(PY) -m kfeed cluster down --dir $(DEMO_CLUSTER) --wipe; rm -f $(DEMO_CHECKPOINT)*.pt; \
	exit $$rc

clean:
	rm -rf build src/kfeed/*.so ext/*.c $(DEBUG_BUILD) $(DEBUG_BUILD)-tmp

# Throughput against a real broker: kcat (from the system packages, where apt-get
# can install it) as the no-Python reference, a local 1-node Apache Kafka, the loader and
# producer benchmarks (bench/bench_loader.py; BENCH_ARGS="--write" records the
# tables in bench/RESULTS.md), then the micro-benchmarks; the cluster is stopped
# even when a benchmark fails or misses its target.
BENCH_CLUSTER := .kfeed/bench-cluster
BENCH_PORT := 39792
BENCH_ARGS ?=

bench: install
	@set -u; \
	command -v kcat >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && apt-get install -y -qq kcat >/dev/null; } \
		|| echo "kcat is not installed (needs root and apt-get): its rows are skipped"; \
	$(PY) -m kfeed cluster up --nodes 1 --dir $(BENCH_CLUSTER) --port $(BENCH_PORT) || { $(PY) -m kfeed cluster down --dir $(BENCH_CLUSTER) --wipe; exit 1; }; \
	export KFEED_BOOTSTRAP=$$($(PY) -m kfeed cluster status --dir $(BENCH_CLUSTER) | tail -n 1); \
	$(PY) bench/bench_loader.py $(BENCH_ARGS); rc=$$?; \
	$(PY) -m pytest --benchmark-only -q bench/test_micro.py; micro=$$?; \
	[ $$rc -ne 0 ] || rc=$$micro; \
	$(PY) -m kfeed cluster down --dir $(BENCH_CLUSTER) --wipe; \
	exit $$rc

# A py-spy profile of the Loader on the block workload against a local 1-node
# Apache Kafka: produce PROFILE_SAMPLES synthetic samples into a block topic,
# then read it to its end PROFILE_EPOCHS times (bench/profile_loader.py run)
# under `py-spy record --native --threads --idle`, twice: once into the flame
# graph bench/profile-loader.svg (open it in a browser; --idle keeps the waits,
# so the data stall shows), once as collapsed stacks that
# `bench/profile_loader.py summarize` turns into a per-thread table
# ($(PROFILE_OUT)/profile-loader.txt, printed too). py-spy runs the consumer as
# its child, which needs no root. The cluster is stopped even when a step fails.
PROFILE_CLUSTER := .kfeed/profile-cluster
PROFILE_PORT := 39992  # its controller takes +100; clear of test, demo and bench
PROFILE_OUT := .kfeed/profile
PROFILE_SAMPLES ?= 200000
PROFILE_EPOCHS ?= 5
PROFILE_RATE ?= 100
PYSPY := $(VENV)/bin/py-spy
PYSPY_RECORD = $(PYSPY) record --native --threads --idle --rate $(PROFILE_RATE)
PROFILE_RUN = $(PY) bench/profile_loader.py run --topic kfeed-profile --epochs $(PROFILE_EPOCHS)

profile: install
	@set -u; \
	test -x $(PYSPY) || $(PY) -m pip install -q "py-spy>=0.3.14" || exit 1; \
	mkdir -p $(PROFILE_OUT); \
	$(PY) -m kfeed cluster up --nodes 1 --dir $(PROFILE_CLUSTER) --port $(PROFILE_PORT) || { $(PY) -m kfeed cluster down --dir $(PROFILE_CLUSTER) --wipe; exit 1; }; \
	export KFEED_BOOTSTRAP=$$($(PY) -m kfeed cluster status --dir $(PROFILE_CLUSTER) | tail -n 1); \
	$(PY) -m kfeed produce --topic kfeed-profile --partitions 4 --synthetic $(PROFILE_SAMPLES) \
	&& $(PYSPY_RECORD) --format flamegraph -o bench/profile-loader.svg -- $(PROFILE_RUN) \
	&& $(PYSPY_RECORD) --format raw -o $(PROFILE_OUT)/profile-loader.raw -- $(PROFILE_RUN) \
	&& $(PY) bench/profile_loader.py summarize $(PROFILE_OUT)/profile-loader.raw \
		--json $(PROFILE_OUT)/profile-loader.json > $(PROFILE_OUT)/profile-loader.txt \
	&& cat $(PROFILE_OUT)/profile-loader.txt \
	&& echo "flame graph: bench/profile-loader.svg; collapsed stacks: $(PROFILE_OUT)/profile-loader.raw"; rc=$$?; \
	$(PY) -m kfeed cluster down --dir $(PROFILE_CLUSTER) --wipe; \
	exit $$rc
