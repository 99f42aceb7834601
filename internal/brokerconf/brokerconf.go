// Package brokerconf is the credential-brokering config of one sandbox: the
// sandbox's own CA and the secrets granted to it, which the sandbox manager
// builds and the network gateway enforces (it terminates TLS for the
// secrets' hosts and puts the real values on the requests sent to them).
//
// It is a leaf package so that both ends share the type without the
// manager importing the gateway: the gateway's control client implements
// the manager's interfaces, not the other way round.
package brokerconf

// Config is what the gateway needs to broker credentials for one sandbox:
// the sandbox's own CA, with which it terminates TLS for the hosts of the
// sandbox's granted secrets and header rules, and the secrets themselves.
// The sandbox only ever holds Placeholders; Values exist in the server
// (encrypted at rest) and in the gateway process's memory.
type Config struct {
	// CACertPEM and CAKeyPEM are the sandbox's CA (PEM). The certificate is
	// installed in the sandbox's trust stores; the key never enters it.
	CACertPEM []byte   `json:"ca_cert_pem,omitempty"`
	CAKeyPEM  []byte   `json:"ca_key_pem,omitempty"`
	Secrets   []Secret `json:"secrets,omitempty"`
}

// Secret is one secret granted to one sandbox.
type Secret struct {
	Name string `json:"name"`
	// Hosts are the exact names and "*.suffix" patterns the secret may be
	// sent to; requests to them are intercepted.
	Hosts []string `json:"hosts"`
	// Header, if set, is "Name: template" with "{}" standing for the value
	// (e.g. "Authorization: Bearer {}"): the gateway sets that header on
	// every request to Hosts. Empty: the gateway only replaces Placeholder
	// wherever it appears in a request's headers.
	Header string `json:"header,omitempty"`
	// Placeholder is the random stand-in the sandbox sees (its env var of
	// the secret's name); worthless anywhere but on requests to Hosts.
	Placeholder string `json:"placeholder"`
	Value       []byte `json:"value"`
}
