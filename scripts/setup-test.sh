#!/usr/bin/env bash
# Sets up what only the tests and benchmarks need, after scripts/setup.sh
# (`make test`, `make lint` and `make bench` run both, in that order): Debian
# packages, the pinned staticcheck and crictl, etcd and the Kubernetes
# components, the CNI plugins, and the npm clients in e2e/js.
#
#   scripts/setup-test.sh          everything `make test` and `make lint` need
#   scripts/setup-test.sh bench    only what `make bench` adds: bubblewrap (the
#                                  raw tool it compares with), PostgreSQL (the
#                                  cluster benchmark) and e2e/js (the E2B one)
#
# Idempotent: every step checks before it acts. The package install and npm ci
# (downloads) run next to the Go builds. SPACE_CACHE moves the cache (default
# /var/cache/space).
set -euo pipefail
cd "$(dirname "$0")/.."
SETUP=setup-test
. scripts/lib.sh
need_root
setup_start=$SECONDS

case "${1:-all}" in
all) what=all ;;
bench) what=bench ;;
*)
	echo "usage: scripts/setup-test.sh [bench]" >&2
	exit 2
	;;
esac

# bubblewrap: the raw tool the native runtime's test and the benchmarks
# compare with; tmux for the CLI's PTY tests (e2e); containerd (1.6, with its
# CRI plugin) and busybox-static for the shim's integration test
# (internal/shim, internal/testenv/containerdtest); postgresql for cluster
# mode's store tests and benchmark (internal/testenv/pgtest).
if [ "$what" = bench ]; then
	spawn "Debian packages" apt_install bubblewrap postgresql
else
	spawn "Debian packages" apt_install bubblewrap tmux containerd busybox-static postgresql
fi

# The real npm clients the compatibility tests and the E2B benchmark drive
# (E2B's SDK, the MCP TypeScript SDK), exactly as locked in
# e2e/js/package-lock.json. npm ci only when the lockfile changed since the
# last install (its hash is kept beside).
e2e_js() {
	command -v node >/dev/null && command -v npm >/dev/null ||
		{ echo "setup-test: node and npm are needed for the e2e/js tests (Node.js >= 20.18.1)" >&2; exit 1; }
	lock_sum=$(sha256sum e2e/js/package-lock.json | cut -d' ' -f1)
	if [ -d e2e/js/node_modules ] && [ "$(cat e2e/js/node_modules/.space-lock-sha256 2>/dev/null)" = "$lock_sum" ]; then
		echo "setup-test: e2e/js/node_modules matches its lockfile"
	else
		echo "setup-test: npm ci in e2e/js"
		(cd e2e/js && npm ci --no-audit --no-fund --loglevel=error) || { echo "setup-test: npm ci in e2e/js failed" >&2; exit 1; }
		echo "$lock_sum" > e2e/js/node_modules/.space-lock-sha256
	fi
}
spawn "npm ci in e2e/js" e2e_js

# The containerd shim, which only the shim's and the cluster's tests run
# (scripts/setup.sh leaves it out of `make run`).
if [ "$what" != bench ]; then
	scripts/build.sh containerd-shim-space-v2
fi

if [ "$what" = bench ]; then
	wait_spawned
	echo "setup-test: bench set-up done in $((SECONDS - setup_start)) s"
	exit 0
fi

# staticcheck for `make lint` (go vet + staticcheck run before the tests),
# pinned like runsc; its version is in its build info.
STATICCHECK_VERSION=v0.8.2
if go_pinned bin/staticcheck honnef.co/go/tools "$STATICCHECK_VERSION"; then
	echo "setup-test: bin/staticcheck is honnef.co/go/tools@$STATICCHECK_VERSION"
else
	echo "setup-test: building bin/staticcheck (honnef.co/go/tools@$STATICCHECK_VERSION)"
	(bin="$PWD/bin" && cd / && GOBIN="$bin" go install "honnef.co/go/tools/cmd/staticcheck@$STATICCHECK_VERSION") ||
		{ echo "setup-test: building staticcheck failed" >&2; exit 1; }
fi

# crictl for the shim's integration test, pinned like staticcheck. Never
# talks to anything but the test's own containerd socket.
CRICTL_VERSION=v1.37.0
if go_pinned bin/crictl sigs.k8s.io/cri-tools "$CRICTL_VERSION"; then
	echo "setup-test: bin/crictl is sigs.k8s.io/cri-tools@$CRICTL_VERSION"
