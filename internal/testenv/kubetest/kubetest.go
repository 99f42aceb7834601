// Package kubetest runs a real one-node Kubernetes control plane and kubelet
// on this machine for tests: etcd, kube-apiserver and kubelet as built by
// scripts/setup-test.sh (pinned in scripts/kube and scripts/etcd), everything
// on 127.0.0.1 and under one temporary directory, and kubectl pointed at it.
//
// There is no scheduler and no controller-manager: pods name their node
// (spec.nodeName: localhost), and what the controller-manager would make for
// a namespace (the default service account, the kube-root-ca.crt config
// map) PrepareNamespace makes. The kubelet talks to a CRI endpoint the test
// provides (internal/testenv/containerdtest).
//
// Nothing may leave this machine and nothing may stay on it: the node is
// called localhost and the apiserver reaches it by that name
// (--kubelet-preferred-address-types=Hostname, answered by /etc/hosts),
// pods get a resolv.conf naming only 127.0.0.1, and Close stops every
// process, unmounts everything below the directory, removes the cgroups the
// kubelet made (under a cgroup root of this cluster's own) and puts back the
// kernel settings and the /var/log/containers directory the kubelet
// changes. Processes die with the test process (Pdeathsig); what a killed
// test left behind is swept by the next Start.
package kubetest

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/testenv"
)

// The versions scripts/setup-test.sh builds (KUBE_VERSION, ETCD_VERSION there;
// TestVersionsMatchSetup keeps them equal).
const (
	KubeVersion = "v1.37.2"
	EtcdVersion = "v3.7.3"
)

// NodeName is the one node's name. It must be a name this machine answers
// itself (/etc/hosts): the apiserver dials the kubelet by it.
const NodeName = "localhost"

// Binaries are the component executables.
type Binaries struct {
	Etcd, APIServer, Kubelet, Kubectl string
}

// FindBinaries returns the builds scripts/setup-test.sh left in the cache
// (testenv.CacheDir()/kube/…), or an error saying what is missing.
func FindBinaries() (Binaries, error) {
	kdir := filepath.Join(testenv.CacheDir(), "kube", "kubernetes-"+KubeVersion)
	edir := filepath.Join(testenv.CacheDir(), "kube", "etcd-"+EtcdVersion)
	for _, d := range []string{kdir, edir} {
		if _, err := os.Stat(filepath.Join(d, "complete")); err != nil {
			return Binaries{}, fmt.Errorf("%s has no finished build (run scripts/setup-test.sh)", d)
		}
	}
	return Binaries{
		Etcd:      filepath.Join(edir, "etcd"),
		APIServer: filepath.Join(kdir, "kube-apiserver"),
		Kubelet:   filepath.Join(kdir, "kubelet"),
		Kubectl:   filepath.Join(kdir, "kubectl"),
	}, nil
}

// Options say what to start.
type Options struct {
	// CRIEndpoint is the kubelet's container runtime endpoint
	// (unix:///path). Empty: no kubelet, only etcd and the apiserver
	// (enough to validate manifests).
	CRIEndpoint string
	// StopCRI, when set, is called by Close after the kubelet has stopped
	// and before the cgroups are removed: the CRI's containers must be gone
	// for their cgroups to go.
	StopCRI func() error
	// CNIConfDir, when set, is the CRI's CNI configuration directory:
	// Start writes the pod network there (cni.go) before the kubelet
	// starts, so that the runtime reports its network ready and the node
	// becomes Ready. Close removes it.
	CNIConfDir string
	// CNIBinDir, when set, is the CRI's CNI plugin directory: Start links
	// the plugins the configuration uses there (built by
	// scripts/setup-test.sh).
	CNIBinDir string
	// Log receives one line per step with its duration (nil: none).
	Log func(format string, args ...any)
}

// Cluster is a running test cluster.
type Cluster struct {
	Dir        string // everything lives here; removed by Close
	Bin        Binaries
	Kubeconfig string // the admin's (group system:masters)
	Server     string // https://127.0.0.1:port

	opts    Options
	etcdURL string
	lock    *os.File
	pki     *pki
	http    *http.Client
	procs   []*proc // start order
	kubelet *proc
	closed  bool
}

