package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/netns"
)

// The tests in this file run the seed guide's multi-instance layout on separate network stacks:
// every engine, proxy and client is a host of its own (a network namespace with its own address,
// joined to the others by a bridge: package netns), each engine at port 8000 with its side
// channel at 5600 as on four machines. They need root and are skipped without it.

// guidePort and guideSideChannel are every host's ports, as in the guide.
const (
	guidePort        = "8000"
	guideSideChannel = "5600"
)

// hostNetwork makes a network with the named hosts for t, removed when t ends; without root or
// namespaces the test is skipped.
func hostNetwork(t *testing.T, names ...string) map[string]*netns.Host {
	t.Helper()
	n, err := netns.New(t.Context(), netns.Config{})
	if errors.Is(err, netns.ErrUnavailable) {
		t.Skipf("the multi-host tests need network namespaces (root and iproute2): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Error(err)
		}
	})
	hosts := make(map[string]*netns.Host, len(names))
	for _, name := range names {
		h, err := n.AddHost(t.Context(), name)
		if err != nil {
			t.Fatal(err)
		}
		hosts[name] = h
	}
	return hosts
}

// guideEnv is the guide's environment of an engine on host h.
func guideEnv(h *netns.Host) []string {
	return []string{"VLLM_NIXL_SIDE_CHANNEL_HOST=" + h.Addr.String(), "VLLM_NIXL_SIDE_CHANNEL_PORT=" + guideSideChannel, "UCX_NET_DEVICES=all"}
}

// startEngineOn starts `kvbridge serve kvbridge/tiny --port 8000 --kv-transfer-config kv` on h
// with env.
func startEngineOn(t *testing.T, h *netns.Host, env []string, kv string) *process {
	t.Helper()
	return startProcessOn(t, h, env, "serve", "kvbridge/tiny", "--port", guidePort, "--num-gpu-blocks-override", "512",
		"--max-model-len", "4096", "--kv-transfer-config", kv)
}

// kvConfig is a --kv-transfer-config JSON of role with the guide's failure policy and extra
// connector settings.
func kvConfig(role string, extra map[string]any) string {
	doc := map[string]any{"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": "fail"}
	if extra != nil {
		doc["kv_connector_extra_config"] = extra
	}
	b, _ := json.Marshal(doc)
	return string(b)
}

// addrs joins the hosts' addresses with commas, as the proxy's list flags take them.
func addrs(hosts ...*netns.Host) string {
	s := make([]string, len(hosts))
	for i, h := range hosts {
		s[i] = h.Addr.String()
	}
	return strings.Join(s, ",")
}

// ports repeats the guide's port once per host.
func ports(n int) string { return strings.TrimSuffix(strings.Repeat(guidePort+",", n), ",") }

// sampled is a completion body with seeded sampling at temperature 1: its text depends on every
// logit, so KV that is wrong anywhere shows (greedy output of the tiny model hardly depends on
// the context).
func sampled(prompt any) map[string]any {
	return map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 12, "temperature": 1, "seed": 1234}
}

// answer is one HTTP exchange's result.
type answer struct {
	status int
	header http.Header
	body   []byte
	err    error
}

// post sends body to url with hc under deadline; a transport error is in answer.err.
func post(ctx context.Context, hc *http.Client, url string, body any, deadline time.Duration) answer {
	data, _ := json.Marshal(body)
	ctx, cancel := context.WithTimeout(ctx, deadline)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		return answer{err: err}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	return answer{status: resp.StatusCode, header: resp.Header, body: raw, err: err}
}

// mustPost is post that fails the test unless the answer is a 200.
func mustPost(t *testing.T, hc *http.Client, url string, body any) answer {
	t.Helper()
	a := post(t.Context(), hc, url, body, 60*time.Second)
	if a.err != nil || a.status != http.StatusOK {
		t.Fatalf("POST %s: %d %v %s", url, a.status, a.err, a.body)
	}
	return a
}

