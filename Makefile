# forkd: build, quickstart, tests. See README.md (./run installs make and a
# Go toolchain first on a fresh machine, then calls these targets).
GO ?= go
# gofmt of the same toolchain as $(GO).
GOFMT ?= $(if $(findstring /,$(GO)),$(dir $(GO))gofmt,gofmt)
FORKD_TEST_TIMEOUT ?= 60m
# Built images (kernel, initramfs, debootstrapped rootfs) are shared by every
# test package and kept between runs.
FORKD_TEST_CACHE ?= /var/tmp/forkd-test-cache
# Packages whose tests run in CI; everything under ./...
PKGS ?= ./...

.PHONY: all build deps quickstart test unit root vm lint vet fmt-check fuzz clean sdk-python

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -o bin/forkd-agent ./cmd/forkd-agent
	$(GO) build -trimpath -o bin/forkd ./cmd/forkd

deps:
	scripts/install-deps.sh
	scripts/zram-swap.sh

# The main job: from a fresh machine to N children that each ran a command.
quickstart: build
	./bin/forkd quickstart $(ARGS)

vet:
	$(GO) vet ./...

fmt-check:
	@out=$$($(GOFMT) -l cmd internal api client e2e tools); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# The test tiers are levels (internal/testutil): unit tests run anywhere
# without root or host packages; root adds netns, nftables and cgroups;
# vm adds real QEMU guests and the real daemon, and so runs every test.
# FORKD_TEST_STRICT=1 (set by CI) turns any skip within the selected
# tiers into a failure. The race detector needs a C compiler (gcc).
TESTENV = FORKD_AGENT=$(CURDIR)/bin/forkd-agent FORKD_TEST_CACHE=$(FORKD_TEST_CACHE)

# Seconds, without root or apt: the unit tier under the race detector.
unit:
	FORKD_TEST_TIER=unit $(GO) test -race -count=1 $(PKGS)

root: deps build
	$(TESTENV) FORKD_TEST_TIER=root $(GO) test -count=1 -timeout $(FORKD_TEST_TIMEOUT) $(PKGS)

vm: deps build
	$(TESTENV) FORKD_TEST_TIER=vm $(GO) test -count=1 -timeout $(FORKD_TEST_TIMEOUT) $(PKGS)

lint:
	$(GO) tool -modfile=tools/go.mod golangci-lint run ./...

# Bounded fuzz runs: the API's request decoding, and the QEMU migration
# streams a branch takes apart (a guest controls their device state).
# Budgets are counts of inputs (10-25 s each here): with a duration, Go
# before 1.27 may fail a run that found nothing with "context deadline
# exceeded" as the time runs out (golang/go#75804).
fuzz:
	$(GO) test -run=^$$ -fuzz=FuzzDecodeCreateSandbox -fuzztime=80000x -fuzzminimizetime=2s -timeout=10m ./internal/server
	for f in FuzzStateHead FuzzConsumeLive FuzzSpliceState; do \
		$(GO) test -run=^$$ -fuzz=$$f -fuzztime=150000x -fuzzminimizetime=2s -timeout=10m ./internal/vmm/qemu || exit 1; \
	done

# Everything CI runs: vet, format, lint, the unit tier under -race, a
# bounded fuzz run, then every tier (vm). The images the vm tier boots
# are built meanwhile (scripts/prefetch-images.sh, its log in the test
# cache): on a fresh machine their downloads and dpkg runs then overlap
# the compiles of vet, lint, unit and fuzz instead of coming after them.
PREFETCH_LOG = $(FORKD_TEST_CACHE)/prefetch-images.log
test: deps build
	@mkdir -p $(FORKD_TEST_CACHE); \
	FORKD_TEST_CACHE=$(FORKD_TEST_CACHE) scripts/prefetch-images.sh >$(PREFETCH_LOG) 2>&1 & p=$$!; \
	$(MAKE) --no-print-directory vet fmt-check lint unit fuzz; r=$$?; \
	if [ $$r != 0 ]; then kill $$p; wait $$p; exit $$r; fi; \
	wait $$p || echo "prefetch-images failed (the vm tier builds what is missing):"; cat $(PREFETCH_LOG)
	$(MAKE) --no-print-directory vm

clean:
	rm -rf bin

# The Python SDK's tests alone (e2e's TestPythonSDK runs them in `make vm`).
sdk-python: build
	PYTHONDONTWRITEBYTECODE=1 FORKD_CACHE=$(FORKD_TEST_CACHE)/image python3 -m unittest discover -s sdk/python/tests -v
