// Package kubernetes holds kvbridge's Kubernetes deployment — a kustomize base and the one-way
// and bidirectional overlays, and the Dockerfile of the image they run (README.md) — and the
// test that keeps them valid: every manifest decodes strictly into the Kubernetes API types,
// every overlay builds with kustomize, and what the manifests tell kvbridge (arguments,
// environment, ports, probes, the proxy's host lists, the Redis store) agrees with itself and
// with what kvbridge accepts.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package kubernetes
