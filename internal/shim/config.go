package shim

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"

	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/netpolicy"
)

// Config is the shim's configuration file, named by the runtime's
// `options.ConfigPath` in containerd's config (one file per RuntimeClass
// handler). JSON:
//
//	{"server": "unix:///run/space.sock", "api_key_file": "/etc/space/shim.key",
//	 "runtime": "gvisor", "template": "base:latest"}
type Config struct {
	// Server is the space server: "unix:///path" or "http://127.0.0.1:port".
	Server string `json:"server"`
	// APIKeyFile holds the API key (one line); it is read at each load.
	APIKeyFile string `json:"api_key_file"`
	// Runtime is the sandbox runtime: "auto" (default), "gvisor",
	// "microvm" or "native"; a pod's space.dev/runtime annotation overrides.
	Runtime string `json:"runtime,omitempty"`
	// Template is the sandbox template (default "base:latest"); the pod's
	// space.dev/template annotation overrides.
	Template string `json:"template,omitempty"`
	// AllowedRuntimes are the runtimes a pod's space.dev/runtime annotation
	// may choose. Default: only Runtime itself — a RuntimeClass is the
	// cluster admin's choice of isolation, and a pod author must not turn
	// space-gvisor into native with an annotation.
	AllowedRuntimes []string `json:"allowed_runtimes,omitempty"`

	apiKey string
	path   string
}

// Runtimes the shim accepts in its config and in space.dev/runtime.
var Runtimes = []string{"auto", "gvisor", "microvm", "native"}

// LoadConfig reads and checks the config file at path and its key file.
func LoadConfig(path string) (*Config, error) {
	if path == "" {
		return nil, fmt.Errorf("space shim: no config file: set options.ConfigPath of this runtime in containerd's config")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("space shim: reading config: %w", err)
	}
	var c Config
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("space shim: config %s: %w", path, err)
	}
	c.path = path
	if c.Server == "" {
		return nil, fmt.Errorf("space shim: config %s: server is required", path)
	}
	if c.Runtime == "" {
		c.Runtime = "auto"
	}
	if !validRuntime(c.Runtime) {
		return nil, fmt.Errorf("space shim: config %s: runtime %q is not one of %s", path, c.Runtime, strings.Join(Runtimes, ", "))
	}
	if c.Template == "" {
		c.Template = "base:latest"
	}
	for _, r := range c.AllowedRuntimes {
		if !validRuntime(r) {
			return nil, fmt.Errorf("space shim: config %s: allowed_runtimes: %q is not one of %s", path, r, strings.Join(Runtimes, ", "))
		}
	}
	if c.APIKeyFile != "" {
		k, err := os.ReadFile(c.APIKeyFile)
		if err != nil {
			return nil, fmt.Errorf("space shim: config %s: api_key_file: %w", path, err)
		}
		c.apiKey = strings.TrimSpace(string(k))
	}
	return &c, nil
}

// allowedRuntimes is AllowedRuntimes, or the configured runtime alone.
func (c *Config) allowedRuntimes() []string {
	if len(c.AllowedRuntimes) > 0 {
		return c.AllowedRuntimes
	}
	return []string{c.Runtime}
}

func validRuntime(r string) bool {
	for _, x := range Runtimes {
		if r == x {
			return true
		}
	}
	return false
}

// ConfigPathFromOptions returns the ConfigPath of containerd's runtime
// options (a runtimeoptions.v1.Options in an Any, as Create carries them);
// "" when there are none.
func ConfigPathFromOptions(opts *anypb.Any) (string, error) {
	if opts == nil || len(opts.GetValue()) == 0 {
		return "", nil
	}
	var o runtimeoptions.Options
	if err := proto.Unmarshal(opts.GetValue(), &o); err != nil {
		return "", fmt.Errorf("space shim: runtime options (%s): %w", opts.GetTypeUrl(), err)
	}
	return o.GetConfigPath(), nil
}

// Pod annotations (CRI passes them when containerd's runtime lists
// "space.dev/*" in pod_annotations).
const (
	AnnotationRuntime  = "space.dev/runtime"
	AnnotationTemplate = "space.dev/template"
	AnnotationEgress   = "space.dev/egress"
)

