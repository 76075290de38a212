// Package netns holds network namespaces joined by a bridge, so that one machine runs several
// hosts: each Host is a Linux network namespace with its own loopback and one interface, eth0,
// with its own address in a private range; every eth0 is one end of a veth pair whose other end
// is a port of a bridge in a namespace of its own (the switch). The machine's own namespace is
// never touched: no interface, address or route is added to it, so networks of concurrent runs
// never collide, and its firewall never sees the traffic between the hosts.
//
// Processes run on a host through `ip netns exec` (Host.Command); this process reaches a host's
// network through sockets made inside the host's namespace (Host.DialContext, Host.Listen,
// Host.HTTPClient). Links go down and up (Host.SetLink) and can be throttled (Host.Throttle).
//
// Everything needs root and iproute2; New returns an error wrapping ErrUnavailable when the
// machine cannot make namespaces, which tests turn into a skip. Namespace names carry this
// process's id and a random token; Close removes them and kills what still runs in them, and New
// first removes the namespaces of runs whose process has died (a test binary killed by its
// timeout cannot clean up after itself).
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package netns

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ErrUnavailable reports a machine on which namespaces cannot be made (not root, no iproute2,
// or a kernel or sandbox that refuses them).
var ErrUnavailable = errors.New("netns: network namespaces are not available")

// DefaultSubnet is the range host addresses are taken from when Config.Subnet is unset. It is
// used only inside the namespaces of one Network, so it never meets the machine's own networks.
var DefaultSubnet = netip.MustParsePrefix("10.213.0.0/24")

// namePrefix starts every namespace this package makes: "kvb-<pid>-<token>-<host>".
const namePrefix = "kvb-"

// commandTimeout bounds one ip or tc command.
const commandTimeout = 30 * time.Second

// Config configures New. The zero value is usable.
type Config struct {
	// Subnet is where host addresses come from, in the order hosts are added (default
	// DefaultSubnet). It must be IPv4 with room for every host.
	Subnet netip.Prefix
}

// Network is a switch namespace with a bridge, and the hosts attached to it.
type Network struct {
	prefix string // "kvb-<pid>-<token>-"
	subnet netip.Prefix
	sw     string // the switch namespace

	mu     sync.Mutex
	hosts  []*Host
	next   netip.Addr
	closed bool
	once   sync.Once
	err    error
}

// Host is one namespace attached to a Network.
type Host struct {
	// Name is the name given to AddHost.
	Name string
	// Namespace is the namespace's name, as `ip netns` knows it.
	Namespace string
	// Addr is the host's address on eth0.
	Addr netip.Addr

	net  *Network
	port string // the switch's end of the host's veth pair
}

// Interface is the name of every host's link to the switch.
const Interface = "eth0"

// New makes the switch namespace of a new network with its bridge. It first removes the
// namespaces of earlier runs whose process is gone.
func New(ctx context.Context, cfg Config) (_ *Network, err error) {
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("%w: root is needed (running as uid %d)", ErrUnavailable, os.Geteuid())
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return nil, fmt.Errorf("%w: the ip command (iproute2) is missing: %v", ErrUnavailable, err)
	}
	if !cfg.Subnet.IsValid() {
		cfg.Subnet = DefaultSubnet
	}
	if !cfg.Subnet.Addr().Is4() || cfg.Subnet.Bits() > 30 {
		return nil, fmt.Errorf("netns: subnet %s: an IPv4 prefix of at most /30 is needed", cfg.Subnet)
	}
	sweep(ctx)
	var tok [3]byte
	if _, err := rand.Read(tok[:]); err != nil {
		return nil, fmt.Errorf("netns: %w", err)
	}
	n := &Network{
		prefix: fmt.Sprintf("%s%d-%s-", namePrefix, os.Getpid(), hex.EncodeToString(tok[:])),
		subnet: cfg.Subnet.Masked(),
	}
	n.next = n.subnet.Addr().Next()
	n.sw = n.prefix + "switch"
	if err := ip(ctx, "netns", "add", n.sw); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	defer func() {
		if err != nil {
			n.Close()
		}
	}()
	for _, args := range [][]string{
		{"-n", n.sw, "link", "set", "lo", "up"},
		{"-n", n.sw, "link", "add", "br0", "type", "bridge"},
		{"-n", n.sw, "link", "set", "br0", "up"},
	} {
		if err := ip(ctx, args...); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
	}
	return n, nil
}

