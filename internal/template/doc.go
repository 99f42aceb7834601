// Package template stores sandbox templates: immutable root filesystems
// addressed by a content digest ("sha256:<hex>") and named by tags
// ("name:tag"). It also builds the built-in Debian "base" template with
// debootstrap.
package template
