package connector

import (
	"fmt"
	"net/netip"
	"strings"
)

// peerFilter is kv_connector_extra_config.allowed_peers: the hosts an engine may dial because
// kv_transfer_params name them. Entries are host names (matched exactly, case-insensitively),
// IP addresses or CIDR prefixes (matched against a remote_host that is an IP literal). A host
// name in params is never resolved to be checked against a prefix: list it by name. Without
// the key every host is allowed, as in vLLM.
type peerFilter struct {
	names    map[string]bool
	prefixes []netip.Prefix
}

// newPeerFilter parses the entries; nil for none.
func newPeerFilter(entries []string) (*peerFilter, error) {
	if entries == nil {
		return nil, nil
	}
	f := &peerFilter{names: map[string]bool{}}
	for _, e := range entries {
		e = strings.TrimSpace(e)
		switch {
		case e == "":
			return nil, fmt.Errorf("an empty entry")
		case strings.Contains(e, "/"):
			p, err := netip.ParsePrefix(e)
			if err != nil {
				return nil, fmt.Errorf("%q is not a CIDR prefix: %v", e, err)
			}
			f.prefixes = append(f.prefixes, p.Masked())
		default:
			if a, err := netip.ParseAddr(strings.Trim(e, "[]")); err == nil {
				f.prefixes = append(f.prefixes, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
				continue
			}
			f.names[normalizeHost(e)] = true
		}
	}
	return f, nil
}

// normalizeHost lower-cases a host name and drops a trailing dot.
func normalizeHost(h string) string { return strings.TrimSuffix(strings.ToLower(h), ".") }

// allows reports whether host (a remote_host) may be dialled; a nil filter allows all.
func (f *peerFilter) allows(host string) bool {
	if f == nil {
		return true
	}
	if a, err := netip.ParseAddr(strings.Trim(host, "[]")); err == nil {
		a = a.Unmap().WithZone("")
		for _, p := range f.prefixes {
			if p.Contains(a) {
				return true
			}
		}
		return false
	}
	return f.names[normalizeHost(host)]
}
