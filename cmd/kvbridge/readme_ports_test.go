package main

import (
	"errors"
	"fmt"
	"net"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/connector"
)

// The README's commands use the guide's fixed ports (8000, 8100, 8200, 5600, 5601, …), which may
// be taken on the machine that runs the tests. TestREADME runs each block with every fixed port
// replaced by a free one chosen when a scenario first needs it, the same one in every block of
// the scenario that names it; the README itself keeps the guide's numbers.

// portPatterns find the ports in a command block: each pattern's last group is a port or a
// space-separated list of ports.
var portPatterns = []*regexp.Regexp{
	regexp.MustCompile(`\bVLLM_NIXL_SIDE_CHANNEL_PORT=(\d+)`),
	regexp.MustCompile(`--(?:port|prefiller-port|decoder-port)(?:\s+|=)(\d+)`),
	regexp.MustCompile(`--(?:prefiller-ports|decoder-ports)((?:\s+\d+)+)`),
	regexp.MustCompile(`(?:localhost|127\.0\.0\.1|0\.0\.0\.0|\[::1\]):(\d+)`),
}

var (
	number     = regexp.MustCompile(`\d+`)
	portFlag   = regexp.MustCompile(`--port\b`)
	serveModel = regexp.MustCompile(`kvbridge serve (\S+)`)
	longNumber = regexp.MustCompile(`\b\d{4,5}\b`)
)

// dataParallel finds a serve command's data-parallel size: its engine uses the side channel
// ports from VLLM_NIXL_SIDE_CHANNEL_PORT to VLLM_NIXL_SIDE_CHANNEL_PORT + size - 1.
var dataParallel = regexp.MustCompile(`(?:\s-dp|--data-parallel-size)(?:\s+|=)(\d+)`)

// defaultPorts are the ports the README's commands use without naming them: kvbridge serve's and
// kvbridge proxy's --port, and the side channel's when VLLM_NIXL_SIDE_CHANNEL_PORT is unset.
type defaultPorts struct{ serve, proxy, sideChannel int }

func readmeDefaultPorts(t *testing.T) defaultPorts {
	t.Helper()
	flagDefault := func(cmd *cobra.Command) int {
		t.Helper()
		f := cmd.Flags().Lookup("port")
		if f == nil {
			t.Fatalf("kvbridge %s has no --port flag", cmd.Name())
		}
		p, err := strconv.Atoi(f.DefValue)
		if err != nil {
			t.Fatalf("kvbridge %s --port default %q: %v", cmd.Name(), f.DefValue, err)
		}
		return p
	}
	return defaultPorts{
		serve:       flagDefault(newServeCmd()),
		proxy:       flagDefault(newProxyCmd()),
		sideChannel: connector.DefaultSideChannelPort,
	}
}

// portMap is one scenario's choice of a free port for each fixed one.
type portMap struct {
	t        *testing.T
	defaults defaultPorts
	to       map[int]int  // fixed port → the free port used instead
	used     map[int]bool // ports handed out, so that two fixed ports never get the same one
}

func newPortMap(t *testing.T, d defaultPorts) *portMap {
	return &portMap{t: t, defaults: d, to: map[int]int{}, used: map[int]bool{}}
}

// port returns the free port standing for fixed, choosing it at the first call; span > 1 asks
// for that many consecutive free ports (an engine's data-parallel side channels).
func (p *portMap) port(fixed, span int) int {
	p.t.Helper()
	if got, ok := p.to[fixed]; ok {
		return got
	}
	for range 100 {
		base, ok := freePortRange(span)
		if !ok {
			continue
		}
		clash := false
		for i := range span {
			clash = clash || p.used[base+i]
		}
		if clash {
			continue
		}
		for i := range span {
			p.used[base+i] = true
		}
		p.to[fixed] = base
		return base
	}
	p.t.Fatalf("found no %d consecutive free ports for the README's port %d", span, fixed)
	return 0
}

// freePortRange returns the first of span consecutive ports that were free on every address when
// it looked.
func freePortRange(span int) (int, bool) {
	first, err := net.Listen("tcp", ":0")
	if err != nil {
		return 0, false
	}
	defer first.Close()
	base := first.Addr().(*net.TCPAddr).Port
	for i := 1; i < span; i++ {
		if base+i > 65535 {
			return 0, false
		}
		l, err := net.Listen("tcp", fmt.Sprintf(":%d", base+i))
		if err != nil {
			return 0, false
		}
		defer l.Close()
	}
	return base, true
}

