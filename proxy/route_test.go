package proxy_test

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/kvevents"
	"github.com/kvbridge/kvbridge/proxy"
)

// KV-aware routing through real engines: prefillers that publish their KV cache events (vLLM's
// hashes from a shared PYTHONHASHSEED), one decoder, the proxy subscribed to every prefiller,
// and a single engine without a connector as the reference for outputs.

// prefiller is an engine publishing KV events, with the endpoints a proxy subscribes to.
type prefiller struct {
	in             *instance.Instance
	events, replay string
}

func startPrefillers(t *testing.T, n int) []prefiller {
	t.Helper()
	out := make([]prefiller, n)
	for i := range out {
		ev, err := kvevents.ParseConfig(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://127.0.0.1:0"}`)
		if err != nil {
			t.Fatal(err)
		}
		in := startEngine(t, "kv_producer", 4096, func(c *instance.Config) { c.KVEvents = &ev; c.DevMode = true })
		pub := in.Ranks[0].KVEvents
		out[i] = prefiller{in: in, events: "tcp://127.0.0.1:" + strconv.Itoa(pub.Addr().(*net.TCPAddr).Port),
			replay: "tcp://" + pub.ReplayAddr().String()}
	}
	return out
}

// routingConfig is the proxy's config for kv-aware routing over ps and d, with their replay
// sockets when replay.
func routingConfig(t *testing.T, ps []prefiller, d *instance.Instance, replay bool) proxy.Config {
	t.Helper()
	seed, seeded := os.LookupEnv("PYTHONHASHSEED")
	cfg := proxy.Config{Decode: []proxy.Instance{instanceOf(t, d.URL)},
		Routing: proxy.RoutingConfig{Policy: proxy.KVAware, HashSeed: seed, HashSeeded: seeded}}
	for _, p := range ps {
		cfg.Prefill = append(cfg.Prefill, instanceOf(t, p.in.URL))
		cfg.Routing.KVEvents = append(cfg.Routing.KVEvents, p.events)
		if replay {
			cfg.Routing.KVEventsReplay = append(cfg.Routing.KVEventsReplay, p.replay)
		}
	}
	return cfg
}

// complete asks url for a greedy completion of prompt and returns its text.
func complete(t *testing.T, url, prompt string) string {
	t.Helper()
	resp, raw := do(t, http.MethodPost, url+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %d %s", url, resp.StatusCode, raw)
	}
	var out struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(raw, &out); err != nil || len(out.Choices) != 1 {
		t.Fatalf("%s: %v %s", url, err, raw)
	}
	return out.Choices[0].Text
}

// sameAsSingle sends prompt through the proxy and to the single engine and checks the answers
// are the same.
func sameAsSingle(t *testing.T, px, single, prompt string) {
	t.Helper()
	if got, want := complete(t, px, prompt), complete(t, single, prompt); got != want {
		t.Fatalf("through the proxy %q, single engine %q (prompt %.30q…)", got, want, prompt)
	}
}

// indexed returns the proxy's kvbridge:proxy_kv_index_blocks per prefiller.
func indexed(t *testing.T, px string, ps []prefiller) []float64 {
	t.Helper()
	s := fixture.Scrape(t, http.DefaultClient, px)
	out := make([]float64, len(ps))
	for i, p := range ps {
		out[i] = s.Sum("kvbridge:proxy_kv_index_blocks", "instance", instanceOf(t, p.in.URL).String())
	}
	return out
}

// waitIndexed polls the proxy's index (its /metrics, one round trip a poll) until cond holds of
// its per-prefiller block counts, under a deadline.
func waitIndexed(t *testing.T, px string, ps []prefiller, what string, cond func([]float64) bool) []float64 {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		n := indexed(t, px, ps)
		if cond(n) {
			return n
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: the proxy's index never got there: %v", what, n)
		}
	}
}

// prefixHits returns each prefiller's vllm:prefix_cache_hits_total (tokens).
func prefixHits(t *testing.T, ps []prefiller) []float64 {
	t.Helper()
	out := make([]float64, len(ps))
	for i, p := range ps {
		out[i] = fixture.Scrape(t, http.DefaultClient, p.in.URL).Sum("vllm:prefix_cache_hits_total")
	}
	return out
}

