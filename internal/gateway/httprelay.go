package gateway

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/gateway/sniff"
	"github.com/spacehq/space/internal/netpolicy"
)

// The plain-HTTP relay. A connection proved by its first request's Host is
// not proved for the rest: every request on it is read whole, checked and
// written upstream again from what was parsed, until the upstream has
// really switched protocols (a 101 answering a request that asked for it,
// or a 2xx answering a CONNECT the policy allows). Whether it switched is
// read from the upstream's responses, which the relay follows as it passes
// them on (responses.follow); a request that asks to switch waits for that
// answer before anything after it is read from the sandbox.

// maxPipelined bounds the requests a sandbox has sent upstream whose
// responses have not come back.
const maxPipelined = 32

// maxResponseHead bounds a response head the relay follows; past it the
// relay stops following (the connection goes on, but can no longer switch
// protocols).
const maxResponseHead = 16 << 10

// exchange is one request written upstream, as its response is read.
type exchange struct {
	method string
	// switchOK: the request may switch the connection's protocol (it
	// carries Upgrade, or is a CONNECT the policy allows); switched then
	// receives the response's answer.
	switchOK bool
	switched chan bool
}

// responses follows the upstream's side of one HTTP connection.
type responses struct {
	pending chan *exchange
	// done is closed when it stops following (unsolicited or unparsable
	// bytes, a protocol switch, the end): no later request may switch.
	done chan struct{}
}

func newResponses() *responses {
	return &responses{pending: make(chan *exchange, maxPipelined), done: make(chan struct{})}
}

// verdict waits for whether x's response switched protocols.
func (rs *responses) verdict(x *exchange) bool {
	select {
	case ok := <-x.switched:
		return ok
	case <-rs.done:
		select { // sent before done closed
		case ok := <-x.switched:
			return ok
		default:
			return false
		}
	}
}

// run passes everything from up to down and follows the responses in it
// while it can; it returns when up ends.
func (rs *responses) run(down io.Writer, up io.Reader) {
	br := bufio.NewReaderSize(io.TeeReader(up, down), maxResponseHead)
	rs.follow(br)
	close(rs.done)
	// What br read ahead went to down already (the tee).
	pump(down, up)
}

func (rs *responses) follow(br *bufio.Reader) {
	for {
		if _, err := br.Peek(1); err != nil {
			return
		}
		var x *exchange
		select {
		case x = <-rs.pending:
		default:
			return // bytes no request asked for: stop trusting the framing
		}
	interim:
		resp, err := readResponse(br, &http.Request{Method: x.method})
		if err != nil {
			return
		}
		code := resp.StatusCode
		switch {
		case code == http.StatusSwitchingProtocols:
			if x.switchOK && x.method != http.MethodConnect {
				x.switched <- true
			}
			return // what follows is another protocol (or nothing we follow)
		case code >= 100 && code < 200:
			goto interim // 100 Continue, 103 Early Hints: the final one follows
		case x.method == http.MethodConnect && code >= 200 && code < 300:
			if !x.switchOK {
				return
			}
			x.switched <- true
			continue // the tunnel: the relay proves it like a new connection
		}
		if err := discardBody(resp.Body); err != nil {
			return
		}
		if x.switchOK {
			x.switched <- false
		}
	}
}

// bulkBuffers lend the response follower a bulk-sized buffer while it
// reads a body: a read that large goes past bufio straight to the tee, so
// a download reaches the sandbox in 64 KiB writes, and an idle connection
// holds none.
var bulkBuffers = sync.Pool{New: func() any { return new([relayBuffer]byte) }}