// internalError checks that a is the engines' HTTP 500 in OpenAI's error JSON.
func internalError(t *testing.T, a answer) {
	t.Helper()
	var e struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    int    `json:"code"`
		} `json:"error"`
	}
	if a.err != nil || a.status != http.StatusInternalServerError || json.Unmarshal(a.body, &e) != nil ||
		e.Error.Message != "Internal server error" || e.Error.Type != "InternalServerError" || e.Error.Code != 500 {
		t.Fatalf("got %d %v %s; want 500 Internal server error in OpenAI's error JSON", a.status, a.err, a.body)
	}
}

// logLine waits (at most 10 s) for a line of p's log holding every one of parts.
func (p *process) logLine(t *testing.T, parts ...string) bool {
	t.Helper()
	return p.waitFor(func(log string) bool {
		for line := range strings.SplitSeq(log, "\n") {
			if containsAll(line, parts) {
				return true
			}
		}
		return false
	})
}

// waitFor waits (at most 10 s) until ok holds for p's log.
func (p *process) waitFor(ok func(log string) bool) bool {
	deadline := time.Now().Add(10 * time.Second)
	for !ok(p.log()) {
		if time.Now().After(deadline) {
			return false
		}
		select {
		case <-p.done:
			return ok(p.log())
		case <-time.After(5 * time.Millisecond):
		}
	}
	return true
}

func containsAll(s string, parts []string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}

// metric reads the engine's /metrics and returns the sum of the samples of name (labels
// aside), e.g. vllm:kv_cache_usage_perc or vllm:nixl_bytes_transferred_sum.
func metric(ctx context.Context, hc *http.Client, url, name string) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url+"/metrics", nil)
	resp, err := hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sum, found := 0.0, false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), name)
		if !ok || (rest != "" && rest[0] != '{' && rest[0] != ' ') {
			continue
		}
		if i := strings.LastIndexByte(rest, ' '); i >= 0 {
			v, err := strconv.ParseFloat(rest[i+1:], 64)
			if err != nil {
				return 0, err
			}
			sum, found = sum+v, true
		}
	}
	if !found {
		return 0, fmt.Errorf("%s/metrics has no %s (%v)", url, name, sc.Err())
	}
	return sum, nil
}

// waitPoolsFull waits, at most within, until every engine's KV pool is full again (no block in
// use), read over HTTP from the client host.
func waitPoolsFull(t *testing.T, hc *http.Client, within time.Duration, engines ...*process) {
	t.Helper()
	deadline := time.Now().Add(within)
	for _, e := range engines {
		for {
			u, err := metric(t.Context(), hc, e.url, "vllm:kv_cache_usage_perc")
			if err == nil && u == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("%s: KV cache usage %v (%v), want 0: blocks not returned to the pool", e.url, u, err)
				break
			}
			time.Sleep(20 * time.Millisecond) // polling another process's metrics, under the deadline
		}
	}
}

// checkBinds checks that every listener on h but the HTTP port is bound to h's address: the
// side channel and the transfer listener take VLLM_NIXL_SIDE_CHANNEL_HOST.
func checkBinds(t *testing.T, h *netns.Host) {
	t.Helper()
	ls, err := h.Listeners()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range ls {
		if strconv.Itoa(int(l.Port())) == guidePort {
			continue
		}
		n++
		if l.Addr() != h.Addr {
			t.Errorf("host %s: a listener on %s, want every connector listener on %s", h, l, h.Addr)
		}
	}
	if n < 2 {
		t.Errorf("host %s: listeners %v; want the side channel and the transfer listener besides HTTP", h, ls)
	}
}

