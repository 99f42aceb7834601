package native

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// agentPath returns the copy of the agent binary the sandbox init is
// started from. The init runs as the sandbox's unprivileged host uid, which
// must be able to execute it, so it lives under DataDir/bin (0711 dirs,
// 0555 file) rather than wherever the server found it. It is refreshed
// once per Runtime.
func (r *Runtime) agentPath() (string, error) {
	r.agentOnce.Do(func() {
		r.agentCopy, r.agentErr = r.installAgent()
	})
	return r.agentCopy, r.agentErr
}

func (r *Runtime) installAgent() (string, error) {
	if r.cfg.AgentBinary == "" {
		return "", fmt.Errorf("no agent binary configured")
	}
	if err := r.prepareDataDir(); err != nil {
		return "", err
	}
	dir := filepath.Join(r.cfg.DataDir, "bin")
	if err := os.MkdirAll(dir, 0o711); err != nil {
		return "", err
	}
	in, err := os.Open(r.cfg.AgentBinary)
	if err != nil {
		return "", fmt.Errorf("agent binary: %w", err)
	}
	defer in.Close()
	tmp, err := os.CreateTemp(dir, ".space-agent-")
	if err != nil {
		return "", err
	}
	_, err = io.Copy(tmp, in)
	if err == nil {
		err = tmp.Chmod(0o555)
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	dst := filepath.Join(dir, "space-agent")
	if err == nil {
		err = os.Rename(tmp.Name(), dst)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return "", fmt.Errorf("install agent binary: %w", err)
	}
	return dst, nil
}

// prepareDataDir makes DataDir searchable by the sandboxes' host uids: the
// sandbox init resolves its overlay directories itself, as that uid. It
// reports a parent directory that would block it.
func (r *Runtime) prepareDataDir() error {
	if err := os.MkdirAll(r.cfg.DataDir, 0o711); err != nil {
		return err
	}
	if err := os.Chmod(r.cfg.DataDir, 0o711); err != nil {
		return err
	}
	for d := filepath.Dir(r.cfg.DataDir); ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		if fi.Mode().Perm()&0o001 == 0 {
			return fmt.Errorf("directory %s (mode %v) is not searchable by sandbox uids; DataDir must be reachable with o+x", d, fi.Mode().Perm())
		}
		if d == "/" {
			return nil
		}
	}
}