func promptTokens(t *testing.T, url, prompt string) int {
	t.Helper()
	resp, raw := do(t, http.MethodPost, url+"/tokenize", map[string]any{"model": "kvbridge/tiny", "prompt": prompt})
	var out struct {
		Count int `json:"count"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(raw, &out) != nil {
		t.Fatalf("tokenize: %d %s", resp.StatusCode, raw)
	}
	return out.Count
}

// sharedPrefix is a system prompt of several blocks, distinct from block 0 for each k.
func sharedPrefix(k int) string {
	return fmt.Sprintf("System %d: you are assistant number %d. ", k, k) + strings.Repeat(fmt.Sprintf("Rule %d says be brief and kind. ", k), 8)
}

// TestKVAwareRoutesToTheHolder: with 3 prefillers, a request whose prompt shares a prefix with an
// earlier one goes to the prefiller that computed it (its prefix-cache hits grow, the others'
// do not), once the proxy has indexed that prefiller's events; every answer is the single
// engine's.
func TestKVAwareRoutesToTheHolder(t *testing.T) {
	fixture.SeedBlockHashes(t)
	ps := startPrefillers(t, 3)
	d, single := startEngine(t, "kv_consumer", 4096), startEngine(t, "", 4096)
	px := startProxy(t, routingConfig(t, ps, d, true))
	for k := range 3 {
		prefix := sharedPrefix(k)
		full := promptTokens(t, ps[0].in.URL, prefix) / 16 // the blocks the prefix fills
		if full < 3 {
			t.Fatalf("the prefix fills %d blocks; the test wants several", full)
		}
		before := indexed(t, px.URL, ps)
		sameAsSingle(t, px.URL, single.URL, prefix+"First user: what is a cat?")
		holder := -1
		waitIndexed(t, px.URL, ps, "the first request's blocks", func(n []float64) bool {
			for i := range n {
				if n[i]-before[i] >= float64(full) {
					holder = i
					return true
				}
			}
			return false
		})
		hits := prefixHits(t, ps)
		sameAsSingle(t, px.URL, single.URL, prefix+"Second user: and a dog?")
		after := prefixHits(t, ps)
		for i := range ps {
			grew := after[i] - hits[i]
			switch {
			case i == holder && grew < float64(full*16):
				t.Errorf("prefix %d: prefiller %d holds it but its prefix-cache hits grew by %v tokens (want ≥ %d): the request went elsewhere", k, i, grew, full*16)
			case i != holder && grew != 0:
				t.Errorf("prefix %d: prefiller %d, not the holder (%d), hit %v tokens", k, i, holder, grew)
			}
		}
	}
	s := fixture.Scrape(t, http.DefaultClient, px.URL)
	if hit := s.Sum("kvbridge:proxy_route_total", "policy", proxy.KVAware, "reason", "hit"); hit != 3 {
		t.Errorf("kvbridge:proxy_route_total{reason=hit} = %v, want 3 (one per second request)", hit)
	}
	if s.Sum("kvbridge:proxy_route_prefix_tokens_sum") < 3*3*16 {
		t.Errorf("kvbridge:proxy_route_prefix_tokens_sum = %v", s.Sum("kvbridge:proxy_route_prefix_tokens_sum"))
	}
}

// TestKVAwareLateSubscriberReplays: a proxy that subscribes after a prefiller cached a prompt
// sees the prefiller's next batch with a sequence number past 0 and replays what it missed from
// the replay socket, so the prompt's next user is routed to that prefiller. Without replay
// endpoints the same gap marks the index stale, and the request is still answered, as a single
// engine answers it.
func TestKVAwareLateSubscriberReplays(t *testing.T) {
	fixture.SeedBlockHashes(t)
	ps := startPrefillers(t, 2)
	d, single := startEngine(t, "kv_consumer", 4096), startEngine(t, "", 4096)
	prefix := sharedPrefix(7)
	complete(t, ps[1].in.URL, prefix+"Before the proxy.")
	// Its store is published (to no subscriber) before any proxy subscribes.
	for deadline := time.Now().Add(time.Minute); ps[1].in.Ranks[0].KVEvents.Sent() == 0; {
		if time.Now().After(deadline) {
			t.Fatal("prefiller 1 never published its store")
		}
		runtime.Gosched()
	}
	full := promptTokens(t, ps[0].in.URL, prefix) / 16
	for _, replay := range []bool{true, false} {
		t.Run(fmt.Sprintf("replay=%v", replay), func(t *testing.T) {
			cfg := routingConfig(t, ps, d, replay)
			px := startProxy(t, cfg)
			// Another prompt sent to the holder directly until the proxy has dealt with the gap
			// before its first batch: replayed it, or marked the index stale (a subscription
			// takes effect at the publisher some time after the dial).
			deadline := time.Now().Add(time.Minute)
			var stale, replays float64
			for i := 0; stale+replays == 0; i++ {
				complete(t, ps[1].in.URL, fmt.Sprintf("Sentinel %d of %v: ", i, replay)+strings.Repeat("x y z ", 10))
				s := fixture.Scrape(t, http.DefaultClient, px.URL)
				stale = s.Sum("kvbridge:proxy_kv_index_stale", "instance", cfg.Prefill[1].String())
				replays = s.Sum("kvbridge:proxy_kv_event_replays_total", "instance", cfg.Prefill[1].String())
				if time.Now().After(deadline) {
					t.Fatal("the proxy never dealt with the gap before its first batch of prefiller 1")
				}
			}
			if replay && (stale != 0 || replays < 1) {
				t.Fatalf("with replay: stale %v, %v replays", stale, replays)
			}
			if !replay && stale != 1 {
				t.Fatalf("without replay: stale %v, want 1", stale)
			}
			hits := prefixHits(t, ps)
			sameAsSingle(t, px.URL, single.URL, prefix+"A user after the proxy came.")
			grew := prefixHits(t, ps)[1] - hits[1]
			if replay && grew < float64(full*16) {
				t.Errorf("with replay, the holder's prefix-cache hits grew by %v tokens, want ≥ %d", grew, full*16)
			}
		})
	}
}

// TestKVAwareDegradesNeverFails: a prefiller whose events cannot be had (nothing listens at its
// endpoint), a prefix cache cleared under the index (AllBlocksCleared) and a /tokenize that
// does not answer in time give worse choices, never errors: every answer is the single engine's.
func TestKVAwareDegradesNeverFails(t *testing.T) {
	fixture.SeedBlockHashes(t)
	ps := startPrefillers(t, 2)
	d, single := startEngine(t, "kv_consumer", 4096), startEngine(t, "", 4096)
	cfg := routingConfig(t, ps, d, false)
	cfg.Routing.KVEvents[0] = "tcp://" + fixture.DeadAddr(t)
	px := startProxy(t, cfg)
	prefix := sharedPrefix(3)
	for i := range 4 {
		sameAsSingle(t, px.URL, single.URL, prefix+fmt.Sprintf("User %d.", i))
	}
	// Prompts of their own straight to prefiller 1 until the proxy has indexed some of its
	// blocks: its subscription takes effect at the publisher some time after the dial, and
	// without a replay socket what came before is lost (a later batch shows the gap).
	for i := 0; indexed(t, px.URL, ps)[1] == 0; i++ {
		if i == 2000 {
			t.Fatal("2000 prompts to prefiller 1 and the proxy has indexed none of its blocks")
		}
		complete(t, ps[1].in.URL, fmt.Sprintf("Filler %d: ", i)+strings.Repeat("a b c ", 10))
	}
	// Clear prefiller 1's cache: its index empties on AllBlocksCleared.
	// 409 while a lease for D still holds blocks (until D's release reaches P).
	for deadline := time.Now().Add(time.Minute); ; {
		resp, raw := do(t, http.MethodPost, ps[1].in.URL+"/reset_prefix_cache", nil)
		if resp.StatusCode == http.StatusOK {
			break
		}
		if resp.StatusCode != http.StatusConflict || time.Now().After(deadline) {
			t.Fatalf("reset_prefix_cache: %d %s", resp.StatusCode, raw)
		}
	}
	waitIndexed(t, px.URL, ps, "the cleared cache", func(n []float64) bool { return n[1] == 0 })
	sameAsSingle(t, px.URL, single.URL, prefix+"User after the reset.")
	s := fixture.Scrape(t, http.DefaultClient, px.URL)
	if s.Sum("kvbridge:proxy_kv_events_connected", "instance", cfg.Prefill[0].String()) != 0 {
		t.Error("connected to an endpoint nothing listens at")
	}
	if s.Sum("kvbridge:proxy_route_total") != 5 {
		t.Errorf("%v routing decisions counted, want 5", s.Sum("kvbridge:proxy_route_total"))
	}

	// A /tokenize that cannot answer in time: least-loaded, counted as no-tokens.
	cfg2 := routingConfig(t, ps, d, false)
	cfg2.Routing.TokenizeTimeout = time.Nanosecond
	px2 := startProxy(t, cfg2)
	for i := 0; fixture.Scrape(t, http.DefaultClient, px2.URL).Sum("kvbridge:proxy_route_total", "reason", "no-tokens") == 0; i++ {
		// Until the proxy has seen a store (its block size), it routes without an index.
		sameAsSingle(t, px2.URL, single.URL, prefix+fmt.Sprintf("Impatient user %d.", i))
		if i == 100 {
			t.Fatal("no decision without tokens in 100 requests")
		}
	}
}

// TestMultiTurnKVAware: the multi-turn proxy routes by KV too. Two conversations with their own
// system prompts over two bidirectional prefillers that publish events: each conversation's later
// turns go to the prefiller that computed its first (its prefix-cache hits grow, the other's do
// not), its decoder stays the conversation's, and every answer equals the single engine's.
func TestMultiTurnKVAware(t *testing.T) {
	fixture.SeedBlockHashes(t)
	var ps []prefiller
	for range 2 {
		ev, err := kvevents.ParseConfig(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://127.0.0.1:0"}`)
		if err != nil {
			t.Fatal(err)
		}
		kv, err := connector.ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}`), nil)
		if err != nil {
			t.Fatal(err)
		}
		in := startInstance(t, instance.Config{OpenedModel: openTiny(t), Host: "127.0.0.1", NumBlocks: 1024, MaxModelLen: 8192,
			PrefixCaching: true, SideChannelPort: -1, KVTransfer: kv, PromptTokensDetails: true, KVEvents: &ev})
		pub := in.Ranks[0].KVEvents
		ps = append(ps, prefiller{in: in, events: "tcp://127.0.0.1:" + strconv.Itoa(pub.Addr().(*net.TCPAddr).Port), replay: "tcp://" + pub.ReplayAddr().String()})
	}
	d, single := startBidirectional(t, "kv_consumer", true), startEngine(t, "", 8192)
	cfg := routingConfig(t, ps, d, true)
	mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mt)
	t.Cleanup(func() { srv.Close(); mt.Close() })
	via, ref := chatClient{t, srv.URL}, chatClient{t, single.URL}
	for c := range 2 {
		conv := fmt.Sprintf("conv-%d", c)
		msgs := []map[string]any{{"role": "system", "content": sharedPrefix(10 + c)}}
		holder := -1
		for turn := 1; turn <= 3; turn++ {
			msgs = append(msgs, map[string]any{"role": "user", "content": fmt.Sprintf("Turn %d of %s: say more.", turn, conv)})
			before := indexed(t, srv.URL, ps)
			hits := prefixHits(t, ps)
			got, want := via.send(conv, msgs, turn == 2, 12), ref.send("", msgs, false, 12)
			if got.status != http.StatusOK || got.text != want.text {
				t.Fatalf("%s turn %d: %d %q, single engine %q (%s)", conv, turn, got.status, got.text, want.text, got.raw)
			}
			grew := prefixHits(t, ps)
			if holder >= 0 && (grew[holder] == hits[holder] || grew[1-holder] != hits[1-holder]) {
				t.Errorf("%s turn %d: prefix-cache hits %v → %v; want growth on prefiller %d only", conv, turn, hits, grew, holder)
			}
			if holder < 0 { // the first turn: who computed it, once the proxy has indexed it
				waitIndexed(t, srv.URL, ps, conv+"'s first turn", func(n []float64) bool {
					for i := range n {
						if n[i] >= before[i]+3 {
							holder = i
							return true
						}
					}
					return false
				})
			}
			msgs = append(msgs, map[string]any{"role": "assistant", "content": got.text})
		}
	}
}

// TestKVEventsPerDataParallelRank: a prefiller with two data-parallel ranks publishes each rank's
// events on the endpoint with vLLM's rank offset (ipc paths get "_dp1"); with --kv-events-dp 2
// the proxy subscribes to both (and to both replay sockets), so its index holds every block
// either rank caches.
func TestKVEventsPerDataParallelRank(t *testing.T) {
	fixture.SeedBlockHashes(t)
	dir := t.TempDir()
	ev, err := kvevents.ParseConfig(fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "ipc://%s/pub", "replay_endpoint": "ipc://%s/replay"}`, dir, dir))
	if err != nil {
		t.Fatal(err)
	}
	p := startEngine(t, "kv_producer", 4096, func(c *instance.Config) { c.KVEvents = &ev; c.DataParallelSize = 2 })
	d := startEngine(t, "kv_consumer", 4096)
	ps := []prefiller{{in: p, events: "ipc://" + dir + "/pub", replay: "ipc://" + dir + "/replay"}}
	cfg := routingConfig(t, ps, d, true)
	cfg.Routing.KVEventsDP = 2
	px := startProxy(t, cfg)
	// Different prompts straight to P until both ranks have published (the engine spreads
	// requests over its ranks by load), then until the index holds what both ranks cache.
	for i := 0; p.Ranks[0].KVEvents.Sent() == 0 || p.Ranks[1].KVEvents.Sent() == 0; i++ {
		if i == 200 {
			t.Fatal("200 prompts and a rank has published nothing")
		}
		complete(t, p.URL, fmt.Sprintf("Prompt %d: ", i)+strings.Repeat("tell me about ranks ", 4))
	}
	cached := func() float64 { return float64(p.Ranks[0].Pool.NumCached() + p.Ranks[1].Pool.NumCached()) }
	waitIndexed(t, px.URL, ps, "both ranks' blocks", func(n []float64) bool { return n[0] == cached() })
}

