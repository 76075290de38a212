package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// readmeBlock is one ```sh block of README.md with its <!-- readme-test: … --> annotation.
type readmeBlock struct {
	line     int
	scenario string // a scenario name, "skip" or "fails"
	expect   string // for "fails": a substring of the output
	text     string
}

var annotation = regexp.MustCompile(`^<!-- readme-test: (\S+)(?: "([^"]*)")?.*-->$`)

// readmeBlocks parses README.md. Every sh block must be annotated, so none goes untested by
// accident.
func readmeBlocks(t *testing.T, path string) []readmeBlock {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var blocks []readmeBlock
	var pending *readmeBlock
	var cur *readmeBlock
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch {
		case cur != nil && strings.HasPrefix(line, "```"):
			blocks = append(blocks, *cur)
			cur = nil
		case cur != nil:
			cur.text += line + "\n"
		case annotation.MatchString(line):
			m := annotation.FindStringSubmatch(line)
			pending = &readmeBlock{scenario: m[1], expect: m[2]}
		case line == "```sh" || line == "```bash":
			if pending == nil {
				t.Fatalf("README.md:%d: a shell block without a <!-- readme-test: … --> annotation", n)
			}
			cur, pending = pending, nil
			cur.line = n
		}
	}
	return blocks
}

// TestREADME runs the README's command blocks against real processes on loopback: each
// scenario's servers start in the background (the test waits for their ports), the other blocks
// run in the foreground and must succeed without an error body; blocks marked "fails" must exit
// non-zero with the stated message. `kvbridge` is this test binary re-executed as the CLI.
func TestREADME(t *testing.T) {
	if testing.Short() {
		t.Skip("starts many engines")
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	shim := fmt.Sprintf("#!/bin/sh\nKVBRIDGE_TEST_MAIN=1 exec %q \"$@\"\n", os.Args[0])
	if err := os.WriteFile(filepath.Join(bin, "kvbridge"), []byte(shim), 0o755); err != nil {
		t.Fatal(err)
	}
	env := append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"), "HOME="+t.TempDir())
	var order []string
	byScenario := map[string][]readmeBlock{}
	for _, b := range readmeBlocks(t, filepath.Join(root, "README.md")) {
		switch b.scenario {
		case "skip":
			continue
		case "fails":
			b.scenario = fmt.Sprintf("fails-line-%d", b.line)
		}
		if _, ok := byScenario[b.scenario]; !ok {
			order = append(order, b.scenario)
		}
		byScenario[b.scenario] = append(byScenario[b.scenario], b)
	}
	if len(order) == 0 {
		t.Fatal("no README blocks to run")
	}
	// The commands run on free ports standing for the README's fixed ones, which the test holds
	// (those it can take) so that a port the rewriting misses fails the test on any machine.
	defaults := readmeDefaultPorts(t)
	var all []readmeBlock
	for _, name := range order {
		all = append(all, byScenario[name]...)
	}
	fixed := fixedPorts(t, all, defaults)
	t.Logf("holding the README's ports %v (of %v)", holdPorts(t, fixed), fixed)
	for _, name := range order {
		t.Run(name, func(t *testing.T) {
			// A free port the map picked can be taken by another process (another package's
			// tests) before the server binds it: the scenario then starts over on new ports.
			for attempt := 1; runScenario(t, root, env, newPortMap(t, defaults), byScenario[name]); attempt++ {
				if attempt == 3 {
					t.Fatal("a server could not bind its port three times: another process took a free port each time, or a block names a port the rewriting misses (the README's own ports are held)")
				}
				t.Logf("another process took a free port before a server bound it: the scenario starts over on new ports")
			}
		})
	}
}

// commandDeadline bounds a server's start and a foreground block's run. Both are watched for
// their own signal (the serving log line, the exit), so the bound only decides how long a broken
// command takes to fail: generous, because on a loaded 2-core machine a server's start (exec,
// model load, KV arena) took over 60 s.
const commandDeadline = 5 * time.Minute

// server is a README command running in the background.
type server struct {
	cmd   *exec.Cmd
	done  chan struct{} // closed when the process has exited
	ready chan struct{} // closed when it logged that it serves
	mu    sync.Mutex
	out   bytes.Buffer
}

func (s *server) log() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.out.String()
}

// runScenario runs a scenario's blocks in order. It reports true, having stopped its servers,
// when a server could not bind a port of the map because another process had taken it.
func runScenario(t *testing.T, dir string, env0 []string, ports *portMap, blocks []readmeBlock) (portTaken bool) {
	var servers []*server
	defer func() {
		for _, s := range servers {
			_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
			<-s.done
			if t.Failed() {
				t.Logf("server output:\n%s", s.log())
			}
		}
	}()
	for _, b := range blocks {
		var env []string
		b.text, env = ports.rewrite(b.text, env0)
		first := firstCommand(b.text)
		isServer := strings.HasPrefix(first, "kvbridge serve") || strings.HasPrefix(first, "kvbridge proxy")
		if !isServer || strings.HasPrefix(b.scenario, "fails-") {
			runForeground(t, dir, env, b)
			continue
		}
		s := startServer(t, dir, env, b)
		servers = append(servers, s)
		select {
		case <-s.ready:
		case <-s.done:
			if strings.Contains(s.log(), "address already in use") {
				return true
			}
			t.Fatalf("README.md:%d: the server exited:\n%s", b.line, s.log())
		case <-time.After(commandDeadline):
			t.Fatalf("README.md:%d: the server did not start in %s:\n%s", b.line, commandDeadline, s.log())
		}
	}
	return false
}

// startServer runs a block in the background, in its own process group, and watches its log
// for the line that says it serves.
func startServer(t *testing.T, dir string, env []string, b readmeBlock) *server {
	t.Helper()
	s := &server{done: make(chan struct{}), ready: make(chan struct{})}
	s.cmd = exec.Command("bash", "-c", b.text)
	s.cmd.Dir, s.cmd.Env = dir, env
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	s.cmd.Stdout, s.cmd.Stderr = pw, pw
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pw.Close()
	go func() {
		defer close(s.done)
		sc := bufio.NewScanner(pr)
		ready := false
		for sc.Scan() {
			s.mu.Lock()
			s.out.WriteString(sc.Text() + "\n")
			s.mu.Unlock()
			if !ready && (strings.Contains(sc.Text(), "kvbridge serving") || strings.Contains(sc.Text(), "kvbridge proxy listening")) {
				ready = true
				close(s.ready)
			}
		}
		_ = s.cmd.Wait()
	}()
	return s
}

// firstCommand returns the block's first command, without comments and VAR=value prefixes.
func firstCommand(text string) string {
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(line), "\\"))
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		for _, f := range strings.Fields(line) {
			if !envAssign.MatchString(f) {
				return line[strings.Index(line, f):]
			}
		}
	}
	return ""
}

var envAssign = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*=`)

func runForeground(t *testing.T, dir string, env []string, b readmeBlock) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), commandDeadline)
	defer cancel()
	c := exec.CommandContext(ctx, "bash", "-c", "set -e\n"+b.text)
	c.Dir, c.Env = dir, env
	out, err := c.CombinedOutput()
	if strings.HasPrefix(b.scenario, "fails-") {
		if err == nil || !strings.Contains(string(out), b.expect) {
			t.Errorf("README.md:%d: want a failure mentioning %q, got %v:\n%s", b.line, b.expect, err, out)
		}
		return
	}
	if err != nil || bytes.Contains(out, []byte(`{"error":`)) {
		t.Errorf("README.md:%d: %v:\n%s", b.line, err, out)
	}
}
