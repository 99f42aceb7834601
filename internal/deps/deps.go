// Package deps pins the modules the project uses while packages are being
// written in parallel; it is removed once every dependency is imported for real.
package deps

import (
	_ "github.com/coder/websocket"
	_ "github.com/creack/pty"
	_ "github.com/elastic/go-seccomp-bpf"
	_ "github.com/hashicorp/yamux"
	_ "github.com/landlock-lsm/go-landlock/landlock"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "github.com/spf13/cobra"
	_ "github.com/vbauerster/mpb/v8"
	_ "golang.org/x/sys/unix"
	_ "golang.org/x/term"
	_ "modernc.org/sqlite"
)