// Start starts etcd, the apiserver and (with opts.CRIEndpoint) the kubelet,
// and returns once the node has registered. On error everything started is
// stopped and cleaned.
func Start(ctx context.Context, opts Options) (c *Cluster, err error) {
	bin, err := FindBinaries()
	if err != nil {
		return nil, err
	}
	if opts.Log == nil {
		opts.Log = func(string, ...any) {}
	}
	Sweep()
	dir, err := os.MkdirTemp("", dirPrefix)
	if err != nil {
		return nil, err
	}
	c = &Cluster{Dir: dir, Bin: bin, opts: opts}
	defer func() {
		if err != nil {
			err = errors.Join(err, c.Close())
			c = nil
		}
	}()
	// The lock says a live process owns dir; Sweep cleans only dirs whose
	// lock it can take. O_CLOEXEC (Go's default) keeps it from children.
	if c.lock, err = os.OpenFile(filepath.Join(dir, "lock"), os.O_CREATE|os.O_RDWR, 0o600); err != nil {
		return c, err
	}
	if err := unix.Flock(int(c.lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return c, err
	}
	t0 := time.Now()
	if err := c.writePKI(); err != nil {
		return c, fmt.Errorf("pki: %w", err)
	}
	opts.Log("kubetest: pki %v", time.Since(t0).Round(time.Millisecond))
	t0 = time.Now()
	if err := c.startEtcd(ctx); err != nil {
		return c, err
	}
	opts.Log("kubetest: etcd ready %v", time.Since(t0).Round(time.Millisecond))
	t0 = time.Now()
	if err := c.startAPIServer(ctx); err != nil {
		return c, err
	}
	opts.Log("kubetest: kube-apiserver ready %v", time.Since(t0).Round(time.Millisecond))
	if c.Kubeconfig, err = c.kubeconfig("admin", c.pkiFile("admin.crt"), c.pkiFile("admin.key")); err != nil {
		return c, err
	}
	t0 = time.Now()
	for _, ns := range []string{"default", "kube-system"} {
		if err := c.PrepareNamespace(ctx, ns); err != nil {
			return c, err
		}
	}
	opts.Log("kubetest: namespaces prepared %v", time.Since(t0).Round(time.Millisecond))
	if opts.CRIEndpoint == "" {
		return c, nil
	}
	t0 = time.Now()
	if err := c.startKubelet(ctx); err != nil {
		return c, err
	}
	opts.Log("kubetest: node %s registered %v", NodeName, time.Since(t0).Round(time.Millisecond))
	return c, nil
}

const dirPrefix = "space-kubetest-"

// id is what names this cluster's host objects (its cgroup root).
func (c *Cluster) id() string { return filepath.Base(c.Dir) }

func (c *Cluster) writePKI() error {
	p, err := newPKI(filepath.Join(c.Dir, "pki"))
	if err != nil {
		return err
	}
	c.pki = p
	specs := []certSpec{
		{file: "apiserver", cn: "kube-apiserver", server: true},
		{file: "admin", cn: "kubetest-admin", groups: []string{"system:masters"}},
		{file: "apiserver-kubelet-client", cn: "kube-apiserver-kubelet-client", groups: []string{"system:masters"}},
		{file: "kubelet-client", cn: "system:node:" + NodeName, groups: []string{"system:nodes"}},
		{file: "kubelet", cn: NodeName, server: true},
	}
	for _, s := range specs {
		if _, _, err := p.issue(s); err != nil {
			return err
		}
	}
	if _, _, err := p.serviceAccountKey(); err != nil {
		return err
	}
	cert, err := tls.LoadX509KeyPair(c.pkiFile("admin.crt"), c.pkiFile("admin.key"))
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AddCert(p.ca)
	c.http = &http.Client{
		Timeout: 30 * time.Second,
		Transport: &http.Transport{
			TLSClientConfig: &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool},
			// Only ever 127.0.0.1: no proxy from the environment.
			Proxy: nil,
		},
	}
	return nil
}

func (c *Cluster) pkiFile(name string) string { return filepath.Join(c.Dir, "pki", name) }

