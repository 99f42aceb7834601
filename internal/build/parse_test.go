package build

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/spacehq/space/internal/errdefs"
)

func mustParse(t *testing.T, src string) *File {
	t.Helper()
	f, err := Parse(strings.NewReader(src))
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	return f
}

func TestParseInstructions(t *testing.T) {
	src := `# syntax=docker/dockerfile:1
# escape=\

# a comment
FROM base:latest AS build
LABEL org.opencontainers.image.title="ignored"
RUN apt-get update && \
    # a comment inside the instruction is dropped
    apt-get install -y curl
RUN --network=none ["make", "-j2"]
COPY --chown=1000:1000 src/ a.txt /app/
ADD ["x y.txt", "/opt/"]
ENV A=1 B="two words" C='$A'
ENV LEGACY some value
WORKDIR /app
USER 1000:1000
CMD ["python3", "-m", "http.server"]
START python3 -m http.server 8000
READY --timeout=30s --interval=250ms curl -fs localhost:8000
run echo lower-case keyword
`
	f := mustParse(t, src)
	type want struct {
		line  int
		cmd   string
		args  []string
		flags map[string]string
		json  bool
		raw   string
	}
	wants := []want{
		{5, "FROM", []string{"base:latest"}, nil, false, "base:latest AS build"},
		{7, "RUN", []string{"/bin/sh", "-c", "apt-get update &&     apt-get install -y curl"}, nil, false, ""},
		{10, "RUN", []string{"make", "-j2"}, map[string]string{"network": "none"}, true, ""},
		{11, "COPY", nil, map[string]string{"chown": "1000:1000"}, false, "src/ a.txt /app/"},
		{12, "ADD", []string{"x y.txt", "/opt/"}, nil, true, ""},
		{13, "ENV", nil, nil, false, `A=1 B="two words" C='$A'`},
		{14, "ENV", nil, nil, false, "LEGACY some value"},
		{15, "WORKDIR", nil, nil, false, "/app"},
		{16, "USER", nil, nil, false, "1000:1000"},
		{17, "CMD", []string{"python3", "-m", "http.server"}, nil, true, ""},
		{18, "START", []string{"/bin/sh", "-c", "python3 -m http.server 8000"}, nil, false, ""},
		{19, "READY", []string{"/bin/sh", "-c", "curl -fs localhost:8000"}, map[string]string{"timeout": "30s", "interval": "250ms"}, false, ""},
		{20, "RUN", []string{"/bin/sh", "-c", "echo lower-case keyword"}, nil, false, ""},
	}
	if len(f.Instructions) != len(wants) {
		for _, in := range f.Instructions {
			t.Logf("%+v", in)
		}
		t.Fatalf("%d instructions, want %d (LABEL dropped)", len(f.Instructions), len(wants))
	}
	for i, w := range wants {
		in := f.Instructions[i]
		if in.Line != w.line || in.Cmd != w.cmd || !reflect.DeepEqual(in.Args, w.args) || !reflect.DeepEqual(in.Flags, w.flags) || in.JSON != w.json {
			t.Errorf("instruction %d = {line %d %s %q %v json=%v}, want %+v", i, in.Line, in.Cmd, in.Args, in.Flags, in.JSON, w)
		}
		if w.raw != "" && in.Raw != w.raw {
			t.Errorf("instruction %d raw = %q, want %q", i, in.Raw, w.raw)
		}
	}
	if got := f.Instructions[1].Text; !strings.HasPrefix(got, "RUN apt-get update && ") {
		t.Errorf("Text = %q", got)
	}
}

