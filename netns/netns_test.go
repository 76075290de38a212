package netns

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// newNetwork makes a network for a test, skipping it where namespaces cannot be made.
func newNetwork(t *testing.T, hosts ...string) (*Network, []*Host) {
	t.Helper()
	n, err := New(t.Context(), Config{})
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("hosts need network namespaces: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Error(err)
		}
	})
	out := make([]*Host, len(hosts))
	for i, name := range hosts {
		if out[i], err = n.AddHost(t.Context(), name); err != nil {
			t.Fatal(err)
		}
	}
	return n, out
}

// TestTwoHosts: a listener on one host takes a connection dialled from the other, which comes
// from the other host's own address; neither host's address exists in this process's namespace;
// byte counters count the bytes; with a link down nothing gets through; and Close leaves no
// namespace behind.
func TestTwoHosts(t *testing.T) {
	n, hosts := newNetwork(t, "a", "b")
	a, b := hosts[0], hosts[1]
	if a.Addr == b.Addr || !DefaultSubnet.Contains(a.Addr) || !DefaultSubnet.Contains(b.Addr) {
		t.Fatalf("addresses %s and %s", a.Addr, b.Addr)
	}
	ln, err := a.Listen("tcp4", netip.AddrPortFrom(a.Addr, 0).String())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	payload := strings.Repeat("kvbridge ", 100_000)
	got := make(chan string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			got <- err.Error()
			return
		}
		defer c.Close()
		data, _ := io.ReadAll(c)
		got <- c.RemoteAddr().String() + " " + string(data)
	}()
	before, err := a.Counters()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	c, err := b.DialContext(ctx, "tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(c, payload); err != nil {
		t.Fatal(err)
	}
	c.Close()
	select {
	case s := <-got:
		from, data, _ := strings.Cut(s, " ")
		if ap, err := netip.ParseAddrPort(from); err != nil || ap.Addr() != b.Addr || data != payload {
			t.Fatalf("a received %d bytes from %s; want %d from %s", len(data), from, len(payload), b.Addr)
		}
	case <-ctx.Done():
		t.Fatal("no connection")
	}
	after, err := a.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if after.RxBytes-before.RxBytes < uint64(len(payload)) {
		t.Errorf("a's eth0 received %d bytes, want at least %d", after.RxBytes-before.RxBytes, len(payload))
	}
	listeners, err := a.Listeners()
	if err != nil {
		t.Fatal(err)
	}
	if want := netip.MustParseAddrPort(ln.Addr().String()); len(listeners) != 1 || listeners[0] != want {
		t.Errorf("a's listeners %v, want [%s]", listeners, want)
	}
	if other, _ := b.Listeners(); len(other) != 0 {
		t.Errorf("b's listeners %v, want none", other)
	}
	// This process's own namespace has neither address.
	if c, err := net.DialTimeout("tcp4", ln.Addr().String(), time.Second); err == nil {
		c.Close()
		t.Errorf("%s reached from the machine's own namespace", ln.Addr())
	}

	// A command runs on the host: it sees the host's eth0 and address.
	out, err := a.Command(ctx, "ip", "-o", "-4", "addr", "show", "dev", Interface).CombinedOutput()
	if err != nil || !strings.Contains(string(out), a.Addr.String()+"/") {
		t.Errorf("ip addr on host a: %v %s", err, out)
	}

	if err := a.SetLink(ctx, false); err != nil {
		t.Fatal(err)
	}
	short, cancelShort := context.WithTimeout(ctx, 500*time.Millisecond)
	if c, err := b.DialContext(short, "tcp4", ln.Addr().String()); err == nil {
		c.Close()
		t.Error("dialled a host whose link is down")
	}
	cancelShort()
	if err := a.SetLink(ctx, true); err != nil {
		t.Fatal(err)
	}
	go func() {
		if c, err := ln.Accept(); err == nil {
			c.Close()
		}
	}()
	if c, err := b.DialContext(ctx, "tcp4", ln.Addr().String()); err != nil {
		t.Errorf("after the link came back: %v", err)
	} else {
		c.Close()
	}

	names := []string{a.Namespace, b.Namespace}
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	if err := n.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	for _, name := range names {
		if _, err := os.Stat("/run/netns/" + name); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("namespace %s left behind: %v", name, err)
		}
	}
}

// TestSweep: the namespaces of a run whose process is gone are removed by the next New, with
// the processes left in them.
func TestSweep(t *testing.T) {
	newNetwork(t) // skips where namespaces cannot be made
	// A dead process's network: its id is taken by a process that has exited.
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	name := namePrefix + strconv.Itoa(dead.Process.Pid) + "-abcdef-x"
	if err := ip(t.Context(), "netns", "add", name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = remove(context.Background(), name) })
	n, err := New(t.Context(), Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	if _, err := os.Stat("/run/netns/" + name); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the dead run's namespace %s is still there", name)
	}
}
