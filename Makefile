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

.PHONY: all build deps quickstart test vet fmt-check fuzz clean

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -o bin/forkd-agent ./cmd/forkd-agent
	$(GO) build -trimpath -o bin/forkd ./cmd/forkd

deps:
	scripts/install-deps.sh

# The main job: from a fresh machine to N children that each ran a command.
quickstart: build
	./bin/forkd quickstart $(ARGS)

vet:
	$(GO) vet ./...

fmt-check:
	@out=$$($(GOFMT) -l cmd internal api client e2e); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# Unit, root and VM tiers. As root with the packages installed every tier
# runs; FORKD_TEST_STRICT=1 (set by CI) turns any skip into a failure.
test: deps build vet fmt-check
	FORKD_AGENT=$(CURDIR)/bin/forkd-agent FORKD_TEST_CACHE=$(FORKD_TEST_CACHE) $(GO) test -count=1 -timeout $(FORKD_TEST_TIMEOUT) $(PKGS)
	$(GO) test -run=^$$ -fuzz=FuzzDecodeCreateSandbox -fuzztime=20s -fuzzminimizetime=2s ./internal/server

clean:
	rm -rf bin
