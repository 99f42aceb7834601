package confine

import "golang.org/x/sys/unix"

// ServiceFilter assembles a seccomp program for a host service that parses
// hostile bytes (the network gateway): only the syscalls in allowed, no
// namespaces through clone, sockets of AF_INET and AF_INET6 only, x32 and
// foreign architectures killed, everything else EPERM (an error the
// service sees, not a crash that would take every sandbox's network down
// with it).
func ServiceFilter(allowed []uint32) []unix.SockFilter {
	var p program
	p.prologue()

	var b program
	b.ld(offArgLo(0))
	b.jmp(unix.BPF_JEQ, unix.AF_INET, 1, 0)
	b.jmp(unix.BPF_JEQ, unix.AF_INET6, 0, 1)
	b.ret(retAllow)
	b.ret(retErrno(unix.EAFNOSUPPORT))
	p.onSyscall(unix.SYS_SOCKET, b)

	for _, nr := range allowed {
		if nr == unix.SYS_CLONE || nr == unix.SYS_CLONE3 || nr == unix.SYS_SOCKET {
			continue
		}
		p.jmp(unix.BPF_JEQ, nr, 0, 1)
		p.ret(retAllow)
	}
	p.ret(retEPERM)
	return p
}

// LoadServiceFilter installs ServiceFilter(allowed) on every thread of the
// process (SECCOMP_FILTER_FLAG_TSYNC). no_new_privs must already be set.
func LoadServiceFilter(allowed []uint32) error {
	return load(ServiceFilter(allowed), unix.SECCOMP_FILTER_FLAG_TSYNC)
}