// TestKVAwareEngineRestart: a prefiller restarts on the same ports (a new incarnation, its cache
// empty, its sequence from 0): the proxy's subscriber dials it again and resets its entries, so
// the prefix it held is no longer a hit, and the request that shares it is answered as the single
// engine answers it.
func TestKVAwareEngineRestart(t *testing.T) {
	fixture.SeedBlockHashes(t)
	ps := startPrefillers(t, 2)
	d, single := startEngine(t, "kv_consumer", 4096), startEngine(t, "", 4096)
	cfg := routingConfig(t, ps, d, true)
	px := startProxy(t, cfg)
	prefix := sharedPrefix(5)
	before := indexed(t, px.URL, ps)
	sameAsSingle(t, px.URL, single.URL, prefix+"Before the restart.")
	holder := -1
	waitIndexed(t, px.URL, ps, "the first request's blocks", func(n []float64) bool {
		for i := range n {
			if n[i] >= before[i]+3 {
				holder = i
				return true
			}
		}
		return false
	})
	old := ps[holder].in
	pubPort := old.Ranks[0].KVEvents.Addr().(*net.TCPAddr).Port
	replayAddr := old.Ranks[0].KVEvents.ReplayAddr().String()
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	ev, err := kvevents.ParseConfig(fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://%s"}`, pubPort, replayAddr))
	if err != nil {
		t.Fatal(err)
	}
	ps[holder].in = startEngine(t, "kv_producer", 4096, func(c *instance.Config) { c.KVEvents = &ev; c.DevMode = true; c.Port = old.Addr.Port })
	// Prompts straight to the new incarnation until the proxy has reset the old one's entries.
	inst := cfg.Prefill[holder].String()
	for i := 0; fixture.Scrape(t, http.DefaultClient, px.URL).Sum("kvbridge:proxy_kv_index_resets_total", "instance", inst) == 0; i++ {
		if i == 2000 {
			t.Fatal("the proxy never reset the restarted prefiller's entries")
		}
		complete(t, ps[holder].in.URL, fmt.Sprintf("After the restart %d: ", i)+strings.Repeat("x y ", 10))
	}
	hits := fixture.Scrape(t, http.DefaultClient, px.URL).Sum("kvbridge:proxy_route_total", "reason", "hit")
	sameAsSingle(t, px.URL, single.URL, prefix+"After the restart.")
	if now := fixture.Scrape(t, http.DefaultClient, px.URL).Sum("kvbridge:proxy_route_total", "reason", "hit"); now != hits {
		t.Errorf("a hit counted on the restarted prefiller's old entries (%v → %v)", hits, now)
	}
}
