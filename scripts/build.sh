#!/usr/bin/env bash
# Builds space's own binaries into bin/ — the one list of them, used by
# `make build` and scripts/setup.sh: bin/space (the CLI, a small static
# client), bin/space-server (the server and the other host-side commands
# `bin/space` hands to it), and the static bin/space-agent, bin/space-nsinit,
# bin/space-jail, bin/space-gateway and bin/containerd-shim-space-v2. The two
# go builds (static and not) run side by side; Go's build cache makes an
# unchanged rebuild take seconds.
#
#   scripts/build.sh            all of them
#   scripts/build.sh NAME...    only those (setup.sh builds space and
#                               space-server first: the base root
#                               filesystem's build needs them)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin

STATIC=(space space-agent space-nsinit space-jail space-gateway containerd-shim-space-v2)
want=("$@")
if [ ${#want[@]} -eq 0 ]; then
	want=(space-server "${STATIC[@]}")
fi
server=0
static=()
for name in "${want[@]}"; do
	case " space-server ${STATIC[*]} " in
	*" $name "*) ;;
	*)
		echo "build: no binary $name (space-server ${STATIC[*]})" >&2
		exit 2
		;;
	esac
	if [ "$name" = space-server ]; then server=1; else static+=("./cmd/$name"); fi
done

mkdir -p bin
start=$SECONDS
pid=
if [ ${#static[@]} -gt 0 ]; then
	CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o bin/ "${static[@]}" &
	pid=$!
fi
if [ $server = 1 ]; then
	go build -trimpath -o bin/space-server ./cmd/space-server || { [ -z "$pid" ] || wait "$pid" || true; exit 1; }
fi
[ -z "$pid" ] || wait "$pid"
echo "build: ${want[*]} are in bin/ ($((SECONDS - start)) s)"
