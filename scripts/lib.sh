# Helpers shared by scripts/setup.sh and scripts/setup-test.sh (sourced, not
# run). The caller sets SETUP to its name, for messages.

export PATH=$PATH:/usr/local/go/bin
CACHE=${SPACE_CACHE:-/var/cache/space}

need_root() {
	if [ "$(id -u)" != 0 ]; then
		echo "$SETUP: run as root (namespaces, cgroups, debootstrap and apt-get need it)" >&2
		exit 1
	fi
}

# apt_install [--no-install-recommends] PKG...: installs those of PKG that are
# not installed yet, with one apt-get update per run; nothing at all when every
# PKG is installed.
apt_install() {
	local opts=() missing=() p
	if [ "${1:-}" = --no-install-recommends ]; then opts+=("$1") && shift; fi
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
	done
	[ ${#missing[@]} -gt 0 ] || return 0
	echo "$SETUP: installing ${missing[*]}"
	if [ -z "${APT_UPDATED:-}" ]; then
		apt-get update -qq
		APT_UPDATED=1
	fi
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${opts[@]}" "${missing[@]}" >/dev/null
}

# go_pinned BINARY MODULE VERSION: BINARY exists and was built from MODULE at
# VERSION (its build info, which go install records).
go_pinned() {
	[ -x "$1" ] && go version -m "$1" 2>/dev/null | grep -qE "^[[:space:]]+mod[[:space:]]+$2[[:space:]]+$3([[:space:]]|\$)"
}

# spawn NAME COMMAND...: runs COMMAND in the background (steps that do not
# depend on each other: a download next to a build); wait_spawned waits for all
# of them and fails naming each that failed. A foreground step that fails
# still waits for them on exit, so that nothing is left running behind the
# script.
SPAWNED_PIDS=()
SPAWNED_NAMES=()
spawn() {
	local name=$1
	shift
	"$@" &
	SPAWNED_PIDS+=("$!")
	SPAWNED_NAMES+=("$name")
}
wait_spawned() {
	local i failed=()
	for i in "${!SPAWNED_PIDS[@]}"; do
		wait "${SPAWNED_PIDS[$i]}" || failed+=("${SPAWNED_NAMES[$i]}")
	done
	SPAWNED_PIDS=()
	SPAWNED_NAMES=()
	if [ ${#failed[@]} -gt 0 ]; then
		echo "$SETUP: failed: ${failed[*]}" >&2
		exit 1
	fi
}
trap '[ -z "$(jobs -p)" ] || { echo "$SETUP: waiting for the steps still running" >&2; wait; }' EXIT
