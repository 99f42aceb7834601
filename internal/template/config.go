package template

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/netpolicy"
)

var (
	envKeyRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	userRE   = regexp.MustCompile(`^([a-z_][a-z0-9_-]{0,31}|[0-9]{1,10})(:([a-z_][a-z0-9_-]{0,31}|[0-9]{1,10}))?$`)
)

// Bounds on template defaults; they end up in every sandbox's environment
// and in every create operation.
const (
	maxEnvEntries    = 256
	maxEnvBytes      = 64 << 10
	maxArgs          = 256
	maxArgBytes      = 16 << 10
	maxReadyTimeout  = 600
	maxReadyInterval = 60_000
)

// ValidateConfig checks template defaults: env names, an absolute workdir,
// a "uid[:gid]" or name user, a start command with sane bounds, and a
// network policy netpolicy accepts.
func ValidateConfig(c api.TemplateConfig) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("template config: %s: %w", fmt.Sprintf(format, args...), errdefs.ErrInvalidArgument)
	}
	if len(c.Env) > maxEnvEntries {
		return bad("%d env entries (limit %d)", len(c.Env), maxEnvEntries)
	}
	size := 0
	for k, v := range c.Env {
		if !envKeyRE.MatchString(k) {
			return bad("env name %q is not [A-Za-z_][A-Za-z0-9_]*", k)
		}
		if strings.IndexByte(v, 0) >= 0 {
			return bad("env %s contains a NUL byte", k)
		}
		size += len(k) + len(v)
	}
	if size > maxEnvBytes {
		return bad("env is %d bytes (limit %d)", size, maxEnvBytes)
	}
	if c.Workdir != "" && (!strings.HasPrefix(c.Workdir, "/") || len(c.Workdir) > 4096 || strings.IndexByte(c.Workdir, 0) >= 0) {
		return bad("workdir %q must be an absolute path", c.Workdir)
	}
	if c.User != "" && !userRE.MatchString(c.User) {
		return bad("user %q must be uid[:gid] or a user name", c.User)
	}
	if st := c.Start; st != nil {
		if len(st.Cmd) == 0 || st.Cmd[0] == "" {
			return bad("start command is empty")
		}
		for _, argv := range [][]string{st.Cmd, st.Ready} {
			if len(argv) > maxArgs {
				return bad("command has %d arguments (limit %d)", len(argv), maxArgs)
			}
			for _, a := range argv {
				if len(a) > maxArgBytes || strings.IndexByte(a, 0) >= 0 {
					return bad("command argument too long or contains NUL")
				}
			}
		}
		if st.ReadyTimeoutSeconds < 0 || st.ReadyTimeoutSeconds > maxReadyTimeout {
			return bad("ready_timeout_seconds %v must be 0..%d", st.ReadyTimeoutSeconds, maxReadyTimeout)
		}
		if st.ReadyIntervalMS < 0 || st.ReadyIntervalMS > maxReadyInterval {
			return bad("ready_interval_ms %d must be 0..%d", st.ReadyIntervalMS, maxReadyInterval)
		}
		if len(st.Ready) == 0 && (st.ReadyTimeoutSeconds != 0 || st.ReadyIntervalMS != 0) {
			return bad("ready timeout/interval set without a ready command")
		}
	}
	if c.Network != nil {
		if err := netpolicy.Validate(*c.Network); err != nil {
			return fmt.Errorf("template config: %w", err)
		}
	}
	return nil
}
