package agentclient_test

// This file sorts first so its test runs before any in-process agent (whose
// process-wide reaper would collect the children started here).

import (
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/testenv"
)

// TestAgentBinary runs the real static space-agent binary on a unix socket
// and talks to it across reconnects.
func TestAgentBinary(t *testing.T) {
	bin := testenv.AgentBinary(t)
	dir, err := os.MkdirTemp("", "agb")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s")
	root := t.TempDir()
	p, err := os.StartProcess(bin, []string{"space-agent", "--socket", sock, "--root", root}, &os.ProcAttr{Files: []*os.File{nil, os.Stderr, os.Stderr}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		p.Kill()
		p.Wait() // may fail with ECHILD under -count>1 (a reaper took it)
	}()
	var conn net.Conn
	for deadline := time.Now().Add(10 * time.Second); ; {
		if conn, err = net.Dial("unix", sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent never listened: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for round := 0; round < 3; round++ {
		if round > 0 {
			if conn, err = net.Dial("unix", sock); err != nil {
				t.Fatal(err)
			}
		}
		c, err := agentclient.New(conn)
		if err != nil {
			t.Fatal(err)
		}
		h, err := c.Health(ctxT(t))
		if err != nil || h.Pid != p.Pid {
			t.Fatalf("health %+v %v", h, err)
		}
		res, err := c.Exec(ctxT(t), agentproto.ExecRequest{Cmd: []string{"sh", "-c", "echo hi; exit 4"}})
		if err != nil || res.Stdout != "hi\n" || res.ExitCode != 4 {
			t.Fatalf("exec %+v %v", res, err)
		}
		c.Close()
		select {
		case <-c.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("Done not closed after Close")
		}
	}
}

// TestAgentBinaryInheritedFD starts the agent the way nsinit leaves it: the
// listening socket as fd 3 and SPACE_AGENT_FD=3.
func TestAgentBinaryInheritedFD(t *testing.T) {
	bin := testenv.AgentBinary(t)
	dir, err := os.MkdirTemp("", "agb")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	lf, err := ln.File()
	if err != nil {
		t.Fatal(err)
	}
	p, err := os.StartProcess(bin, []string{"space-agent", "--root", t.TempDir()}, &os.ProcAttr{
		Env:   []string{"SPACE_AGENT_FD=3", "PATH=/usr/bin:/bin"},
		Files: []*os.File{nil, os.Stderr, os.Stderr, lf},
	})
	lf.Close()
	ln.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		p.Kill()
		p.Wait()
	}()
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	c, err := agentclient.New(conn)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	res, err := c.Exec(ctxT(t), agentproto.ExecRequest{Cmd: []string{"sh", "-c", "echo ${SPACE_AGENT_FD-unset}; ls /proc/$$/fd"}})
	if err != nil || res.Stdout != "unset\n0\n1\n2\n" {
		t.Fatalf("exec %+v %v", res, err)
	}
}
