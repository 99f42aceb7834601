#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine of this project's kind to run space (`make
# run`): the Debian packages the server and its runtimes need, the pinned guest
# kernel for microvm, space's own binaries (scripts/build.sh), the pinned
# static runsc, and the cached Debian base root filesystem that the built-in
# `base` template is made from. What only the tests and benchmarks need is
# scripts/setup-test.sh's. Idempotent: every step checks before it acts.
# Independent steps run side by side: the kernel download next to the Go
# builds, debootstrap of the base root filesystem next to the builds of our
# static binaries and runsc.
# SPACE_CACHE moves the cache (default /var/cache/space).
set -euo pipefail
cd "$(dirname "$0")/.."
SETUP=setup
. scripts/lib.sh
need_root
setup_start=$SECONDS

# debootstrap builds the base root filesystem; mkfs.ext4 (e2fsprogs) makes
# sandbox disks. The microvm runtime: QEMU (TCG here, KVM where a guest really
# runs under it) and erofs-utils for root images, without recommends.
apt_install debootstrap e2fsprogs iproute2 procps util-linux ca-certificates
apt_install --no-install-recommends qemu-system-x86 erofs-utils

# The microvm runtime's guest kernel: a pinned Debian cloud kernel unpacked
# into the cache — never installed into the host's /boot. apt-get download
# checks the .deb against the signed archive; the sha256 pinned here also
# catches a different build published under the same version. A download:
# it runs next to the Go builds.
microvm_kernel() {
	MICROVM_KERNEL_PKG=linux-image-6.1.0-50-cloud-amd64
	MICROVM_KERNEL_VERSION=6.1.176-1
	MICROVM_KERNEL_RELEASE=6.1.0-50-cloud-amd64
	MICROVM_KERNEL_SHA256=efe19f605b6f54a8352e68d85a629abb2d30b72a085faef603a9152590baa791
	MICROVM_DIR="$CACHE/microvm"
	MICROVM_KERNEL_DIR="$MICROVM_DIR/kernel-$MICROVM_KERNEL_RELEASE"
	if [ -e "$MICROVM_KERNEL_DIR/complete" ]; then
		echo "setup: guest kernel $MICROVM_KERNEL_RELEASE is in $MICROVM_KERNEL_DIR"
	else
		echo "setup: fetching guest kernel $MICROVM_KERNEL_PKG=$MICROVM_KERNEL_VERSION"
		mkdir -p "$MICROVM_DIR/debs"
		deb="$MICROVM_DIR/debs/${MICROVM_KERNEL_PKG}_${MICROVM_KERNEL_VERSION}_amd64.deb"
		microvm_download() {
			(cd "$MICROVM_DIR/debs" && apt-get download -q "$MICROVM_KERNEL_PKG=$MICROVM_KERNEL_VERSION" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
		}
		if [ ! -e "$deb" ]; then
			microvm_download
			# Package lists older than the pin (or none yet): refresh once.
			[ -e "$deb" ] || { apt-get update -qq && microvm_download; }
		fi
		[ -e "$deb" ] || { echo "setup: apt-get download $MICROVM_KERNEL_PKG=$MICROVM_KERNEL_VERSION failed (run apt-get update?)" >&2; exit 1; }
		if ! echo "$MICROVM_KERNEL_SHA256  $deb" | sha256sum -c --quiet -; then
			rm -f "$deb"
			echo "setup: $deb does not match the pinned sha256" >&2
			exit 1
		fi
		rm -rf "$MICROVM_KERNEL_DIR.tmp"
		mkdir -p "$MICROVM_KERNEL_DIR.tmp"
		dpkg -x "$deb" "$MICROVM_KERNEL_DIR.tmp"
		[ -e "$MICROVM_KERNEL_DIR.tmp/boot/vmlinuz-$MICROVM_KERNEL_RELEASE" ] &&
			[ -d "$MICROVM_KERNEL_DIR.tmp/lib/modules/$MICROVM_KERNEL_RELEASE" ] ||
			{ echo "setup: $deb has no vmlinuz/modules for $MICROVM_KERNEL_RELEASE" >&2; exit 1; }
		rm -rf "$MICROVM_KERNEL_DIR"
		mv "$MICROVM_KERNEL_DIR.tmp" "$MICROVM_KERNEL_DIR"
		touch "$MICROVM_KERNEL_DIR/complete"
	fi
	echo "setup: microvm kernel $MICROVM_KERNEL_DIR/boot/vmlinuz-$MICROVM_KERNEL_RELEASE, modules $MICROVM_KERNEL_DIR/lib/modules/$MICROVM_KERNEL_RELEASE"
}
spawn "guest kernel" microvm_kernel

# The base root filesystem: debootstrap from the host's Debian mirror, which
# needs only bin/space and bin/space-server, so it starts once those two are
# built and runs next to the other builds (our static binaries, then runsc).
scripts/build.sh space space-server
if [ ! -e "$CACHE/base-bookworm/complete" ]; then
	echo "setup: building the Debian base root filesystem into $CACHE (once; a few minutes, alongside the builds)"
fi
spawn "base root filesystem" bin/space template build-base --local --cache "$CACHE"
# Not the containerd shim: running the server does not need it, and it alone
# brings in gRPC (≈ 85 packages). scripts/setup-test.sh builds it (its tests
# do), as `make build` does.
scripts/build.sh space-agent space-nsinit space-jail space-gateway

# runsc (gVisor) for the gvisor runtime: a static build pinned to an exact
# version. Debian's runsc is from 2022 (no systrap), and a cgo build fails
# every sandbox (fork/exec /proc/self/exe), so it is built with CGO_ENABLED=0.
# Building takes several minutes on 2 cores: only when bin/runsc is missing or
# another version. The module version is in the binary's build info (go
# version -m): a go install build has no version stamped for `runsc
# --version`.
RUNSC_VERSION=v0.0.0-20260905035102-160fafc42237
if go_pinned bin/runsc gvisor.dev/gvisor "$RUNSC_VERSION"; then
	echo "setup: bin/runsc is gvisor.dev/gvisor/runsc@$RUNSC_VERSION"
else
	echo "setup: building bin/runsc (gvisor.dev/gvisor/runsc@$RUNSC_VERSION, static; several minutes)"
	runsc_start=$SECONDS
	# No DWARF or symbol table, as scripts/build.sh: a shorter cold compile.
	(bin="$PWD/bin" && cd / && CGO_ENABLED=0 GOBIN="$bin" go install -trimpath -ldflags='-s -w' -gcflags=all=-dwarf=false "gvisor.dev/gvisor/runsc@$RUNSC_VERSION") ||
		{ echo "setup: building runsc failed" >&2; exit 1; }
	go_pinned bin/runsc gvisor.dev/gvisor "$RUNSC_VERSION" ||
		{ echo "setup: bin/runsc is not gvisor.dev/gvisor@$RUNSC_VERSION" >&2; exit 1; }
	echo "setup: bin/runsc built in $((SECONDS - runsc_start)) s"
fi
# A dynamically linked runsc has a program interpreter; refuse it.
if readelf -l bin/runsc 2>/dev/null | grep -q 'Requesting program interpreter'; then
	echo "setup: bin/runsc is not static (built with cgo?); remove it and re-run" >&2
	exit 1
fi

wait_spawned
echo "setup: done in $((SECONDS - setup_start)) s. Start the server with: bin/space server"
