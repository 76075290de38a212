package netns

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// String returns the host's name and address.
func (h *Host) String() string { return h.Name + "(" + h.Addr.String() + ")" }

// Command returns a command that runs name with args on the host (`ip netns exec`, which execs
// the program: the command's process is the program's). The process is killed if this
// process's thread that started it dies, so a test binary killed by its timeout leaves none
// behind.
func (h *Host) Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", h.Namespace, name}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// Do runs f on an OS thread that has entered the host's network namespace: sockets f makes
// belong to the host and keep belonging to it afterwards. f must not start goroutines that make
// sockets (they would run on other threads).
func (h *Host) Do(f func() error) error {
	errc := make(chan error, 1)
	go func() {
		// The thread stays locked unless it is back in its own namespace: if going back fails,
		// the runtime ends the thread with this goroutine instead of reusing it.
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("netns: %w", err)
			return
		}
		defer orig.Close()
		target, err := os.Open("/run/netns/" + h.Namespace)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("netns: host %s: %w", h.Name, err)
			return
		}
		defer target.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("netns: enter host %s: %w", h.Name, err)
			return
		}
		ferr := f()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err == nil {
			runtime.UnlockOSThread()
		}
		errc <- ferr
	}()
	return <-errc
}

// DialContext connects from the host, like net.Dialer.DialContext. addr must be an IP literal
// and port (no name lookups happen inside the namespace).
func (h *Host) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	if _, err := netip.ParseAddrPort(addr); err != nil {
		return nil, fmt.Errorf("netns: dial from %s: %q is not an IP address and port", h.Name, addr)
	}
	var c net.Conn
	err := h.Do(func() error {
		var err error
		// An IP literal is dialled on the calling goroutine, so the socket is the host's.
		c, err = (&net.Dialer{Timeout: 10 * time.Second}).DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// Listen listens on the host, like net.Listen; accepted connections are the host's.
func (h *Host) Listen(network, addr string) (net.Listener, error) {
	var ln net.Listener
	err := h.Do(func() error {
		var err error
		ln, err = net.Listen(network, addr)
		return err
	})
	return ln, err
}

// Transport returns an HTTP transport whose connections leave from the host.
func (h *Host) Transport() *http.Transport {
	return &http.Transport{
		DialContext:         h.DialContext,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
}

// HTTPClient returns an HTTP client whose connections leave from the host.
func (h *Host) HTTPClient() *http.Client { return &http.Client{Transport: h.Transport()} }

// SetLink takes the host's eth0 down or brings it up: with the link down the host neither
// sends nor receives anything on the network (its loopback still works), and its established
// connections are not told.
func (h *Host) SetLink(ctx context.Context, up bool) error {
	state := "down"
	if up {
		state = "up"
	}
	return ip(ctx, "-n", h.Namespace, "link", "set", Interface, state)
}

// Throttle limits what the host sends to bitsPerSecond (a token bucket on eth0, `tc qdisc …
// tbf`); 0 removes the limit. It returns an error wrapping ErrUnavailable when the kernel has
// no tbf qdisc.
func (h *Host) Throttle(ctx context.Context, bitsPerSecond int64) error {
	if bitsPerSecond <= 0 {
		return run(ctx, "tc", "-n", h.Namespace, "qdisc", "del", "dev", Interface, "root")
	}
	if _, err := exec.LookPath("tc"); err != nil {
		return fmt.Errorf("%w: the tc command is missing", ErrUnavailable)
	}
	burst := max(bitsPerSecond/8/100, 16<<10) // 10 ms of data, at least a few frames
	err := run(ctx, "tc", "-n", h.Namespace, "qdisc", "replace", "dev", Interface, "root", "tbf",
		"rate", strconv.FormatInt(bitsPerSecond, 10)+"bit", "burst", strconv.FormatInt(burst, 10), "latency", "1s")
	if err != nil && strings.Contains(err.Error(), "qdisc kind is unknown") {
		return fmt.Errorf("%w: the kernel has no tbf qdisc: %v", ErrUnavailable, err)
	}
	return err
}

// Counters are a host's eth0 byte counters.
type Counters struct {
	RxBytes, TxBytes uint64
}

// Counters reads the host's eth0 byte counters.
func (h *Host) Counters() (Counters, error) {
	var c Counters
	err := h.Do(func() error {
		data, err := os.ReadFile("/proc/thread-self/net/dev")
		if err != nil {
			return err
		}
		for line := range strings.SplitSeq(string(data), "\n") {
			name, rest, ok := strings.Cut(line, ":")
			if !ok || strings.TrimSpace(name) != Interface {
				continue
			}
			f := strings.Fields(rest)
			if len(f) < 9 {
				break
			}
			c.RxBytes, _ = strconv.ParseUint(f[0], 10, 64)
			c.TxBytes, _ = strconv.ParseUint(f[8], 10, 64)
			return nil
		}
		return fmt.Errorf("no %s in /proc/net/dev", Interface)
	})
	if err != nil {
		return Counters{}, fmt.Errorf("netns: counters of host %s: %w", h.Name, err)
	}
	return c, nil
}

// Listeners returns the addresses of the host's listening TCP sockets (IPv4 and IPv6).
func (h *Host) Listeners() ([]netip.AddrPort, error) {
	var out []netip.AddrPort
	err := h.Do(func() error {
		for _, file := range []string{"/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"} {
			f, err := os.Open(file)
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			if err != nil {
				return err
			}
			sc := bufio.NewScanner(f)
			sc.Scan() // the header
			for sc.Scan() {
				fields := strings.Fields(sc.Text())
				if len(fields) < 4 || fields[3] != "0A" { // TCP_LISTEN
					continue
				}
				ap, err := parseProcAddr(fields[1])
				if err != nil {
					f.Close()
					return err
				}
				out = append(out, ap)
			}
			f.Close()
			if err := sc.Err(); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("netns: listeners of host %s: %w", h.Name, err)
	}
	return out, nil
}

// parseProcAddr parses /proc/net/tcp's "0100007F:1F90": the address as 32-bit words in host
// byte order (little-endian here), then the port in hex.
func parseProcAddr(s string) (netip.AddrPort, error) {
	a, p, ok := strings.Cut(s, ":")
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("bad socket address %q", s)
	}
	raw, err := hex.DecodeString(a)
	if err != nil || (len(raw) != 4 && len(raw) != 16) {
		return netip.AddrPort{}, fmt.Errorf("bad socket address %q", s)
	}
	for i := 0; i < len(raw); i += 4 { // each 32-bit word is little-endian
		raw[i], raw[i+1], raw[i+2], raw[i+3] = raw[i+3], raw[i+2], raw[i+1], raw[i]
	}
	port, err := strconv.ParseUint(p, 16, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("bad socket port %q", s)
	}
	addr, _ := netip.AddrFromSlice(raw)
	return netip.AddrPortFrom(addr.Unmap(), uint16(port)), nil
}