func discardBody(body io.ReadCloser) error {
	buf := bulkBuffers.Get().(*[relayBuffer]byte)
	defer bulkBuffers.Put(buf)
	defer body.Close()
	for {
		_, err := body.Read(buf[:])
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// refusal is a request (or a tunnel's first bytes) the relay refused;
// the event is recorded.
type refusal struct{ reason string }

func (r *refusal) Error() string { return r.reason }

// refuseOut records the deny event of what the sandbox sent on a relayed
// connection to dst:port (name: what it named, "" if nothing parsed) and
// returns the refusal.
func (l *link) refuseOut(proto, name string, dst netip.Addr, port uint16, reason string) error {
	l.events.add(api.NetworkEvent{Protocol: proto, Name: clip(name, 255), IP: dst.String(), Port: int(port),
		Verdict: api.VerdictDeny, Reason: reason})
	return &refusal{reason}
}

// httpOut reads, checks and forwards the sandbox's requests on one
// connection to dst:port. rs follows the responses (nil: the connection
// may never switch protocols; every byte is read as requests until it
// ends). It returns nil when the sandbox ended the stream, a *refusal when
// it sent something it may not.
func (l *link) httpOut(up io.Writer, br *bufio.Reader, dst netip.Addr, port uint16, rs *responses, n *int64) error {
	cw := &countingWriter{w: up, bw: l.bwOut, n: n, total: &l.bytesOut}
	bw := bufio.NewWriterSize(cw, 8<<10)
	tunnel := "" // inside a CONNECT tunnel: the name every request must name
	refuse := func(host, reason string) error {
		return l.refuseOut("http", host, dst, port, reason)
	}
	for {
		req, res, err := readRequest(br)
		if err == io.EOF {
			return nil
		}
		if err != nil {
			var ne net.Error
			if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) || errors.As(err, &ne) {
				return nil // the stream broke mid-request
			}
			return refuse(res.Name, "http: "+err.Error())
		}
		name := res.Name
		connect := req.Method == http.MethodConnect
		pol := l.policy.Load()
		switch {
		case tunnel != "" && connect:
			return refuse(name, "http: CONNECT inside a CONNECT tunnel")
		case tunnel != "" && name != tunnel:
			return refuse(name, "a request in the tunnel to "+tunnel+" names "+name)
		case tunnel == "":
			if why := l.nameRefused(pol, name, dst, port); why != "" {
				return refuse(name, "a later request on the connection names "+name+": "+why)
			}
			if connect {
				if v := pol.Check(name, dst, uint16(res.HostPort)); !v.Allow {
					return refuse(name, "CONNECT "+name+":"+strconv.Itoa(res.HostPort)+": "+v.Reason)
				}
			}
		}
		x := &exchange{method: req.Method, switchOK: rs != nil && (res.Upgrade || connect)}
		if x.switchOK {
			x.switched = make(chan bool, 1)
		}
		if rs != nil {
			select {
			case rs.pending <- x:
			case <-rs.done:
				x.switchOK = false
			}
		}
		if err := forwardRequest(bw, req, res); err != nil {
			return nil
		}
		if !x.switchOK || !rs.verdict(x) {
			continue
		}
		if !connect {
			// The upstream answered 101: what follows is another protocol.
			pump(cw, br)
			return nil
		}
		// A tunnel to name:port through the upstream, proved like a new
		// connection to that authority.
		tunnel = name
		kind, head, why := l.proveTunnel(br, pol, name, dst, uint16(res.HostPort))
		switch kind {
		case sniff.HTTP:
			br = bufio.NewReaderSize(io.MultiReader(bytes.NewReader(head), br), maxRelayHead)
			continue
		case sniff.TLS, sniff.Unknown:
			if why != "" {
				return refuse(name, why)
			}
			if _, err := cw.Write(head); err != nil {
				return nil
			}
			pump(cw, br)
			return nil
		}
	}
}

// proveTunnel reads the first bytes sent into a CONNECT tunnel to
// name:port: a TLS ClientHello must name name, HTTP is read request by
// request (kind HTTP), anything else passes only if the policy allows name
// on that port as an opaque protocol. why is the refusal, or "".
func (l *link) proveTunnel(br *bufio.Reader, pol *netpolicy.Policy, name string, dst netip.Addr, port uint16) (kind sniff.Kind, head []byte, why string) {
	head, res, err := sniff.Peek(br, peekMax)
	if err != nil && len(head) == 0 {
		return sniff.Unknown, nil, ""
	}
	switch {
	case res.Kind == sniff.TLS && (res.Err != nil || res.Name != name):
		return sniff.TLS, head, fmt.Sprintf("tls in the tunnel to %s names %q", name, res.Name)
	case res.Kind == sniff.TLS:
		return sniff.TLS, head, ""
	case res.Kind == sniff.HTTP:
		return sniff.HTTP, head, "" // every request is checked against the tunnel's name
	case pol.Check(name, dst, port).OpaqueOK:
		return sniff.Unknown, head, ""
	}
	return sniff.Unknown, head, "neither tls nor http in the tunnel to " + name + " (allow it with an explicit port for other protocols)"
}

// nameRefused says why name may not be used on a connection to dst:port
// ("" if it may): it must be a name this sandbox resolved to dst, allowed
// there by the policy.
func (l *link) nameRefused(pol *netpolicy.Policy, name string, dst netip.Addr, port uint16) string {
	if name == "" {
		return "no name"
	}
	if !l.bindings.has(name, dst) {
		return fmt.Sprintf("not resolved to %s by this sandbox", dst)
	}
	if v := pol.Check(name, dst, port); !v.Allow {
		return v.Reason
	}
	return ""
}

func hostHeader(name string, port int) string {
	if port == 0 {
		if ip, err := netip.ParseAddr(name); err == nil && ip.Is6() {
			return "[" + name + "]"
		}
		return name
	}
	return net.JoinHostPort(name, strconv.Itoa(port))
}

var errNotHTTP = errors.New("not an HTTP/1.x request")

// maxEmptyLines bounds the empty lines skipped before a request line.
const maxEmptyLines = 8

// readRequest reads the next request from br: its head strictly
// (sniff.ParseRequestHead: the rules the first request met), then with
// net/http, which frames the body the strict rules left unambiguous. Empty
// lines before the request line (RFC 9112 §2.2 lets servers skip them) are
// dropped here, never forwarded. io.EOF: the stream ended between requests.
func readRequest(br *bufio.Reader) (*http.Request, sniff.Result, error) {
	for i := 0; ; i++ {
		b, err := br.Peek(2)
		if len(b) == 0 && err != nil {
			return nil, sniff.Result{}, err
		}
		if len(b) < 2 || b[0] != '\r' || b[1] != '\n' {
			break
		}
		if i == maxEmptyLines {
			return nil, sniff.Result{}, fmt.Errorf("%w: more than %d empty lines before a request", sniff.ErrMalformed, maxEmptyLines)
		}
		_, _ = br.Discard(2)
	}
	if err := bufferHead(br); err != nil {
		switch err {
		case io.EOF:
			err = io.ErrUnexpectedEOF
		case errHeadTooLarge:
			err = fmt.Errorf("request head over %d KiB", br.Size()>>10)
		}
		return nil, sniff.Result{}, err
	}
	b, _ := br.Peek(br.Buffered())
	end := bytes.Index(b, []byte("\r\n\r\n"))
	if end < 0 {
		return nil, sniff.Result{}, fmt.Errorf("%w: a line not ended by CRLF", sniff.ErrMalformed)
	}
	res := sniff.ParseRequestHead(b[:end])
	if res.Kind != sniff.HTTP {
		return nil, res, errNotHTTP
	}
	if res.Err != nil {
		return nil, res, res.Err
	}
	req, err := http.ReadRequest(br)
	if err != nil {
		return nil, res, fmt.Errorf("%w: %v", sniff.ErrMalformed, err)
	}
	if req.Method != res.Method {
		return nil, res, fmt.Errorf("%w: method", sniff.ErrMalformed)
	}
	return req, res, nil
}

// forwardRequest writes req (read by readRequest, res its strict parse)
// to bw from what was parsed, and flushes: the name in one canonical form
// (the sandbox chooses no letter case), the body framed by net/http
// (Content-Length, or chunked without trailers), streamed.
func forwardRequest(bw *bufio.Writer, req *http.Request, res sniff.Result) error {
	req.Host = hostHeader(res.Name, res.HostPort)
	if _, has := req.Header["User-Agent"]; !has {
		req.Header["User-Agent"] = []string{""} // Write adds Go's own otherwise
	}
	if req.Body != nil && req.Body != http.NoBody {
		req.Body = &flushingBody{ReadCloser: req.Body, w: bw}
	}
	if err := req.Write(bufferedOut{bw}); err != nil {
		return err
	}
	return bw.Flush()
}

// bufferedOut is the relay's writer upstream as Request.Write sees it: a
// ByteWriter, so Write writes into it as it is (the head stays there until
// flushingBody or the caller flushes it), and without bufio's ReadFrom,
// which would read the body into the very buffer flushingBody flushes.
type bufferedOut struct{ w *bufio.Writer }

func (b bufferedOut) Write(p []byte) (int, error) { return b.w.Write(p) }
func (b bufferedOut) WriteByte(c byte) error      { return b.w.WriteByte(c) }

// lateProof is the sandbox's side of a connection allowed for name as an
// opaque protocol (an entry with an explicit port), relayed before the
// sandbox said anything (the server may speak first). Whenever its first
// bytes come, they are proved as on any connection: a TLS ClientHello must
// name an allowed name resolved to dst, HTTP is read request by request
// (it never switches protocols here); only what is neither goes through
// unread. It returns the protocol seen and the name proved, or a *refusal.
func (l *link) lateProof(up io.Writer, c net.Conn, br *bufio.Reader, dst netip.Addr, port uint16, n *int64) (proto, name string, err error) {
	if _, err := br.Peek(1); err != nil {
		return "tcp", "", nil // nothing sent: the server spoke, or nobody did
	}
	_ = c.SetReadDeadline(time.Now().Add(peekTimeout))
	kind, why := classifyFirst(br)
	_ = c.SetReadDeadline(time.Time{})
	cw := &countingWriter{w: up, bw: l.bwOut, n: n, total: &l.bytesOut}
	refuse := func(proto, name, reason string) (string, string, error) {
		return proto, name, l.refuseOut(proto, name, dst, port, reason)
	}
	switch kind {
	case sniff.HTTP:
		if why != "" {
			return refuse("http", "", why)
		}
		err := l.httpOut(up, br, dst, port, nil, n)
		return "http", "", err
	case sniff.TLS:
		_ = c.SetReadDeadline(time.Now().Add(peekTimeout))
		head, res, perr := sniff.Peek(br, peekMax)
		_ = c.SetReadDeadline(time.Time{})
		switch {
		case perr != nil:
			return refuse("tls", "", "tls: the ClientHello did not arrive")
		case res.Err != nil:
			return refuse("tls", res.Name, "tls: "+res.Err.Error())
		case res.Name == "":
			return refuse("tls", "", "tls without sni")
		}
		if why := l.nameRefused(l.policy.Load(), res.Name, dst, port); why != "" {
			return refuse("tls", res.Name, "tls names "+res.Name+": "+why)
		}
		if _, err := cw.Write(head); err != nil {
			return "tls", res.Name, nil
		}
		pump(cw, br)
		return "tls", res.Name, nil
	}
	pump(cw, br)
	return "tcp", "", nil
}

// classifyFirst tells from the first bytes in br whether a connection
// speaks TLS, HTTP or something else, generously: anything a lenient HTTP
// server could take for a request (leading white space or empty lines, a
// method in any case, a request line with HTTP/ anywhere in it) is HTTP,
// and then must pass the strict reader. A first line that starts like a
// request line but does not end within the peek bound or the deadline is
// refused (why). The bytes stay in br.
func classifyFirst(br *bufio.Reader) (kind sniff.Kind, why string) {
	b, _ := br.Peek(1)
	if len(b) == 0 {
		return sniff.Unknown, ""
	}
	if b[0] == 0x16 {
		return sniff.TLS, ""
	}
	// Skip white space; then a token and a space or tab could begin a
	// request line: look at the whole first line.
	i := 0
	for {
		b, _ = br.Peek(i + 1)
		if len(b) <= i {
			return sniff.Unknown, "" // ended in white space
		}
		if c := b[i]; c != ' ' && c != '\t' && c != '\r' && c != '\n' {
			break
		}
		i++
		if i >= peekMax {
			return sniff.HTTP, "only white space before the peek bound"
		}
	}
	lead := i
	for {
		b, err := br.Peek(i + 1)
		if len(b) <= i {
			if err != nil && !isTimeout(err) && i > lead {
				break // ended: judge what came
			}
			if i > lead {
				return sniff.HTTP, "a first line that could be an HTTP request did not end"
			}
			return sniff.Unknown, ""
		}
		c := b[i]
		if c == ' ' || c == '\t' {
			if i == lead {
				break
			}
			// A token then a space: read up to the end of the line.
			line := b
			for !bytes.ContainsRune(line[i:], '\n') {
				if len(line) >= peekMax {
					return sniff.HTTP, "a first line that could be an HTTP request is over the peek bound"
				}
				nb, err := br.Peek(len(line) + 1)
				if len(nb) == len(line) {
					if err != nil && !isTimeout(err) {
						break
					}
					return sniff.HTTP, "a first line that could be an HTTP request did not end"
				}
				line = nb
			}
			if j := bytes.IndexByte(line, '\n'); j >= 0 {
				line = line[:j]
			}
			if bytes.Contains(bytes.ToUpper(line), []byte("HTTP/")) || lead > 0 {
				return sniff.HTTP, ""
			}
			return sniff.Unknown, ""
		}
		if !isTokenByte(c) {
			break
		}
		i++
	}
	if lead > 0 && i > lead {
		return sniff.HTTP, "" // white space, then a word: the strict reader decides
	}
	return sniff.Unknown, ""
}

func isTokenByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || bytes.IndexByte([]byte("!#$%&'*+-.^_`|~"), c) >= 0
}
