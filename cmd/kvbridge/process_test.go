package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/netns"
)

// TestMain lets a test re-execute this binary as the kvbridge command: with KVBRIDGE_TEST_MAIN
// set, the process runs the CLI on its arguments instead of the tests.
func TestMain(m *testing.M) {
	if os.Getenv("KVBRIDGE_TEST_MAIN") == "1" {
		os.Exit(run(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// process is a kvbridge command running as a child process.
type process struct {
	cmd  *exec.Cmd
	url  string
	mu   sync.Mutex
	logs bytes.Buffer
	done chan struct{}
	err  error
}

// urlAttr finds the URL in a text (url=http://…) or JSON ("url":"http://…") log line.
var urlAttr = regexp.MustCompile(`(?:url|addr)"?[=:]"?(http://[^\s"]+)`)

// startProcess runs `kvbridge args...` with extra environment variables and waits (at most
// 60 s) for its "serving"/"listening" log line, which names its URL.
func startProcess(t *testing.T, env []string, args ...string) *process {
	t.Helper()
	return startProcessOn(t, nil, env, args...)
}

// startProcessOn is startProcess on host h of a netns network (nil: this machine's own
// network); the URL is then the host's address and the port the process logged.
func startProcessOn(t *testing.T, h *netns.Host, env []string, args ...string) *process {
	t.Helper()
	p := &process{done: make(chan struct{})}
	if h != nil {
		p.cmd = h.Command(context.Background(), os.Args[0], args...)
	} else {
		p.cmd = exec.Command(os.Args[0], args...)
	}
	p.cmd.Env = append(append(os.Environ(), "KVBRIDGE_TEST_MAIN=1"), env...)
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	found := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			p.mu.Lock()
			p.logs.WriteString(line + "\n")
			p.mu.Unlock()
			if m := urlAttr.FindStringSubmatch(line); m != nil && (strings.Contains(line, "serving") || strings.Contains(line, "listening")) {
				select {
				case found <- strings.Replace(m[1], "[::]", "127.0.0.1", 1):
				default:
				}
			}
		}
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() { p.kill(); <-p.done })
	select {
	case p.url = <-found:
		if h != nil {
			p.url = "http://" + net.JoinHostPort(h.Addr.String(), port(t, p.url))
		}
	case <-p.done:
		t.Fatalf("kvbridge %s exited early: %v\n%s", strings.Join(args, " "), p.err, p.log())
	case <-time.After(60 * time.Second):
		t.Fatalf("kvbridge %s did not start in 60 s\n%s", strings.Join(args, " "), p.log())
	}
	return p
}

func (p *process) log() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.logs.String()
}

// waitLog waits (at most 10 s) until the process has logged a line containing s; stderr is
// read by another goroutine, so a line written before an HTTP answer may arrive after it.
func (p *process) waitLog(t *testing.T, s string) bool {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(p.log(), s) {
		if time.Now().After(deadline) {
			return false
		}
		select {
		case <-p.done:
			return strings.Contains(p.log(), s)
		case <-time.After(5 * time.Millisecond):
		}
	}
	return true
}

func (p *process) kill() { _ = p.cmd.Process.Signal(syscall.SIGKILL) }

// stop sends SIGTERM and waits (at most 30 s) for the process to exit; it returns the exit
// error (nil for status 0).
func (p *process) stop(t *testing.T) error {
	t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return p.err
	case <-time.After(30 * time.Second):
		t.Fatalf("kvbridge did not exit in 30 s after SIGTERM\n%s", p.log())
		return nil
	}
}

// postJSON sends body and returns the status and the raw response.
func postJSON(t *testing.T, url string, body any) (int, []byte) {
	t.Helper()
	data, _ := json.Marshal(body)
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, raw
}

// completionText returns the text of a non-streaming completion.
func completionText(t *testing.T, raw []byte) string {
	t.Helper()
	var r struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(raw, &r); err != nil || len(r.Choices) == 0 {
		t.Fatalf("not a completion: %v: %s", err, raw)
	}
	return r.Choices[0].Text + r.Choices[0].Message.Content
}
