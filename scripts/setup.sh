#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine of this project's kind for space:
# Debian packages, the two binaries, and the cached Debian base root
# filesystem that the built-in `base` template is made from.
# Idempotent: every step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."

need_root() {
	if [ "$(id -u)" != 0 ]; then
		echo "setup.sh: run as root (namespaces, cgroups and debootstrap need it)" >&2
		exit 1
	fi
}
need_root

# containerd (1.6, with its CRI plugin) and busybox-static for the shim's
# integration test (internal/shim, internal/testenv/containerdtest);
# postgresql for cluster mode's store tests (internal/testenv/pgtest).
PKGS=(debootstrap bubblewrap e2fsprogs iproute2 tmux procps util-linux ca-certificates containerd busybox-static postgresql)
missing=()
for p in "${PKGS[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "setup: installing ${missing[*]}"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

export PATH=$PATH:/usr/local/go/bin
echo "setup: building bin/space, bin/space-server, bin/space-agent, bin/space-nsinit, bin/space-jail, bin/space-gateway and bin/containerd-shim-space-v2"
mkdir -p bin
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o bin/space ./cmd/space
go build -trimpath -o bin/space-server ./cmd/space-server
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o bin/space-agent ./cmd/space-agent
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o bin/space-nsinit ./cmd/space-nsinit
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o bin/space-jail ./cmd/space-jail
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o bin/space-gateway ./cmd/space-gateway
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o bin/containerd-shim-space-v2 ./cmd/containerd-shim-space-v2

# runsc (gVisor) for the gvisor runtime: a static build pinned to an exact
# version. Debian's runsc is from 2022 (no systrap), and a cgo build fails
# every sandbox (fork/exec /proc/self/exe), so it is built with CGO_ENABLED=0.
# Building takes several minutes on 2 cores: only when bin/runsc is missing or
# another version.
RUNSC_VERSION=v0.0.0-20260905035102-160fafc42237
# The module version is in the binary's build info (go version -m): a go
# install build has no version stamped for `runsc --version`.
runsc_is_pinned() {
	[ -x bin/runsc ] && go version -m bin/runsc 2>/dev/null | grep -qE "^[[:space:]]+mod[[:space:]]+gvisor.dev/gvisor[[:space:]]+$RUNSC_VERSION([[:space:]]|\$)"
}
if runsc_is_pinned; then
	echo "setup: bin/runsc is gvisor.dev/gvisor/runsc@$RUNSC_VERSION"
else
	echo "setup: building bin/runsc (gvisor.dev/gvisor/runsc@$RUNSC_VERSION, static; several minutes)"
	(bin="$PWD/bin" && cd / && CGO_ENABLED=0 GOBIN="$bin" go install -trimpath "gvisor.dev/gvisor/runsc@$RUNSC_VERSION") ||
		{ echo "setup: building runsc failed" >&2; exit 1; }
	runsc_is_pinned || { echo "setup: bin/runsc is not gvisor.dev/gvisor@$RUNSC_VERSION" >&2; exit 1; }
fi
# A dynamically linked runsc has a program interpreter; refuse it.
if readelf -l bin/runsc 2>/dev/null | grep -q 'Requesting program interpreter'; then
	echo "setup: bin/runsc is not static (built with cgo?); remove it and re-run" >&2
	exit 1
fi

# staticcheck for `make test` (go vet + staticcheck run before the tests),
# pinned like runsc; its version is in its build info.
STATICCHECK_VERSION=v0.8.2
if [ -x bin/staticcheck ] && go version -m bin/staticcheck 2>/dev/null | grep -qE "^[[:space:]]+mod[[:space:]]+honnef.co/go/tools[[:space:]]+$STATICCHECK_VERSION([[:space:]]|\$)"; then
	echo "setup: bin/staticcheck is honnef.co/go/tools@$STATICCHECK_VERSION"
else
	echo "setup: building bin/staticcheck (honnef.co/go/tools@$STATICCHECK_VERSION)"
	(bin="$PWD/bin" && cd / && GOBIN="$bin" go install "honnef.co/go/tools/cmd/staticcheck@$STATICCHECK_VERSION") ||
		{ echo "setup: building staticcheck failed" >&2; exit 1; }
fi

# crictl for the shim's integration test, pinned like staticcheck (its
# module version is in its build info). Never talks to anything but the
# test's own containerd socket.
CRICTL_VERSION=v1.37.0
if [ -x bin/crictl ] && go version -m bin/crictl 2>/dev/null | grep -qE "^[[:space:]]+mod[[:space:]]+sigs.k8s.io/cri-tools[[:space:]]+$CRICTL_VERSION([[:space:]]|\$)"; then
	echo "setup: bin/crictl is sigs.k8s.io/cri-tools@$CRICTL_VERSION"
else
	echo "setup: building bin/crictl (sigs.k8s.io/cri-tools@$CRICTL_VERSION)"
	(bin="$PWD/bin" && cd / && CGO_ENABLED=0 GOBIN="$bin" go install -trimpath "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION") ||
		{ echo "setup: building crictl failed" >&2; exit 1; }
