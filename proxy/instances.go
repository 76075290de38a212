package proxy

import (
	"fmt"
	"net"
	"net/url"
	"strconv"
)

// Instance is one engine the proxy routes to.
type Instance struct {
	// Host and Port address the engine's HTTP server.
	Host string
	Port int
	// base is "http://host:port".
	base string
}

// NewInstance returns the engine at host:port.
func NewInstance(host string, port int) (Instance, error) {
	if host == "" {
		return Instance{}, fmt.Errorf("proxy: empty host")
	}
	if port <= 0 || port > 65535 {
		return Instance{}, fmt.Errorf("proxy: port %d out of range", port)
	}
	u := url.URL{Scheme: "http", Host: net.JoinHostPort(host, strconv.Itoa(port))}
	return Instance{Host: host, Port: port, base: u.String()}, nil
}

// URL returns the absolute URL of path on the instance.
func (i Instance) URL(path string) string { return i.base + path }

// String returns host:port.
func (i Instance) String() string { return net.JoinHostPort(i.Host, strconv.Itoa(i.Port)) }

// Pairs zips hosts and ports into instances; the lists must have the same length.
func Pairs(role string, hosts []string, ports []int) ([]Instance, error) {
	if len(hosts) != len(ports) {
		return nil, fmt.Errorf("proxy: %d %s hosts but %d %s ports: give one port per host", len(hosts), role, len(ports), role)
	}
	if len(hosts) == 0 {
		return nil, fmt.Errorf("proxy: no %s instances", role)
	}
	out := make([]Instance, len(hosts))
	for i := range hosts {
		inst, err := NewInstance(hosts[i], ports[i])
		if err != nil {
			return nil, fmt.Errorf("%s %d: %w", role, i, err)
		}
		out[i] = inst
	}
	return out, nil
}
