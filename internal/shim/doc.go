// Package shim is containerd's runtime v2 shim for space
// (`containerd-shim-space-v2`, runtime type `io.containerd.space.v2`).
//
// A Kubernetes pod is one space sandbox; each of its containers is a
// process tree chrooted into a copy of the container's image inside that
// sandbox. The shim is a thin client of the node's `space server` (package
// sdk): it holds no state of its own that a restart would need, other than
// the small file it leaves in each bundle for `delete`.
//
// One shim daemon serves one pod: `start` runs for every task and returns
// the address of the pod's daemon (grouped by the CRI sandbox id), starting
// it for the pod's first task. The daemon serves containerd's task service
// (containerd.task.v2.Task) over ttrpc on a unix socket and forwards task
// events to containerd ($TTRPC_ADDRESS) through a Publisher.
//
// Mapping (see docs/cluster.md, "containerd shim"):
//   - the pod task (CRI container type "sandbox") creates the space
//     sandbox, labelled with the pod's namespace/name/uid and the containerd
//     ids, and its delete deletes it;
//   - a container task mounts containerd's rootfs on <bundle>/rootfs,
//     streams it as a tar into the sandbox at ContainersDir/<id>/rootfs,
//     unmounts it, and runs the OCI process there as a command session with
//     api.ExecRequest.Root; its output goes into the FIFOs CRI gave;
//   - exec is another command session with the same root.
package shim