// TestHostsFourHostLayout runs the guide's multi-instance layout — two prefillers and two
// decoders on four hosts, each with its VLLM_NIXL_SIDE_CHANNEL_HOST, and the proxy on a fifth —
// one-way behind `kvbridge proxy` and bidirectional behind `kvbridge proxy --multi-turn`, with
// a client on a sixth. Outputs equal a single engine's; between hosts the transfer engine falls
// back from SHM (abstract Unix sockets do not cross network namespaces, though the boot ids
// match) to TCP and says so; each engine binds and advertises its host's address; every pool
// is full afterwards.
func TestHostsFourHostLayout(t *testing.T) {
	hosts := hostNetwork(t, "p1", "p2", "d1", "d2", "proxy", "client")
	single := startProcess(t, nil, serveArgs()...)
	want := func(body any) string {
		t.Helper()
		return completionText(t, mustPost(t, http.DefaultClient, single.url+pathOf(body), body).body)
	}
	hc := hosts["client"].HTTPClient()
	p1h, p2h, d1h, d2h := hosts["p1"], hosts["p2"], hosts["d1"], hosts["d2"]

	t.Run("one-way", func(t *testing.T) {
		p1 := startEngineOn(t, p1h, guideEnv(p1h), kvConfig("kv_producer", nil))
		p2 := startEngineOn(t, p2h, guideEnv(p2h), kvConfig("kv_producer", nil))
		d1 := startEngineOn(t, d1h, guideEnv(d1h), kvConfig("kv_consumer", nil))
		d2 := startEngineOn(t, d2h, guideEnv(d2h), kvConfig("kv_consumer", nil))
		px := startProcessOn(t, hosts["proxy"], nil, "proxy", "--host", "0.0.0.0", "--port", "8192",
			"--prefiller-hosts", addrs(p1h, p2h), "--prefiller-ports", ports(2),
			"--decoder-hosts", addrs(d1h, d2h), "--decoder-ports", ports(2))
		bodies := []map[string]any{
			sampled("Hi"),
			sampled(strings.Repeat("many words make many blocks ", 30)),
			sampled([]int{5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21}),
			{"model": "kvbridge/tiny", "messages": []map[string]string{{"role": "user", "content": strings.Repeat("a chat across hosts ", 12)}},
				"max_tokens": 12, "temperature": 1, "seed": 99},
		}
		// The proxy takes P and D in turn: requests 0 and 2 go P1 → D1, 1 and 3 P2 → D2.
		for i, b := range bodies {
			got := completionText(t, mustPost(t, hc, px.url+pathOf(b), b).body)
			if w := want(b); got != w {
				t.Errorf("request %d: across hosts %q, single engine %q", i, got, w)
			}
		}
		for i, d := range []*process{d1, d2} {
			pAddr := []*netns.Host{p1h, p2h}[i].Addr.String() + ":" + guideSideChannel
			if !d.logLine(t, "NIXL handshake done", "peer_addr="+pAddr, "backend=TCP") {
				t.Errorf("decoder %d did not report a TCP handshake with %s:\n%s", i+1, pAddr, d.log())
			}
			if !d.logLine(t, "transfer backend fallback", "backend=TCP", "SHM: ") {
				t.Errorf("decoder %d did not log why it fell back from SHM to TCP:\n%s", i+1, d.log())
			}
			if strings.Contains(d.log(), "backend=SHM") {
				t.Errorf("decoder %d used SHM across hosts:\n%s", i+1, d.log())
			}
		}
		for _, e := range []struct {
			p *process
			h *netns.Host
		}{{p1, p1h}, {p2, p2h}, {d1, d1h}, {d2, d2h}} {
			if !e.p.logLine(t, "kvbridge serving", "side_channel="+e.h.Addr.String()+":"+guideSideChannel) {
				t.Errorf("host %s: the engine did not put its side channel at its address:\n%s", e.h, e.p.log())
			}
			checkBinds(t, e.h)
		}

		// P advertises its host's address in its params, and a decoder that never met it (D2
		// only ever read from P2) reads from it there.
		b := sampled(strings.Repeat("advertised ", 40))
		pre := withKeys(b, map[string]any{"max_tokens": 1, "kv_transfer_params": map[string]any{"do_remote_decode": true}})
		var pr struct {
			KV map[string]any `json:"kv_transfer_params"`
		}
		if err := json.Unmarshal(mustPost(t, hc, p1.url+"/v1/completions", pre).body, &pr); err != nil || pr.KV == nil {
			t.Fatalf("no params from P1: %v", err)
		}
		if pr.KV["remote_host"] != p1h.Addr.String() || fmt.Sprint(pr.KV["remote_port"]) != guideSideChannel {
			t.Errorf("P1's params name %v:%v, want %s:%s", pr.KV["remote_host"], pr.KV["remote_port"], p1h.Addr, guideSideChannel)
		}
		got := completionText(t, mustPost(t, hc, d2.url+"/v1/completions", withKeys(b, map[string]any{"kv_transfer_params": pr.KV})).body)
		if w := want(b); got != w {
			t.Errorf("D2 reading P1: %q, single engine %q", got, w)
		}
		if !d2.logLine(t, "NIXL handshake done", "peer_addr="+p1h.Addr.String()+":"+guideSideChannel, "backend=TCP") {
			t.Errorf("D2 did not handshake with P1 over TCP:\n%s", d2.log())
		}
		waitPoolsFull(t, hc, 10*time.Second, p1, p2, d1, d2)
	})

	t.Run("bidirectional", func(t *testing.T) {
		// decoder_kv_blocks_ttl: how long D holds a turn's blocks. P declines to read a hold with
		// less than 5 s left, so the proxy forgets a conversation sooner than ttl−5 s.
		const ttl = 8
		bidi := map[string]any{"bidirectional_kv_xfer": true}
		p1 := startEngineOn(t, p1h, guideEnv(p1h), kvConfig("kv_producer", bidi))
		p2 := startEngineOn(t, p2h, guideEnv(p2h), kvConfig("kv_producer", bidi))
		dcfg := kvConfig("kv_consumer", map[string]any{"bidirectional_kv_xfer": true, "decoder_kv_blocks_ttl": ttl})
		d1 := startEngineOn(t, d1h, guideEnv(d1h), dcfg)
		d2 := startEngineOn(t, d2h, guideEnv(d2h), dcfg)
		px := startProcessOn(t, hosts["proxy"], nil, "proxy", "--multi-turn", "--host", "0.0.0.0", "--port", guidePort,
			"--conversation-ttl", "2s",
			"--prefiller-hosts", addrs(p1h, p2h), "--prefiller-ports", ports(2),
			"--decoder-hosts", addrs(d1h, d2h), "--decoder-ports", ports(2))
		// Two conversations of three turns. The proxy takes P in turn and keeps a conversation
		// on the decoder of its first turn, so sending A, B, then B, A, then A, B puts A on D1
		// and B on D2, and every turn after the first on the other prefiller than the turn
		// before: each such turn pulls from a decoder on another host what its prefiller lacks
		// (each user message is longer than kv_recompute_threshold, 64 tokens).
		msg := func(id string, turn int) map[string]string {
			return map[string]string{"role": "user", "content": strings.Repeat(fmt.Sprintf("conversation %s turn %d says something long. ", id, turn), 8)}
		}
		convs := map[string][]map[string]string{"A": {msg("A", 1)}, "B": {msg("B", 1)}}
		pulled := func(p *process) float64 { // bytes P has read from decoders so far
			t.Helper()
			v, err := metric(t.Context(), hc, p.url, "vllm:nixl_bytes_transferred_sum")
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
		sent := 0
		for turn, order := range [][]string{{"A", "B"}, {"B", "A"}, {"A", "B"}} {
			for _, id := range order {
				p := []*process{p1, p2}[sent%2]
				sent++
				before := pulled(p)
				msgs := convs[id]
				body := map[string]any{"model": "kvbridge/tiny", "messages": msgs, "max_tokens": 12, "temperature": 1, "seed": 7}
				a := mustPost(t, hc, px.url+"/v1/chat/completions", withKeys(body, map[string]any{"conversation_id": id}))
				got := completionText(t, a.body)
				if w := want(body); got != w {
					t.Errorf("conversation %s turn %d: across hosts %q, single engine %q", id, turn+1, got, w)
				}
				if turn > 0 {
					// At least a user message's KV (64 tokens of 512 bytes) came from D.
					if c, n := a.header.Get("X-KVBridge-Cache"), pulled(p)-before; c != "hit" || n < 64*512 {
						t.Errorf("conversation %s turn %d: cache %q, P read %v bytes from D; want a hit and a pull", id, turn+1, c, n)
					}
				}
				convs[id] = append(msgs, map[string]string{"role": "assistant", "content": got}, msg(id, turn+2))
			}
		}
		// P pulled the earlier turns from D over TCP, at D's advertised address.
		for _, e := range []struct {
			p  *process
			d  *netns.Host
			nm string
		}{{p1, d1h, "P1"}, {p1, d2h, "P1"}, {p2, d1h, "P2"}, {p2, d2h, "P2"}} {
			if !e.p.logLine(t, "NIXL handshake done", "peer_addr="+e.d.Addr.String()+":"+guideSideChannel, "backend=TCP") {
				t.Errorf("%s did not pull from %s over TCP:\n%s", e.nm, e.d, e.p.log())
			}
		}
		// D holds the last turn's blocks for decoder_kv_blocks_ttl, then frees them.
		waitPoolsFull(t, hc, (ttl+10)*time.Second, p1, p2, d1, d2)
	})
}

// pathOf is the API path of a body: chat if it has messages.
func pathOf(body any) string {
	if m, ok := body.(map[string]any); ok {
		if _, chat := m["messages"]; chat {
			return "/v1/chat/completions"
		}
	}
	return "/v1/completions"
}

// withKeys returns a copy of a with b's keys set.
func withKeys(a, b map[string]any) map[string]any {
	out := make(map[string]any, len(a)+len(b))
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] = v
	}
	return out
}

