// Package microvm is the microvm runtime (registered as "microvm"): every
// sandbox is a QEMU -M microvm guest with a kernel of its own, so code in
// the sandbox meets a guest kernel and QEMU's device models, never the
// host kernel's syscall surface. KVM is used only where a guest really
// runs under it (ProbeKVM); otherwise TCG, which isolates as well but is
// slow, and so ranks below gVisor for "auto".
//
// Pieces:
//
//   - Runtime (microvm.go): Create, Open, Sweep, PrepareTemplate; the probe
//     (probe.go) boots one real sandbox guest and is cached per host boot.
//   - instance (instance.go): one sandbox; a cold Start boots the guest
//     from the template's read-only erofs root image (Images, one per tree
//     digest) and the sandbox's writable ext4 disk, and returns once the
//     agent and the guest's init answer. QEMU is detached from the server
//     and re-adopted by Open (pid + start time). A watchdog pings the
//     guest's init; ExitReason tells a panic, a power-off, a QEMU crash
//     and a hung guest apart, with the console's tail. Its parts are
//     fields of their own types: layout (layout.go, the directory's
//     files), vmm (vmm.go, the QEMU process, QMP and the watchdog),
//     guestCtl (guestctl.go, the guest init's control port), snapshots
//     (suspend.go) and warmer (warm.go).
//   - Snapshots (suspend.go, fork.go, warm.go, migrate.go): QMP migration
//     to a file and back; fork; warm templates.
//   - Boot: FindKernel locates the pinned Debian cloud kernel that
//     scripts/setup.sh unpacks into the cache; BuildInitramfs packs the
//     static space-agent as /init plus the guest's kernel modules.
//   - VM, Launch, Process (qemu.go): QEMU's command line and process; the
//     agent's stream is a virtio-serial port behind a unix socket (no
//     vhost-vsock on these hosts), the guest's init has a second port for
//     package vmctl, QEMU's monitor is QMP (qmp.go).
//   - Package jail confines QEMU (own uid, namespaces, cgroup, -sandbox).
//
// Inside the guest, package vminit (run by space-agent as PID 1) mounts
// the root, applies the sandbox's limits in a cgroup, starts the agent
// confined in user, pid and mount namespaces, and serves vmctl.
package microvm