func TestParseErrors(t *testing.T) {
	cases := []struct {
		name, src, want string
	}{
		{"empty", "# only a comment\n\n", "no instructions"},
		{"first not FROM", "\nRUN true\n", "line 2: the first instruction must be FROM"},
		{"scratch", "FROM scratch\n", "line 1: FROM: FROM scratch is not supported"},
		{"FROM two refs", "FROM a b\n", "line 1: FROM: FROM takes one template ref"},
		{"FROM platform", "FROM --platform=linux/arm64 base\n", "line 1: FROM --platform is not supported"},
		{"second FROM", "FROM base\nRUN true\nFROM base\n", "line 3: a second FROM: multi-stage builds are not supported"},
		{"unknown", "FROM base\n\nFROBNICATE x\n", "line 3: unknown instruction FROBNICATE"},
		{"ARG", "FROM base\nARG X=1\n", "line 2: ARG is not supported: build arguments are not supported; use ENV"},
		{"EXPOSE", "FROM base\nEXPOSE 80\n", "line 2: EXPOSE is not supported"},
		{"VOLUME", "FROM base\nVOLUME /data\n", "line 2: VOLUME is not supported"},
		{"ENTRYPOINT", "FROM base\nENTRYPOINT [\"x\"]\n", "line 2: ENTRYPOINT is not supported: use START"},
		{"HEALTHCHECK", "FROM base\nHEALTHCHECK CMD true\n", "line 2: HEALTHCHECK is not supported: use READY"},
		{"SHELL", "FROM base\nSHELL [\"bash\", \"-c\"]\n", "line 2: SHELL is not supported"},
		{"ONBUILD", "FROM base\nONBUILD RUN x\n", "line 2: ONBUILD is not supported"},
		{"STOPSIGNAL", "FROM base\nSTOPSIGNAL SIGTERM\n", "line 2: STOPSIGNAL is not supported"},
		{"MAINTAINER", "FROM base\nMAINTAINER me\n", "line 2: MAINTAINER is not supported"},
		{"ARG before FROM", "ARG V=1\nFROM base\n", "line 1: ARG is not supported"},
		{"RUN empty", "FROM base\nRUN\n", "line 2: RUN needs arguments"},
		{"RUN empty exec", "FROM base\nRUN []\n", "line 2: RUN: empty command"},
		{"RUN bad network", "FROM base\nRUN --network=bridge true\n", "line 2: RUN: --network=bridge: use none, default or host"},
		{"RUN mount", "FROM base\nRUN --mount=type=cache,target=/x true\n", "line 2: RUN --mount is not supported"},
		{"RUN heredoc", "FROM base\nRUN <<EOF\necho hi\nEOF\n", "line 2: heredocs are not supported"},
		{"RUN unknown flag", "FROM base\nRUN --frob true\n", "line 2: RUN does not take the flag --frob"},
		{"COPY one word", "FROM base\nCOPY onlyone\n", "line 2: COPY: COPY needs at least one source and a destination"},
		{"COPY from", "FROM base\nCOPY --from=build /a /b\n", "line 2: COPY --from is not supported: multi-stage builds"},
		{"COPY chmod", "FROM base\nCOPY --chmod=755 a /b\n", "line 2: COPY --chmod is not supported"},
		{"COPY chown name", "FROM base\nCOPY --chown=app a /b\n", "line 2: COPY: --chown=app: want numeric uid[:gid]"},
		{"COPY chown range", "FROM base\nCOPY --chown=70000 a /b\n", "line 2: COPY: --chown=70000: ids above 65535"},
		{"COPY twice flag", "FROM base\nCOPY --chown=1 --chown=2 a /b\n", "line 2: COPY --chown given twice"},
		{"COPY quote", "FROM base\nCOPY \"a /b\n", "line 2: COPY: unterminated \" quote"},
		{"ADD URL", "FROM base\nADD https://example.com/x.tgz /x\n", "line 2: ADD: ADD https://example.com/x.tgz: a URL source needs the network"},
		{"ENV no value", "FROM base\nENV ONLYNAME\n", "line 2: ENV: ENV ONLYNAME needs a value"},
		{"ENV not pair", "FROM base\nENV A=1 B\n", "line 2: ENV: \"B\" is not name=value"},
		{"ENV empty name", "FROM base\nENV =1\n", "line 2: ENV: ENV name is empty"},
		{"ENV digit name", "FROM base\nENV 1A=x\n", "line 2: ENV: ENV name \"1A\": use letters, digits and _"},
		{"ENV bad subst", "FROM base\nENV A=${B:?x}\n", "line 2: ENV: bad substitution"},
		{"ENV unterminated brace", "FROM base\nENV A=${B\n", "line 2: ENV: bad substitution"},
		{"USER two words", "FROM base\nUSER a b\n", "line 2: USER: USER takes one user[:group]"},
		{"WORKDIR quote", "FROM base\nWORKDIR '/a\n", "line 2: WORKDIR: unterminated ' quote"},
		{"READY bad timeout", "FROM base\nREADY --timeout=forever true\n", "line 2: READY: --timeout=forever"},
		{"READY fast interval", "FROM base\nREADY --interval=1ms true\n", "line 2: READY: --interval=1ms"},
		{"READY flag", "FROM base\nREADY --retries=3 true\n", "line 2: READY does not take the flag --retries"},
		{"CMD flag", "FROM base\nCMD --x y\n", "line 2: CMD does not take the flag --x"},
		{"escape directive", "# escape=`\nFROM base\n", "line 1: the escape directive is not supported"},
		{"continuation line counted", "FROM base\nRUN a \\\n  b\nNOPE\n", "line 4: unknown instruction NOPE"},
		{"NUL", "FROM base\nRUN a\x00\n", "line 2: not valid UTF-8"},
		{"latin1", "FROM base\n\nRUN caf\xe9\n", "line 3: not valid UTF-8"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse(strings.NewReader(c.src))
			if err == nil {
				t.Fatalf("no error, want %q", c.want)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q, want it to contain %q", err, c.want)
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("error %q does not wrap ErrInvalidArgument", err)
			}
		})
	}
}

