package bench

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clustertls"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/internal/testenv/pgtest"
	"github.com/spacehq/space/sdk"
)

// TestClusterBench is issue 15's cluster numbers, on this machine with a
// real PostgreSQL, two `space node` processes and two replicas
// (`space server --store`), native sandboxes:
//   - create (waiting for it to run) then exec `true`, SPACE_BENCH_N times
//     (default 50) straight to a node's own API and through a replica that
//     proxies to a node, interleaved, p50/p99 and the ratio;
//   - creates per second: 4 clients per replica creating (and deleting)
//     sandboxes for 20 s through both replicas onto both nodes.
func TestClusterBench(t *testing.T) {
	if os.Getenv("SPACE_BENCH") == "" {
		t.Skip("benchmark: set SPACE_BENCH=1 (make bench)")
	}
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	n := 50
	if s := os.Getenv("SPACE_BENCH_N"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v <= 0 {
			t.Fatalf("SPACE_BENCH_N=%q", s)
		}
		n = v
	}
	ctx := context.Background()
	root, err := os.MkdirTemp("", "clb-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(root)
	bin := filepath.Join(root, "space-server")
	if out, err := exec.Command("go", "build", "-o", bin, "../cmd/space-server").CombinedOutput(); err != nil {
		t.Fatalf("build space-server: %v\n%s", err, out)
	}
	dsn := pgtest.Shared(t).NewDatabase(t)
	certs := filepath.Join(root, "certs")
	if err := clustertls.NewCA(certs, time.Hour); err != nil {
		t.Fatal(err)
	}
	tlsArgs := func(role, name string) []string {
		out := filepath.Join(certs, name)
		var hosts []string
		if role == clustertls.RoleNode {
			hosts = []string{"127.0.0.1"}
		}
		if err := clustertls.Issue(certs, role, name, hosts, out, time.Hour); err != nil {
			t.Fatal(err)
		}
		return []string{"--cluster-ca", filepath.Join(certs, clustertls.CACertFile), "--cluster-cert", out + ".crt", "--cluster-key", out + ".key"}
	}
	var procs []*exec.Cmd
	defer func() {
		for i := len(procs) - 1; i >= 0; i-- {
			procs[i].Process.Signal(syscall.SIGTERM)
			procs[i].Wait()
		}
	}()
	run := func(name string, args ...string) string {
		addr := freeAddr(t)
		data := filepath.Join(root, name)
		args = append(args, "--data", data, "--listen", addr, "--cache", testenv.CacheDir(), "--pool-default", "0",
			"--dns-upstream", "127.0.0.1:9", "--egress-dial-guard", "loopback")
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "SPACE_AGENT_BIN="+testenv.AgentBinary(t), "SPACE_JAIL_BIN="+testenv.JailBinary(t),
			"SPACE_GATEWAY_BIN="+testenv.GatewayBinary(t))
		log, _ := os.Create(data + ".log")
		cmd.Stdout, cmd.Stderr = log, log
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		procs = append(procs, cmd)
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if resp, err := http.Get("http://" + addr + "/healthz"); err == nil {
				resp.Body.Close()
				return "http://" + addr
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s did not come up; see %s.log", name, data)
			}
		}
	}
	key := func(name string) string {
		b, err := os.ReadFile(filepath.Join(root, name, "api-key"))
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	var nodes []*sdk.Client
	for _, name := range []string{"n1", "n2"} {
		url := run(name, append([]string{"node", "--cluster-store", dsn, "--node-id", name, "--cluster-listen", freeAddr(t)}, tlsArgs(clustertls.RoleNode, name)...)...)
		c, _ := sdk.New(url, key(name))
		nodes = append(nodes, c)
	}
	r1 := run("r1", append([]string{"server", "--store", dsn}, tlsArgs(clustertls.RoleReplica, "r1")...)...)
	r2 := run("r2", append([]string{"server", "--store", dsn}, tlsArgs(clustertls.RoleReplica, "r2")...)...)
	replicas := []*sdk.Client{}
	for _, u := range []string{r1, r2} {
		c, _ := sdk.New(u, key("r1"))
		replicas = append(replicas, c)
	}
	round := func(c *sdk.Client) (time.Duration, error) {
		t0 := time.Now()
		sb, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
		if err != nil {
			return 0, err
		}
		res, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"true"}})
		d := time.Since(t0)
		if op, derr := c.DeleteSandbox(ctx, sb.ID, true); derr == nil {
			c.WaitOperation(ctx, op.ID)
		}
		if err == nil && res.ExitCode != 0 {
			err = fmt.Errorf("exit %d", res.ExitCode)
		}
		return d, err
	}
	// Warm both nodes' base template.
	for _, c := range nodes {
		if _, err := round(c); err != nil {
			t.Fatal(err)
		}
	}
	var direct, proxied samples
	for i := 0; i < n; i++ {
		d, err := round(nodes[i%2])
		if err != nil {
			t.Fatal(err)
		}
		direct = append(direct, d)
		if d, err = round(replicas[i%2]); err != nil {
			t.Fatal(err)
		}
		proxied = append(proxied, d)
	}
	line := func(name string, s samples) {
		fmt.Printf("%-44s n=%d p50=%.2fms p99=%.2fms\n", name, len(s), ms(s.pct(0.5)), ms(s.pct(0.99)))
	}
	line("create+exec, node's own API", direct)
	line("create+exec, through a replica (proxied)", proxied)
	fmt.Printf("%-44s p50 ×%.2f\n", "replica / direct", float64(proxied.pct(0.5))/float64(direct.pct(0.5)))

	// Throughput: 4 clients per replica for 20 s.
	var mu sync.Mutex
	var lat samples
	var errs int
	deadline := time.Now().Add(20 * time.Second)
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := replicas[w%2]
			for time.Now().Before(deadline) {
				t0 := time.Now()
				sb, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
				d := time.Since(t0)
				mu.Lock()
				if err != nil {
					errs++
				} else {
					lat = append(lat, d)
				}
				mu.Unlock()
				if err == nil {
					if op, err := c.DeleteSandbox(ctx, sb.ID, true); err == nil {
						c.WaitOperation(ctx, op.ID)
					}
				}
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	line("create (8 clients, 2 replicas, 2 nodes)", lat)
	fmt.Printf("%-44s %.1f creates/s (%d in %.1fs, %d errors; each client also deletes its sandbox)\n", "throughput", float64(len(lat))/el.Seconds(), len(lat), el.Seconds(), errs)
	if errs > 0 {
		t.Errorf("%d creates failed", errs)
	}
}

func freeAddr(t testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func TestMain(m *testing.M) {
	code := m.Run()
	pgtest.StopShared()
	os.Exit(code)
}
