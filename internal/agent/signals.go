package agent

import (
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// sigRTMax is the highest signal number Linux accepts.
const sigRTMax = 64

// parseSignal accepts "TERM", "SIGTERM", "term" or a number 1..64.
func parseSignal(s string) (unix.Signal, error) {
	if s == "" {
		return 0, fmt.Errorf("empty signal: %w", errdefs.ErrInvalidArgument)
	}
	if n, err := strconv.Atoi(s); err == nil {
		if n < 1 || n > sigRTMax {
			return 0, fmt.Errorf("signal number %d out of range 1..%d: %w", n, sigRTMax, errdefs.ErrInvalidArgument)
		}
		return unix.Signal(n), nil
	}
	name := strings.ToUpper(s)
	if !strings.HasPrefix(name, "SIG") {
		name = "SIG" + name
	}
	if sig := unix.SignalNum(name); sig != 0 {
		return sig, nil
	}
	if len(s) > 32 {
		s = s[:32]
	}
	return 0, fmt.Errorf("unknown signal %q: %w", s, errdefs.ErrInvalidArgument)
}

// signalName is "TERM" for SIGTERM and the number for signals without a name.
func signalName(sig unix.Signal) string {
	if n := unix.SignalName(sig); n != "" {
		return strings.TrimPrefix(n, "SIG")
	}
	return strconv.Itoa(int(sig))
}

// exitStatus converts a wait status to the API's form: the exit code, or
// the signal name with exit code 128+n as shells report it.
func exitStatus(ws unix.WaitStatus) *api.ExitStatus {
	if ws.Signaled() {
		sig := ws.Signal()
		reason := "killed by signal " + signalName(sig)
		if ws.CoreDump() {
			reason += " (core dumped)"
		}
		return &api.ExitStatus{ExitCode: 128 + int(sig), Signal: signalName(sig), Reason: reason}
	}
	return &api.ExitStatus{ExitCode: ws.ExitStatus()}
}

func describeStatus(ws unix.WaitStatus) string {
	es := exitStatus(ws)
	if es.Signal != "" {
		return es.Reason
	}
	return "exit " + strconv.Itoa(es.ExitCode)
}
