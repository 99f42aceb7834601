package shim

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

// The part of an OCI runtime spec (config.json) the shim reads.
type ociSpec struct {
	Process     *ociProcess       `json:"process,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

type ociProcess struct {
	Terminal    bool `json:"terminal,omitempty"`
	ConsoleSize *struct {
		Height uint `json:"height"`
		Width  uint `json:"width"`
	} `json:"consoleSize,omitempty"`
	User struct {
		UID uint32 `json:"uid"`
		GID uint32 `json:"gid"`
	} `json:"user"`
	Args []string `json:"args,omitempty"`
	Env  []string `json:"env,omitempty"`
	Cwd  string   `json:"cwd"`
}

// readSpec reads <bundle>/config.json.
func readSpec(bundle string) (*ociSpec, error) {
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return nil, err
	}
	var s ociSpec
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("bundle %s: config.json: %w", bundle, err)
	}
	return &s, nil
}

// isPod says whether a spec is CRI's pod sandbox (pause) container.
func (s *ociSpec) isPod() bool { return s.Annotations[criContainerType] == criContainerTypeBox }

// group is the id tasks are grouped by into one shim: CRI's sandbox id,
// else the task's own id.
func (s *ociSpec) group(id string) string {
	if g := s.Annotations[criSandboxID]; g != "" {
		return g
	}
	return id
}
