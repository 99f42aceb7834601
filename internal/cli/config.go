package cli

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/spacehq/space/sdk"
)

// Config is where the CLI finds its server.
type Config struct {
	URL    string
	APIKey string
}

// DataDir is the server's data directory: $SPACE_DATA or /var/lib/space.
func DataDir() string {
	if d := os.Getenv("SPACE_DATA"); d != "" {
		return d
	}
	return "/var/lib/space"
}

// maxKeyFile bounds the key file read; a key is a short token.
const maxKeyFile = 4 << 10

// discoverConfig resolves the server URL (flag, SPACE_URL, default) and API
// key (flag, SPACE_API_KEY, then the key file the server writes into its
// data directory). A missing key file is not an error: the server decides.
func discoverConfig(flagURL, flagKey string) (Config, error) {
	cfg := Config{URL: flagURL, APIKey: flagKey}
	if cfg.URL == "" {
		cfg.URL = os.Getenv("SPACE_URL")
	}
	if cfg.URL == "" {
		cfg.URL = sdk.DefaultURL
	}
	if cfg.APIKey == "" {
		cfg.APIKey = os.Getenv("SPACE_API_KEY")
	}
	if cfg.APIKey == "" {
		p := filepath.Join(DataDir(), "api-key")
		b, err := readSmallFile(p, maxKeyFile)
		switch {
		case err == nil:
			cfg.APIKey = strings.TrimSpace(string(b))
		case errors.Is(err, fs.ErrNotExist):
		default:
			return cfg, fmt.Errorf("reading API key file: %w (set SPACE_API_KEY or --api-key)", err)
		}
	}
	if strings.ContainsAny(cfg.APIKey, " \t\r\n") {
		return cfg, usagef("API key contains whitespace")
	}
	return cfg, nil
}

func readSmallFile(p string, limit int64) ([]byte, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s: larger than %d bytes", p, limit)
	}
	return b, nil
}
