// Command space-jail is the microvm runtime's QEMU jailer. It runs on the
// host, as root, and is never placed inside a sandbox (that is why it is
// not a stage of space-agent): the runtime starts it in new namespaces
// (package jail, Start), moves it into the sandbox's host cgroup and sends
// it a plan over the control socket named by $SPACE_JAIL_FD; it builds
// QEMU's root, drops every privilege and execs QEMU, keeping its pid. It
// takes no arguments and is not meant to be run by hand.
package main

import "github.com/spacehq/space/internal/runtime/microvm/jail"

func main() {
	jail.Main()
}
