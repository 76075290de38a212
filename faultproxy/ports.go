package faultproxy

import (
	"bytes"
	"encoding/json"
	"io"
	"maps"
	"net/http"
	"sync"
)

// PortRewriter is the transport of a P/D proxy's engine legs in fault tests: it rewrites
// kv_transfer_params.remote_port in JSON request bodies from an engine's side-channel port to
// the port of a fault proxy in front of it, so that the consumer's handshake crosses the fault
// proxy. Before, if set, is called with each leg's host:port just before it leaves (to act on
// the engine it goes to). Safe for concurrent use.
type PortRewriter struct {
	next   http.RoundTripper
	mu     sync.Mutex
	ports  map[int]int
	before func(hostPort string)
}

// NewPortRewriter returns a rewriter that sends legs through next, mapping side-channel ports
// from → to as ports says.
func NewPortRewriter(next http.RoundTripper, ports map[int]int) *PortRewriter {
	return &PortRewriter{next: next, ports: maps.Clone(ports)}
}

// SetPorts replaces the port mapping.
func (p *PortRewriter) SetPorts(ports map[int]int) {
	p.mu.Lock()
	p.ports = maps.Clone(ports)
	p.mu.Unlock()
}

// SetBefore sets the function called before each leg; nil removes it.
func (p *PortRewriter) SetBefore(f func(hostPort string)) {
	p.mu.Lock()
	p.before = f
	p.mu.Unlock()
}

// RoundTrip implements http.RoundTripper.
func (p *PortRewriter) RoundTrip(req *http.Request) (*http.Response, error) {
	p.mu.Lock()
	ports, before := p.ports, p.before
	p.mu.Unlock()
	if before != nil {
		before(req.URL.Host)
	}
	if req.Body == nil || req.Method != http.MethodPost || len(ports) == 0 {
		return p.next.RoundTrip(req)
	}
	data, err := io.ReadAll(req.Body)
	req.Body.Close()
	if err != nil {
		return nil, err
	}
	var m map[string]any
	if json.Unmarshal(data, &m) == nil {
		if kv, ok := m["kv_transfer_params"].(map[string]any); ok {
			if port, ok := kv["remote_port"].(float64); ok {
				if to, ok := ports[int(port)]; ok {
					kv["remote_port"] = to
					data, _ = json.Marshal(m)
				}
			}
		}
	}
	r2 := req.Clone(req.Context())
	r2.Body = io.NopCloser(bytes.NewReader(data))
	r2.ContentLength = int64(len(data))
	r2.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }
	return p.next.RoundTrip(r2)
}