var hostName = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,31}$`)

// AddHost makes a host namespace, links it to the switch and gives it the next address of the
// subnet. name must be lower-case letters, digits and dashes, unique in the network.
func (n *Network) AddHost(ctx context.Context, name string) (_ *Host, err error) {
	if !hostName.MatchString(name) || name == "switch" {
		return nil, fmt.Errorf("netns: host name %q: lower-case letters, digits and dashes, at most 32, not \"switch\"", name)
	}
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return nil, errors.New("netns: the network is closed")
	}
	for _, h := range n.hosts {
		if h.Name == name {
			n.mu.Unlock()
			return nil, fmt.Errorf("netns: host %q already exists", name)
		}
	}
	addr := n.next
	if !n.subnet.Contains(addr) || !n.subnet.Contains(addr.Next()) { // keep the broadcast address free
		n.mu.Unlock()
		return nil, fmt.Errorf("netns: subnet %s is full", n.subnet)
	}
	n.next = addr.Next()
	h := &Host{Name: name, Namespace: n.prefix + name, Addr: addr, net: n, port: "v" + strconv.Itoa(len(n.hosts))}
	n.hosts = append(n.hosts, h)
	n.mu.Unlock()

	if err := ip(ctx, "netns", "add", h.Namespace); err != nil {
		return nil, err
	}
	cidr := netip.PrefixFrom(addr, n.subnet.Bits()).String()
	for _, args := range [][]string{
		{"-n", h.Namespace, "link", "set", "lo", "up"},
		// The veth pair is made in the switch with its host end placed straight into the host
		// namespace, so no name ever exists in the machine's own namespace.
		{"-n", n.sw, "link", "add", h.port, "type", "veth", "peer", "name", Interface, "netns", h.Namespace},
		{"-n", n.sw, "link", "set", h.port, "master", "br0"},
		{"-n", n.sw, "link", "set", h.port, "up"},
		{"-n", h.Namespace, "addr", "add", cidr, "dev", Interface},
		{"-n", h.Namespace, "link", "set", Interface, "up"},
	} {
		if err := ip(ctx, args...); err != nil {
			return nil, err
		}
	}
	return h, nil
}

// Hosts returns the network's hosts in the order they were added.
func (n *Network) Hosts() []*Host {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]*Host(nil), n.hosts...)
}

// Close kills every process still running in the network's namespaces and removes them (the
// veth pairs and the bridge go with them). It is idempotent.
func (n *Network) Close() error {
	n.once.Do(func() {
		n.mu.Lock()
		n.closed = true
		names := []string{n.sw}
		for _, h := range n.hosts {
			names = append(names, h.Namespace)
		}
		n.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
		defer cancel()
		var errs []error
		for _, name := range names {
			errs = append(errs, remove(ctx, name))
		}
		n.err = errors.Join(errs...)
	})
	return n.err
}

// remove kills the processes in namespace name and deletes it; a namespace already gone is not
// an error.
func remove(ctx context.Context, name string) error {
	if _, err := os.Stat("/run/netns/" + name); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	killAll(ctx, name)
	if err := ip(ctx, "netns", "del", name); err != nil {
		if _, serr := os.Stat("/run/netns/" + name); errors.Is(serr, os.ErrNotExist) {
			return nil
		}
		return err
	}
	return nil
}

// killAll sends SIGKILL to every process in namespace name (a namespace outlives its file while
// a process is in it).
func killAll(ctx context.Context, name string) {
	out, err := exec.CommandContext(ctx, "ip", "netns", "pids", name).Output()
	if err != nil {
		return
	}
	for _, f := range strings.Fields(string(out)) {
		if pid, err := strconv.Atoi(f); err == nil && pid != os.Getpid() {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

var ownName = regexp.MustCompile(`^` + namePrefix + `(\d+)-[0-9a-f]+-`)

// sweep removes the namespaces of runs whose process no longer exists.
func sweep(ctx context.Context) {
	entries, err := os.ReadDir("/run/netns")
	if err != nil {
		return
	}
	for _, e := range entries {
		m := ownName.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		pid, err := strconv.Atoi(m[1])
		if err != nil || pid == os.Getpid() || syscall.Kill(pid, 0) != syscall.ESRCH {
			continue
		}
		_ = remove(ctx, e.Name())
	}
}

// ip runs the ip command with args.
func ip(ctx context.Context, args ...string) error {
	return run(ctx, "ip", args...)
}

func run(ctx context.Context, name string, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, commandTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("netns: %s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return nil
}
