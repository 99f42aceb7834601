package api

import "time"

// NetworkPolicy is what a sandbox may reach. The zero value reaches nothing.
// Its fields model E2B's network configuration so a compatibility layer can
// map it 1:1 (E2B's "deny all traffic" maps to Internet=false with no
// AllowOut; see docs/DECISIONS.md).
type NetworkPolicy struct {
	// AllowOut entries: an exact domain ("pypi.org"), a wildcard ("*.suffix":
	// subdomains at any depth, not the apex; a bare "*" is invalid), an IP or
	// a CIDR; each optionally with ":port" (IPv6 literals in brackets:
	// "[2001:db8::1]:443").
	AllowOut []string `json:"allow_out,omitempty"`
	// DenyOut entries: IPs or CIDRs, optionally with ":port". Deny wins over
	// an allowed CIDR, and a name that is allowed still needs its IP not
	// denied.
	DenyOut []string `json:"deny_out,omitempty"`
	// Internet allows every public destination (DNS for any name, TCP to any
	// public address). DenyOut still applies.
	Internet bool `json:"internet,omitempty"`
	// AllowPrivate are the special ranges (loopback, RFC 1918, CGNAT,
	// link-local, …: IPs or CIDRs, no ports) an allow_out NAME entry may
	// lead into: an allowed name resolving to such an address is bound and
	// reachable only if the address lies in one of them (and in a range
	// the operator opened with --egress-allow-private, the outer limit).
	// An allow_out IP/CIDR entry opens its own range without it. Empty: a
	// name never leads into special space, whatever its DNS says.
	AllowPrivate []string `json:"allow_private,omitempty"`
	// Rules are per-domain HTTP header transforms (the hook of credential
	// brokering). Validated and stored; applied by a later layer.
	Rules []HeaderRule `json:"rules,omitempty"`
	// EgressProxy is a SOCKS5 upstream ("socks5://host:port") through which
	// every allowed connection is re-originated; if it cannot be reached the
	// connection fails (never falls back to a direct dial).
	EgressProxy string `json:"egress_proxy,omitempty"`
}

// HeaderRule transforms the HTTP headers of requests to one domain pattern.
type HeaderRule struct {
	Domain        string            `json:"domain"` // exact or "*.suffix", as in AllowOut (no port)
	SetHeaders    map[string]string `json:"set_headers,omitempty"`
	RemoveHeaders []string          `json:"remove_headers,omitempty"`
}

// NetworkInfo is GET /v1/sandboxes/{id}/network.
type NetworkInfo struct {
	Policy NetworkPolicy `json:"policy"`
	// Address and Gateway are the sandbox's side of its one virtual link
	// and the gateway's (its resolver); never routed on the host.
	Address string       `json:"address,omitempty"`
	Gateway string       `json:"gateway,omitempty"`
	Stats   NetworkStats `json:"stats"`
	// Attached is false while the sandbox has no live link (stopped,
	// suspended, or its gateway is being restarted).
	Attached bool `json:"attached"`
	// History are the counters of the sandbox's earlier links, as they
	// were when each ended (stop, suspend, …), newest first; persisted.
	History []NetworkSummary `json:"history,omitempty"`
}

// NetworkSummary is the record of one link that ended.
type NetworkSummary struct {
	EndedAt time.Time    `json:"ended_at"`
	During  string       `json:"during"` // what ended it: "stop", "suspend", "delete", …
	Stats   NetworkStats `json:"stats"`
}

// NetworkStats are counters of one sandbox's link since it was attached.
type NetworkStats struct {
	BytesOut      int64            `json:"bytes_out"` // sandbox → outside, payload bytes
	BytesIn       int64            `json:"bytes_in"`
	Connections   int64            `json:"connections"` // currently open
	DNSQueries    int64            `json:"dns_queries"`
	Verdicts      map[string]int64 `json:"verdicts,omitempty"` // events by verdict
	EventsDropped int64            `json:"events_dropped"`     // ring overflow
}

// Network event verdicts.
const (
	VerdictAllow = "allow"
	VerdictDeny  = "deny"
	VerdictDrop  = "drop"  // silently discarded (UDP/ICMP out, DNS to another address)
	VerdictLimit = "limit" // refused by a per-sandbox limit (rate, connections, exfiltration bounds)
	VerdictError = "error" // allowed, but the upstream could not be reached
)

// NetworkEvent is one DNS query or connection attempt of a sandbox.
type NetworkEvent struct {
	Seq        uint64    `json:"seq"`
	Time       time.Time `json:"time"`
	Protocol   string    `json:"protocol"` // "dns", "tcp", "tls", "http", "https", "udp", "icmp", "other", "ingress", "policy", "summary" (refusals counted, not recorded one by one)
	Name       string    `json:"name,omitempty"`
	IP         string    `json:"ip,omitempty"`
	Port       int       `json:"port,omitempty"`
	Verdict    string    `json:"verdict"`
	Reason     string    `json:"reason,omitempty"` // the rule that allowed it, or why it was refused
	BytesOut   int64     `json:"bytes_out,omitempty"`
	BytesIn    int64     `json:"bytes_in,omitempty"`
	DurationMS float64   `json:"duration_ms,omitempty"`
	// Answers are the addresses a DNS answer carried (after filtering).
	Answers []string `json:"answers,omitempty"`
	// Method, Path (without the query), Status and Secrets describe one
	// request on an intercepted connection (protocol "https"): Secrets are
	// the names of the brokered secrets the gateway put into it, never
	// their values.
	Method  string   `json:"method,omitempty"`
	Path    string   `json:"path,omitempty"`
	Status  int      `json:"status,omitempty"`
	Secrets []string `json:"secrets,omitempty"`
	// Exe is the executable that opened the connection, as the host saw
	// it in the sandbox's socket table (native runtime, sandboxes with
	// policy rules); never taken from anything the sandbox says.
	Exe string `json:"exe,omitempty"`
}
