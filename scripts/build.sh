#!/usr/bin/env bash
# Builds space's own binaries into bin/ — the one list of them, used by
# `make build` and scripts/setup.sh: bin/space (the CLI, a small client),
# bin/space-server (the server and the other host-side commands `bin/space`
# hands to it), bin/space-agent, bin/space-nsinit, bin/space-jail,
# bin/space-gateway and bin/containerd-shim-space-v2. All are static
# (CGO_ENABLED=0) and built by one `go build`, so the packages they share
# compile once; Go's build cache makes an unchanged rebuild take seconds.
# Without DWARF or a symbol table (-gcflags=all=-dwarf=false, -s -w): stack
# traces and pprof need neither, and a cold compile is shorter without them.
#
#   scripts/build.sh            all of them
#   scripts/build.sh NAME...    only those (setup.sh builds space and
#                               space-server first: the base root
#                               filesystem's build needs them)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin

ALL=(space-server space space-agent space-nsinit space-jail space-gateway containerd-shim-space-v2)
want=("$@")
if [ ${#want[@]} -eq 0 ]; then
	want=("${ALL[@]}")
fi
pkgs=()
for name in "${want[@]}"; do
	case " ${ALL[*]} " in
	*" $name "*) pkgs+=("./cmd/$name") ;;
	*)
		echo "build: no binary $name (${ALL[*]})" >&2
		exit 2
		;;
	esac
done

mkdir -p bin
start=$SECONDS
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -gcflags=all=-dwarf=false -o bin/ "${pkgs[@]}"
echo "build: ${want[*]} are in bin/ ($((SECONDS - start)) s)"
