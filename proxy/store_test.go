package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvbridge/kvbridge/proxy"
)

// redisServer is a real redis-server (Debian's package) on a loopback port, for the proxy tier's
// tests; .ci/run installs it when missing.
type redisServer struct {
	t    *testing.T
	port int
	cmd  *exec.Cmd
	done chan struct{}
}

// startRedis starts redis-server on a free port (or on port, when not 0) without persistence,
// and waits (at most 10 s) for it to accept connections.
func startRedis(t *testing.T, port int) *redisServer {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
	}
	if port == 0 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port = ln.Addr().(*net.TCPAddr).Port
		ln.Close()
	}
	r := &redisServer{t: t, port: port, done: make(chan struct{})}
	r.cmd = exec.Command(bin, "--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
	out, err := r.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ready := make(chan struct{})
	go func() {
		defer close(r.done)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if strings.Contains(sc.Text(), "Ready to accept connections") {
				close(ready)
			}
		}
		_ = r.cmd.Wait()
	}()
	t.Cleanup(r.stop)
	select {
	case <-ready:
	case <-r.done:
		t.Fatal("redis-server exited before accepting connections")
	case <-time.After(10 * time.Second):
		t.Fatal("redis-server did not accept connections within 10 s")
	}
	return r
}

// stop kills the server and waits for it (idempotent).
func (r *redisServer) stop() {
	_ = r.cmd.Process.Kill()
	select {
	case <-r.done:
	case <-time.After(10 * time.Second):
		r.t.Error("redis-server did not exit")
	}
}

func (r *redisServer) url() string { return fmt.Sprintf("redis://127.0.0.1:%d/0", r.port) }

// tierKey is the conversation store key the replicas of a test tier share.
const tierKey = "tier-secret-0123456789"

// replica starts one multi-turn proxy of a tier sharing store.
func replica(t *testing.T, p, d string, store string) (*httptest.Server, *proxy.MultiTurn) {
	t.Helper()
	return replicaWithKey(t, p, d, store, tierKey)
}

// replicaWithKey starts one multi-turn proxy sealing what it stores under key.
func replicaWithKey(t *testing.T, p, d, store, key string) (*httptest.Server, *proxy.MultiTurn) {
	t.Helper()
	return serveMultiTurn(t, proxy.MultiTurnConfig{Config: proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p)},
		Decode: []proxy.Instance{instanceOf(t, d)}}, Store: store, StoreKey: key})
}

