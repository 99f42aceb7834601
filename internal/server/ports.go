package server

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/sandbox"
)

// Ingress: a service listening inside a sandbox, reached through the
// server. Two HTTP forms reach the same place:
//
//   - host-routed: any request whose Host is <port>-<id>.<anything>
//     (http://8000-sb-x.localhost:7070/…) is proxied before the API mux
//     sees it, path unchanged;
//   - path-routed: /v1/sandboxes/{id}/ports/{port}/{path...}, the prefix
//     stripped.
//
// and /v1/sandboxes/{id}/ports/{port}/tcp (a WebSocket) carries one raw
// TCP connection (space port-forward). Every byte goes through the
// sandbox's own NIC: Networking.DialPort → the gateway dials the sandbox's
// address from its side of the link.
//
// A port is reached with the sandbox's access token (header
// X-Space-Port-Token, query space_token — kept then in a cookie for that
// host —, or the API key), unless the sandbox made it public. The token is
// an HMAC, under a server secret kept in the data directory, of the
// sandbox's id and creation time: nothing to store, different for every
// sandbox ever created, and useless once the sandbox is deleted. Deleting
// the secret file revokes every token at the next server start.

// portSecretFile is the HMAC key of the access tokens, in the data dir.
const portSecretFile = "port-token-key"

func loadOrCreatePortSecret(dir string) ([]byte, error) {
	p := filepath.Join(dir, portSecretFile)
	if b, err := os.ReadFile(p); err == nil {
		k, err := hex.DecodeString(strings.TrimSpace(string(b)))
		if err != nil || len(k) < 16 {
			return nil, fmt.Errorf("%s does not hold a hex key of at least 16 bytes", p)
		}
		return k, nil
	}
	k := make([]byte, 32)
	if _, err := rand.Read(k); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	if _, err := f.WriteString(hex.EncodeToString(k) + "\n"); err != nil {
		f.Close()
		return nil, err
	}
	return k, f.Close()
}

