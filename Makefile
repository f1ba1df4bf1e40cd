# capctl — build, test and demo. `make demo` and `make test` set everything up from a fresh
# Debian 12 machine (Python 3.11, gcc); see README.md.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.capctl-installed
SIMLIB := build/simnvml/libnvidia-ml.so.1
SIM_SRC := $(wildcard csrc/simnvml/*.c csrc/simnvml/*.h)
PROTOS := $(wildcard protos/capctl/v1/*.proto)
PROTO_STAMP := capctl/v1/.generated

.PHONY: all setup build wheel-envs release-deps test test-fast demo bench bench-loop bench-soak bench-failover clean slurm-deps etcd-deps slurm-up slurm-down

all: build

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@# Debian's own python3 needs python3-venv for `-m venv` (ensurepip); install it when missing.
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
	    apt-get update -q && apt-get install -y -q python3-venv && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[build,test,sim]'
	touch $@

# The simulated NVML driver, compiled against NVIDIA's real nvml.h (PyPI nvidia-nvml-dev, pinned).
$(SIMLIB): $(SIM_SRC) $(STAMP)
	@mkdir -p build/simnvml
	NVML_INC=$$($(PY) -c 'import capctl.simgpu.build as b; print(b.nvml_include_dir())') && \
	gcc -O2 -g -std=gnu11 -Wall -Wextra -Werror -fPIC -shared -pthread \
	    -I"$$NVML_INC" -Icsrc/simnvml -Wl,-soname,libnvidia-ml.so.1 \
	    -o $@ $(filter %.c,$(SIM_SRC)) -lm

# gRPC/protobuf code generated from protos/ (not committed).
$(PROTO_STAMP): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $@

build: $(STAMP) $(SIMLIB) $(PROTO_STAMP)

# Slurm (Debian slurm-wlm 22.05 + munge) for the integration tests; installed when missing.
slurm-deps:
	@bash tests/slurmcluster/install.sh

# The wheel built from a clean copy of the sources, installed as capctl[agent] and
# capctl[coordinator] in two fresh venvs (tests/release/wheelenvs.sh); the Slurm cluster tests run
# the daemons, hooks and CLI from those (tests/slurmcluster/installed.py).
WHEELENVS := build/wheelenvs
wheel-envs: build
	bash tests/release/wheelenvs.sh $(PY) $(WHEELENVS)

# systemd-analyze (unit-file tests) and man (verify resolves Documentation=man:); Debian packages.
release-deps:
	@bash tests/release/install-systemd.sh

# etcd (Debian etcd-server 3.4) for the coordinator HA tests (-m ha); installed when missing.
etcd-deps:
	@bash tests/etcdcluster/install.sh

# Two pytest-xdist workers (tests/conftest.py groups the tests by file, and the Slurm and etcd
# cluster tests each on one worker): most tests wait on real daemons' intervals, not on the CPU.
TEST_WORKERS ?= 2
test: build slurm-deps release-deps etcd-deps wheel-envs
	CAPCTL_TEST_AGENT_VENV=$(CURDIR)/$(WHEELENVS)/agent CAPCTL_TEST_COORDINATOR_VENV=$(CURDIR)/$(WHEELENVS)/coordinator \
	    $(PY) -m pytest -q --durations=10 -n $(TEST_WORKERS) --dist loadgroup

test-fast: build
	$(PY) -m pytest -q -m 'not slurm and not faults and not ha'

demo: build
	$(VENV)/bin/capctl demo

# Benchmarks (docs/benchmarks.md). bench-loop and bench-soak start 100-1,000 agents on loopback.
bench: build
	$(PY) bench/solver_scale.py
	$(PY) bench/sim_compare.py

bench-loop: build
	$(PY) bench/control_loop.py

bench-soak: build
	$(PY) bench/soak.py

bench-failover: build etcd-deps
	$(PY) bench/failover.py

slurm-up: build slurm-deps
	$(PY) -m tests.slurmcluster up

slurm-down:
	$(PY) -m tests.slurmcluster down

clean:
	rm -rf build $(VENV) capctl/v1/*_pb2*.py* $(PROTO_STAMP)
