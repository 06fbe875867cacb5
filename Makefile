# dsec: `make demo` and `make test` are the two commands (see README.md).
SHELL := /bin/bash
BUILD_DIR   ?= build
BUILD_TYPE  ?= RelWithDebInfo
JOBS        ?= $(shell nproc)
# Test images are cached here and rebuilt only when missing.
IMAGE_CACHE ?= /var/cache/dsec/test-images
export DSEC_IMAGE_CACHE := $(IMAGE_CACHE)
PYTEST_ARGS ?=
# Debian's interpreter, which has python3-pytest (a pyenv python3 may shadow it).
PYTHON      ?= /usr/bin/python3

.PHONY: all build deps images vm-image lazy-images test unit e2e demo bench bench-lazy clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

build: $(BUILD_DIR)/CMakeCache.txt
	cmake --build $(BUILD_DIR) -j $(JOBS)

images:
	@scripts/build-test-images.sh $(IMAGE_CACHE)
	@scripts/build-vm-image.sh $(IMAGE_CACHE)

# Only the vm backend's bootable disk (vm-debian.qcow2: debootstrap + systemd +
# qemu-guest-agent + cloud kernel + extlinux; minutes, once). `images` builds it too.
vm-image:
	@scripts/build-vm-image.sh $(IMAGE_CACHE)

# bench/lazy's >1 GB three-layer image (minutes, once; cached under $(IMAGE_CACHE)/lazy).
lazy-images: images
	@scripts/build-lazy-image.sh $(IMAGE_CACHE)

unit: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

e2e: build images
	$(PYTHON) -m pytest tests $(PYTEST_ARGS)

test: deps
	$(MAKE) build
	$(MAKE) images
	$(MAKE) unit
	$(MAKE) e2e

demo: deps
	$(MAKE) build
	$(MAKE) images
	PYTHON=$(PYTHON) scripts/demo.sh

bench: build images
	bench/create
	bench/exec
	bench/throughput
	bench/density

# Separate from `bench`: it needs a >1 GB image and takes a few minutes.
bench-lazy: build lazy-images
	bench/lazy

clean:
	rm -rf $(BUILD_DIR)
