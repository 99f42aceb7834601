// Package microvm holds the groundwork of the microvm runtime: sandboxes as
// QEMU microVMs with a guest kernel of their own (issue 5).
//
// What exists so far is the boot path, without the runtime itself:
//
//   - FindKernel locates the pinned Debian cloud kernel that scripts/setup.sh
//     unpacks into the cache (never into the host's /boot).
//   - BuildInitramfs packs the static space-agent as /init plus the kernel
//     modules the guest needs (GuestModules, in load order) into a newc cpio,
//     gzip-compressed and cached per (kernel, agent binary) digest.
//   - VM describes one QEMU -M microvm process: the agent's stream is a
//     virtio-serial port backed by a unix socket on the host (this host has
//     no vhost-vsock), the console goes to a log file whose tail explains a
//     guest that died.
//   - ProbeKVM decides whether KVM really runs a guest by booting one to the
//     agent's health answer under a short timeout; /dev/kvm existing proves
//     nothing (see ../shared/MACHINE.md: kvm_pvm runs toy guests only).
//
// Inside the guest, package vminit (run by space-agent as PID 1) mounts the
// kernel filesystems, loads the modules and hands the agent its serial port.
package microvm
