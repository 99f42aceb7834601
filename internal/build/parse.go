package build

import (
	"bytes"
	"encoding/json"
	"fmt"
	"github.com/spacehq/space/api"
	"io"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/netpolicy"
)

// Limits on a build file.
const (
	MaxFileBytes    = 1 << 20
	MaxInstructions = 1000
)

// File is a parsed build file: a Dockerfile subset.
//
// Supported: FROM (a template ref, first and only once), RUN, COPY, ADD of
// local files, ENV, WORKDIR, USER and CMD, plus two extensions: START (the
// same as CMD: the command a sandbox starts with) and READY (the command
// that tells when the started program is ready). LABEL is accepted and
// ignored (it is not kept in File). The other Dockerfile instructions are
// errors that say what to use instead.
type File struct {
	Instructions []Instruction // FROM first
}

// Instruction is one instruction of a build file.
type Instruction struct {
	Line  int               // 1-based line the instruction starts on
	Cmd   string            // keyword in upper case: "RUN"
	Flags map[string]string // "--name=value" flags (value "" for "--name")
	// Raw is the text after the keyword and flags, continuation lines
	// joined. Variables in it are expanded when the build runs (the
	// template's environment is only known then).
	Raw string
	// Args is, for RUN, CMD, START and READY, the command: the exec form's
	// JSON array or ["/bin/sh", "-c", Raw]; for FROM, the template ref; for
	// COPY and ADD in exec form, the JSON array. Otherwise nil.
	Args []string
	JSON bool   // written in exec (JSON array) form
	Text string // the instruction as written, on one line
}

// unsupported says why a Dockerfile instruction is not supported and what
// to use instead.
var unsupported = map[string]string{
	"ARG":         "build arguments are not supported; use ENV",
	"EXPOSE":      "ports need no declaration (a sandbox's ports are reached through the API); remove it",
	"VOLUME":      "volumes are not supported; a sandbox's whole filesystem is writable and kept with it",
	"ENTRYPOINT":  "use START (or CMD) with the whole command",
	"HEALTHCHECK": "use READY for a readiness check of the START command",
	"SHELL":       `RUN's shell form always uses /bin/sh -c; use the exec form, e.g. RUN ["bash", "-c", "…"]`,
	"ONBUILD":     "build triggers are not supported",
	"STOPSIGNAL":  "sandboxes are stopped by the runtime; remove it",
	"MAINTAINER":  "it is deprecated; use a comment (LABEL is accepted and ignored)",
}

// flagsAllowed lists the flags each instruction takes; flagsRefused says
// why known Docker flags are refused.
var (
	flagsAllowed = map[string][]string{
		"RUN":     {"network"},
		"COPY":    {"chown"},
		"ADD":     {"chown"},
		"READY":   {"timeout", "interval"},
		"NETWORK": {"internet", "deny", "allow-private"},
	}
	flagsRefused = map[string]string{
		"from":     "multi-stage builds are not supported",
		"platform": "templates are built for this host's platform",
		"mount":    "RUN mounts are not supported",
		"security": "RUN runs unprivileged in a sandbox",
		"chmod":    "set modes with RUN chmod",
		"link":     "every step is already its own cached layer",
	}
)

var directiveRE = regexp.MustCompile(`^#\s*([a-zA-Z][a-zA-Z0-9_-]*)\s*=\s*(.*?)\s*$`)

// lineError is a build file error at a line.
func lineError(line int, format string, args ...any) error {
	return fmt.Errorf("line %d: %s: %w", line, fmt.Sprintf(format, args...), errdefs.ErrInvalidArgument)
}