fi

CACHE=${SPACE_CACHE:-/var/cache/space}

# microvm runtime: QEMU (TCG here, KVM where a guest really runs under it),
# erofs-utils for root images, and a pinned Debian cloud kernel unpacked into
# the cache — never installed into the host's /boot. apt-get download checks
# the .deb against the signed archive; the sha256 pinned here also catches a
# different build published under the same version.
MICROVM_PKGS=(qemu-system-x86 erofs-utils)
missing=()
for p in "${MICROVM_PKGS[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "setup: installing ${missing[*]}"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
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

# Kubernetes components for the cluster tests (internal/testenv/kubetest,
# deploy/kubernetes): kubelet, kube-apiserver and kubectl from
# k8s.io/kubernetes, and etcd, each built from a checked-in scratch module
# (scripts/kube, scripts/etcd: versions and sums pinned there) with
# CGO_ENABLED=0 into the cache outside the clone, then linked into bin/.
# A cold build takes ~8 minutes on 2 cores and needs ~5 GB of scratch (its
# own GOCACHE and GOMODCACHE, removed afterwards); it only runs when the
# cached build's stamp (the module files' sum and the Go version) differs.
KUBE_VERSION=v1.37.2
ETCD_VERSION=v3.7.3
KUBE_DIR="$CACHE/kube/kubernetes-$KUBE_VERSION"
ETCD_DIR="$CACHE/kube/etcd-$ETCD_VERSION"
KUBE_BUILD="$CACHE/kube/build.tmp"
kube_stamp() { # module dir → what a finished build of it records
	echo "$(cat "$1/go.mod" "$1/go.sum" | sha256sum | cut -d' ' -f1) $(go env GOVERSION)"
}
kube_built() { # dir module-dir main-module version binaries...
	local dir=$1 mod=$2 main=$3 version=$4 b
	shift 4
	[ "$(cat "$dir/complete" 2>/dev/null)" = "$(kube_stamp "$mod")" ] || return 1
	for b in "$@"; do
		go version -m "$dir/$b" 2>/dev/null | grep -qE "^[[:space:]]+(mod|dep)[[:space:]]+$main[[:space:]]+$version([[:space:]]|\$)" || return 1
	done
}
kube_go() { # module-dir, then go arguments: a build in its own caches
	(cd "$1" && shift && CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false" GOTOOLCHAIN=local \
		GOCACHE="$KUBE_BUILD/gocache" GOMODCACHE="$KUBE_BUILD/mod" go "$@")
}
kube_scratch() {
	local avail
	mkdir -p "$CACHE/kube"
	avail=$(df -Pk "$CACHE/kube" | awk 'NR==2 {print $4}')
	if [ "$avail" -lt $((6 * 1024 * 1024)) ]; then
		echo "setup: building Kubernetes needs ~6 GB free in $CACHE/kube (has $((avail / 1024)) MB)" >&2
		exit 1
	fi
}
if kube_built "$ETCD_DIR" scripts/etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION" etcd; then
	echo "setup: etcd $ETCD_VERSION is in $ETCD_DIR"
else
	kube_scratch
	echo "setup: building etcd $ETCD_VERSION into $ETCD_DIR (~1 minute cold)"
	start=$SECONDS
	rm -rf "$ETCD_DIR.tmp" && mkdir -p "$ETCD_DIR.tmp"
	kube_go scripts/etcd build -trimpath -ldflags='-s -w' -o "$ETCD_DIR.tmp/etcd" go.etcd.io/etcd/server/v3 ||
		{ echo "setup: building etcd failed" >&2; exit 1; }
	kube_stamp scripts/etcd > "$ETCD_DIR.tmp/complete"
	rm -rf "$ETCD_DIR" && mv "$ETCD_DIR.tmp" "$ETCD_DIR"
	kube_built "$ETCD_DIR" scripts/etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION" etcd ||
		{ echo "setup: $ETCD_DIR/etcd is not go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2; exit 1; }
	echo "setup: etcd built in $((SECONDS - start)) s"
fi
KUBE_BINS=(kubelet kube-apiserver kubectl)
if kube_built "$KUBE_DIR" scripts/kube k8s.io/kubernetes "$KUBE_VERSION" "${KUBE_BINS[@]}"; then
	echo "setup: kubelet, kube-apiserver, kubectl $KUBE_VERSION are in $KUBE_DIR"
else
	kube_scratch
	echo "setup: building kubelet, kube-apiserver, kubectl $KUBE_VERSION into $KUBE_DIR (~8 minutes cold)"
	# What a release build stamps (hack/lib/version.sh), so that /version
	# and kubectl version tell the truth; the date is the tag's.
	major=${KUBE_VERSION#v} && major=${major%%.*}
	minor=${KUBE_VERSION#v*.} && minor=${minor%%.*}
	ldflags="-s -w"
	for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
		ldflags+=" -X $pkg.gitCommit= -X $pkg.gitTreeState=clean -X $pkg.buildDate=2026-10-27T12:01:04Z"
	done
	rm -rf "$KUBE_DIR.tmp" && mkdir -p "$KUBE_DIR.tmp"
	for b in "${KUBE_BINS[@]}"; do
		start=$SECONDS
		kube_go scripts/kube build -trimpath -ldflags="$ldflags" -o "$KUBE_DIR.tmp/$b" "k8s.io/kubernetes/cmd/$b" ||
			{ echo "setup: building $b failed" >&2; exit 1; }
		echo "setup: $b built in $((SECONDS - start)) s"
	done
	kube_stamp scripts/kube > "$KUBE_DIR.tmp/complete"
	rm -rf "$KUBE_DIR" && mv "$KUBE_DIR.tmp" "$KUBE_DIR"
	kube_built "$KUBE_DIR" scripts/kube k8s.io/kubernetes "$KUBE_VERSION" "${KUBE_BINS[@]}" ||
		{ echo "setup: $KUBE_DIR does not hold k8s.io/kubernetes@$KUBE_VERSION builds" >&2; exit 1; }
fi
# The scratch caches are only worth keeping for the next version bump;
# the module cache is read-only, so make it writable before removing.
if [ -d "$KUBE_BUILD" ]; then
	chmod -R u+w "$KUBE_BUILD" && rm -rf "$KUBE_BUILD"
fi
# The test cluster's pod network (internal/testenv/kubetest/cni.go): the
# dummy, host-local and loopback CNI plugins, pinned like the rest, into the
# cache. Not Debian's containernetworking-plugins: it depends on iptables,
# with which the kubelet writes KUBE-* chains into the host's firewall and
# `criu check` (the native runtime's probe) lists rules with reverse DNS
# lookups — packets to the host's resolver.
CNI_VERSION=v1.10.0
CNI_DIR="$CACHE/kube/cni-$CNI_VERSION"
CNI_PLUGINS=(main/tap main/loopback ipam/host-local)
cni_built() {
	local p
	for p in "${CNI_PLUGINS[@]}"; do
		go version -m "$CNI_DIR/${p#*/}" 2>/dev/null | grep -qE "^[[:space:]]+mod[[:space:]]+github.com/containernetworking/plugins[[:space:]]+$CNI_VERSION([[:space:]]|\$)" || return 1
	done
}
if cni_built; then
	echo "setup: CNI plugins $CNI_VERSION are in $CNI_DIR"
else
	echo "setup: building CNI plugins $CNI_VERSION into $CNI_DIR"
	pkgs=()
	for p in "${CNI_PLUGINS[@]}"; do pkgs+=("github.com/containernetworking/plugins/plugins/$p@$CNI_VERSION"); done
	rm -rf "$CNI_DIR.tmp" && mkdir -p "$CNI_DIR.tmp"
	(cd / && CGO_ENABLED=0 GOBIN="$CNI_DIR.tmp" go install -trimpath -ldflags='-s -w' "${pkgs[@]}") ||
		{ echo "setup: building the CNI plugins failed" >&2; exit 1; }
	rm -rf "$CNI_DIR" && mv "$CNI_DIR.tmp" "$CNI_DIR"
	cni_built || { echo "setup: $CNI_DIR does not hold github.com/containernetworking/plugins@$CNI_VERSION" >&2; exit 1; }
fi
for b in "${KUBE_BINS[@]}"; do ln -sfn "$KUBE_DIR/$b" "bin/$b"; done
ln -sfn "$ETCD_DIR/etcd" bin/etcd

# The real npm clients the compatibility tests drive (E2B's SDK, the MCP
# TypeScript SDK), exactly as locked in e2e/js/package-lock.json. npm ci only
# when the lockfile changed since the last install (its hash is kept beside).
command -v node >/dev/null && command -v npm >/dev/null ||
	{ echo "setup: node and npm are needed for the e2e/js tests (Node.js >= 20.18.1)" >&2; exit 1; }
lock_sum=$(sha256sum e2e/js/package-lock.json | cut -d' ' -f1)
if [ -d e2e/js/node_modules ] && [ "$(cat e2e/js/node_modules/.space-lock-sha256 2>/dev/null)" = "$lock_sum" ]; then
	echo "setup: e2e/js/node_modules matches its lockfile"
else
	echo "setup: npm ci in e2e/js"
	(cd e2e/js && npm ci --no-audit --no-fund --loglevel=error) || { echo "setup: npm ci in e2e/js failed" >&2; exit 1; }
	echo "$lock_sum" > e2e/js/node_modules/.space-lock-sha256
fi

if [ ! -e "$CACHE/base-bookworm/complete" ]; then
	echo "setup: building the Debian base root filesystem into $CACHE (once; a few minutes)"
fi
bin/space template build-base --local --cache "$CACHE"
echo "setup: done. Start the server with: bin/space server"
