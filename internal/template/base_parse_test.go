package template

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/spacehq/space/internal/errdefs"
)

// Lines as debootstrap 1.0.128 prints them (trimmed from a real run).
var debootstrapOutput = `I: Target architecture can be executed
I: Retrieving InRelease
I: Checking Release signature
I: Valid Release signature (key id 4D64FEC119C2029067D6E791F8D2585B8783D481)
I: Retrieving Packages
I: Validating Packages
I: Resolving dependencies of required packages...
I: Resolving dependencies of base packages...
I: Checking component main on http://deb.debian.org/debian...
I: Retrieving adduser 3.134
I: Validating adduser 3.134
I: Retrieving apt 2.6.1
I: Validating apt 2.6.1
I: Retrieving base-files 12.4+deb12u11
I: Validating base-files 12.4+deb12u11
I: Chosen extractor for .deb packages: dpkg-deb
I: Extracting adduser...
I: Extracting base-files...
I: Installing required packages...
I: Unpacking required packages...
I: Unpacking adduser...
I: Unpacking apt...
I: Unpacking base-files...
I: Configuring required packages...
I: Configuring base-files...
I: Configuring adduser...
I: Configuring apt...
I: Base system installed successfully.
W: something the parser ignores
`

func TestDebootstrapParser(t *testing.T) {
	var got []Progress
	p := &debootstrapParser{emit: func(pr Progress) { got = append(got, pr) }}
	for _, line := range splitLines(debootstrapOutput) {
		p.line(line)
	}
	last := map[string]Progress{}
	for _, pr := range got {
		if pr.Total != 0 && pr.Done > pr.Total {
			t.Errorf("done > total: %+v", pr)
		}
		last[pr.Phase] = pr
	}
	want := map[string][2]int{ // phase -> final done, total
		PhaseRetrieve:  {3, 0},
		PhaseExtract:   {2, 3},
		PhaseUnpack:    {3, 3},
		PhaseConfigure: {3, 3},
	}
	for phase, w := range want {
		if l := last[phase]; l.Done != w[0] || l.Total != w[1] {
			t.Errorf("phase %s ended at %d/%d, want %d/%d", phase, l.Done, l.Total, w[0], w[1])
		}
	}
	// Validation lines stay in the retrieve phase instead of resetting it.
	for i, pr := range got {
		if pr.Message == "Validating apt 2.6.1" && pr.Phase != PhaseRetrieve {
			t.Errorf("event %d: %+v", i, pr)
		}
	}
	if l := got[len(got)-1]; l.Message != "Base system installed successfully." {
		t.Errorf("last event %+v", l)
	}
}

func splitLines(s string) []string {
	var out []string
	start := 0
	for i := 0; i < len(s); i++ {
		if s[i] == '\n' {
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return out
}

func TestDebianMirror(t *testing.T) {
	t.Setenv("SPACE_DEBIAN_MIRROR", "")
	write := func(dir, name, text string) {
		t.Helper()
		p := filepath.Join(dir, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// deb822 with a security suite first, a disabled stanza, and a
	// disabled-by-rename file that must be ignored.
	d1 := t.TempDir()
	write(d1, "sources.list.d/debian.sources", `Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main

Types: deb
URIs: http://disabled.example/debian
Suites: bookworm
Enabled: no

# comment
Types: deb-src deb
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
`)
	write(d1, "sources.list.d/other.list.disabled-by-farm", "deb http://wrong.example/debian bookworm main\n")
	// One-line format with options and a comment; sources.list wins by order.
	d2 := t.TempDir()
	write(d2, "sources.list", `# deb http://commented.example/debian bookworm main
deb-src http://src.example/debian bookworm main
deb [arch=amd64 signed-by=/k.gpg] http://one.example/debian bookworm main contrib # trailing
`)
	write(d2, "sources.list.d/x.sources", "Types: deb\nURIs: http://later.example/debian\nSuites: bookworm\n")
	d3 := t.TempDir()
	write(d3, "sources.list", "deb http://x.example/debian trixie main\n")

	for dir, want := range map[string]string{d1: "http://mirror.example/debian", d2: "http://one.example/debian"} {
		got, err := debianMirror(dir)
		if err != nil || got != want {
			t.Errorf("debianMirror(%s) = %q, %v; want %q", dir, got, err, want)
		}
	}
	if _, err := debianMirror(d3); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("no bookworm source: %v", err)
	}
	t.Setenv("SPACE_DEBIAN_MIRROR", "http://override.example/debian")
	if got, _ := debianMirror(d3); got != "http://override.example/debian" {
		t.Errorf("override: %q", got)
	}
}