// Parse reads a build file. Errors wrap errdefs.ErrInvalidArgument and name
// the line (a file over MaxFileBytes or MaxInstructions wraps
// errdefs.ErrTooLarge).
func Parse(r io.Reader) (*File, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxFileBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read build file: %w", err)
	}
	if len(data) > MaxFileBytes {
		return nil, fmt.Errorf("build file is larger than %d bytes: %w", MaxFileBytes, errdefs.ErrTooLarge)
	}
	if bytes.IndexByte(data, 0) >= 0 || !utf8.Valid(data) {
		line := 1 + bytes.Count(data[:firstInvalid(data)], []byte("\n"))
		return nil, lineError(line, "not valid UTF-8 text")
	}
	lines := strings.Split(string(data), "\n")
	for i := range lines {
		lines[i] = strings.TrimSuffix(lines[i], "\r")
	}
	f := &File{}
	i := 0
	// Parser directives come first, before any blank line or instruction.
	for ; i < len(lines); i++ {
		m := directiveRE.FindStringSubmatch(lines[i])
		if m == nil {
			break
		}
		switch strings.ToLower(m[1]) {
		case "escape":
			if m[2] != `\` {
				return nil, lineError(i+1, "the escape directive is not supported (the escape character is always \\)")
			}
		case "syntax", "check":
			// A frontend image or lint settings mean nothing here.
		}
	}
	for ; i < len(lines); i++ {
		trimmed := strings.TrimSpace(lines[i])
		if trimmed == "" || strings.HasPrefix(trimmed, "#") {
			continue
		}
		start := i + 1
		text, cont := continued(strings.TrimLeft(lines[i], " \t"))
		for cont && i+1 < len(lines) {
			i++
			next := strings.TrimSpace(lines[i])
			if next == "" || strings.HasPrefix(next, "#") {
				continue // comments and blank lines inside an instruction are dropped, as in Docker
			}
			var part string
			part, cont = continued(lines[i])
			text += part
		}
		if len(f.Instructions) >= MaxInstructions {
			return nil, fmt.Errorf("line %d: more than %d instructions: %w", start, MaxInstructions, errdefs.ErrTooLarge)
		}
		in, err := parseInstruction(start, text)
		if err != nil {
			return nil, err
		}
		if in.Cmd == "LABEL" {
			continue
		}
		if len(f.Instructions) == 0 && in.Cmd != "FROM" {
			return nil, lineError(start, "the first instruction must be FROM <template>, not %s", in.Cmd)
		}
		if len(f.Instructions) > 0 && in.Cmd == "FROM" {
			return nil, lineError(start, "a second FROM: multi-stage builds are not supported")
		}
		f.Instructions = append(f.Instructions, in)
	}
	if len(f.Instructions) == 0 {
		return nil, fmt.Errorf("build file has no instructions; it starts with FROM <template>: %w", errdefs.ErrInvalidArgument)
	}
	return f, nil
}

func firstInvalid(data []byte) int {
	for i := 0; i < len(data); {
		r, n := utf8.DecodeRune(data[i:])
		if r == 0 || r == utf8.RuneError && n == 1 {
			return i
		}
		i += n
	}
	return len(data)
}

// continued strips a trailing line-continuation backslash (blanks may follow
// it) and reports whether there was one.
func continued(line string) (string, bool) {
	t := strings.TrimRight(line, " \t")
	if strings.HasSuffix(t, `\`) {
		return strings.TrimSuffix(t, `\`), true
	}
	return line, false
}

func parseInstruction(line int, text string) (Instruction, error) {
	text = strings.TrimSpace(text)
	kw, rest, _ := strings.Cut(text, " ")
	if k, r, ok := strings.Cut(text, "\t"); ok && len(k) < len(kw) {
		kw, rest = k, r
	}
	in := Instruction{Line: line, Cmd: strings.ToUpper(kw), Text: text}
	rest = strings.TrimLeft(rest, " \t")
	if why, ok := unsupported[in.Cmd]; ok {
		return in, lineError(line, "%s is not supported: %s", in.Cmd, why)
	}
	switch in.Cmd {
	case "FROM", "RUN", "COPY", "ADD", "ENV", "WORKDIR", "USER", "CMD", "START", "READY", "LABEL", "NETWORK":
	default:
		return in, lineError(line, "unknown instruction %s", kw)
	}
	// Flags: leading "--name[=value]" words.
	for strings.HasPrefix(rest, "--") {
		word, after, _ := strings.Cut(rest, " ")
		if w, a, ok := strings.Cut(rest, "\t"); ok && len(w) < len(word) {
			word, after = w, a
		}
		name, value, _ := strings.Cut(strings.TrimPrefix(word, "--"), "=")
		allowed := false
		for _, a := range flagsAllowed[in.Cmd] {
			allowed = allowed || a == name
		}
		if !allowed {
			if why, ok := flagsRefused[name]; ok {
				return in, lineError(line, "%s --%s is not supported: %s", in.Cmd, name, why)
			}
			return in, lineError(line, "%s does not take the flag --%s", in.Cmd, name)
		}
		if in.Flags == nil {
			in.Flags = map[string]string{}
		}
		if _, dup := in.Flags[name]; dup {
			return in, lineError(line, "%s --%s given twice", in.Cmd, name)
		}
		in.Flags[name] = value
		rest = strings.TrimLeft(after, " \t")
	}
	in.Raw = rest
	if rest == "" && in.Cmd != "LABEL" && !(in.Cmd == "NETWORK" && len(in.Flags) > 0) {
		return in, lineError(line, "%s needs arguments", in.Cmd)
	}
	if strings.HasPrefix(rest, "<<") && (in.Cmd == "RUN" || in.Cmd == "COPY" || in.Cmd == "ADD") {
		return in, lineError(line, "heredocs are not supported; use a COPY'd script or a one-line RUN")
	}
	var err error
	switch in.Cmd {
	case "FROM":
		err = in.parseFrom()
	case "RUN", "CMD", "START", "READY":
		err = in.parseCommand()
	case "COPY", "ADD":
		err = in.parseCopy()
	case "ENV":
		_, err = parseEnv(rest, placeholder)
	case "NETWORK":
		_, err = in.NetworkPolicy()
	case "WORKDIR", "USER":
		var v string
		v, err = expandWord(rest, placeholder)
		if err == nil && in.Cmd == "USER" && strings.ContainsAny(v, " \t") {
			err = fmt.Errorf("USER takes one user[:group]")
		}
	}
	if err != nil {
		return in, lineError(line, "%s: %v", in.Cmd, err)
	}
	return in, nil
}

func (in *Instruction) parseFrom() error {
	words := strings.Fields(in.Raw)
	if len(words) == 3 && strings.EqualFold(words[1], "AS") {
		words = words[:1] // a single stage may be named; the name is unused
	}
	if len(words) != 1 {
		return fmt.Errorf("FROM takes one template ref (name:tag or sha256:…)")
	}
	if strings.EqualFold(words[0], "scratch") {
		return fmt.Errorf("FROM scratch is not supported: start from a template (for example base), or import a directory or tar archive as a template")
	}
	in.Args = words
	return nil
}

// parseMaybeJSON returns the exec form's array, if Raw is one (as Docker,
// anything that is not a valid JSON array of strings is shell form).
func (in *Instruction) parseMaybeJSON() bool {
	if !strings.HasPrefix(in.Raw, "[") {
		return false
	}
	var arr []string
	if err := json.Unmarshal([]byte(in.Raw), &arr); err != nil {
		return false
	}
	in.Args, in.JSON = arr, true
	return true
}

func (in *Instruction) parseCommand() error {
	if !in.parseMaybeJSON() {
		in.Args = []string{"/bin/sh", "-c", in.Raw}
	}
	if len(in.Args) == 0 || in.Args[0] == "" {
		return fmt.Errorf("empty command")
	}
	switch in.Cmd {
	case "RUN":
		if v, ok := in.Flags["network"]; ok && v != "none" && v != "default" && v != "host" {
			return fmt.Errorf("--network=%s: use none, default or host", v)
		}
	case "READY":
		if _, err := readyTimings(in.Flags); err != nil {
			return err
		}
	}
	return nil
}

// readyDurations are READY's timing flags.
type readyDurations struct{ timeout, interval time.Duration }

func readyTimings(flags map[string]string) (readyDurations, error) {
	var d readyDurations
	if v, ok := flags["timeout"]; ok {
		t, err := time.ParseDuration(v)
		if err != nil || t <= 0 || t > 10*time.Minute {
			return d, fmt.Errorf("--timeout=%s: want a duration up to 10m, e.g. 60s", v)
		}
		d.timeout = t
	}
	if v, ok := flags["interval"]; ok {
		t, err := time.ParseDuration(v)
		if err != nil || t < 10*time.Millisecond || t > time.Minute {
			return d, fmt.Errorf("--interval=%s: want a duration from 10ms to 1m, e.g. 100ms", v)
		}
		d.interval = t
	}
	return d, nil
}

func (in *Instruction) parseCopy() error {
	words, err := copyWords(in, placeholder)
	if err != nil {
		return err
	}
	if len(words) < 2 {
		return fmt.Errorf("%s needs at least one source and a destination", in.Cmd)
	}
	if v, ok := in.Flags["chown"]; ok && !strings.Contains(v, "$") {
		if _, err := parseChown(v); err != nil {
			return err
		}
	}
	if in.Cmd == "ADD" {
		for _, w := range words[:len(words)-1] {
			if isURL(w) {
				return fmt.Errorf("ADD %s: a URL source needs the network, and builds have none outside RUN; download it in a RUN step", w)
			}
		}
	}
	return nil
}

// copyWords returns COPY's or ADD's sources and destination, expanded.
func copyWords(in *Instruction, lookup lookupFunc) ([]string, error) {
	if in.JSON || in.parseMaybeJSON() {
		out := make([]string, len(in.Args))
		for i, a := range in.Args {
			// In exec form quotes are JSON's; only variables expand.
			v, err := expandWord(strings.NewReplacer(`\`, `\\`, `'`, `\'`, `"`, `\"`).Replace(a), lookup)
			if err != nil {
				return nil, err
			}
			out[i] = v
		}
		return out, nil
	}
	return expandAll(in.Raw, lookup)
}

