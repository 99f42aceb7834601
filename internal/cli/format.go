package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// sizeRe is a size as users type it: an integer or decimal and an optional
// unit; a bare number is MiB.
var sizeRe = regexp.MustCompile(`^([0-9]+)(\.[0-9]+)?([a-zA-Z]*)$`)

// parseMiB parses "512m", "1g", "1.5g", "2GiB" or "1024" (MiB) into MiB.
// Anything that is not a whole, positive number of MiB is rejected.
func parseMiB(s string) (int64, error) {
	m := sizeRe.FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return 0, fmt.Errorf("size %q: want a number with an optional unit m or g (e.g. 512m, 1g, 1024)", s)
	}
	var mult float64
	switch strings.ToLower(m[3]) {
	case "", "m", "mb", "mi", "mib":
		mult = 1
	case "g", "gb", "gi", "gib":
		mult = 1024
	case "t", "tb", "ti", "tib":
		mult = 1024 * 1024
	case "k", "kb", "ki", "kib", "b":
		return 0, fmt.Errorf("size %q: the smallest unit is MiB (use m or g)", s)
	default:
		return 0, fmt.Errorf("size %q: unknown unit %q (use m or g)", s, m[3])
	}
	v, err := strconv.ParseFloat(m[1]+m[2], 64)
	if err != nil {
		return 0, fmt.Errorf("size %q: %v", s, err)
	}
	mib := v * mult
	if mib != math.Trunc(mib) {
		return 0, fmt.Errorf("size %q is not a whole number of MiB", s)
	}
	if mib < 1 {
		return 0, fmt.Errorf("size %q must be at least 1 MiB", s)
	}
	if mib > 1<<40 {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return int64(mib), nil
}

// parseSeconds parses a Go duration ("90s", "1h30m") into whole seconds.
func parseSeconds(flag, s string) (int64, error) {
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("--%s %q: want a duration like 30s, 5m or 1h", flag, s)
	}
	if d < time.Second {
		return 0, fmt.Errorf("--%s %q: must be at least 1s", flag, s)
	}
	if d%time.Second != 0 {
		return 0, fmt.Errorf("--%s %q: must be a whole number of seconds", flag, s)
	}
	return int64(d / time.Second), nil
}

// parseKV parses repeated k=v flags. For env (allowBare) a bare "K" takes
// K's value from the local environment, as docker -e does.
func parseKV(flag string, items []string, allowBare bool) (map[string]string, error) {
	if len(items) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(items))
	for _, it := range items {
		k, v, ok := strings.Cut(it, "=")
		if !ok && allowBare {
			lv, set := os.LookupEnv(k)
			if !set {
				return nil, fmt.Errorf("--%s %q: not set in the local environment (use K=V)", flag, it)
			}
			v, ok = lv, true
		}
		if !ok || k == "" {
			return nil, fmt.Errorf("--%s %q: want KEY=VALUE", flag, it)
		}
		if strings.ContainsAny(k, "\x00=") || strings.ContainsRune(v, 0) {
			return nil, fmt.Errorf("--%s %q: invalid character", flag, it)
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("--%s: %q given twice", flag, k)
		}
		out[k] = v
	}
	return out, nil
}

// printJSON writes v as indented JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// table writes rows aligned in columns.
type table struct{ tw *tabwriter.Writer }

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)}
	if len(header) > 0 {
		t.row(header...)
	}
	return t
}

func (t *table) row(cols ...string) {
	for i, c := range cols {
		// A tab or newline in a value (labels, error text) would break the
		// columns; values come from the server and sandboxes, so sanitise.
		cols[i] = strings.Map(func(r rune) rune {
			if r == '\t' || r == '\n' || r == '\r' || r < 0x20 {
				return ' '
			}
			return r
		}, c)
	}
	fmt.Fprintln(t.tw, strings.Join(cols, "\t"))
}

func (t *table) flush() error { return t.tw.Flush() }

// fmtMap renders a map as sorted k=v pairs.
func fmtMap(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + m[k]
	}
	return strings.Join(parts, ",")
}

// ago renders how long ago t was, coarsely, for tables.
func ago(now, t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := now.Sub(t)
	switch {
	case d < 0:
		return "just now"
	case d < time.Minute:
		return fmt.Sprintf("%ds ago", int(d/time.Second))
	case d < time.Hour:
		return fmt.Sprintf("%dm ago", int(d/time.Minute))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh ago", int(d/time.Hour))
	}
	return fmt.Sprintf("%dd ago", int(d/(24*time.Hour)))
}

// humanBytes renders a byte count in binary units.
func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for v := n / unit; v >= unit; v /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
