# The README's commands. Everything Python goes into .venv (VENV=... to use another
# environment); FUSE and the test tools come from the system's packages.
VENV      ?= .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: setup dev demo test lint bench wheel clean

# What the demo needs: libfuse 3 and fusermount3, a C compiler for the slow-store
# emulator (tools/slowfs.c), cachefs itself and Pillow (the demo makes JPEGs).
setup: $(STAMP)

$(STAMP): pyproject.toml
	@tools/system-packages.sh fuse3 libfuse3-dev gcc
	@test -e /dev/fuse || { echo "/dev/fuse is missing: modprobe fuse (in a container: --device /dev/fuse --cap-add SYS_ADMIN)"; exit 1; }
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e . 'pillow>=9.1'
	$(PY) tools/slowfs.py --build-only
	touch $@

# What the tests need on top: linters and test libraries, PyTorch's CPU build (unless the
# environment has a torch already), and the system tools the tests drive for real.
dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP)
	@tools/system-packages.sh util-linux e2fsprogs systemd memcached
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) tools/install_torch.py
	touch $@

demo: setup
	$(PY) tools/demo.py

lint: dev
	$(PY) -m ruff check src tools tests
	$(PY) -m mypy src

# Everything, mounts in the default mode (passthrough where this machine allows it); then
# the mounted tests again with passthrough off (zero-message opens, the daemon's read path).
test: lint
	$(PY) -m pytest -q
	CACHEFS_TEST_PASSTHROUGH=off $(PY) -m pytest -q -m fuse

bench: setup
	$(PY) tools/bench.py epoch
	$(PY) tools/bench.py epoch --hdd --latency 0.2ms --bandwidth 150MB
	$(PY) tools/bench.py seq
	$(PY) tools/bench.py cache

# A wheel to install cachefs into another environment: pip install dist/cachefs-*.whl
wheel: setup
	$(PY) -m pip wheel -q --no-deps -w dist .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist src/*.egg-info
