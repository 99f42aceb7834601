package kubetest

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/spacehq/space/internal/testenv"
)

// The pod network. The kubelet reports its node Ready only when the CRI
// reports its network ready, and containerd does so only with a CNI
// configuration. This one gives each pod's network namespace an eth0 that
// is a TAP device existing only in that namespace (the `tap` plugin), with
// an address from host-local: no host-side device, no route, no bridge, no
// firewall rule — a pod's packets to anything but itself go nowhere, and
// nothing is left on the host when the namespace goes. (A space sandbox
// does not use the pod's network namespace at all: its only NIC is space's
// own, docs/network.md.) The plugins are built by scripts/setup.sh from
// github.com/containernetworking/plugins (CNIVersion), not Debian's
// package, which depends on iptables. See docs/DECISIONS.md.
const (
	CNIVersion    = "v1.10.0"
	cniConfigName = "10-space-kubetest.conflist"
	cniSubnet     = "198.19.255.0/24" // RFC 2544 benchmarking space, as space's own link addresses
)

// cniPlugins are the plugins the configuration runs (loopback: the CRI's
// own "lo" network).
var cniPlugins = []string{"tap", "host-local", "loopback"}

// cniDir is where scripts/setup.sh builds the plugins.
func cniDir() string { return filepath.Join(testenv.CacheDir(), "kube", "cni-"+CNIVersion) }

func (c *Cluster) writeCNIConfig() error {
	if c.opts.CNIBinDir != "" {
		for _, p := range cniPlugins {
			src := filepath.Join(cniDir(), p)
			if _, err := os.Stat(src); err != nil {
				return fmt.Errorf("%w (run scripts/setup.sh)", err)
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
			"type": "tap",
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