// serveMultiTurn starts a multi-turn proxy for cfg behind a test server; both close with the test.
func serveMultiTurn(t *testing.T, cfg proxy.MultiTurnConfig) (*httptest.Server, *proxy.MultiTurn) {
	t.Helper()
	mt, err := proxy.NewMultiTurn(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mt)
	t.Cleanup(func() {
		srv.Close()
		if err := mt.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return srv, mt
}

// dialogue is one conversation's history, sent turn by turn.
type dialogue struct {
	id   string
	msgs []map[string]any
}

// next sends the next user message through url and checks the answer against the single
// engine; it returns the cache state the proxy reported.
func (c *dialogue) next(t *testing.T, url, single, text string) string {
	t.Helper()
	c.msgs = append(c.msgs, map[string]any{"role": "user", "content": text})
	got := chatClient{t, url}.send(c.id, c.msgs, false, 8)
	want := chatClient{t, single}.send("", c.msgs, false, 8)
	if got.status != 200 || got.text != want.text {
		t.Fatalf("%s turn %d: %d %q, the single engine says %q", c.id, len(c.msgs)/2+1, got.status, got.raw, want.text)
	}
	c.msgs = append(c.msgs, map[string]any{"role": "assistant", "content": got.text})
	return got.header.Get(proxy.HeaderCache)
}

// TestRedisTierSharesConversations: two replicas of the multi-turn proxy share conversations
// through Redis. A client whose turns alternate between them hits on every turn after the
// first; a replica that goes away mid-conversation loses nothing.
func TestRedisTierSharesConversations(t *testing.T) {
	rs := startRedis(t, 0)
	single := startEngine(t, "", 8192)
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	a, _ := replica(t, p.URL, d.URL, rs.url())
	b, bmt := replica(t, p.URL, d.URL, rs.url())
	for i := range 3 {
		c := &dialogue{id: fmt.Sprintf("tier-%d", i), msgs: []map[string]any{{"role": "system", "content": strings.Repeat("Shared system prompt. ", 8)}}}
		for turn := 1; turn <= 4; turn++ {
			url := a.URL
			if turn%2 == 0 {
				url = b.URL
			}
			if got := c.next(t, url, single.URL, fmt.Sprintf("turn %d", turn)); turn > 1 && got != "hit" {
				t.Errorf("%s turn %d: %s, want hit", c.id, turn, got)
			}
		}
	}
	// Replica B goes away; the conversation goes on through A.
	c := &dialogue{id: "survivor"}
	if got := c.next(t, b.URL, single.URL, "hello"); got != "miss" {
		t.Fatalf("first turn: %s", got)
	}
	b.Close()
	if err := bmt.Close(); err != nil {
		t.Fatal(err)
	}
	if got := c.next(t, a.URL, single.URL, "and then?"); got != "hit" {
		t.Errorf("after the replica that served turn 1 went away: %s, want hit", got)
	}
	_, raw := do(t, http.MethodGet, a.URL+"/metrics", nil)
	for _, want := range []string{"kvbridge:proxy_conversation_store_up 1", "kvbridge:proxy_conversation_store_seconds_count{op=\"take\"}", "kvbridge:proxy_conversations_claimed_total"} {
		if !strings.Contains(string(raw), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}

// TestRedisTierIgnoresUnknownDecoder: a conversation in the shared store names the decoder
// that holds its KV. A replica whose decode instances do not include it (here the same engine
// under another name, as a stale or forged entry would name any host) does not send the turn,
// nor the client's headers, there: the turn is a miss, answered right, and the conversation
// hits again from the next turn on that replica.
func TestRedisTierIgnoresUnknownDecoder(t *testing.T) {
	rs := startRedis(t, 0)
	single := startEngine(t, "", 8192)
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	if !strings.Contains(d.URL, "127.0.0.1") {
		t.Fatalf("decoder URL %s: want a 127.0.0.1 address", d.URL)
	}
	a, _ := replica(t, p.URL, d.URL, rs.url())
	b, _ := replica(t, p.URL, strings.Replace(d.URL, "127.0.0.1", "localhost", 1), rs.url())
	c := &dialogue{id: "unknown-decoder", msgs: []map[string]any{{"role": "system", "content": strings.Repeat("Shared system prompt. ", 8)}}}
	c.next(t, a.URL, single.URL, "turn 1")
	if got := c.next(t, b.URL, single.URL, "turn 2"); got != "miss" {
		t.Errorf("turn 2 on a replica that does not know the stored decoder: %s, want miss", got)
	}
	if got := c.next(t, b.URL, single.URL, "turn 3"); got != "hit" {
		t.Errorf("turn 3 on the same replica: %s, want hit", got)
	}
}

// TestRedisTierClaimIsAtomic: two replicas racing for one conversation's turn: exactly one
// claims it (a hit), the other computes it (a miss); both answers are right.
func TestRedisTierClaimIsAtomic(t *testing.T) {
	rs := startRedis(t, 0)
	single := startEngine(t, "", 8192)
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	a, _ := replica(t, p.URL, d.URL, rs.url())
	b, _ := replica(t, p.URL, d.URL, rs.url())
	for round := range 5 {
		c := &dialogue{id: fmt.Sprintf("race-%d", round), msgs: []map[string]any{{"role": "system", "content": strings.Repeat("Race. ", 20)}}}
		c.next(t, a.URL, single.URL, "first")
		states := make([]string, 2)
		var wg sync.WaitGroup
		for i, url := range []string{a.URL, b.URL} {
			twin := &dialogue{id: c.id, msgs: append([]map[string]any(nil), c.msgs...)}
			wg.Go(func() { states[i] = twin.next(t, url, single.URL, "second") })
		}
		wg.Wait()
		if n := strings.Count(strings.Join(states, " "), "hit"); n != 1 {
			t.Errorf("round %d: %v, want exactly one hit", round, states)
		}
	}
}

// TestRedisRestartMeansMisses: Redis going away turns hits into misses — never errors or
// wrong answers — and once it is back, conversations hit again.
func TestRedisRestartMeansMisses(t *testing.T) {
	rs := startRedis(t, 0)
	single := startEngine(t, "", 8192)
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	a, _ := replica(t, p.URL, d.URL, rs.url())
	c := &dialogue{id: "restart"}
	c.next(t, a.URL, single.URL, "one")
	rs.stop()
	if got := c.next(t, a.URL, single.URL, "two"); got != "miss" {
		t.Errorf("with Redis down: %s, want miss", got)
	}
	_, raw := do(t, http.MethodGet, a.URL+"/metrics", nil)
	if !strings.Contains(string(raw), "kvbridge:proxy_conversation_store_up 0") || !strings.Contains(string(raw), `kvbridge:proxy_conversation_store_errors_total{op="take"}`) {
		t.Errorf("/metrics does not show the store down:\n%s", raw)
	}
	startRedis(t, rs.port)
	c.next(t, a.URL, single.URL, "three") // stored in the new Redis
	if got := c.next(t, a.URL, single.URL, "four"); got != "hit" {
		t.Errorf("after Redis came back: %s, want hit", got)
	}
}

// TestRedisStoreKeepsParamsSealed: what the multi-turn proxy keeps in Redis holds D's
// kv_transfer_params (and their lease token) sealed: read raw from Redis, the entry names none
// of their fields; the conversation still hits (P pulls from D) through a replica with the
// tier's key. A replica with another key, and an entry tampered with in Redis, are misses —
// answered right, counted — never errors. A Redis store without a key is refused.
func TestRedisStoreKeepsParamsSealed(t *testing.T) {
	rs := startRedis(t, 0)
	single := startEngine(t, "", 8192)
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	a, _ := replica(t, p.URL, d.URL, rs.url())
	other, _ := replicaWithKey(t, p.URL, d.URL, rs.url(), "another-secret")
	rdb := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", rs.port)})
	defer rdb.Close()
	raw := func(conv string) []byte {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		v, err := rdb.Get(ctx, "kvbridge:conversation:"+conv).Bytes()
		if err != nil {
			t.Fatalf("reading %s's entry from Redis: %v", conv, err)
		}
		return v
	}
	system := map[string]any{"role": "system", "content": strings.Repeat("Sealed system prompt. ", 8)}

	c := &dialogue{id: "sealed", msgs: []map[string]any{system}}
	c.next(t, a.URL, single.URL, "turn 1")
	v := raw(c.id)
	for _, clear := range []string{"kvbridge_lease", "remote_block_ids", "remote_engine_id", "do_remote", "kv_transfer_params", "remote_num_tokens"} {
		if bytes.Contains(v, []byte(clear)) {
			t.Errorf("the Redis entry holds %q in clear text: %s", clear, v)
		}
	}
	if got := c.next(t, a.URL, single.URL, "turn 2"); got != "hit" {
		t.Errorf("turn 2 through the replica with the tier's key: %s, want hit", got)
	}

	// Another key: the entry does not open; a miss, counted.
	c.next(t, a.URL, single.URL, "turn 3") // stored again
	if got := c.next(t, other.URL, single.URL, "turn 4"); got != "miss" {
		t.Errorf("through a replica with another key: %s, want miss", got)
	}
	// Turn 4 was stored under the other key: the tier's replica cannot open it either.
	if got := c.next(t, a.URL, single.URL, "turn 5"); got != "miss" {
		t.Errorf("an entry another key sealed: %s, want miss", got)
	}
	// Tampered with in Redis: one byte of the sealed params flipped.
	var entry map[string]any
	if err := json.Unmarshal(raw(c.id), &entry); err != nil {
		t.Fatal(err)
	}
	sealed, err := base64.StdEncoding.DecodeString(entry["sealed"].(string))
	if err != nil || len(sealed) < 20 {
		t.Fatalf("the entry's sealed params: %v (%d bytes)", err, len(sealed))
	}
	sealed[len(sealed)/2] ^= 1
	entry["sealed"] = sealed
	forged, _ := json.Marshal(entry)
	if err := rdb.Set(t.Context(), "kvbridge:conversation:"+c.id, forged, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if got := c.next(t, a.URL, single.URL, "turn 6"); got != "miss" {
		t.Errorf("a tampered entry: %s, want miss", got)
	}
	for url, want := range map[string]string{a.URL: "kvbridge:proxy_conversation_store_unsealable_total 2", other.URL: "kvbridge:proxy_conversation_store_unsealable_total 1"} {
		if _, m := do(t, http.MethodGet, url+"/metrics", nil); !strings.Contains(string(m), want) {
			t.Errorf("%s/metrics lacks %q", url, want)
		}
	}
	if got := c.next(t, a.URL, single.URL, "turn 7"); got != "hit" {
		t.Errorf("the turn after: %s, want hit", got)
	}

	if _, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)},
		Decode: []proxy.Instance{instanceOf(t, d.URL)}}, Store: rs.url()}); !errors.Is(err, proxy.ErrStoreKey) {
		t.Errorf("a Redis store without a key: %v, want ErrStoreKey", err)
	}
}
