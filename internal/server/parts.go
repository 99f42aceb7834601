package server

// The Server's parts: each serves one group of routes and reaches the
// shared state through the Server it belongs to. A part is a value made
// where it is used (filesAPI{s}.readFile): it holds nothing of its own.

// filesAPI serves the files routes through the manager's one decided door
// (sandbox.FileSession).
type filesAPI struct{ s *Server }

// portsAPI serves sandbox ports: their settings and tokens, the host- and
// path-routed proxies and the raw tunnel.
type portsAPI struct{ s *Server }

// policyAPI serves the temporal policy's rule sets, approvals and proposals.
type policyAPI struct{ s *Server }

// templatesAPI serves templates (import, pull, build, tags, export, gc) and
// warm pools.
type templatesAPI struct{ s *Server }

// secretsAPI serves the secrets store and sandboxes' grants.
type secretsAPI struct{ s *Server }

// keysAPI serves API keys and tenants, and authenticates requests.
type keysAPI struct{ s *Server }

// auditAPI serves the audit log (list, follow, export, key) and keeps a
// node's chain anchored.
type auditAPI struct{ s *Server }

// networkAPI serves sandboxes' network policies and events, and their stats.
type networkAPI struct{ s *Server }
