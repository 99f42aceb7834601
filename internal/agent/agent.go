// Package agent is space-agent: it runs inside a sandbox and serves the
// protocol of internal/agentproto over the stream its runtime provides.
package agent

// Main parses the agent's flags and serves until the listener closes.
func Main(args []string) error {
	return serveMain(args)
}
