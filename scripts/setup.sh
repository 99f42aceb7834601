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

PKGS=(debootstrap bubblewrap e2fsprogs iproute2 tmux procps util-linux ca-certificates)
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
echo "setup: building bin/space and bin/space-agent"
mkdir -p bin
go build -trimpath -o bin/space ./cmd/space
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o bin/space-agent ./cmd/space-agent

CACHE=${SPACE_CACHE:-/var/cache/space}
if [ ! -e "$CACHE/base-bookworm/complete" ]; then
	echo "setup: building the Debian base root filesystem into $CACHE (once; a few minutes)"
fi
bin/space template build-base --local --cache "$CACHE"
echo "setup: done. Start the server with: bin/space server"