// TestHostsMisconfigured: between hosts, a setting that cannot work fails the request clearly —
// HTTP 500 in OpenAI's error JSON, a log line naming the cause — well within the connector's
// handshake deadline (10 s), never silently: a prefiller started without
// VLLM_NIXL_SIDE_CHANNEL_HOST advertises localhost, which the decoder's host cannot reach (its
// own port 5600 there is its own side channel, on its address, not on localhost); and SHM forced
// between hosts is refused, never replaced by TCP.
func TestHostsMisconfigured(t *testing.T) {
	hosts := hostNetwork(t, "p", "d", "proxy", "client")
	hc := hosts["client"].HTTPClient()
	const deadline = 10*time.Second + 15*time.Second // the handshake deadline, and slack
	run := func(t *testing.T, penv []string, pkv, dkv string) (*process, *process, answer) {
		p := startEngineOn(t, hosts["p"], penv, pkv)
		d := startEngineOn(t, hosts["d"], guideEnv(hosts["d"]), dkv)
		px := startProcessOn(t, hosts["proxy"], nil, "proxy", "--host", "0.0.0.0", "--port", "8192",
			"--prefiller-hosts", hosts["p"].Addr.String(), "--prefiller-ports", guidePort,
			"--decoder-hosts", hosts["d"].Addr.String(), "--decoder-ports", guidePort)
		a := post(t.Context(), hc, px.url+"/v1/completions", sampled(strings.Repeat("misconfigured ", 20)), deadline)
		internalError(t, a)
		waitPoolsFull(t, hc, 10*time.Second, d)
		return p, d, a
	}
	t.Run("advertised-localhost", func(t *testing.T) {
		penv := []string{"VLLM_NIXL_SIDE_CHANNEL_PORT=" + guideSideChannel} // no VLLM_NIXL_SIDE_CHANNEL_HOST
		p, d, _ := run(t, penv, kvConfig("kv_producer", map[string]any{"kv_lease_duration": 2}), kvConfig("kv_consumer", nil))
		if !p.logLine(t, "kvbridge serving", "side_channel=127.0.0.1:"+guideSideChannel) {
			t.Errorf("P's side channel is not on its loopback:\n%s", p.log())
		}
		if !d.logLine(t, "NIXL transfer failure: handshake_setup_failed", "peer_addr=localhost:"+guideSideChannel) {
			t.Errorf("D did not log the failed handshake with localhost:\n%s", d.log())
		}
		waitPoolsFull(t, hc, 15*time.Second, p) // P's lease (2 s) expires: nobody read its blocks
	})
	t.Run("forced-SHM", func(t *testing.T) {
		shm := map[string]any{"backends": []string{"SHM"}, "kv_lease_duration": 2}
		p, d, _ := run(t, guideEnv(hosts["p"]), kvConfig("kv_producer", shm), kvConfig("kv_consumer", shm))
		if !d.logLine(t, "NIXL transfer failure", "none of the requested backends can be used", "SHM: ") {
			t.Errorf("D did not say SHM cannot reach P:\n%s", d.log())
		}
		if strings.Contains(d.log(), "backend=TCP") {
			t.Errorf("D used TCP though SHM was forced:\n%s", d.log())
		}
		waitPoolsFull(t, hc, 15*time.Second, p)
	})
}

