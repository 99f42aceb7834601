//go:build tools

// Package etcd only records, for go mod tidy, that scripts/setup-test.sh builds
// the etcd server command; it is never compiled.
package etcd

import _ "go.etcd.io/etcd/server/v3"
