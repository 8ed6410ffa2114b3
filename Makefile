# The README's commands. Everything installs into .venv; FUSE comes from the system (fuse3).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if ! command -v fusermount3 >/dev/null 2>&1 || [ ! -e /usr/include/fuse3/fuse.h ] || ! command -v cc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing fuse3, libfuse3-dev and a C compiler (for tools/slowfs)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse3-dev gcc >/dev/null; \
	  else \
	    echo "missing: run 'sudo apt-get install fuse3 libfuse3-dev gcc' (or your distribution's packages)"; \
	    exit 1; \
	  fi; \
	fi
	@test -e /dev/fuse || { echo "/dev/fuse is missing: modprobe fuse (in a container: --device /dev/fuse --cap-add SYS_ADMIN)"; exit 1; }
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0   # the CPU build (tests of the torch extra); pinned so pip never picks a GPU build
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) tools/slowfs.py --build-only
	touch $(STAMP)

demo: setup
	$(PY) tools/demo.py

lint: setup
	$(PY) -m ruff check cachefs tools tests
	$(PY) -m mypy cachefs

test: lint
	$(PY) -m pytest -q

bench: setup
	$(PY) tools/bench.py epoch
	$(PY) tools/bench.py epoch --hdd --latency 0.2ms --bandwidth 150MB
	$(PY) tools/bench.py seq
	$(PY) tools/bench.py cache

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
