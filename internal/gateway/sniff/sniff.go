// Package sniff peeks at the first bytes a sandbox sends on a TCP connection
// and learns the name it claims: the SNI of a TLS ClientHello, or the Host
// (or CONNECT authority) of an HTTP/1.x request.
//
// Input is hostile: reading stops at a caller-given bound, nothing is
// allocated in proportion to a length the peer claims, and ambiguous
// requests (two Host headers, a Host disagreeing with an absolute-form
// URI, bare LF line ends, folded headers) are reported as errors rather
// than resolved one way, because the upstream server might resolve them the
// other way.
//
// ParseRequestHead applies the same rules to every later request of a
// connection, one head at a time.
//
// Peek only sees the start of a connection: the first HTTP request of a
// kept-alive connection, the outer ClientHello of TLS. What follows is the
// gateway's business.
package sniff

import (
	"bytes"
	"errors"
	"io"
)

// Kind is the protocol Peek recognised.
type Kind int

const (
	Unknown Kind = iota // neither TLS nor HTTP/1.x (or not decided before an error)
	TLS                 // a TLS ClientHello
	HTTP                // an HTTP/1.x request
)

func (k Kind) String() string {
	switch k {
	case TLS:
		return "tls"
	case HTTP:
		return "http"
	}
	return "unknown"
}

// DefaultMax is the peek bound used when Peek is given max <= 0; MaxMax is
// the largest accepted.
const (
	DefaultMax = 16 << 10
	MaxMax     = 1 << 20
)

// Errors reported in Result.Err: the connection is TLS or HTTP, but what it
// claims is malformed or ambiguous. The gateway should refuse it.
var (
	ErrMalformed     = errors.New("malformed")
	ErrTooLarge      = errors.New("larger than the peek bound")
	ErrBadName       = errors.New("invalid name")
	ErrDuplicateHost = errors.New("duplicate Host")
	ErrMissingHost   = errors.New("missing Host")
	ErrHostMismatch  = errors.New("the Host header disagrees with the request URI")
	ErrDuplicateSNI  = errors.New("more than one server name")
	// ErrFraming: where the request's body ends (or whether it has one) is
	// not something every HTTP/1.1 reader agrees on.
	ErrFraming = errors.New("ambiguous message framing")
)

// Result is what Peek learnt.
type Result struct {
	Kind Kind
	// Name is the SNI, the Host header's host, or CONNECT's authority host:
	// lowercased, trailing dot stripped, without port (an IPv6 literal
	// without brackets). "" if the peer named nothing (a ClientHello
	// without SNI, an HTTP/1.0 request without Host).
	Name string
	// HostPort is the port of the Host header; for CONNECT, or a request
	// without Host whose target is absolute-form, the port of the target's
	// authority. 0 if none.
	HostPort int
	// ECH: the ClientHello carries encrypted_client_hello; Name is then the
	// outer (public) name, and the real one is hidden.
	ECH bool
	// HTTP only: the request's method, whether it carries an Upgrade
	// header (asks to switch protocols), and whether it has a body.
	Method  string
	Upgrade bool
	Body    bool
	// Err, when not nil, says why the request is not acceptable as seen
	// (one of the Err… values above, possibly wrapped with detail); Kind
	// still says what the bytes are.
	Err error
}

// state carries what decide learnt across calls, so a peer trickling one
// byte at a time costs linear, not quadratic, work for HTTP.
type state struct {
	kind Kind
	scan int // HTTP: where to resume looking for the end of the headers
}

// Peek reads from r at most max bytes (DefaultMax if max <= 0, at most
// MaxMax) until it can tell what the connection is and what name it
// claims, and returns every byte it read (to be replayed upstream) and the
// result. The error is a read error only (the caller's deadline expiring,
// io.EOF or io.ErrUnexpectedEOF when the peer stops early): with it, Result
// carries the Kind tentatively recognised so far and no name. Problems with
// the content go to Result.Err with a nil error.
func Peek(r io.Reader, max int) ([]byte, Result, error) {
	if max <= 0 {
		max = DefaultMax
	}
	if max > MaxMax {
		max = MaxMax
	}
	buf := make([]byte, 0, min(max, 2048))
	var st state
	need := 1
	zeroReads := 0
	for {
		for len(buf) < need {
			if len(buf) == cap(buf) {
				nb := make([]byte, len(buf), min(max, 2*cap(buf)))
				copy(nb, buf)
				buf = nb
			}
			n, err := r.Read(buf[len(buf):cap(buf)])
			buf = buf[:len(buf)+n]
			if n == 0 && err == nil {
				if zeroReads++; zeroReads > 100 {
					err = io.ErrNoProgress
				}
			}
			if err != nil && len(buf) < need {
				if err == io.EOF && len(buf) > 0 {
					err = io.ErrUnexpectedEOF
				}
				return buf, Result{Kind: st.kind}, err
			}
		}
		res, done, next := decide(buf, max, &st)
		if done {
			return buf, res, nil
		}
		need = next
	}
}

// decide looks at buf (never more than max bytes) and either decides or
// says how many bytes it needs at least (always more than len(buf), at
// most max; when the bound is reached it decides ErrTooLarge).
func decide(buf []byte, max int, st *state) (Result, bool, int) {
	var (
		res  Result
		done bool
		need int
	)
	switch {
	case st.kind == TLS || st.kind == Unknown && buf[0] == recordHandshake:
		st.kind = TLS
		res, done, need = decideTLS(buf)
	case st.kind == HTTP || methodPrefix(buf):
		res, done, need = decideHTTP(buf, st) // sets st.kind once "METHOD " is seen
	default:
		return Result{Kind: Unknown}, true, 0
	}
	if done {
		return res, true, 0
	}
	if need > max {
		return Result{Kind: res.Kind, Err: ErrTooLarge}, true, 0
	}
	return res, false, need
}

// ParseRequestHead parses one HTTP/1.x request head: the request line and
// the header fields up to and without the empty line that ends them, every
// line ending in CRLF. It applies Peek's rules (a request Peek would find
// malformed or ambiguous has Err set) and also refuses framing two readers
// could disagree on (ErrFraming). Kind is HTTP unless the method is not one
// Peek recognises (Unknown).
func ParseRequestHead(head []byte) Result {
	if !methodPrefix(head) || bytes.IndexByte(head, ' ') < 0 {
		return Result{Kind: Unknown, Err: malformed("request line")}
	}
	for i, c := range head {
		if c == '\n' && (i == 0 || head[i-1] != '\r') {
			return Result{Kind: HTTP, Err: malformed("bare LF")}
		}
		if c == '\r' && (i+1 == len(head) || head[i+1] != '\n') {
			return Result{Kind: HTTP, Err: malformed("bare CR")}
		}
	}
	res := parseRequest(string(head))
	res.Kind = HTTP
	return res
}
