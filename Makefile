# Two commands matter: `make demo` and `make test`. Everything they need is installed here,
# into .venv (Python) or with apt-get (promtool, systemd-analyze), so a fresh clone works.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# The editable install leaves the project's own modules uncompiled, and where
# PYTHONDONTWRITEBYTECODE is set every daemon, worker and command would compile them again as
# it starts (about 0.1 CPU s each). A packaged install compiles them once (the deb's postinst);
# so do the targets that start many processes, before they start them.
COMPILE := $(PY) -m compileall -q client daemon

.PHONY: demo demo-dcp test lint typecheck unit bench chaos clean system-deps deb test-deb

$(VENV)/.stamp-install: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -e '.[test]'
	touch $@

$(VENV)/.stamp-torch: $(VENV)/.stamp-install
	$(PIP) install 'torch==2.13.0' numpy
	touch $@

# promtool (Debian's prometheus) and systemd-analyze (Debian's systemd) for the ops tests;
# strace for the chaos suites' syscall fault injection (tests/chaos).
system-deps:
	@if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null || ! command -v systemd-analyze >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus systemd >/dev/null; \
	fi
	@if ! command -v strace >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq strace >/dev/null; \
	fi

demo: $(VENV)/.stamp-install
	$(COMPILE)
	$(PY) examples/demo.py

# A 4-rank torchrun job saving through DCP + ckptdrain, killed mid-run and resumed (< 2 min).
demo-dcp: $(VENV)/.stamp-torch
	$(PY) examples/dcp_train.py

# mypy resolves ckptdrain.* through a symlinked tree: the sources live in client/ and daemon/,
# mapped to ckptdrain.client / ckptdrain.daemon by setuptools, which mypy cannot follow.
lint: $(VENV)/.stamp-install
	$(VENV)/bin/ruff check client daemon tests examples
	mkdir -p build/mypy/ckptdrain
	ln -sfn ../../../client build/mypy/ckptdrain/client
	ln -sfn ../../../daemon build/mypy/ckptdrain/daemon
	cd build/mypy && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml -p ckptdrain.client -p ckptdrain.daemon

# Three pytest-xdist workers: most of the suite's time is its daemons waiting (commit waits,
# timeouts, restarts, an owed abort's backoff), not CPU, so on two cores two at once halved it
# (659 s -> 360 s), and three keep both cores busy as the S3 fault tests grew (two: 722 s).
# Each worker starts its own SeaweedFS; every server picks free ports.
TEST_WORKERS ?= 3
test: $(VENV)/.stamp-install $(VENV)/.stamp-torch system-deps lint
	$(COMPILE)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --durations=15

# The chaos suites at full size (docs/testing.md): >= 200 kill -9 trials and 10,000 fuzzed
# sessions; `make test` runs a fixed slice of them. Override CHAOS_KILLS, CHAOS_SESSIONS,
# CHAOS_SEED_BASE, or replay one trial with CHAOS_SEED=<n>.
CHAOS_KILLS ?= 200
CHAOS_SESSIONS ?= 10000
chaos: $(VENV)/.stamp-install system-deps
	$(COMPILE)
	CHAOS_KILLS=$(CHAOS_KILLS) CHAOS_SESSIONS=$(CHAOS_SESSIONS) PATH=$(CURDIR)/$(VENV)/bin:$$PATH \
		$(PY) -m pytest -q -p no:cacheprovider -o timeout=3600 tests/chaos

bench: $(VENV)/.stamp-install
	$(COMPILE)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m tests.bench

# The Debian package (dpkg-deb): a self-contained environment in /opt/ckptdrain, /usr/bin/ckptdrain,
# the units, /etc/ckptdrain/ckptdrain.toml and the docs. Needs the package registry (the daemon's
# dependencies go into the package). `make test-deb` installs it here (root), checks and removes it.
DEB_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
DEB := build/ckptdrain_$(DEB_VERSION)_$(shell dpkg --print-architecture 2>/dev/null || echo amd64).deb
deb: $(DEB)
$(DEB): pyproject.toml $(wildcard client/*.py daemon/*.py daemon/backends/*.py systemd/* docs/*.md packaging/deb/*) deploy/ckptdrain.example.toml
	packaging/deb/build.sh build

test-deb: $(VENV)/.stamp-install system-deps $(DEB)
	CKPTDRAIN_TEST_DEB=$(CURDIR)/$(DEB) PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q -p no:cacheprovider tests/integration/test_deb.py

clean:
	rm -rf $(VENV) .demo build *.egg-info
