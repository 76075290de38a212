package reliability

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	kvstack "github.com/kvbridge/kvbridge/stack"
)

// childEnv names the environment variable that turns the test binary into an engine process:
// its value is the JSON childSpec.
const childEnv = "KVBRIDGE_RELIABILITY_CHILD"

// TestMain re-executes this test binary as an engine process when childEnv is set, so that a
// test can kill an engine with SIGKILL without building the kvbridge command.
func TestMain(m *testing.M) {
	if spec := os.Getenv(childEnv); spec != "" {
		os.Exit(childMain(spec))
	}
	os.Exit(m.Run())
}

// childSpec is what a child engine process runs.
type childSpec struct {
	Role          connector.Role
	Policy        connector.FailurePolicy
	Bidirectional bool
	EngineID      string
	LeaseSeconds  float64
	Backends      []string
	AdvertiseTCP  string
	TP            int // --tensor-parallel-size (default 1)
}

func (s childSpec) options() engineOptions {
	return engineOptions{role: s.Role, policy: s.Policy, bidirectional: s.Bidirectional, engineID: s.EngineID,
		lease: time.Duration(s.LeaseSeconds * float64(time.Second)), backends: s.Backends, advertiseTCP: s.AdvertiseTCP, tp: s.TP}
}

// childReady is the log message a child writes once it serves; its attributes name the URL, the
// side channel and the transfer listener.
const childReady = "reliability child ready"

// childMain runs one engine until its stdin closes (the parent ended) or it gets SIGTERM.
func childMain(specJSON string) int {
	var spec childSpec
	var err error
	if err = json.Unmarshal([]byte(specJSON), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "child: bad spec:", err)
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	e, err := kvstack.StartEngine(ctx, spec.options().config("child", log))
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	defer e.Close()
	in := e.Instance()
	tcp, _ := in.Connector.Agent().Addrs()
	if l := e.TransferAddr(); l != "" {
		tcp = l
	}
	log.Info(childReady, "url", in.URL, "side_channel", in.Connector.SideChannelAddr(), "transfer", tcp)
	stdinClosed := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stdinClosed)
	}()
	select {
	case <-ctx.Done():
	case <-stdinClosed:
	}
	return 0
}

// child is an engine running as a child process.
type child struct {
	name     string
	cmd      *exec.Cmd
	stdin    io.WriteCloser
	URL      string
	side     string // side-channel host:port
	transfer string // transfer TCP listen address
	done     chan struct{}
	mu       sync.Mutex
	logs     bytes.Buffer
}

var readyAttrs = regexp.MustCompile(`url=(\S+) side_channel=(\S+) transfer=(\S+)`)

// startChild starts an engine process and waits (at most 60 s) for it to serve. It is killed
// at cleanup if still running.
func startChild(t *testing.T, name string, spec childSpec) *child {
	t.Helper()
	data, _ := json.Marshal(spec)
	c := &child{name: name, done: make(chan struct{})}
	c.cmd = exec.Command(os.Args[0])
	c.cmd.Env = append(os.Environ(), childEnv+"="+string(data))
	stderr, err := c.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if c.stdin, err = c.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ready := make(chan []string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			c.mu.Lock()
			c.logs.WriteString(line + "\n")
			c.mu.Unlock()
			if strings.Contains(line, childReady) {
				if m := readyAttrs.FindStringSubmatch(line); m != nil {
					select {
					case ready <- m[1:]:
					default:
					}
				}
			}
		}
		_ = c.cmd.Wait()
		close(c.done)
	}()
	t.Cleanup(func() {
		if err := c.kill(); err != nil {
			t.Error(err)
		}
		if t.Failed() {
			t.Logf("%s's log:\n%s", name, c.log())
		}
	})
	select {
	case m := <-ready:
		c.URL, c.side, c.transfer = m[0], m[1], m[2]
	case <-c.done:
		t.Fatalf("%s exited before serving:\n%s", name, c.log())
	case <-time.After(60 * time.Second):
		t.Fatalf("%s did not serve within 60 s:\n%s", name, c.log())
	}
	return c
}

func (c *child) log() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.logs.String()
}

// kill sends SIGKILL and waits (at most waitFor) for the process to be gone. It may be called
// from any goroutine.
func (c *child) kill() error {
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-c.done:
		return nil
	case <-time.After(waitFor):
		return fmt.Errorf("%s did not exit within %v of SIGKILL", c.name, waitFor)
	}
}

// mustKill is kill for the test's goroutine.
func (c *child) mustKill(t *testing.T) {
	t.Helper()
	if err := c.kill(); err != nil {
		t.Fatal(err)
	}
}
