#!/usr/bin/env bash
# Builds space's own binaries into bin/ — the one list of them, used by
# `make build` and scripts/setup.sh: bin/space (the CLI, a small static
# client), bin/space-server (the server and the other host-side commands
# `bin/space` hands to it), and the static bin/space-agent, bin/space-nsinit,
# bin/space-jail, bin/space-gateway and bin/containerd-shim-space-v2. The two
# go builds (static and not) run side by side; Go's build cache makes an
# unchanged rebuild take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin

STATIC=(space space-agent space-nsinit space-jail space-gateway containerd-shim-space-v2)
mkdir -p bin
start=$SECONDS
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o bin/ "${STATIC[@]/#/./cmd/}" &
static=$!
go build -trimpath -o bin/space-server ./cmd/space-server || { wait "$static" || true; exit 1; }
wait "$static"
echo "build: space-server ${STATIC[*]} are in bin/ ($((SECONDS - start)) s)"
