package kubetest

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// The pod network. The kubelet reports its node Ready only when the CRI
// reports its network ready, and containerd does so only with a CNI
// configuration. This one (Debian's containernetworking-plugins) is a
// bridge of this cluster's own with no address on the host, no gateway,
// no masquerade and no route: a pod's eth0 reaches the other pods on the
// bridge and nothing else — not the host, not another machine. (A space
// sandbox does not use the pod's network namespace at all: its only NIC is
// space's own, docs/network.md.) See docs/DECISIONS.md.
// debianCNI is where Debian's containernetworking-plugins puts them.
const debianCNI = "/usr/lib/cni"

// cniPlugins are the plugins the configuration runs (loopback: the CRI's
// own "lo" network).
var cniPlugins = []string{"bridge", "host-local", "loopback"}

const (
	cniConfigName = "10-space-kubetest.conflist"
	cniSubnet     = "198.19.255.0/24" // RFC 2544 benchmarking space, as space's own link addresses
)

// bridgeName is the cluster's bridge: a name no other cluster has (device
// names are at most 15 bytes).
func (c *Cluster) bridgeName() string {
	return fmt.Sprintf("ktbr%08x", crc32.ChecksumIEEE([]byte(c.Dir)))
}

func (c *Cluster) writeCNIConfig() error {
	if c.opts.CNIBinDir != "" {
		for _, p := range cniPlugins {
			src := filepath.Join(debianCNI, p)
			if _, err := os.Stat(src); err != nil {
				return fmt.Errorf("%w (apt-get install containernetworking-plugins; scripts/setup.sh does)", err)
			}
			dst := filepath.Join(c.opts.CNIBinDir, p)
			if err := os.Symlink(src, dst); err != nil && !errors.Is(err, fs.ErrExist) {
				return err
			}
		}
	}
	conf := map[string]any{
		"cniVersion": "1.0.0",
		"name":       "space-kubetest",
		"plugins": []any{map[string]any{
			"type":        "bridge",
			"bridge":      c.bridgeName(),
			"isGateway":   false,
			"ipMasq":      false,
			"hairpinMode": false,
			"ipam": map[string]any{
				"type":    "host-local",
				"dataDir": filepath.Join(c.Dir, "cni-ipam"),
				"ranges":  [][]map[string]string{{{"subnet": cniSubnet}}},
			},
		}},
	}
	b, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		return err
	}
	// Renamed into place: the CRI watches the directory and must never
	// load half a file.
	dst := filepath.Join(c.opts.CNIConfDir, cniConfigName)
	tmp := filepath.Join(c.opts.CNIConfDir, ".space-kubetest.tmp") // not a CNI file name
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, dst)
}

// deleteLink removes a network device if it exists.
func deleteLink(name string) error {
	if _, err := os.Stat("/sys/class/net/" + name); err != nil {
		return nil
	}
	out, err := exec.Command("ip", "link", "del", name).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip link del %s: %v: %s", name, err, strings.TrimSpace(string(out)))
	}
	return nil
}
