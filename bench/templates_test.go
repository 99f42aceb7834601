package bench

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// These run only with SPACE_BENCH=1 (`make bench`): each takes tens of
// seconds and the numbers only mean something on a quiet machine.
func requireBench(t *testing.T) {
	if os.Getenv("SPACE_BENCH") == "" {
		t.Skip("benchmark: set SPACE_BENCH=1 (make bench)")
	}
}

func printSamples(name string, s samples) {
	fmt.Printf("%-34s n=%d p50=%.1fms p99=%.1fms\n", name, len(s), ms(s.pct(0.5)), ms(s.pct(0.99)))
}

// randomLayer is a layer of n files of size bytes of incompressible data.
func randomLayer(t *testing.T, dir string, n, size int) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir + "/", Mode: 0o755})
	data := make([]byte, size)
	for i := 0; i < n; i++ {
		rand.Read(data)
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("%s/f%03d", dir, i), Mode: 0o644, Size: int64(size)})
		tw.Write(data)
	}
	tw.Close()
	b := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestTemplateImportOCI100MB imports a ~100 MB `docker save` image (4
// layers of incompressible files) through the API.
func TestTemplateImportOCI100MB(t *testing.T) {
	requireBench(t)
	h := start(t)
	ctx := context.Background()
	img := empty.Image
	var err error
	for i := 0; i < 4; i++ {
		if img, err = mutate.AppendLayers(img, randomLayer(t, fmt.Sprintf("data%d", i), 25, 1<<20)); err != nil {
			t.Fatal(err)
		}
	}
	file := filepath.Join(t.TempDir(), "image.tar")
	ref, _ := name.ParseReference("bench/big:1")
	if err := tarball.WriteToFile(file, ref, img); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(file)
	var s samples
	for i := 0; i < 5; i++ {
		f, err := os.Open(file)
		if err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		tpl, err := h.client.ImportOCI(ctx, f, "big:1")
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		s = append(s, time.Since(t0))
		if i == 0 {
			fmt.Printf("imported %s (%d MB archive, %d MB content)\n", tpl.Digest[:19], fi.Size()>>20, tpl.SizeBytes>>20)
		}
	}
	printSamples("import_oci_100MB", s)
}

const fiveSteps = `FROM base:latest
RUN echo one > /one && mkdir -p /app
COPY input.txt /app/input.txt
ENV GREETING=hello
RUN sh -c 'echo "$GREETING" > /app/greeting; wc -c /app/input.txt > /app/size'
WORKDIR /app
`

// TestTemplateBuildCached builds a 5-step build file from scratch (no
// cache) and then again fully cached.
func TestTemplateBuildCached(t *testing.T) {
	requireBench(t)
	h := start(t)
	ctx := context.Background()
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte(fiveSteps), 0o644)
	os.WriteFile(filepath.Join(dir, "input.txt"), bytes.Repeat([]byte("x"), 1<<20), 0o644)
	var first, cached samples
	var digest string
	for i := 0; i < 3; i++ {
		t0 := time.Now()
		tpl, err := h.client.BuildTemplate(ctx, dir, sdk.BuildOptions{Tags: []string{"five:1"}, NoCache: true}, nil)
		if err != nil {
			t.Fatal(err)
		}
		first = append(first, time.Since(t0))
		digest = tpl.Digest
		for j := 0; j < 5; j++ {
			hits := 0
			t0 = time.Now()
			tpl, err := h.client.BuildTemplate(ctx, dir, sdk.BuildOptions{Tags: []string{"five:1"}}, func(ev api.BuildEvent) {
				if ev.Status == "cached" {
					hits++
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			cached = append(cached, time.Since(t0))
			if tpl.Digest != digest || hits != 5 {
				t.Fatalf("cached rebuild: digest %s (want %s), %d cache hits of 5", tpl.Digest, digest, hits)
			}
		}
	}
	printSamples("build_5_steps_first", first)
	printSamples("build_5_steps_cached", cached)
}

// TestCreateTimeBySize creates sandboxes from base (~280 MB) and from base
// plus 1 GiB of files, interleaved: creation must not copy the template.
func TestCreateTimeBySize(t *testing.T) {
	requireBench(t)
	h := start(t)
	ctx := context.Background()
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte(`FROM base:latest
RUN mkdir /big && for i in $(seq 1 64); do head -c 16777216 /dev/urandom > /big/f$i; done
`), 0o644)
	t0 := time.Now()
	big, err := h.client.BuildTemplate(ctx, dir, sdk.BuildOptions{Tags: []string{"big:1"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	base, err := h.client.GetTemplate(ctx, "base:latest")
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("built big:1 (%d MB) in %s; base is %d MB\n", big.SizeBytes>>20, time.Since(t0).Round(time.Millisecond), base.SizeBytes>>20)
	create := func(ref string) time.Duration {
		t0 := time.Now()
		sb, err := h.client.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Template: ref, Runtime: "native"})
		if err != nil {
			t.Fatal(err)
		}
		res, err := h.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"true"}})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("exec: %v %+v", err, res)
		}
		d := time.Since(t0)
		if op, err := h.client.DeleteSandbox(ctx, sb.ID, true); err == nil {
			h.client.WaitOperation(ctx, op.ID)
		}
		return d
	}
	// The first sandbox of each must already be fast: the server derived
	// the runtime's copy when the template was built.
	firstSmall, firstBig := create("base:latest"), create("big:1")
	fmt.Printf("first create: base %.1fms, big %.1fms\n", ms(firstSmall), ms(firstBig))
	var small, large samples
	for i := 0; i < 30; i++ {
		small = append(small, create("base:latest"))
		large = append(large, create("big:1"))
	}
	printSamples("create_small_template", small)
	printSamples("create_1GiB_template", large)
	fmt.Printf("1 GiB / small (p50): %.2fx\n", ms(large.pct(0.5))/ms(small.pct(0.5)))
	if !strings.HasPrefix(big.Digest, "sha256:") {
		t.Fatal(big.Digest)
	}
}
