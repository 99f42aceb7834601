package template

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"

	"github.com/spacehq/space/internal/errdefs"
)

// --- registries -------------------------------------------------------------

// resolveRemote finds the image in a registry (anonymously).
func resolveRemote(ctx context.Context, src OCISource, plat v1.Platform) (*ociImage, name.Reference, error) {
	ref, err := name.ParseReference(src.Image)
	if err != nil {
		return nil, nil, invalid("bad image reference: %v", err)
	}
	loopback := isLoopbackHost(ref.Context().RegistryStr())
	if src.Insecure || loopback {
		if ref, err = name.ParseReference(src.Image, name.Insecure); err != nil {
			return nil, nil, invalid("bad image reference: %v", err)
		}
	}
	base := remote.DefaultTransport.(*http.Transport).Clone()
	if !src.AllowPrivate {
		d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second, Control: refusePrivate}
		base.DialContext = d.DialContext
	}
	rt := &registryTransport{base: base, insecure: src.Insecure, loopbackRegistry: loopback}
	img, err := remote.Image(ref, remote.WithContext(ctx), remote.WithTransport(rt),
		remote.WithPlatform(plat), remote.WithUserAgent("space"))
	if err != nil {
		return nil, nil, registryErr(err, "manifest")
	}
	mt, err := img.MediaType()
	if err != nil {
		return nil, nil, registryErr(err, "manifest")
	}
	if !manifestTypes[mt] {
		return nil, nil, invalid("unsupported manifest media type %q", mt)
	}
	raw, err := img.RawManifest()
	if err != nil {
		return nil, nil, registryErr(err, "manifest")
	}
	if len(raw) > maxManifestBytes {
		return nil, nil, invalid("manifest is %d bytes (limit %d)", len(raw), maxManifestBytes)
	}
	var m v1.Manifest
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, nil, invalid("manifest is not valid JSON: %v", err)
	}
	if err := checkManifest(&m); err != nil {
		return nil, nil, err
	}
	cb, err := img.RawConfigFile() // size checked by checkManifest, digest by go-containerregistry
	if err != nil {
		return nil, nil, registryErr(err, "image config")
	}
	cfg, err := parseConfig(cb, len(m.Layers), plat)
	if err != nil {
		return nil, nil, err
	}
	out := &ociImage{config: cfg}
	for _, l := range m.Layers {
		l := l
		out.layers = append(out.layers, ociLayer{digest: l.Digest, size: l.Size, mediaType: l.MediaType,
			open: func(context.Context) (io.ReadCloser, error) {
				cl, err := img.LayerByDigest(l.Digest)
				if err != nil {
					return nil, registryErr(err, "layer")
				}
				rc, err := cl.Compressed()
				if err != nil {
					return nil, registryErr(err, "layer blob")
				}
				return rc, nil
			}})
	}
	return out, ref, nil
}

// registryErr maps registry failures to sentinels: a missing manifest or
// platform is ErrNotFound, a missing blob or a verification failure (the
// registry served something else than the digest names) ErrInvalidArgument,
// a refusal of anonymous access ErrInvalidArgument, anything else (network)
// ErrUnavailable.
func registryErr(err error, what string) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	if errors.Is(err, errdefs.ErrInvalidArgument) {
		return err
	}
	// Registry errors quote response bodies: keep what reaches an API
	// client short (and a hostile registry's text bounded).
	err = shortErr{err}
	var te *transport.Error
	if errors.As(err, &te) {
		switch {
		case te.StatusCode == http.StatusNotFound && what == "manifest":
			return fmt.Errorf("%s: %w: %w", what, err, errdefs.ErrNotFound)
		case te.StatusCode == http.StatusNotFound:
			return invalid("%s missing in the registry: %v", what, err)
		case te.StatusCode == http.StatusUnauthorized || te.StatusCode == http.StatusForbidden:
			return invalid("the registry refused anonymous access to the %s: %v", what, err)
		}
		return fmt.Errorf("%s: %w: %w", what, err, errdefs.ErrUnavailable)
	}
	msg := err.Error()
	switch {
	case strings.Contains(msg, "no child with platform"):
		return fmt.Errorf("%s: %w: %w", what, err, errdefs.ErrNotFound)
	case strings.Contains(msg, "error verifying"), strings.Contains(msg, "does not match"):
		return invalid("%s: digest or size mismatch: %v", what, err)
	case strings.Contains(msg, "refusing"):
		return invalid("%v", err)
	}
	return fmt.Errorf("%s: %w: %w", what, err, errdefs.ErrUnavailable)
}

// shortErr bounds an error's text, keeping it for errors.As/Is.
type shortErr struct{ err error }

func (e shortErr) Error() string {
	const max = 400
	if m := e.err.Error(); len(m) > max {
		return m[:max] + "…"
	}
	return e.err.Error()
}
func (e shortErr) Unwrap() error { return e.err }

// refusePrivate is a net.Dialer Control: it sees the resolved address.
func refusePrivate(network, address string, _ syscall.RawConn) error {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return err
	}
	ip := net.ParseIP(host)
	if ip == nil || ip.IsLoopback() || ip.IsPrivate() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() ||
		ip.IsUnspecified() || ip.IsMulticast() {
		return fmt.Errorf("refusing to connect to %s: registries on loopback, private or link-local addresses are not allowed by this server: %w",
			host, errdefs.ErrInvalidArgument)
	}
	return nil
}

func isLoopbackHost(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// registryTransport enforces the plain-HTTP policy on every request
// (go-containerregistry falls back to HTTP for private addresses on its
// own) and keeps a remote registry from redirecting us to this host.
type registryTransport struct {
	base             http.RoundTripper
	insecure         bool
	loopbackRegistry bool
}

func (t *registryTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if err := t.allow(req.URL.Scheme, req.URL.Host); err != nil {
		return nil, err
	}
	return t.base.RoundTrip(req)
}

func (t *registryTransport) allow(scheme, host string) error {
	loop := isLoopbackHost(host)
	if loop && !t.loopbackRegistry {
		return fmt.Errorf("refusing a request to loopback address %s for a registry that is not on this host", host)
	}
	if scheme == "http" && !loop && !t.insecure {
		return fmt.Errorf("refusing plain HTTP to registry %s (not a loopback address; allow it with insecure)", host)
	}
	return nil
}