else
	echo "setup-test: building bin/crictl (sigs.k8s.io/cri-tools@$CRICTL_VERSION)"
	(bin="$PWD/bin" && cd / && CGO_ENABLED=0 GOBIN="$bin" go install -trimpath "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION") ||
		{ echo "setup-test: building crictl failed" >&2; exit 1; }
fi

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
		echo "setup-test: building Kubernetes needs ~6 GB free in $CACHE/kube (has $((avail / 1024)) MB)" >&2
		exit 1
	fi
}
if kube_built "$ETCD_DIR" scripts/etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION" etcd; then
	echo "setup-test: etcd $ETCD_VERSION is in $ETCD_DIR"
else
	kube_scratch
	echo "setup-test: building etcd $ETCD_VERSION into $ETCD_DIR (~1 minute cold)"
	start=$SECONDS
	rm -rf "$ETCD_DIR.tmp" && mkdir -p "$ETCD_DIR.tmp"
	kube_go scripts/etcd build -trimpath -ldflags='-s -w' -o "$ETCD_DIR.tmp/etcd" go.etcd.io/etcd/server/v3 ||
		{ echo "setup-test: building etcd failed" >&2; exit 1; }
	kube_stamp scripts/etcd > "$ETCD_DIR.tmp/complete"
	rm -rf "$ETCD_DIR" && mv "$ETCD_DIR.tmp" "$ETCD_DIR"
	kube_built "$ETCD_DIR" scripts/etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION" etcd ||
		{ echo "setup-test: $ETCD_DIR/etcd is not go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2; exit 1; }
	echo "setup-test: etcd built in $((SECONDS - start)) s"
fi
KUBE_BINS=(kubelet kube-apiserver kubectl)
if kube_built "$KUBE_DIR" scripts/kube k8s.io/kubernetes "$KUBE_VERSION" "${KUBE_BINS[@]}"; then
	echo "setup-test: kubelet, kube-apiserver, kubectl $KUBE_VERSION are in $KUBE_DIR"
else
	kube_scratch
	echo "setup-test: building kubelet, kube-apiserver, kubectl $KUBE_VERSION into $KUBE_DIR (~8 minutes cold)"
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
	# One go build for the three, so that one's link runs beside the
	# others' compiles.
	start=$SECONDS
	kube_go scripts/kube build -trimpath -ldflags="$ldflags" -o "$KUBE_DIR.tmp/" "${KUBE_BINS[@]/#/k8s.io/kubernetes/cmd/}" ||
		{ echo "setup-test: building ${KUBE_BINS[*]} failed" >&2; exit 1; }
	echo "setup-test: ${KUBE_BINS[*]} built in $((SECONDS - start)) s"
	kube_stamp scripts/kube > "$KUBE_DIR.tmp/complete"
	rm -rf "$KUBE_DIR" && mv "$KUBE_DIR.tmp" "$KUBE_DIR"
	kube_built "$KUBE_DIR" scripts/kube k8s.io/kubernetes "$KUBE_VERSION" "${KUBE_BINS[@]}" ||
		{ echo "setup-test: $KUBE_DIR does not hold k8s.io/kubernetes@$KUBE_VERSION builds" >&2; exit 1; }
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
	echo "setup-test: CNI plugins $CNI_VERSION are in $CNI_DIR"
else
	echo "setup-test: building CNI plugins $CNI_VERSION into $CNI_DIR"
	pkgs=()
	for p in "${CNI_PLUGINS[@]}"; do pkgs+=("github.com/containernetworking/plugins/plugins/$p@$CNI_VERSION"); done
	rm -rf "$CNI_DIR.tmp" && mkdir -p "$CNI_DIR.tmp"
	(cd / && CGO_ENABLED=0 GOBIN="$CNI_DIR.tmp" go install -trimpath -ldflags='-s -w' "${pkgs[@]}") ||
		{ echo "setup-test: building the CNI plugins failed" >&2; exit 1; }
	rm -rf "$CNI_DIR" && mv "$CNI_DIR.tmp" "$CNI_DIR"
	cni_built || { echo "setup-test: $CNI_DIR does not hold github.com/containernetworking/plugins@$CNI_VERSION" >&2; exit 1; }
fi
for b in "${KUBE_BINS[@]}"; do ln -sfn "$KUBE_DIR/$b" "bin/$b"; done
ln -sfn "$ETCD_DIR/etcd" bin/etcd

wait_spawned
echo "setup-test: done in $((SECONDS - setup_start)) s"