// freePort returns a port free on 127.0.0.1 now (the component binds it a
// moment later; nothing else on this machine hands out ports in that range
// at that rate).
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func (c *Cluster) startEtcd(ctx context.Context) error {
	cport, err := freePort()
	if err != nil {
		return err
	}
	pport, err := freePort()
	if err != nil {
		return err
	}
	client := fmt.Sprintf("http://127.0.0.1:%d", cport)
	peer := fmt.Sprintf("http://127.0.0.1:%d", pport)
	p, err := c.start("etcd", c.Bin.Etcd, "",
		"--name=kubetest",
		"--data-dir="+filepath.Join(c.Dir, "etcd"),
		"--listen-client-urls="+client, "--advertise-client-urls="+client,
		"--listen-peer-urls="+peer, "--initial-advertise-peer-urls="+peer,
		"--initial-cluster=kubetest="+peer,
		"--unsafe-no-fsync", // test data: fsync only costs time
		"--log-level=warn",
	)
	if err != nil {
		return err
	}
	c.etcdURL = client
	return c.waitFor(ctx, p, 30*time.Second, "etcd /health", func() error {
		resp, err := (&http.Client{Timeout: time.Second, Transport: &http.Transport{Proxy: nil}}).Get(client + "/health")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 || !bytes.Contains(b, []byte(`"health":"true"`)) {
			return fmt.Errorf("%s: %s", resp.Status, b)
		}
		return nil
	})
}

func (c *Cluster) startAPIServer(ctx context.Context) error {
	port, err := freePort()
	if err != nil {
		return err
	}
	c.Server = fmt.Sprintf("https://127.0.0.1:%d", port)
	p, err := c.start("kube-apiserver", c.Bin.APIServer, "",
		"--etcd-servers="+c.etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
		"--secure-port="+strconv.Itoa(port),
		"--cert-dir="+filepath.Join(c.Dir, "apiserver"),
		"--tls-cert-file="+c.pkiFile("apiserver.crt"), "--tls-private-key-file="+c.pkiFile("apiserver.key"),
		"--client-ca-file="+c.pki.CAFile,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+c.pkiFile("sa.pub"),
		"--service-account-signing-key-file="+c.pkiFile("sa.key"),
		"--service-cluster-ip-range=10.96.0.0/24",
		"--authorization-mode=Node,RBAC",
		"--allow-privileged=true",
		// The kubelet is reached at its node's Hostname address, which
		// is localhost (answered by /etc/hosts): never the VM's own
		// address, never a name for the host resolver.
		"--kubelet-preferred-address-types=Hostname",
		"--kubelet-client-certificate="+c.pkiFile("apiserver-kubelet-client.crt"),
		"--kubelet-client-key="+c.pkiFile("apiserver-kubelet-client.key"),
		"--kubelet-certificate-authority="+c.pki.CAFile,
		// The default reconciler refuses a loopback advertise address.
		"--endpoint-reconciler-type=none",
		"--profiling=false",
		"--v=1",
	)
	if err != nil {
		return err
	}
	return c.waitFor(ctx, p, 60*time.Second, "kube-apiserver /readyz", func() error {
		_, err := c.do(ctx, "GET", "/readyz", nil)
		return err
	})
}