func TestParseLimits(t *testing.T) {
	big := "FROM base\nRUN " + strings.Repeat("x", MaxFileBytes) + "\n"
	if _, err := Parse(strings.NewReader(big)); !errors.Is(err, errdefs.ErrTooLarge) {
		t.Errorf("oversized file: %v, want ErrTooLarge", err)
	}
	many := "FROM base\n" + strings.Repeat("ENV A=1\n", MaxInstructions)
	_, err := Parse(strings.NewReader(many))
	if !errors.Is(err, errdefs.ErrTooLarge) || !strings.Contains(err.Error(), "line 1001:") {
		t.Errorf("too many instructions: %v, want ErrTooLarge at line 1001", err)
	}
	ok := "FROM base\n" + strings.Repeat("ENV A=1\n", MaxInstructions-1)
	if _, err := Parse(strings.NewReader(ok)); err != nil {
		t.Errorf("%d instructions: %v", MaxInstructions, err)
	}
}

func TestParseContinuationAtEOF(t *testing.T) {
	f := mustParse(t, "FROM base\r\nRUN echo a \\\r\n\r\n  b \\")
	if got := f.Instructions[1].Args[2]; got != "echo a   b" {
		t.Errorf("RUN = %q", got)
	}
}

func TestShellFormWithBracketIsShell(t *testing.T) {
	f := mustParse(t, "FROM base\nRUN [ -f /etc/passwd ]\n")
	if in := f.Instructions[1]; in.JSON || in.Args[0] != "/bin/sh" {
		t.Errorf("RUN [ … ] parsed as %+v, want shell form", in)
	}
}

func TestExpandWord(t *testing.T) {
	env := mapLookup(map[string]string{"A": "1", "HOME": "/root", "SP": "a b", "EMPTY": ""})
	cases := []struct{ in, want string }{
		{"$A", "1"},
		{"${A}x", "1x"},
		{"$Ax", ""},
		{"$HOME/app", "/root/app"},
		{`\$A`, "$A"},
		{`'$A'`, "$A"},
		{`"$A b"`, "1 b"},
		{`"a\"b\\c\d"`, `a"b\c\d`},
		{"${UNSET:-def}", "def"},
		{"${EMPTY:-def}", "def"},
		{"${A:-def}", "1"},
		{"${A:+alt}", "alt"},
		{"${UNSET:+alt}", ""},
		{"${UNSET:-$HOME/x}", "/root/x"},
		{"$", "$"},
		{"a$", "a$"},
		{"$-x", "$-x"},
		{`a\ b`, "a b"},
		{"$SP", "a b"},
	}
	for _, c := range cases {
		got, err := expandWord(c.in, env)
		if err != nil || got != c.want {
			t.Errorf("expandWord(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
	for _, bad := range []string{"${}", "${A", "${A:?x}", "${A:-x", `"open`, "'open"} {
		if _, err := expandWord(bad, env); err == nil {
			t.Errorf("expandWord(%q): no error", bad)
		}
	}
}

func TestSplitWords(t *testing.T) {
	got, err := splitWords(`a "b c" 'd e'  f\ g "h\"i"`)
	want := []string{"a", `"b c"`, `'d e'`, `f\ g`, `"h\"i"`}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Errorf("splitWords = %q, %v; want %q", got, err, want)
	}
}

func TestParseEnv(t *testing.T) {
	env := mapLookup(map[string]string{"A": "old"})
	got, err := parseEnv(`A=new B=$A C="x y" D=${A}-z`, env)
	want := [][2]string{{"A", "new"}, {"B", "old"}, {"C", "x y"}, {"D", "old-z"}}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Errorf("parseEnv = %q, %v; want %q", got, err, want)
	}
	got, err = parseEnv(`GREETING hello "big" $A world`, env)
	want = [][2]string{{"GREETING", `hello big old world`}}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Errorf("legacy parseEnv = %q, %v; want %q", got, err, want)
	}
}

// TestNetworkAllowPrivate: NETWORK --allow-private lists the special
// ranges the template's names may lead into (allow_private), checked at
// parse time like the rest of the policy.
func TestNetworkAllowPrivate(t *testing.T) {
	f := mustParse(t, "FROM base\nNETWORK --allow-private=10.0.0.0/8,127.0.0.2 db.internal.example\n")
	p, err := f.Instructions[1].NetworkPolicy()
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(p.AllowPrivate, []string{"10.0.0.0/8", "127.0.0.2"}) || !reflect.DeepEqual(p.AllowOut, []string{"db.internal.example"}) {
		t.Fatalf("%+v", p)
	}
	for _, bad := range []string{"NETWORK --allow-private= a.example", "NETWORK --allow-private=8.8.8.0/24 a.example", "NETWORK --allow-private=db.example a.example"} {
		_, err := Parse(strings.NewReader("FROM base\n" + bad + "\n"))
		if err == nil || !strings.Contains(err.Error(), "line 2") {
			t.Errorf("%q: %v, want an error on line 2", bad, err)
		}
	}
}
