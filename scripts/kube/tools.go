//go:build tools

// Package kube only records, for go mod tidy, which commands of
// k8s.io/kubernetes scripts/setup-test.sh builds; it is never compiled.
package kube

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