// kubeconfig writes a kubeconfig for the given client certificate.
func (c *Cluster) kubeconfig(name, cert, key string) (string, error) {
	path := filepath.Join(c.Dir, name+".kubeconfig")
	body := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: kubetest
  cluster:
    server: %s
    certificate-authority: %s
users:
- name: %s
  user:
    client-certificate: %s
    client-key: %s
contexts:
- name: kubetest
  context: {cluster: kubetest, user: %s}
current-context: kubetest
`, c.Server, c.pki.CAFile, name, cert, key, name)
	return path, os.WriteFile(path, []byte(body), 0o600)
}

func (c *Cluster) startKubelet(ctx context.Context) error {
	kc, err := c.kubeconfig("kubelet", c.pkiFile("kubelet-client.crt"), c.pkiFile("kubelet-client.key"))
	if err != nil {
		return err
	}
	if err := c.takeNodeState(); err != nil {
		return err
	}
	if c.opts.CNIConfDir != "" {
		if err := c.writeCNIConfig(); err != nil {
			return fmt.Errorf("cni: %w", err)
		}
	}
	port, err := freePort()
	if err != nil {
		return err
	}
	// Pods' resolv.conf: only this machine. (A space sandbox has its own
	// resolver from space's network gateway; this is the pod's.)
	resolv := filepath.Join(c.Dir, "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver 127.0.0.1\n"), 0o644); err != nil {
		return err
	}
	cfg := map[string]any{
		"apiVersion":               "kubelet.config.k8s.io/v1beta1",
		"kind":                     "KubeletConfiguration",
		"containerRuntimeEndpoint": c.opts.CRIEndpoint,
		// No systemd here; cgroup v1 (hybrid), which 1.37 refuses unless told.
		"cgroupDriver": "cgroupfs",
		"failCgroupV1": false,
		// A root of this cluster's own, so its cgroups are one subtree to
		// remove and never meet another kubelet's kubepods.
		"cgroupRoot":         "/" + c.id(),
		"failSwapOn":         false,
		"podLogsDir":         filepath.Join(c.Dir, "pod-logs"),
		"resolvConf":         resolv,
		"address":            "127.0.0.1",
		"port":               port,
		"readOnlyPort":       0,
		"healthzBindAddress": "127.0.0.1",
		"healthzPort":        0,
		"tlsCertFile":        c.pkiFile("kubelet.crt"),
		"tlsPrivateKeyFile":  c.pkiFile("kubelet.key"),
		"authentication": map[string]any{
			"anonymous": map[string]any{"enabled": false},
			"webhook":   map[string]any{"enabled": true},
			"x509":      map[string]any{"clientCAFile": c.pki.CAFile},
		},
		"authorization": map[string]any{"mode": "Webhook"},
		// The images are imported, never pulled: never collect them.
		"imageGCHighThresholdPercent": 100,
		"imageGCLowThresholdPercent":  99,
		// A test machine's disk may be fuller than a node's: no evictions.
		"evictionHard":       map[string]string{"memory.available": "0%", "nodefs.available": "0%", "imagefs.available": "0%"},
		"rotateCertificates": false,
		"serverTLSBootstrap": false,
		"registerNode":       true,
		"fileCheckFrequency": "1s",
		"syncFrequency":      "5s",
	}
	b, err := json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		return err
	}
	cfgFile := filepath.Join(c.Dir, "kubelet.json")
	if err := os.WriteFile(cfgFile, b, 0o600); err != nil {
		return err
	}
	noFirewall, err := c.noFirewall()
	if err != nil {
		return err
	}
	p, err := c.start("kubelet", c.Bin.Kubelet, noFirewall,
		"--config="+cfgFile,
		"--kubeconfig="+kc,
		"--root-dir="+filepath.Join(c.Dir, "kubelet"),
		"--hostname-override="+NodeName,
		"--v=1",
	)
	if err != nil {
		return err
	}
	c.kubelet = p
	return c.waitFor(ctx, p, 60*time.Second, "node "+NodeName+" registered", func() error {
		_, err := c.do(ctx, "GET", "/api/v1/nodes/"+NodeName, nil)
		return err
	})
}

// firewallTools are what the kubelet runs to keep its own chains in the
// host's firewall (KUBE-FIREWALL, which drops packets to 127.0.0.0/8 from
// elsewhere, KUBE-KUBELET-CANARY, KUBE-IPTABLES-HINT); its pods need none
// of them here (no kube-proxy, no host ports).
var firewallTools = []string{"iptables", "ip6tables", "iptables-save", "ip6tables-save", "iptables-restore", "ip6tables-restore"}

// noFirewall makes a directory of stand-ins for firewallTools that fail,
// put first on the kubelet's PATH: whether or not this machine has
// iptables, the kubelet leaves its firewall alone (it logs the failure and
// carries on, as on a host without iptables).
func (c *Cluster) noFirewall() (string, error) {
	dir := filepath.Join(c.Dir, "no-firewall")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	for _, t := range firewallTools {
		script := "#!/bin/sh\necho \"kubetest: the kubelet may not change this machine's firewall\" >&2\nexit 1\n"
		if err := os.WriteFile(filepath.Join(dir, t), []byte(script), 0o755); err != nil {
			return "", err
		}
	}
	return dir, nil
}

// WaitNodeReady waits until the node's Ready condition is True.
func (c *Cluster) WaitNodeReady(ctx context.Context, timeout time.Duration) error {
	return c.waitFor(ctx, c.kubelet, timeout, "node "+NodeName+" Ready", func() error {
		b, err := c.do(ctx, "GET", "/api/v1/nodes/"+NodeName, nil)
		if err != nil {
			return err
		}
		var n struct {
			Status struct {
				Conditions []struct{ Type, Status, Reason, Message string }
			}
		}
		if err := json.Unmarshal(b, &n); err != nil {
			return err
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == "Ready" {
				if cond.Status == "True" {
					return nil
				}
				return fmt.Errorf("condition Ready=%s: %s: %s", cond.Status, cond.Reason, cond.Message)
			}
		}
		return errors.New("no Ready condition yet")
	})
}

// PrepareNamespace creates namespace ns if needed and what the absent
// controller-manager would put in it: the default service account and the
// kube-root-ca.crt config map that every pod's token volume projects.
func (c *Cluster) PrepareNamespace(ctx context.Context, ns string) error {
	ca, err := os.ReadFile(c.pki.CAFile)
	if err != nil {
		return err
	}
	objs := []struct {
		path string
		obj  map[string]any
	}{
		{"/api/v1/namespaces", map[string]any{"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": ns}}},
		{"/api/v1/namespaces/" + ns + "/serviceaccounts", map[string]any{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": map[string]any{"name": "default"}}},
		{"/api/v1/namespaces/" + ns + "/configmaps", map[string]any{"apiVersion": "v1", "kind": "ConfigMap", "metadata": map[string]any{"name": "kube-root-ca.crt"}, "data": map[string]string{"ca.crt": string(ca)}}},
	}
	for _, o := range objs {
		body, err := json.Marshal(o.obj)
		if err != nil {
			return err
		}
		// The apiserver makes default and kube-system itself, shortly
		// after it is ready: a create that races it conflicts, and one
		// into a namespace not there yet is retried.
		err = c.waitFor(ctx, nil, 30*time.Second, "create "+o.path, func() error {
			_, err := c.do(ctx, "POST", o.path, body)
			var se *statusError
			if errors.As(err, &se) && se.code == http.StatusConflict {
				return nil
			}
			return err
		})
		if err != nil {
			return err
		}
	}
	return nil
}

type statusError struct {
	code int
	body string
}

func (e *statusError) Error() string { return fmt.Sprintf("HTTP %d: %s", e.code, e.body) }

// do sends one request to the apiserver as the admin.
func (c *Cluster) do(ctx context.Context, method, path string, body []byte) ([]byte, error) {
	var r io.Reader
	if body != nil {
		r = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.Server+path, r)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 != 2 {
		return nil, &statusError{code: resp.StatusCode, body: strings.TrimSpace(string(b))}
	}
	return b, nil
}

// Kubectl runs kubectl against the cluster and returns its stdout; a
// failure carries its stderr.
func (c *Cluster) Kubectl(ctx context.Context, args ...string) (string, error) {
	cmd := c.KubectlCmd(ctx, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

// KubectlCmd is kubectl with the admin kubeconfig and a cache directory of
// the cluster's own (never ~/.kube), for callers that wire its streams.
func (c *Cluster) KubectlCmd(ctx context.Context, args ...string) *exec.Cmd {
	all := append([]string{"--kubeconfig=" + c.Kubeconfig, "--cache-dir=" + filepath.Join(c.Dir, "kubectl-cache")}, args...)
	cmd := exec.CommandContext(ctx, c.Bin.Kubectl, all...)
	cmd.Env = append(os.Environ(), "HOME="+filepath.Join(c.Dir, "home"), "KUBECONFIG=", "HTTPS_PROXY=", "https_proxy=", "NO_PROXY=", "no_proxy=")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// LogTail returns the last n bytes of a component's log (etcd,
// kube-apiserver, kubelet).
func (c *Cluster) LogTail(name string, n int64) string {
	f, err := os.Open(filepath.Join(c.Dir, name+".log"))
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > n {
		f.Seek(st.Size()-n, io.SeekStart)
	}
	b, _ := io.ReadAll(f)
	return string(b)
}
