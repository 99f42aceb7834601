package templatesvc

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/template"
)

// Owners records which tenant owns each template tag. A tag nobody owns
// is shared: every tenant sees it, only an admin moves or removes it.
type Owners interface {
	TagOwner(ctx context.Context, tag string) (tenant string, err error)
	SetTagOwner(ctx context.Context, tag, tenant string) error
}

// caller is the principal in ctx; without one (the server's own work) or
// with admin, everything is visible and writable.
func caller(ctx context.Context) (principal.Principal, bool) {
	p, ok := principal.From(ctx)
	if !ok || p.Admin() {
		return principal.Principal{}, false
	}
	return p, true
}

// seesTag reports whether the caller in ctx may see tag.
func (s *Service) seesTag(ctx context.Context, tag string) (bool, error) {
	p, limited := caller(ctx)
	if !limited || s.cfg.Owners == nil {
		return true, nil
	}
	owner, err := s.cfg.Owners.TagOwner(ctx, tag)
	if err != nil {
		return false, err
	}
	return owner == "" || owner == p.Tenant, nil
}

// visible is t as the caller in ctx sees it: only the tags it may see; ok
// is false if it may see none (another tenant's template, or an untagged
// one: a tenant names templates by its tags).
func (s *Service) visible(ctx context.Context, t api.Template) (api.Template, bool, error) {
	if _, limited := caller(ctx); !limited || s.cfg.Owners == nil {
		return t, true, nil
	}
	var tags []string
	for _, tag := range t.Tags {
		ok, err := s.seesTag(ctx, tag)
		if err != nil {
			return t, false, err
		}
		if ok {
			tags = append(tags, tag)
		}
	}
	t.Tags = tags
	return t, len(tags) > 0, nil
}

// notFound is the error for a template the caller may not see: the same
// as for one that does not exist.
func notFound(ref string) error {
	return fmt.Errorf("template %q not found: %w", ref, errdefs.ErrNotFound)
}

// checkVisible returns the template ref names if the caller may see it: a
// tag it may see, or a digest of a template with such a tag.
func (s *Service) checkVisible(ctx context.Context, ref string, t api.Template) (api.Template, error) {
	if !strings.HasPrefix(ref, "sha256:") {
		if tag, err := template.ParseTag(ref); err == nil {
			ok, err := s.seesTag(ctx, tag)
			if err != nil {
				return api.Template{}, err
			}
			if !ok {
				return api.Template{}, notFound(ref)
			}
		}
	}
	t, ok, err := s.visible(ctx, t)
	if err != nil {
		return api.Template{}, err
	}
	if !ok {
		return api.Template{}, notFound(ref)
	}
	return t, nil
}

// Usable checks that the caller in ctx may use template t, which ref
// names and the caller looked up itself (a create's plan): Visible
// without a second lookup.
func (s *Service) Usable(ctx context.Context, ref string, t api.Template) error {
	_, err := s.checkVisible(ctx, ref, t)
	return err
}

// Visible checks that the caller in ctx may use template ref (create a
// sandbox from it, build FROM it); the error is ErrNotFound otherwise.
func (s *Service) Visible(ctx context.Context, ref string) error {
	_, err := s.Get(ctx, ref)
	return err
}

// claimTags checks that the caller in ctx may point each of tags at a new
// template: a tag it owns, or a new one. It returns the normalised tags.
func (s *Service) claimTags(ctx context.Context, tags []string) ([]string, error) {
	p, limited := caller(ctx)
	if !limited || s.cfg.Owners == nil {
		return tags, nil
	}
	var out []string
	for _, raw := range tags {
		tag, err := template.ParseTag(raw)
		if err != nil {
			return nil, err
		}
		owner, err := s.cfg.Owners.TagOwner(ctx, tag)
		if err != nil {
			return nil, err
		}
		if owner == p.Tenant {
			out = append(out, tag)
			continue
		}
		if owner != "" {
			// Another tenant's name: taken, without saying by whom.
			return nil, fmt.Errorf("template tag %s is taken; choose another name: %w", tag, errdefs.ErrConflict)
		}
		if _, err := s.cfg.Templates.Get(ctx, tag); err == nil {
			return nil, fmt.Errorf("template tag %s is shared; only an admin key may move it: %w", tag, errdefs.ErrPermissionDenied)
		}
		out = append(out, tag)
	}
	return out, nil
}

// ownTags records the caller's tenant as the owner of tags it just made.
func (s *Service) ownTags(ctx context.Context, tags []string) error {
	p, limited := caller(ctx)
	if !limited || s.cfg.Owners == nil {
		return nil
	}
	for _, raw := range tags {
		tag, err := template.ParseTag(raw)
		if err != nil {
			return err
		}
		if err := s.cfg.Owners.SetTagOwner(ctx, tag, p.Tenant); err != nil {
			return err
		}
	}
	return nil
}

// ClaimTag is claimTags for one tag made outside this service (a
// sandbox's snapshot): check before, Own after.
func (s *Service) ClaimTag(ctx context.Context, tag string) error {
	_, err := s.claimTags(ctx, []string{tag})
	return err
}

// OwnTag records the caller's tenant as the owner of tag.
func (s *Service) OwnTag(ctx context.Context, tag string) error { return s.ownTags(ctx, []string{tag}) }

// filterVisible keeps the templates the caller may see, with their
// visible tags.
func (s *Service) filterVisible(ctx context.Context, ts []api.Template) ([]api.Template, error) {
	out := ts[:0]
	for _, t := range ts {
		t, ok, err := s.visible(ctx, t)
		if err != nil {
			return nil, err
		}
		if ok {
			out = append(out, t)
		}
	}
	return slices.Clip(out), nil
}
