package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/server"
)

// TestE2BBench: the same work through E2B's JS SDK (unmodified, against
// /e2b) and through space's Go SDK, in one run on one server, default
// runtime: create → first command output, a `true` command's round trip,
// and a 1 MiB file written and read back. E2B's SDK runs every command as
// `/bin/bash -l -c CMD` in a command session, so the Go side runs the same
// argv through a command session too (create, attach, wait for exit) and,
// for reference, through the one-shot exec. Numbers in docs/BENCHMARKS.md.
func TestE2BBench(t *testing.T) {
	requireBench(t)
	_, c, _ := serve(t, server.NetworkOptions{})
	l := c.BaseURL
	n := 50
	if v, err := strconv.Atoi(os.Getenv("BENCH_N")); err == nil && v > 0 {
		n = v
	}
	ctx := context.Background()
	bash := []string{"/bin/bash", "-l", "-c", "true"}
	session := func(id string) error {
		st, err := c.Run(ctx, id, api.ExecRequest{Cmd: bash, User: "user"}, io.Discard, io.Discard)
		if err == nil && st.ExitCode != 0 {
			err = fmt.Errorf("exit %d", st.ExitCode)
		}
		return err
	}
	var goCreate, goSession, goExec, goFile samples
	for i := 0; i < max(5, n/5); i++ {
		t0 := time.Now()
		sb, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if err := session(sb.ID); err != nil {
			t.Fatal(err)
		}
		goCreate = append(goCreate, time.Since(t0))
		if op, err := c.DeleteSandbox(ctx, sb.ID, true); err == nil {
			c.WaitOperation(ctx, op.ID)
		}
	}
	sb, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{})
	if err != nil {
		t.Fatal(err)
	}
	mib := bytes.Repeat([]byte{1, 2, 3, 4}, 1<<18)
	for i := 0; i < n; i++ {
		t0 := time.Now()
		if err := session(sb.ID); err != nil {
			t.Fatal(err)
		}
		goSession = append(goSession, time.Since(t0))
		t0 = time.Now()
		if _, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: bash, User: "user"}); err != nil {
			t.Fatal(err)
		}
		goExec = append(goExec, time.Since(t0))
		t0 = time.Now()
		if _, err := c.WriteFile(ctx, sb.ID, "/tmp/bench.bin", bytes.NewReader(mib), 0o644); err != nil {
			t.Fatal(err)
		}
		rc, err := c.ReadFile(ctx, sb.ID, "/tmp/bench.bin")
		if err != nil {
			t.Fatal(err)
		}
		var back bytes.Buffer
		back.ReadFrom(rc)
		rc.Close()
		goFile = append(goFile, time.Since(t0))
		if back.Len() != len(mib) {
			t.Fatalf("read %d bytes", back.Len())
		}
	}

	// The layer's own cost, without either SDK: the same Go HTTP client
	// writes and reads 1 MiB through envd's /files (as E2B's user, the
	// envd token) and through the native files API (as the same user).
	var sbInfo struct {
		Token string `json:"envdAccessToken"`
	}
	if err := getJSON(l+"/e2b/sandboxes/"+sb.ID, map[string]string{"X-API-KEY": c.APIKey}, &sbInfo); err != nil {
		t.Fatal(err)
	}
	envd := map[string]string{"E2b-Sandbox-Id": sb.ID, "X-Access-Token": sbInfo.Token}
	var rawE2B, rawE2BMultipart, rawNative samples
	for i := 0; i < n; i++ {
		t0 := time.Now()
		if err := roundTrip(http.MethodPost, l+"/e2b/envd/files?path=/tmp/raw-e2b.bin&username=user", envd, "application/octet-stream", mib); err != nil {
			t.Fatal(err)
		}
		if err := roundTrip(http.MethodGet, l+"/e2b/envd/files?path=/tmp/raw-e2b.bin&username=user", envd, "", nil); err != nil {
			t.Fatal(err)
		}
		rawE2B = append(rawE2B, time.Since(t0))
		body, ct := multipartBody(t, "/tmp/raw-mp.bin", mib)
		t0 = time.Now()
		if err := roundTrip(http.MethodPost, l+"/e2b/envd/files?username=user", envd, ct, body); err != nil {
			t.Fatal(err)
		}
		if err := roundTrip(http.MethodGet, l+"/e2b/envd/files?path=/tmp/raw-mp.bin&username=user", envd, "", nil); err != nil {
			t.Fatal(err)
		}
		rawE2BMultipart = append(rawE2BMultipart, time.Since(t0))
		bearer := map[string]string{"Authorization": "Bearer " + c.APIKey}
		t0 = time.Now()
		if err := roundTrip(http.MethodPut, l+"/v1/sandboxes/"+sb.ID+"/files?path=/tmp/raw-native.bin&user=user", bearer, "application/octet-stream", mib); err != nil {
			t.Fatal(err)
		}
		if err := roundTrip(http.MethodGet, l+"/v1/sandboxes/"+sb.ID+"/files?path=/tmp/raw-native.bin&user=user", bearer, "", nil); err != nil {
			t.Fatal(err)
		}
		rawNative = append(rawNative, time.Since(t0))
	}

	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatal("node is not on PATH")
	}
	_, file, _, _ := runtime.Caller(0)
	js := filepath.Join(filepath.Dir(file), "..", "e2e", "js")
	cmd := exec.Command(node, "bench/e2b-bench.mjs")
	cmd.Dir = js
	cmd.Env = append(os.Environ(), "BENCH_N="+strconv.Itoa(n),
		"E2B_API_URL="+l+"/e2b", "E2B_SANDBOX_URL="+l+"/e2b/envd", "E2B_API_KEY="+c.APIKey, "E2B_DOMAIN=localhost")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	outb, err := cmd.Output()
	if err != nil {
		t.Fatalf("node bench: %v\n%s", err, stderr.String())
	}
	var js2 map[string][]float64
	if err := json.Unmarshal(outb, &js2); err != nil {
		t.Fatalf("node bench output %q: %v", outb, err)
	}
	toSamples := func(v []float64) samples {
		var s samples
		for _, x := range v {
			s = append(s, time.Duration(x*float64(time.Millisecond)))
		}
		return s
	}
	row := func(name string, e2b, native samples) {
		fmt.Printf("%-34s e2b p50=%7.2fms p99=%7.2fms | space p50=%7.2fms p99=%7.2fms | ratio p50 %.2fx\n", name,
			ms(e2b.pct(0.5)), ms(e2b.pct(0.99)), ms(native.pct(0.5)), ms(native.pct(0.99)), ms(e2b.pct(0.5))/ms(native.pct(0.5)))
	}
	row("create → first output", toSamples(js2["create_first_output"]), goCreate)
	row("run true (session)", toSamples(js2["run_true"]), goSession)
	row("run true vs one-shot exec", toSamples(js2["run_true"]), goExec)
	row("1 MiB write+read", toSamples(js2["file_1mib"]), goFile)
	row("1 MiB, one Go client: envd octet", rawE2B, rawNative)
	row("1 MiB, one Go client: envd multipart", rawE2BMultipart, rawNative)
}

func roundTrip(method, url string, hdr map[string]string, contentType string, body []byte) error {
	req, err := http.NewRequest(method, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	n, _ := io.Copy(io.Discard, res.Body)
	if res.StatusCode/100 != 2 {
		return fmt.Errorf("%s %s: %d (%d bytes)", method, url, res.StatusCode, n)
	}
	return nil
}

func getJSON(url string, hdr map[string]string, v any) error {
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	for k, val := range hdr {
		req.Header.Set(k, val)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	if res.StatusCode != 200 {
		return fmt.Errorf("GET %s: %d", url, res.StatusCode)
	}
	return json.NewDecoder(res.Body).Decode(v)
}

func multipartBody(t *testing.T, dest string, data []byte) ([]byte, string) {
	var b bytes.Buffer
	mw := multipart.NewWriter(&b)
	fw, err := mw.CreateFormFile("file", dest)
	if err != nil {
		t.Fatal(err)
	}
	fw.Write(data)
	mw.Close()
	return b.Bytes(), mw.FormDataContentType()
}