func isURL(s string) bool {
	l := strings.ToLower(s)
	for _, p := range []string{"http://", "https://", "ftp://", "git://", "git@", "ssh://"} {
		if strings.HasPrefix(l, p) {
			return true
		}
	}
	return false
}

// parseChown parses --chown's numeric uid[:gid] (a uid alone is also the
// gid, as in Docker).
func parseChown(v string) ([2]int, error) {
	u, g, hasGroup := strings.Cut(v, ":")
	if !hasGroup {
		g = u
	}
	uid, err1 := strconv.ParseUint(u, 10, 32)
	gid, err2 := strconv.ParseUint(g, 10, 32)
	if err1 != nil || err2 != nil {
		return [2]int{}, fmt.Errorf("--chown=%s: want numeric uid[:gid] (user names are not looked up)", v)
	}
	if uid > 65535 || gid > 65535 {
		return [2]int{}, fmt.Errorf("--chown=%s: ids above 65535 are outside a sandbox's id range", v)
	}
	return [2]int{int(uid), int(gid)}, nil
}

// parseEnv parses ENV's "k=v …" or legacy "k value with blanks" form.
// Values are expanded with the environment from before the instruction
// (so "ENV A=1 B=$A" sees the previous A, as in Docker).
func parseEnv(raw string, lookup lookupFunc) ([][2]string, error) {
	words, err := splitWords(raw)
	if err != nil {
		return nil, err
	}
	if len(words) == 0 {
		return nil, fmt.Errorf("ENV needs name=value")
	}
	if !strings.Contains(words[0], "=") {
		// Legacy form: the rest of the line is the value.
		name := words[0]
		value := strings.TrimLeft(strings.TrimPrefix(raw, name), " \t")
		if value == "" {
			return nil, fmt.Errorf("ENV %s needs a value (ENV name=value)", name)
		}
		v, err := expandWord(value, lookup)
		if err != nil {
			return nil, err
		}
		if err := checkEnvName(name); err != nil {
			return nil, err
		}
		return [][2]string{{name, v}}, nil
	}
	var out [][2]string
	for _, w := range words {
		name, value, ok := strings.Cut(w, "=")
		if !ok {
			return nil, fmt.Errorf("%q is not name=value", w)
		}
		if err := checkEnvName(name); err != nil {
			return nil, err
		}
		v, err := expandWord(value, lookup)
		if err != nil {
			return nil, err
		}
		out = append(out, [2]string{name, v})
	}
	return out, nil
}