// CRI's annotations on the specs it hands the runtime.
const (
	criContainerType    = "io.kubernetes.cri.container-type"
	criContainerTypeBox = "sandbox"
	criSandboxID        = "io.kubernetes.cri.sandbox-id"
	criSandboxName      = "io.kubernetes.cri.sandbox-name"
	criSandboxNamespace = "io.kubernetes.cri.sandbox-namespace"
	criSandboxUID       = "io.kubernetes.cri.sandbox-uid"
	criContainerName    = "io.kubernetes.cri.container-name"
)

// Labels the shim puts on a pod's sandbox, so an operator (and `delete`)
// can find it.
const (
	LabelContainerdID = "space.dev/containerd-id"
	LabelContainerdNS = "space.dev/containerd-namespace"
	LabelPodNamespace = "space.dev/k8s-namespace"
	LabelPodName      = "space.dev/k8s-pod"
	LabelPodUID       = "space.dev/k8s-pod-uid"
)

// SandboxRequest builds the create request of a pod's sandbox from the
// shim's config and the pod's annotations. An unknown annotation under
// space.dev/ or a bad value is an error naming it (it reaches kubectl as
// the pod's event).
func SandboxRequest(c *Config, ns, id string, ann map[string]string) (api.CreateSandboxRequest, error) {
	req := api.CreateSandboxRequest{Runtime: c.Runtime, Template: c.Template, Labels: map[string]string{
		LabelContainerdID: id,
		LabelContainerdNS: ns,
	}}
	for k, v := range map[string]string{LabelPodNamespace: ann[criSandboxNamespace], LabelPodName: ann[criSandboxName], LabelPodUID: ann[criSandboxUID]} {
		if v != "" {
			req.Labels[k] = v
		}
	}
	for k, v := range ann {
		if !strings.HasPrefix(k, "space.dev/") {
			continue
		}
		switch k {
		case AnnotationRuntime:
			if !validRuntime(v) {
				return req, fmt.Errorf("annotation %s=%q: runtime must be one of %s", k, v, strings.Join(Runtimes, ", "))
			}
			if allowed := c.allowedRuntimes(); !slices.Contains(allowed, v) {
				return req, fmt.Errorf("annotation %s=%q: this RuntimeClass allows %s (the shim config's allowed_runtimes)", k, v, strings.Join(allowed, ", "))
			}
			req.Runtime = v
		case AnnotationTemplate:
			if v == "" || len(v) > 256 || strings.ContainsAny(v, " \t\r\n\x00") {
				return req, fmt.Errorf("annotation %s=%q: want a template reference such as base:latest or sha256:…", k, v)
			}
			req.Template = v
		case AnnotationEgress:
			p, err := ParseEgress(v)
			if err != nil {
				return req, fmt.Errorf("annotation %s=%q: %w", k, v, err)
			}
			req.Network = &p
		default:
			return req, fmt.Errorf("annotation %s is not one the space runtime knows (%s, %s, %s)", k, AnnotationRuntime, AnnotationTemplate, AnnotationEgress)
		}
	}
	return req, nil
}

// ParseEgress parses space.dev/egress: comma-separated allowed
// destinations (as api.NetworkPolicy.AllowOut: a domain, "*.suffix", an IP
// or a CIDR, each with an optional ":port"), "private=CIDR" for an
// AllowPrivate entry (a private range the allowed names may lead into),
// "internet" for every public destination, or "none" for nothing (the
// default without the annotation).
func ParseEgress(v string) (api.NetworkPolicy, error) {
	var p api.NetworkPolicy
	v = strings.TrimSpace(v)
	if v == "none" {
		return p, nil
	}
	for _, e := range strings.Split(v, ",") {
		e = strings.TrimSpace(e)
		switch e {
		case "":
			return p, fmt.Errorf("empty destination in the list")
		case "internet":
			p.Internet = true
		default:
			if r, ok := strings.CutPrefix(e, "private="); ok {
				p.AllowPrivate = append(p.AllowPrivate, r)
				continue
			}
			p.AllowOut = append(p.AllowOut, e)
		}
	}
	if err := netpolicy.Validate(p); err != nil {
		return p, err
	}
	return p, nil
}