// rewrite returns the block's text with every fixed port replaced, and the environment the block
// runs with: a kvbridge serve that names no side channel port gets the stand-in of the default
// one, and a serve or proxy without --port gets the stand-in of its default --port.
func (p *portMap) rewrite(text string, env []string) (string, []string) {
	p.t.Helper()
	span := 1
	if m := dataParallel.FindStringSubmatch(text); m != nil {
		span, _ = strconv.Atoi(m[1])
	}
	for _, re := range portPatterns {
		text = re.ReplaceAllStringFunc(text, func(match string) string {
			sub := re.FindStringSubmatchIndex(match)
			lo, hi := sub[len(sub)-2], sub[len(sub)-1]
			n := 1
			if re == portPatterns[0] {
				n = span
			}
			ports := number.ReplaceAllStringFunc(match[lo:hi], func(s string) string {
				fixed, _ := strconv.Atoi(s)
				return strconv.Itoa(p.port(fixed, n))
			})
			return match[:lo] + ports + match[hi:]
		})
	}
	first := firstCommand(text)
	serve, proxy := strings.HasPrefix(first, "kvbridge serve"), strings.HasPrefix(first, "kvbridge proxy")
	hasPort := portFlag.MatchString(text)
	switch {
	case serve && !hasPort:
		text = serveModel.ReplaceAllString(text, fmt.Sprintf("kvbridge serve $1 --port %d", p.port(p.defaults.serve, 1)))
	case proxy && !hasPort:
		text = strings.Replace(text, "kvbridge proxy", fmt.Sprintf("kvbridge proxy --port %d", p.port(p.defaults.proxy, 1)), 1)
	}
	if serve && !strings.Contains(text, "VLLM_NIXL_SIDE_CHANNEL_PORT=") {
		env = append(slices.Clip(env), fmt.Sprintf("VLLM_NIXL_SIDE_CHANNEL_PORT=%d", p.port(p.defaults.sideChannel, span)))
	}
	return text, env
}

// fixedPorts lists every port the blocks use as written, named or by default.
func fixedPorts(t *testing.T, blocks []readmeBlock, d defaultPorts) []int {
	t.Helper()
	seen := map[int]bool{d.serve: true, d.proxy: true, d.sideChannel: true}
	for _, b := range blocks {
		span := 1
		if m := dataParallel.FindStringSubmatch(b.text); m != nil {
			span, _ = strconv.Atoi(m[1])
		}
		for i, re := range portPatterns {
			for _, m := range re.FindAllStringSubmatch(b.text, -1) {
				for _, s := range strings.Fields(m[len(m)-1]) {
					p, _ := strconv.Atoi(s)
					seen[p] = true
					for k := 1; i == 0 && k < span; k++ {
						seen[p+k] = true
					}
				}
			}
		}
	}
	ports := make([]int, 0, len(seen))
	for p := range seen {
		ports = append(ports, p)
	}
	slices.Sort(ports)
	return ports
}

// holdPorts listens on every port it can of ports, on all addresses, until the test ends, so
// that a command still using a fixed port fails at once (its server cannot bind, its client's
// connection is closed unanswered) instead of passing by luck. A port someone else holds is fine:
// the commands must not use it either. It returns the ports it holds.
func holdPorts(t *testing.T, ports []int) []int {
	t.Helper()
	var held []int
	for _, p := range ports {
		l, err := net.Listen("tcp", fmt.Sprintf(":%d", p))
		if err != nil {
			if !errors.Is(err, syscall.EADDRINUSE) {
				t.Logf("cannot hold port %d: %v", p, err)
			}
			continue
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				c, err := l.Accept()
				if err != nil {
					return // closed by the cleanup
				}
				c.Close()
			}
		}()
		t.Cleanup(func() {
			l.Close()
			<-done
		})
		held = append(held, p)
	}
	return held
}

// TestREADMEPortsRewritten checks, without starting anything, that every port in every README
// block TestREADME runs is one of the stand-ins, and that each serve and proxy gets its port and
// side channel from them.
func TestREADMEPortsRewritten(t *testing.T) {
	d := readmeDefaultPorts(t)
	blocks := readmeBlocks(t, "../../README.md")
	scenarios := map[string]*portMap{}
	for _, b := range blocks {
		if b.scenario == "skip" {
			continue
		}
		pm := scenarios[b.scenario]
		if pm == nil {
			pm = newPortMap(t, d)
			scenarios[b.scenario] = pm
		}
		text, env := pm.rewrite(b.text, nil)
		// Independently of the patterns: every number of four or five digits in a block is a
		// port, and must be a stand-in.
		span := 1
		if m := dataParallel.FindStringSubmatch(b.text); m != nil {
			span, _ = strconv.Atoi(m[1])
		}
		stand := map[int]bool{}
		for _, p := range pm.to {
			for k := range span {
				stand[p+k] = true
			}
		}
		for _, s := range longNumber.FindAllString(text+" "+strings.Join(env, " "), -1) {
			if p, _ := strconv.Atoi(s); !stand[p] {
				t.Errorf("README.md:%d: port %d left as written:\n%s", b.line, p, text)
			}
		}
		first := firstCommand(text)
		if (strings.HasPrefix(first, "kvbridge serve") || strings.HasPrefix(first, "kvbridge proxy")) && !portFlag.MatchString(text) {
			t.Errorf("README.md:%d: no --port after rewriting:\n%s", b.line, text)
		}
		if strings.HasPrefix(first, "kvbridge serve") && !strings.Contains(text+strings.Join(env, " "), "VLLM_NIXL_SIDE_CHANNEL_PORT=") {
			t.Errorf("README.md:%d: no side channel port after rewriting:\n%s", b.line, text)
		}
	}
	if len(scenarios) == 0 {
		t.Fatal("no README blocks")
	}
}