// portToken is sandbox sb's access token; "" when the server has no
// secret (then only the API key opens a port).
func (part portsAPI) portToken(sb api.Sandbox) string {
	s := part.s
	if len(s.portSecret) == 0 {
		return ""
	}
	m := hmac.New(sha256.New, s.portSecret)
	fmt.Fprintf(m, "space port token v1\x00%s\x00%d", sb.ID, sb.CreatedAt.UnixNano())
	return "spt_" + base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// parsePort reads a {port} path value.
func parsePort(v string) (int, error) {
	n, err := strconv.Atoi(v)
	if err != nil || len(v) > 5 {
		return 0, fmt.Errorf("port must be a number 1..65535, got %q: %w", truncateQuery(v), errdefs.ErrInvalidArgument)
	}
	if err := sandbox.ValidPort(n); err != nil {
		return 0, err
	}
	return n, nil
}

// portInfo describes how to reach port of sb, in the URLs of the server
// as r reached it.
func (part portsAPI) portInfo(r *http.Request, sb api.Sandbox, port int, ttl time.Duration) api.PortInfo {
	s := part.s
	exp := time.Now().Add(ttl).Truncate(time.Second).UTC()
	scheme := requestScheme(r)
	domain := (portsAPI{s}).portDomain(r)
	return api.PortInfo{
		Port:           port,
		URL:            fmt.Sprintf("%s://%d-%s.%s/", scheme, port, sb.ID, domain),
		PathURL:        fmt.Sprintf("%s://%s/v1/sandboxes/%s/ports/%d/", scheme, r.Host, sb.ID, port),
		Token:          (portsAPI{s}).portTokenUntil(sb, exp),
		Public:         sb.AllPortsPublic || slices.Contains(sb.PublicPorts, port),
		TokenExpiresAt: &exp,
	}
}

// Port tokens handed out by the native API expire; ttl bounds.
const (
	defaultPortTokenTTL = 24 * time.Hour
	maxPortTokenTTL     = 30 * 24 * time.Hour
)

// portTokenTTL reads the ttl query parameter of a port info request.
func portTokenTTL(r *http.Request) (time.Duration, error) {
	v := r.URL.Query().Get("ttl")
	if v == "" {
		return defaultPortTokenTTL, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < time.Minute || d > maxPortTokenTTL {
		return 0, fmt.Errorf("ttl must be a duration between 1m and %s, got %q: %w", maxPortTokenTTL, truncateQuery(v), errdefs.ErrInvalidArgument)
	}
	return d, nil
}

// portTokenUntil is an access token to sb's ports that expires at exp:
// "spt2.<unix exp>.<HMAC of sandbox id, creation time and exp>". Like the
// sandbox-lifetime token (portToken, E2B's traffic token) it opens one
// sandbox only, and nothing once the sandbox is deleted.
func (part portsAPI) portTokenUntil(sb api.Sandbox, exp time.Time) string {
	s := part.s
	if len(s.portSecret) == 0 {
		return ""
	}
	m := hmac.New(sha256.New, s.portSecret)
	fmt.Fprintf(m, "space port token v2\x00%s\x00%d\x00%d", sb.ID, sb.CreatedAt.UnixNano(), exp.Unix())
	return fmt.Sprintf("spt2.%d.%s", exp.Unix(), base64.RawURLEncoding.EncodeToString(m.Sum(nil)))
}

// validPortToken reports whether v opens sb's ports at now.
func (part portsAPI) validPortToken(sb api.Sandbox, v string, now time.Time) bool {
	s := part.s
	if v == "" || len(s.portSecret) == 0 {
		return false
	}
	if rest, ok := strings.CutPrefix(v, "spt2."); ok {
		expS, _, ok := strings.Cut(rest, ".")
		exp, err := strconv.ParseInt(expS, 10, 64)
		if !ok || err != nil || now.Unix() >= exp {
			return false
		}
		want := (portsAPI{s}).portTokenUntil(sb, time.Unix(exp, 0))
		return subtle.ConstantTimeCompare([]byte(v), []byte(want)) == 1
	}
	want := (portsAPI{s}).portToken(sb)
	return subtle.ConstantTimeCompare([]byte(v), []byte(want)) == 1
}

// portDomain is the domain of host-routed port URLs as r reached the
// server: --port-domain, else r's host (a loopback one as localhost).
func (part portsAPI) portDomain(r *http.Request) string {
	s := part.s
	domain := s.cfg.PortDomain
	if domain == "" {
		// Names under .localhost are loopback (RFC 6761): a server reached
		// by a loopback address or name gets <port>-<id>.localhost.
		host, hport, err := net.SplitHostPort(r.Host)
		if err != nil {
			host, hport = r.Host, ""
		}
		domain = host
		if a, err := netip.ParseAddr(strings.Trim(host, "[]")); (err == nil && a.IsLoopback()) || host == "localhost" || host == "" || strings.HasPrefix(r.Host, "unix") {
			domain = "localhost"
		}
		if hport != "" {
			domain += ":" + hport
		}
	}
	return domain
}

func (part portsAPI) getPort(w http.ResponseWriter, r *http.Request) {
	s := part.s
	port, err := parsePort(r.PathValue("port"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	ttl, err := portTokenTTL(r)
	if err != nil {
		writeError(w, r, err)
		return
	}
	sb, err := s.mgr.Get(r.Context(), r.PathValue("id"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, (portsAPI{s}).portInfo(r, sb, port, ttl))
}

func (part portsAPI) putPort(w http.ResponseWriter, r *http.Request) {
	s := part.s
	port, err := parsePort(r.PathValue("port"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	var ps api.PortSettings
	if err := decodeJSON(w, r, &ps); err != nil {
		writeError(w, r, err)
		return
	}
	sb, err := s.mgr.Networking().SetPortPublic(r.Context(), r.PathValue("id"), port, ps.Public)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, (portsAPI{s}).portInfo(r, sb, port, defaultPortTokenTTL))
}

// hostRoute reports whether host (a Host header) names a sandbox port:
// <port>-<id>.<anything>. A port out of range still routes (and is
// refused there), so the caller learns why.
func hostRoute(host string) (id, port string, ok bool) {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	label, rest, dot := strings.Cut(host, ".")
	if !dot || rest == "" {
		return "", "", false
	}
	port, id, dash := strings.Cut(strings.ToLower(label), "-")
	if !dash || port == "" || len(port) > 6 || strings.Trim(port, "0123456789") != "" || sandbox.ValidID(id) != nil {
		return "", "", false
	}
	return id, port, true
}

// proxyTarget is what a proxied request is going to.
type proxyTarget struct {
	id   string
	port int
	// path and rawPath replace the request's (path-routed); empty: kept.
	path, rawPath string
}

// authorizePort checks the caller may reach port of sandbox id and removes
// the credentials it presented from r (the service never sees them). It
// returns the sandbox; cookie reports whether a token came in the query
// (the response should keep it in a cookie). tcp: the raw tunnel, which
// takes no cookie (a browser never needs it).
func (part portsAPI) authorizePort(r *http.Request, id string, port int, tcp bool) (sb api.Sandbox, token string, fromQuery bool, err error) {
	s := part.s
	sb, err = s.mgr.Get(r.Context(), id)
	if err != nil {
		return sb, "", false, err
	}
	matches := func(v string) bool { return (portsAPI{s}).validPortToken(sb, v, time.Now()) }
	ok := sb.AllPortsPublic || slices.Contains(sb.PublicPorts, port)
	// API key: only an Authorization that is the key is consumed; the
	// service's own Authorization passes through.
	// The key must see the sandbox's tenant and may read its ports.
	if bearer, has := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); has {
		if p, err := s.keys.Authenticate(bearer); err == nil {
			if p.Sees(sb.Tenant) && p.Can(principal.ScopeNetworkRead) {
				ok = true
			}
			r.Header.Del("Authorization")
		}
	}
	// Through a cluster replica, the caller it vouches for.
	if p, fromReplica, err := replicaPrincipal(r); fromReplica && err == nil && p.Sees(sb.Tenant) && p.Can(principal.ScopeNetworkRead) {
		ok = true
	}
	// E2B's SDK users send the traffic token in e2b-traffic-access-token.
	for _, hdr := range []string{api.PortTokenHeader, "E2b-Traffic-Access-Token"} {
		if v := r.Header.Get(hdr); v != "" {
			ok = ok || matches(v)
			r.Header.Del(hdr)
		}
	}
	q := r.URL.Query()
	if v := q.Get(api.PortTokenQuery); v != "" || q.Has(api.PortTokenQuery) {
		if matches(v) {
			ok, fromQuery, token = true, !tcp, v
		}
		q.Del(api.PortTokenQuery)
		r.URL.RawQuery = q.Encode()
	}
	if c, cerr := r.Cookie(api.PortTokenCookie); cerr == nil {
		ok = ok || (!tcp && matches(c.Value))
		removeCookie(r, api.PortTokenCookie)
	}
	if !ok {
		return sb, "", false, fmt.Errorf("port %d of sandbox %s needs the sandbox's access token (header %s, query %s= or the API key; `space port %s %d` prints it) unless it is made public: %w",
			port, id, api.PortTokenHeader, api.PortTokenQuery, id, port, errdefs.ErrUnauthorized)
	}
	return sb, token, fromQuery, nil
}

// removeCookie drops one cookie from r's Cookie headers, keeping the rest.
func removeCookie(r *http.Request, name string) {
	cs := r.Cookies()
	r.Header.Del("Cookie")
	var keep []string
	for _, c := range cs {
		if c.Name != name {
			keep = append(keep, c.Name+"="+c.Value)
		}
	}
	if len(keep) > 0 {
		r.Header.Set("Cookie", strings.Join(keep, "; "))
	}
}

type proxyTargetKey struct{}

// proxyPort authorizes r for port of sandbox id and proxies it. cookiePath
// scopes the cookie that keeps a token given in the query.
func (part portsAPI) proxyPort(w http.ResponseWriter, r *http.Request, id, portStr string, t proxyTarget, cookiePath string) {
	s := part.s
	port, err := parsePort(portStr)
	if err != nil {
		writeError(w, r, err)
		return
	}
	_, token, fromQuery, err := (portsAPI{s}).authorizePort(r, id, port, false)
	if err != nil {
		writeError(w, r, err)
		return
	}
	// Wake it (a kept-alive connection to a paused sandbox would not) and
	// hold it active while the request lasts.
	release, err := s.mgr.Hold(r.Context(), id)
	if err != nil {
		writeError(w, r, err)
		return
	}
	defer release()
	if fromQuery {
		http.SetCookie(w, &http.Cookie{Name: api.PortTokenCookie, Value: token, Path: cookiePath,
			HttpOnly: true, SameSite: http.SameSiteLaxMode, Secure: requestScheme(r) == "https"})
	}
	t.id, t.port = id, port
	ctx := context.WithValue(r.Context(), proxyTargetKey{}, t)
	(portsAPI{s}).proxy().ServeHTTP(w, r.WithContext(ctx))
}

// proxyPath is /v1/sandboxes/{id}/ports/{port}/{path...}.
func (part portsAPI) proxyPath(w http.ResponseWriter, r *http.Request) {
	s := part.s
	id, portStr := r.PathValue("id"), r.PathValue("port")
	prefix := "/v1/sandboxes/" + id + "/ports/" + portStr
	raw := strings.TrimPrefix(r.URL.EscapedPath(), prefix)
	if raw == "" || raw[0] != '/' {
		raw = "/" + raw
	}
	p, err := url.PathUnescape(raw)
	if err != nil {
		writeError(w, r, fmt.Errorf("bad path escape: %w", errdefs.ErrInvalidArgument))
		return
	}
	(portsAPI{s}).proxyPort(w, r, id, portStr, proxyTarget{path: p, rawPath: raw}, prefix+"/")
}

// proxyHost serves a host-routed request.
func (part portsAPI) proxyHost(w http.ResponseWriter, r *http.Request, id, port string) {
	s := part.s
	(portsAPI{s}).proxyPort(w, r, id, port, proxyTarget{}, "/")
}

// proxy is the reverse proxy of every port request: one per server, with
// a transport that keeps connections per sandbox and port (the dial
// address is "<id>:<port>") and dials through the sandbox's NIC.
func (part portsAPI) proxy() *httputil.ReverseProxy {
	s := part.s
	s.proxyOnce.Do(func() {
		tr := &http.Transport{
			Proxy: nil,
			DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
				id, p, err := net.SplitHostPort(addr)
				if err != nil {
					return nil, err
				}
				port, err := strconv.Atoi(p)
				if err != nil {
					return nil, err
				}
				return s.mgr.Networking().DialPort(ctx, id, port)
			},
			MaxIdleConnsPerHost: 8,
			// An idle kept-alive connection holds its sandbox active: not
			// for long, so the idle policy can act.
			IdleConnTimeout:    30 * time.Second,
			DisableCompression: true,
		}
		s.proxyRP = &httputil.ReverseProxy{
			Rewrite: func(pr *httputil.ProxyRequest) {
				t := pr.In.Context().Value(proxyTargetKey{}).(proxyTarget)
				pr.Out.URL.Scheme = "http"
				pr.Out.URL.Host = fmt.Sprintf("%s:%d", t.id, t.port)
				if t.path != "" {
					pr.Out.URL.Path, pr.Out.URL.RawPath = t.path, t.rawPath
				}
				pr.Out.URL.RawQuery = pr.In.URL.RawQuery
				pr.SetXForwarded()
				pr.Out.Header.Set(ForwardedProtoHeader, requestScheme(pr.In))
				// A cluster replica's word about its caller is for this
				// node, never for the sandbox.
				pr.Out.Header.Del(PrincipalHeader)
				pr.Out.Host = pr.In.Host // the service sees the name it was reached by
			},
			Transport:     tr,
			FlushInterval: -1, // stream (server-sent events, long polls) as it comes
			ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
				if r.Context().Err() != nil {
					return // the client went away
				}
				t := r.Context().Value(proxyTargetKey{}).(proxyTarget)
				if errdefs.Code(err) == api.CodeInternal {
					err = fmt.Errorf("port %d of sandbox %s: %v: %w", t.port, t.id, err, errdefs.ErrUnavailable)
				}
				writeError(w, r, err)
			},
		}
	})
	return s.proxyRP
}

// portTCP is GET /v1/sandboxes/{id}/ports/{port}/tcp: one raw TCP
// connection to the port, carried over a WebSocket as binary messages. An
// empty message is a half-close of the direction it travels in. A request
// that is not a WebSocket handshake is proxied like any path.
func (part portsAPI) portTCP(w http.ResponseWriter, r *http.Request) {
	s := part.s
	if !strings.EqualFold(r.Header.Get("Upgrade"), "websocket") {
		(portsAPI{s}).proxyPath(w, r)
		return
	}
	id := r.PathValue("id")
	port, err := parsePort(r.PathValue("port"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	if _, _, _, err := (portsAPI{s}).authorizePort(r, id, port, true); err != nil {
		writeError(w, r, err)
		return
	}
	conn, err := s.mgr.Networking().DialPort(r.Context(), id, port)
	if err != nil {
		writeError(w, r, err)
		return
	}
	defer conn.Close()
	ws, err := websocket.Accept(w, r, &websocket.AcceptOptions{InsecureSkipVerify: true})
	if err != nil {
		return
	}
	defer ws.CloseNow()
	ws.SetReadLimit(tunnelChunk + 1024)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := tunnel(ctx, ws, conn); err != nil {
		ws.Close(websocket.StatusInternalError, truncateReason(err.Error()))
		return
	}
	ws.Close(websocket.StatusNormalClosure, "")
}

func truncateReason(s string) string {
	if len(s) > 120 {
		return s[:120]
	}
	return s
}

// tunnelChunk bounds one binary message of a TCP tunnel.
const tunnelChunk = 32 << 10

// tunnel carries conn's bytes over ws both ways until both directions
// have ended: binary messages of data, an empty binary message for the end
// of a direction (passed on as a half-close). The same on both ends of
// `space port-forward`.
func tunnel(ctx context.Context, ws *websocket.Conn, conn net.Conn) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	fail := func(err error) {
		mu.Lock()
		if first == nil && err != nil {
			first = err
		}
		mu.Unlock()
		cancel()
		conn.Close()
	}
	wg.Add(1)
	go func() { // conn → ws
		defer wg.Done()
		buf := make([]byte, tunnelChunk)
		for {
			n, err := conn.Read(buf)
			if n > 0 {
				if werr := ws.Write(ctx, websocket.MessageBinary, buf[:n]); werr != nil {
					fail(nil)
					return
				}
			}
			if err != nil {
				if !errors.Is(err, io.EOF) {
					fail(nil)
					return
				}
				_ = ws.Write(ctx, websocket.MessageBinary, nil)
				return
			}
		}
	}()
	// ws → conn
	for {
		typ, b, err := ws.Read(ctx)
		if err != nil {
			fail(nil) // the peer went away or closed: the tunnel ends
			break
		}
		if typ != websocket.MessageBinary {
			fail(errors.New("tunnel messages must be binary"))
			break
		}
		if len(b) == 0 {
			if cw, ok := conn.(interface{ CloseWrite() error }); ok {
				_ = cw.CloseWrite()
			} else {
				conn.Close()
			}
			// Only the other direction is left.
			wg.Wait()
			return nil
		}
		if _, err := conn.Write(b); err != nil {
			fail(nil)
			break
		}
	}
	wg.Wait()
	return first
}