// faultStack is P, D and the one-way proxy on three hosts and a client on a fourth, with P's
// sending throttled so that a long prompt's KV takes seconds to cross: a fault can then land in
// the middle of D's read.
type faultStack struct {
	hosts    map[string]*netns.Host
	hc       *http.Client
	pkv, dkv string
	p, d, px *process
}

// faultPromptLen is the prompt of the faulted request: 3,000 tokens, 1.5 MB of the tiny model's
// KV, about 6 s at the throttled rate.
const (
	faultPromptLen = 3000
	throttleBits   = 2_000_000
	// midTransfer is how much P has sent of the read when the fault strikes: far more than the
	// HTTP answers and handshakes, far less than the KV.
	midTransfer = 256 << 10
)

func newFaultStack(t *testing.T, pkv, dkv string) *faultStack {
	t.Helper()
	s := &faultStack{hosts: hostNetwork(t, "p", "d", "proxy", "client"), pkv: pkv, dkv: dkv}
	s.hc = s.hosts["client"].HTTPClient()
	if err := s.hosts["p"].Throttle(t.Context(), throttleBits); errors.Is(err, netns.ErrUnavailable) {
		t.Skipf("the faults mid-transfer need a throttled link: %v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	s.p = startEngineOn(t, s.hosts["p"], guideEnv(s.hosts["p"]), pkv)
	s.d = startEngineOn(t, s.hosts["d"], guideEnv(s.hosts["d"]), dkv)
	s.px = startProcessOn(t, s.hosts["proxy"], nil, "proxy", "--host", "0.0.0.0", "--port", "8192",
		"--prefiller-hosts", s.hosts["p"].Addr.String(), "--prefiller-ports", guidePort,
		"--decoder-hosts", s.hosts["d"].Addr.String(), "--decoder-ports", guidePort)
	return s
}

// longPrompt returns n token ids.
func longPrompt(n, salt int) []int {
	p := make([]int, n)
	for i := range p {
		p[i] = 1 + (i*7919+salt*104729)%4000
	}
	return p
}

// sendDuringTransfer sends a long prompt through the proxy and calls fault once P has sent
// midTransfer bytes of it. It returns the client's answer, bounded by deadline.
func (s *faultStack) sendDuringTransfer(t *testing.T, deadline time.Duration, fault func()) answer {
	t.Helper()
	p := s.hosts["p"]
	before, err := p.Counters()
	if err != nil {
		t.Fatal(err)
	}
	res := make(chan answer, 1)
	go func() {
		res <- post(context.Background(), s.hc, s.px.url+"/v1/completions", sampled(longPrompt(faultPromptLen, 1)), deadline)
	}()
	limit := time.Now().Add(30 * time.Second)
	for {
		c, err := p.Counters()
		if err != nil {
			t.Fatal(err)
		}
		if c.TxBytes-before.TxBytes >= midTransfer {
			break
		}
		select {
		case a := <-res:
			t.Fatalf("the request ended before the transfer was under way: %d %v %s", a.status, a.err, a.body)
		case <-time.After(2 * time.Millisecond): // polling the link's counters, under limit
		}
		if time.Now().After(limit) {
			t.Fatalf("P sent %d bytes in 30 s, want %d", c.TxBytes-before.TxBytes, midTransfer)
		}
	}
	fault()
	return <-res
}

// recovered checks that the stack answers right again: the next request (a new prompt) gets
// the single engine's text, and every pool is full afterwards.
func (s *faultStack) recovered(t *testing.T, single *process, engines ...*process) {
	t.Helper()
	if err := s.hosts["p"].Throttle(t.Context(), 0); err != nil {
		t.Fatal(err)
	}
	b := sampled(longPrompt(200, 2))
	got := completionText(t, mustPost(t, s.hc, s.px.url+"/v1/completions", b).body)
	if w := completionText(t, mustPost(t, http.DefaultClient, single.url+"/v1/completions", b).body); got != w {
		t.Errorf("after the fault: %q, single engine %q", got, w)
	}
	waitPoolsFull(t, s.hc, 15*time.Second, engines...)
}

// TestHostsFaults cuts a host off in the middle of D's read of P's KV over TCP, in the three
// ways a machine fails: its process killed (P, then D), and its link down (P). The client's
// outcome is the engines' and the proxy's error JSON within a bounded wait, and the survivors
// serve the next request right with every pool full.
func TestHostsFaults(t *testing.T) {
	single := startProcess(t, nil, serveArgs()...)
	lease := map[string]any{"kv_lease_duration": 3}
	t.Run("P-killed", func(t *testing.T) {
		t.Parallel()
		s := newFaultStack(t, kvConfig("kv_producer", lease), kvConfig("kv_consumer", nil))
		// P's death resets D's connections: D fails the load at once, not at its 60 s deadline.
		a := s.sendDuringTransfer(t, 30*time.Second, s.p.kill)
		internalError(t, a)
		if !s.d.logLine(t, "retrying after a new handshake") || !s.d.logLine(t, "NIXL transfer failure: handshake_setup_failed") {
			t.Errorf("D did not log the failed read, then the failed handshake with the dead P:\n%s", s.d.log())
		}
		<-s.p.done
		s.p = startEngineOn(t, s.hosts["p"], guideEnv(s.hosts["p"]), s.pkv) // the host's engine restarts
		s.recovered(t, single, s.p, s.d)
	})
	t.Run("D-killed", func(t *testing.T) {
		t.Parallel()
		s := newFaultStack(t, kvConfig("kv_producer", lease), kvConfig("kv_consumer", nil))
		a := s.sendDuringTransfer(t, 30*time.Second, s.d.kill)
		var e struct {
			Error struct {
				Type string `json:"type"`
				Code string `json:"code"`
			} `json:"error"`
		}
		if a.err != nil || a.status != http.StatusBadGateway || json.Unmarshal(a.body, &e) != nil ||
			e.Error.Type != "BadGatewayError" || e.Error.Code != "decode_request_failed" {
			t.Fatalf("got %d %v %s; want 502 decode_request_failed", a.status, a.err, a.body)
		}
		// P's blocks were never released by D: its lease (3 s) expires.
		waitPoolsFull(t, s.hc, 15*time.Second, s.p)
		if !s.p.logLine(t, "Releasing expired KV blocks") {
			t.Errorf("P did not free the blocks at its lease expiry:\n%s", s.p.log())
		}
		<-s.d.done
		s.d = startEngineOn(t, s.hosts["d"], guideEnv(s.hosts["d"]), s.dkv)
		s.recovered(t, single, s.p, s.d)
	})
	t.Run("P-link-down", func(t *testing.T) {
		t.Parallel()
		s := newFaultStack(t, kvConfig("kv_producer", lease), kvConfig("kv_consumer", nil))
		p := s.hosts["p"]
		// Nothing tells D that P's link went down but silence: the transfer connections' dead-link
		// detection (keepalive probes, TCP_USER_TIMEOUT: about 12 s) drops them, the retry's
		// handshake cannot reach P (10 s), and the request fails under policy fail — well before
		// the connector's 60 s load deadline, which is what the deadline here tells apart.
		a := s.sendDuringTransfer(t, 45*time.Second, func() {
			if err := p.SetLink(t.Context(), false); err != nil {
				t.Error(err)
			}
		})
		internalError(t, a)
		if !s.d.logLine(t, "NIXL transfer failure") {
			t.Errorf("D did not log the failed read:\n%s", s.d.log())
		}
		// Cut off from D's heartbeats and notification, P freed the blocks at its lease expiry.
		if !s.p.logLine(t, "Releasing expired KV blocks") {
			t.Errorf("P did not free the blocks at its lease expiry:\n%s", s.p.log())
		}
		if err := p.SetLink(t.Context(), true); err != nil {
			t.Fatal(err)
		}
		s.recovered(t, single, s.p, s.d)
	})
}

// TestBenchPDHosts runs `kvbridge bench pd --hosts` on the tiny model: P and D on hosts of
// their own over TCP, the ceiling a raw TCP stream between their hosts, all in one run.
func TestBenchPDHosts(t *testing.T) {
	hostNetwork(t) // skips where namespaces cannot be made
	path := t.TempDir() + "/pd.json"
	cmd := exec.Command(os.Args[0], "bench", "pd", "--hosts", "--model", "kvbridge/tiny", "--prompt-lens", "64,1024", "--iters", "1", "--json", path)
	cmd.Env = append(os.Environ(), "KVBRIDGE_TEST_MAIN=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("bench pd --hosts: %v\n%s", err, out)
	}
	for _, want := range []string{"backend TCP", "on hosts of their own", "raw TCP streams", "ceiling_gbps"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the report lacks %q:\n%s", want, out)
		}
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var rows []map[string]any
	if err := json.Unmarshal(data, &rows); err != nil || len(rows) != 2 {
		t.Fatalf("%d rows (%v), want 2:\n%s", len(rows), err, data)
	}
	for _, r := range rows {
		if r["ceiling"] != "tcp_stream" || r["hosts"] != true || r["backend"] != "TCP" {
			t.Errorf("row %v: want a tcp_stream ceiling across hosts over TCP", r)
		}
		for _, k := range []string{"ttft_single_ms", "ttft_pd_ms", "transfer_gbps", "ceiling_gbps", "ratio", "tcp_1conn_gbps", "tcp_4conn_gbps", "p_leg_ms", "d_engine_ms", "single_cpu_ms", "p_cpu_ms", "d_cpu_ms"} {
			if v, ok := r[k].(float64); !ok || !(v > 0) {
				t.Errorf("prompt %v: %s = %v, want > 0", r["prompt_len"], k, r[k])
			}
		}
	}
	// 1,024 tokens of the tiny model: 512 bytes each.
	if b, _ := rows[1]["transfer_bytes"].(float64); b < 1024*512 {
		t.Errorf("a 1,024-token prompt moved %v bytes, want at least %d", b, 1024*512)
	}
}

// TestBenchPDHostsTP runs `kvbridge bench pd --hosts` with P at TP 2 and D at TP 1, pull and
// push: the engine processes run their ranks (--tensor-parallel-size), D's rank reads (or P's
// ranks write) its heads across the hosts, and every row has figures and names both TP sizes.
func TestBenchPDHostsTP(t *testing.T) {
	hostNetwork(t) // skips where namespaces cannot be made
	path := t.TempDir() + "/pd.json"
	cmd := exec.Command(os.Args[0], "bench", "pd", "--hosts", "--model", "kvbridge/tiny", "--prompt-lens", "256", "--iters", "1",
		"--prefill-tp", "2", "--decode-tp", "1", "--transfer-mode", "pull,push", "--json", path)
	cmd.Env = append(os.Environ(), "KVBRIDGE_TEST_MAIN=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("bench pd --hosts --prefill-tp 2: %v\n%s", err, out)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var rows []map[string]any
	if err := json.Unmarshal(data, &rows); err != nil || len(rows) != 2 {
		t.Fatalf("%d rows (%v), want 2 (pull, push):\n%s\n%s", len(rows), err, data, out)
	}
	for _, r := range rows {
		if r["prefill_tp"] != 2.0 || r["decode_tp"] != 1.0 || r["hosts"] != true || r["unsupported"] != nil {
			t.Errorf("row %v: want P TP 2 → D TP 1 across hosts", r)
		}
		for _, k := range []string{"ttft_single_ms", "ttft_pd_ms", "transfer_gbps"} {
			if v, ok := r[k].(float64); !ok || !(v > 0) {
				t.Errorf("%v: %s = %v, want > 0", r["mode"], k, r[k])
			}
		}
		// 256 tokens of the tiny model: 512 bytes each, all of them moved, split over P's ranks.
		if b, _ := r["transfer_bytes"].(float64); b < 255*512 {
			t.Errorf("%v: a 256-token prompt moved %v bytes, want at least %d", r["mode"], b, 255*512)
		}
	}
}
