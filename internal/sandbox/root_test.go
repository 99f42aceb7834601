package sandbox

import (
	"errors"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// TestExecRootRefused: a process root that is relative, unclean or not a
// directory of the sandbox is the caller's mistake (a 4xx naming it), for
// sync exec and command sessions alike.
func TestExecRootRefused(t *testing.T) {
	h := newHarness(t)
	sb := h.create(api.CreateSandboxRequest{})
	h.writeFile(sb.ID, "/afile", "x")
	for _, c := range []struct{ root, want string }{
		{"etc", "absolute"},
		{"/etc/../etc", "clean"},
		{"/etc/", "clean"},
		{"/afile", "not a directory"},
		{"/nope", "does not exist"},
	} {
		_, err := h.m.cmds.Exec(h.ctx(), sb.ID, api.ExecRequest{Cmd: []string{"true"}, Root: c.root})
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("exec with root %q: %v, want invalid argument saying %q", c.root, err, c.want)
		}
	}
	_, err := h.m.cmds.CreateCommand(h.ctx(), sb.ID, api.CreateCommandRequest{ExecRequest: api.ExecRequest{Cmd: []string{"true"}, Root: "rel"}})
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("command with a relative root: %v", err)
	}
}
