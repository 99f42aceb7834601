package sandbox

import (
	"fmt"
	"math"
	"path"
	"regexp"
	"strings"
	"unicode/utf8"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/template"
)

// Defaults and bounds for sandbox limits. Every sandbox gets a limit on every
// resource: a limit left at zero is the default, never "unlimited"
// (docs/DECISIONS.md, "Limits are always on").
var (
	DefaultLimits = api.Limits{CPUs: 1, MemoryMiB: 512, Pids: 512, DiskMiB: 2048}
	maxLimits     = api.Limits{CPUs: 64, MemoryMiB: 1 << 20, Pids: 1 << 20, DiskMiB: 1 << 20}
	minLimits     = api.Limits{CPUs: 0.01, MemoryMiB: 16, Pids: 8, DiskMiB: 16}
)

const (
	maxEnv        = 256
	maxEnvBytes   = 128 << 10
	maxLabels     = 64
	maxLabelLen   = 256
	maxCmdArgs    = 4096
	maxArgBytes   = 256 << 10
	maxTTLSeconds = 365 * 24 * 3600
	maxPathLen    = 4096
	maxSyncStdin  = 512 << 10
)

var (
	envKeyRE   = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	labelKeyRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$`)
	userRE     = regexp.MustCompile(`^([a-z_][a-z0-9_-]{0,31}|[0-9]{1,10})(:([a-z_][a-z0-9_-]{0,31}|[0-9]{1,10}))?$`)
	idRE       = regexp.MustCompile(`^[a-z]{2,3}-[a-z0-9]{6,32}$`)
)

func invalid(format string, a ...any) error {
	return fmt.Errorf(format+": %w", append(a, errdefs.ErrInvalidArgument)...)
}

// ValidID rejects anything that is not one of our generated ids, so ids can
// be used in paths and SQL without surprises.
func ValidID(id string) error {
	if !idRE.MatchString(id) {
		return fmt.Errorf("malformed id %q: %w", truncate(id, 64), errdefs.ErrNotFound)
	}
	return nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

func resolveLimits(in api.Limits) (api.Limits, error) {
	out := in
	checkF := func(name string, v, lo, hi, def float64) (float64, error) {
		if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return 0, invalid("limits.%s must be a positive number, got %v", name, v)
		}
		if v == 0 {
			return def, nil
		}
		if v < lo || v > hi {
			return 0, invalid("limits.%s must be between %v and %v, got %v", name, lo, hi, v)
		}
		return v, nil
	}
	checkI := func(name string, v, lo, hi, def int64) (int64, error) {
		if v < 0 {
			return 0, invalid("limits.%s must not be negative, got %d", name, v)
		}
		if v == 0 {
			return def, nil
		}
		if v < lo || v > hi {
			return 0, invalid("limits.%s must be between %d and %d, got %d", name, lo, hi, v)
		}
		return v, nil
	}
	var err error
	if out.CPUs, err = checkF("cpus", in.CPUs, minLimits.CPUs, maxLimits.CPUs, DefaultLimits.CPUs); err != nil {
		return out, err
	}
	if out.MemoryMiB, err = checkI("memory_mib", in.MemoryMiB, minLimits.MemoryMiB, maxLimits.MemoryMiB, DefaultLimits.MemoryMiB); err != nil {
		return out, err
	}
	if out.Pids, err = checkI("pids", in.Pids, minLimits.Pids, maxLimits.Pids, DefaultLimits.Pids); err != nil {
		return out, err
	}
	if out.DiskMiB, err = checkI("disk_mib", in.DiskMiB, minLimits.DiskMiB, maxLimits.DiskMiB, DefaultLimits.DiskMiB); err != nil {
		return out, err
	}
	if in.OutputMiB < 0 || in.OutputMiB > 64 {
		return out, invalid("limits.output_mib must be between 0 and 64, got %d", in.OutputMiB)
	}
	return out, nil
}

func validateEnv(env map[string]string) error {
	if len(env) > maxEnv {
		return invalid("too many env entries (%d > %d)", len(env), maxEnv)
	}
	total := 0
	for k, v := range env {
		if !envKeyRE.MatchString(k) || len(k) > 256 {
			return invalid("env key %q must match %s", truncate(k, 64), envKeyRE)
		}
		if strings.IndexByte(v, 0) >= 0 {
			return invalid("env %s contains a NUL byte", k)
		}
		total += len(k) + len(v) + 2
	}
	if total > maxEnvBytes {
		return invalid("env is %d bytes, more than %d", total, maxEnvBytes)
	}
	return nil
}

// ValidateUser checks a sandbox user as requests name one ("name" or
// "uid", optionally ":group" or ":gid"); empty (root) is valid. Whether the
// user exists is for the sandbox's /etc/passwd to say.
func ValidateUser(u string) error {
	if u != "" && !userRE.MatchString(u) {
		return invalid("user must be a name or uid, optionally :group, got %q", truncate(u, 64))
	}
	return nil
}

func validatePath(field, p string, allowEmpty bool) error {
	if p == "" {
		if allowEmpty {
			return nil
		}
		return invalid("%s is required", field)
	}
	if strings.IndexByte(p, 0) >= 0 {
		return invalid("%s contains a NUL byte", field)
	}
	if len(p) > maxPathLen {
		return invalid("%s is %d bytes, longer than %d", field, len(p), maxPathLen)
	}
	if !utf8.ValidString(p) {
		return invalid("%s is not valid UTF-8", field)
	}
	return nil
}

func validateCreate(req *api.CreateSandboxRequest) (api.Limits, error) {
	lim, err := resolveLimits(req.Limits)
	if err != nil {
		return lim, err
	}
	if err := validateEnv(req.Env); err != nil {
		return lim, err
	}
	if req.Workdir != "" {
		if err := validatePath("workdir", req.Workdir, false); err != nil {
			return lim, err
		}
		if !path.IsAbs(req.Workdir) {
			return lim, invalid("workdir must be an absolute path, got %q", truncate(req.Workdir, 64))
		}
	}
	if len(req.Labels) > maxLabels {
		return lim, invalid("too many labels (%d > %d)", len(req.Labels), maxLabels)
	}
	for k, v := range req.Labels {
		if !labelKeyRE.MatchString(k) {
			return lim, invalid("label key %q must match %s", truncate(k, 64), labelKeyRE)
		}
		if k == PoolLabel {
			return lim, invalid("label %s is reserved for the server's warm pools", PoolLabel)
		}
		if len(v) > maxLabelLen || strings.IndexByte(v, 0) >= 0 || !utf8.ValidString(v) {
			return lim, invalid("label %s has an invalid value (max %d bytes of UTF-8, no NUL)", k, maxLabelLen)
		}
	}
	if req.TTLSeconds < 0 || req.TTLSeconds > maxTTLSeconds {
		return lim, invalid("ttl_seconds must be between 0 and %d, got %d", maxTTLSeconds, req.TTLSeconds)
	}
	switch req.OnExpiry {
	case "", api.ExpiryDelete, api.ExpirySuspend:
	default:
		return lim, invalid("on_expiry must be delete or suspend, got %q", truncate(req.OnExpiry, 32))
	}
	if req.Idle != nil {
		switch req.Idle.Action {
		case "pause", "stop", "suspend":
		default:
			return lim, invalid("idle.action must be pause, stop or suspend, got %q", truncate(req.Idle.Action, 32))
		}
		if req.Idle.AfterSeconds <= 0 || req.Idle.AfterSeconds > maxTTLSeconds {
			return lim, invalid("idle.after_seconds must be between 1 and %d, got %d", maxTTLSeconds, req.Idle.AfterSeconds)
		}
	}
	if len(req.Template) > 256 || strings.IndexByte(req.Template, 0) >= 0 {
		return lim, invalid("template reference is malformed")
	}
	// A malformed reference can never resolve: refuse it now rather than
	// record a sandbox whose create can only fail.
	if req.Template != "" {
		if err := template.ValidateRef(req.Template); err != nil {
			return lim, err
		}
	}
	return lim, nil
}

func validateExec(req *api.ExecRequest) error {
	if len(req.Cmd) == 0 {
		return invalid("cmd must have at least one element")
	}
	if len(req.Cmd) > maxCmdArgs {
		return invalid("cmd has %d arguments, more than %d", len(req.Cmd), maxCmdArgs)
	}
	n := 0
	for i, a := range req.Cmd {
		if strings.IndexByte(a, 0) >= 0 {
			return invalid("cmd[%d] contains a NUL byte", i)
		}
		n += len(a)
	}
	if req.Cmd[0] == "" {
		return invalid("cmd[0] must not be empty")
	}
	if n > maxArgBytes {
		return invalid("cmd is %d bytes, more than %d", n, maxArgBytes)
	}
	if err := validateEnv(req.Env); err != nil {
		return err
	}
	if req.Workdir != "" {
		if err := validatePath("workdir", req.Workdir, false); err != nil {
			return err
		}
		if !path.IsAbs(req.Workdir) {
			return invalid("workdir must be an absolute path")
		}
	}
	if req.Root != "" {
		if err := validatePath("root", req.Root, false); err != nil {
			return err
		}
		if !path.IsAbs(req.Root) {
			return invalid("root must be an absolute path, got %q", truncate(req.Root, 64))
		}
		if path.Clean(req.Root) != req.Root {
			return invalid("root must be a clean path (no \"..\", \".\", \"//\" or trailing \"/\"), got %q", truncate(req.Root, 64))
		}
	}
	if err := ValidateUser(req.User); err != nil {
		return err
	}
	if req.TimeoutSeconds < 0 || req.TimeoutSeconds > 24*3600 || math.IsNaN(req.TimeoutSeconds) {
		return invalid("timeout_seconds must be between 0 and 86400")
	}
	if req.MaxOutputBytes < 0 || req.MaxOutputBytes > 16<<20 {
		return invalid("max_output_bytes must be between 0 and %d", 16<<20)
	}
	// Sync-exec stdin travels inside the agent's bounded JSON body; larger
	// input belongs in a file or a command session's stdin frames.
	if len(req.Stdin) > maxSyncStdin {
		return fmt.Errorf("stdin is %d bytes, more than %d; write a file or use a command session: %w", len(req.Stdin), maxSyncStdin, errdefs.ErrTooLarge)
	}
	return nil
}
