# The two commands of the README: `make run` and `make test`.
.PHONY: setup setup-test setup-bench build run test bench lint

# A fresh machine of this kind has Go at /usr/local/go but not always on PATH.
export PATH := $(PATH):/usr/local/go/bin

# What the server and the CLI need (scripts/setup.sh, idempotent).
setup:
	./scripts/setup.sh

# What only the tests need, after the run set-up (idempotent).
setup-test: setup
	./scripts/setup-test.sh

# What the benchmarks add to the run set-up (idempotent).
setup-bench: setup
	./scripts/setup-test.sh bench

# space's own binaries (scripts/build.sh: the one list of them).
build:
	./scripts/build.sh

# Sets everything up (idempotent) and starts the server with its embedded defaults.
run: setup
	bin/space server

# Sets everything up (run and test set-up, idempotent), lints (go vet,
# staticcheck) and runs the whole test suite.
test: lint
	SPACE_CI=$${SPACE_CI:-0} SPACE_AGENT_BIN=$(CURDIR)/bin/space-agent SPACE_JAIL_BIN=$(CURDIR)/bin/space-jail SPACE_GATEWAY_BIN=$(CURDIR)/bin/space-gateway SPACE_SHIM_BIN=$(CURDIR)/bin/containerd-shim-space-v2 go test -p 1 -timeout 15m -count=1 ./...

# Benchmarks (not part of `make test`): p50/p99 over 200 iterations with the
# raw tool in the same run, then the idle-density run (SPACE_BENCH_IDLE sandboxes).
bench: setup-bench
	SPACE_AGENT_BIN=$(CURDIR)/bin/space-agent SPACE_JAIL_BIN=$(CURDIR)/bin/space-jail SPACE_GATEWAY_BIN=$(CURDIR)/bin/space-gateway go test -run '^$$' -bench . -benchtime 200x -timeout 30m ./bench/
	SPACE_BENCH=1 SPACE_AGENT_BIN=$(CURDIR)/bin/space-agent SPACE_JAIL_BIN=$(CURDIR)/bin/space-jail SPACE_GATEWAY_BIN=$(CURDIR)/bin/space-gateway go test -run 'TestTemplate|TestCreateTimeBySize|TestGvisorCheckpointBench|TestGvisorColdCreateBench|TestMicroVMBench|TestNetworkBench|TestDecideBench|TestE2BBench|TestMITMBench|TestAuditBench|TestCLIBench|TestExecBench|TestColdCreateBench|TestPoolBench|TestClusterBench|TestCheckpointPause' -v -timeout 30m ./bench/
	SPACE_BENCH=1 SPACE_AGENT_BIN=$(CURDIR)/bin/space-agent SPACE_JAIL_BIN=$(CURDIR)/bin/space-jail SPACE_GATEWAY_BIN=$(CURDIR)/bin/space-gateway go test -run 'TestIdleDensity|TestGvisorSuspendedDensity' -v -timeout 60m ./bench/

# go vet and the pinned staticcheck (scripts/setup-test.sh installs it into bin/).
lint: setup-test
	go vet ./...
	bin/staticcheck ./...
