# The README's commands. Everything installs into .venv; FUSE comes from the system (fuse3).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if ! command -v fusermount3 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing fuse3 (fusermount3)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 >/dev/null; \
	  else \
	    echo "fusermount3 is missing: run 'sudo apt-get install fuse3' (or your distribution's fuse3 package)"; \
	    exit 1; \
	  fi; \
	fi
	@test -e /dev/fuse || { echo "/dev/fuse is missing: modprobe fuse (in a container: --device /dev/fuse --cap-add SYS_ADMIN)"; exit 1; }
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(PY) tools/demo.py

lint: setup
	$(PY) -m ruff check cachefs tools tests
	$(PY) -m mypy cachefs

test: lint
	$(PY) -m pytest -q

bench: setup
	$(PY) tools/blocksize.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