func checkEnvName(name string) error {
	if name == "" {
		return fmt.Errorf("ENV name is empty")
	}
	for i := 0; i < len(name); i++ {
		if !isNameByte(name[i]) || i == 0 && name[i] >= '0' && name[i] <= '9' {
			return fmt.Errorf("ENV name %q: use letters, digits and _, not starting with a digit", name)
		}
	}
	return nil
}

// NetworkPolicy is the default egress policy a NETWORK instruction gives
// sandboxes of the template: "NETWORK none" reaches nothing; otherwise the
// words are allow_out entries, --internet allows every public destination,
// --deny=CIDR[,CIDR] are deny_out entries and --allow-private=CIDR[,CIDR]
// allow_private entries (the special ranges its names may lead into).
func (in *Instruction) NetworkPolicy() (api.NetworkPolicy, error) {
	var p api.NetworkPolicy
	words := strings.Fields(in.Raw)
	if len(words) == 1 && strings.EqualFold(words[0], "none") {
		if len(in.Flags) > 0 {
			return p, fmt.Errorf("NETWORK none takes no flags")
		}
		return p, nil
	}
	if v, ok := in.Flags["internet"]; ok {
		if v != "" && v != "true" {
			return p, fmt.Errorf("--internet takes no value")
		}
		p.Internet = true
	}
	if v, ok := in.Flags["deny"]; ok {
		if v == "" {
			return p, fmt.Errorf("--deny needs CIDR[,CIDR]")
		}
		p.DenyOut = strings.Split(v, ",")
	}
	if v, ok := in.Flags["allow-private"]; ok {
		if v == "" {
			return p, fmt.Errorf("--allow-private needs CIDR[,CIDR]")
		}
		p.AllowPrivate = strings.Split(v, ",")
	}
	p.AllowOut = words
	if err := netpolicy.Validate(p); err != nil {
		return p, err
	}
	return p, nil
}
