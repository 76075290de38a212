package proxy_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/proxy"
)

const blockSize = 16

func startBidirectional(t *testing.T, role string, prefix bool) *instance.Instance {
	t.Helper()
	kv, err := connector.ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"`+role+`","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	return startInstance(t, instance.Config{OpenedModel: openTiny(t), Host: "127.0.0.1", NumBlocks: 1024, MaxModelLen: 8192,
		PrefixCaching: prefix, SideChannelPort: -1, KVTransfer: kv, PromptTokensDetails: true})
}

// chatClient sends chat turns and parses the answers, streaming or not.
type chatClient struct {
	t   *testing.T
	url string
}

type reply struct {
	text   string
	header http.Header
	status int
	raw    string
}

func (c chatClient) send(conv string, msgs []map[string]any, stream bool, maxTokens int) reply {
	c.t.Helper()
	body := map[string]any{"model": "kvbridge/tiny", "messages": msgs, "max_tokens": maxTokens, "temperature": 0, "stream": stream}
	if conv != "" {
		body["conversation_id"] = conv
	}
	resp, raw := do(c.t, http.MethodPost, c.url+"/v1/chat/completions", body)
	r := reply{header: resp.Header, status: resp.StatusCode, raw: string(raw)}
	if resp.StatusCode != 200 {
		return r
	}
	if !stream {
		var m struct {
			Choices []struct {
				Message struct{ Content string } `json:"message"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(raw, &m); err != nil || len(m.Choices) != 1 {
			c.t.Fatalf("not a chat completion: %s", raw)
		}
		r.text = m.Choices[0].Message.Content
		return r
	}
	for _, data := range sseData(raw) {
		var m struct {
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
			KV map[string]any `json:"kv_transfer_params"`
		}
		if err := json.Unmarshal([]byte(data), &m); err != nil {
			c.t.Fatalf("bad event %q", data)
		}
		if m.KV != nil {
			c.t.Errorf("D's kv_transfer_params leaked to the client: %s", data)
		}
		for _, ch := range m.Choices {
			r.text += ch.Delta.Content
		}
	}
	return r
}

func headerInt(t *testing.T, h http.Header, k string) int {
	t.Helper()
	n, err := strconv.Atoi(h.Get(k))
	if err != nil {
		t.Fatalf("header %s = %q", k, h.Get(k))
	}
	return n
}

func startMultiTurn(t *testing.T, p, d *instance.Instance) (*httptest.Server, *proxy.MultiTurn) {
	t.Helper()
	mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)}, Decode: []proxy.Instance{instanceOf(t, d.URL)}}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mt)
	t.Cleanup(func() { srv.Close(); mt.Close() })
	return srv, mt
}

// TestMultiTurnBidirectional: an 8-turn conversation through the multi-turn proxy with
// bidirectional transfer. Every answer equals the single engine's for the same messages; from
// turn 2 on P pulls the history from D and computes only what is new.
func TestMultiTurnBidirectional(t *testing.T) {
	single := startEngine(t, "", 8192)
	for _, prefix := range []bool{false, true} {
		t.Run(fmt.Sprintf("prefix caching %v", prefix), func(t *testing.T) {
			p, d := startBidirectional(t, "kv_producer", prefix), startBidirectional(t, "kv_consumer", true)
			srv, _ := startMultiTurn(t, p, d)
			via, ref := chatClient{t, srv.URL}, chatClient{t, single.URL}
			// A system prompt longer than kv_recompute_threshold (64) makes turn 2 worth a pull.
			msgs := []map[string]any{{"role": "system", "content": "You answer at length. " + strings.Repeat("Context that every turn repeats. ", 16)}}
			prevPrompt := 0
			for turn := 1; turn <= 8; turn++ {
				msgs = append(msgs, map[string]any{"role": "user", "content": fmt.Sprintf("Turn %d: tell me more about %s.", turn, strings.Repeat("paged attention ", turn))})
				got := via.send("conv-1", msgs, turn%2 == 0, 24)
				want := ref.send("", msgs, false, 24)
				if got.status != 200 || got.text != want.text {
					t.Fatalf("turn %d: %d %q, single engine %q\n%s", turn, got.status, got.text, want.text, got.raw)
				}
				prompt := headerInt(t, got.header, proxy.HeaderPromptTokens)
				pulled := headerInt(t, got.header, proxy.HeaderPulledTokens)
				computed := headerInt(t, got.header, proxy.HeaderComputedTokens)
				cache := got.header.Get(proxy.HeaderCache)
				if turn == 1 && (cache != "miss" || pulled != 0) {
					t.Errorf("turn 1: cache %s, pulled %d", cache, pulled)
				}
				if turn > 1 {
					// P pulls the previous prompt's verified full blocks from D, except the block
					// where the answer begins (its tokenization may differ); with P's own prefix
					// cache on, P already holds them and pulls only the answer's blocks, if any.
					if cache != "hit" || (!prefix && pulled < prevPrompt-2*blockSize) {
						t.Errorf("turn %d: cache %s, pulled %d of the previous prompt's %d tokens", turn, cache, pulled, prevPrompt)
					}
					if computed > prompt-prevPrompt+blockSize {
						t.Errorf("turn %d: P computed %d tokens; the turn added %d", turn, computed, prompt-prevPrompt)
					}
				}
				prevPrompt = prompt
				msgs = append(msgs, map[string]any{"role": "assistant", "content": got.text})
			}
		})
	}
}

// TestMultiTurnEditedHistory: a client that shortens an earlier answer (as clients that strip
// reasoning do) gets the single engine's output — the proxy sees the edit and does not reuse D's
// KV, and P itself verifies any prefix it is offered.
func TestMultiTurnEditedHistory(t *testing.T) {
	single := startEngine(t, "", 8192)
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	srv, mt := startMultiTurn(t, p, d)
	via, ref := chatClient{t, srv.URL}, chatClient{t, single.URL}
	msgs := []map[string]any{{"role": "user", "content": strings.Repeat("history that fills blocks ", 12)}}
	first := via.send("edit", msgs, false, 32)
	msgs = append(msgs, map[string]any{"role": "assistant", "content": first.text[:len(first.text)/2]},
		map[string]any{"role": "user", "content": "and now?"})
	got, want := via.send("edit", msgs, true, 16), ref.send("", msgs, false, 16)
	if got.status != 200 || got.text != want.text {
		t.Fatalf("edited history: %d %q, single engine %q", got.status, got.text, want.text)
	}
	if got.header.Get(proxy.HeaderCache) != "miss" || headerInt(t, got.header, proxy.HeaderPulledTokens) != 0 {
		t.Errorf("edited history was reused: %v", got.header)
	}
	_ = mt
}

// TestMultiTurnInterleavedAndRestart: two conversations interleaved never mix, and a new proxy
// (a restart: its cache is empty) answers the next turn correctly as a miss.
func TestMultiTurnInterleavedAndRestart(t *testing.T) {
	single := startEngine(t, "", 8192)
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	srv, _ := startMultiTurn(t, p, d)
	via, ref := chatClient{t, srv.URL}, chatClient{t, single.URL}
	convs := map[string][]map[string]any{
		"a": {{"role": "user", "content": strings.Repeat("alpha alpha ", 20)}},
		"b": {{"role": "user", "content": strings.Repeat("beta beta ", 20)}},
	}
	for turn := range 3 {
		for _, id := range []string{"a", "b"} {
			got, want := via.send(id, convs[id], false, 12), ref.send("", convs[id], false, 12)
			if got.text != want.text {
				t.Fatalf("conversation %s turn %d: %q, want %q", id, turn, got.text, want.text)
			}
			if turn > 0 && got.header.Get(proxy.HeaderCache) != "hit" {
				t.Errorf("conversation %s turn %d: %s", id, turn, got.header.Get(proxy.HeaderCache))
			}
			convs[id] = append(convs[id], map[string]any{"role": "assistant", "content": got.text}, map[string]any{"role": "user", "content": id + " again"})
		}
	}
	restarted, _ := startMultiTurn(t, p, d)
	got := chatClient{t, restarted.URL}.send("a", convs["a"], false, 12)
	if want := ref.send("", convs["a"], false, 12); got.text != want.text || got.header.Get(proxy.HeaderCache) != "miss" {
		t.Errorf("after a restart: %q (%s), want %q as a miss", got.text, got.header.Get(proxy.HeaderCache), want.text)
	}
	resp, raw := do(t, http.MethodGet, srv.URL+"/health", nil)
	var h map[string]any
	if resp.StatusCode != 200 || json.Unmarshal(raw, &h) != nil || h["cached_conversations"] != 2.0 {
		t.Errorf("/health: %s", raw)
	}
}

// TestMultiTurnConversationID: the id is never forwarded; without one the proxy routes one-way,
// or answers 400 when it requires one.
func TestMultiTurnConversationID(t *testing.T) {
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	dr := record(t, d.URL)
	mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)}, Decode: []proxy.Instance{instanceOf(t, dr.srv.URL)}}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mt)
	defer srv.Close()
	msgs := []map[string]any{{"role": "user", "content": "hello"}}
	if r := (chatClient{t, srv.URL}).send("x", msgs, false, 4); r.status != 200 || r.header.Get(proxy.HeaderCache) != "miss" {
		t.Fatalf("%d %s", r.status, r.raw)
	}
	if _, ok := dr.bodies[0]["conversation_id"]; ok {
		t.Error("conversation_id was forwarded to D")
	}
	if r := (chatClient{t, srv.URL}).send("", msgs, false, 4); r.status != 200 || r.header.Get(proxy.HeaderCache) != "off" {
		t.Errorf("without an id: %d %s", r.status, r.header.Get(proxy.HeaderCache))
	}
	strict, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)}, Decode: []proxy.Instance{instanceOf(t, d.URL)}}, RequireConversationID: true})
	if err != nil {
		t.Fatal(err)
	}
	ssrv := httptest.NewServer(strict)
	defer ssrv.Close()
	if r := (chatClient{t, ssrv.URL}).send("", msgs, false, 4); r.status != 400 || !strings.Contains(r.raw, "missing_conversation_id") {
		t.Errorf("strict proxy without an id: %d %s", r.status, r.raw)
	}
}

// TestMultiTurnKeepsStreamOptions: the multi-turn proxy asks D for usage on a stream but keeps
// the client's other stream_options: with continuous_usage_stats every chunk with a choice
// after the role chunk carries usage, as from the engine itself; a client that asked for no
// usage gets none (and D is not asked for per-chunk usage).
func TestMultiTurnKeepsStreamOptions(t *testing.T) {
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	rec := record(t, d.URL)
	mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: proxy.Config{
		Prefill: []proxy.Instance{instanceOf(t, p.URL)}, Decode: []proxy.Instance{instanceOf(t, rec.srv.URL)}}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mt)
	t.Cleanup(func() { srv.Close(); mt.Close() })
	for i, tc := range []struct {
		options   map[string]any
		toD       string
		usageEach bool
	}{
		{map[string]any{"include_usage": true, "continuous_usage_stats": true}, `{"continuous_usage_stats":true,"include_usage":true}`, true},
		{map[string]any{"include_usage": false, "continuous_usage_stats": true}, `{"include_usage":true}`, false},
	} {
		resp, raw := do(t, http.MethodPost, srv.URL+"/v1/chat/completions", map[string]any{
			"model": "kvbridge/tiny", "messages": []map[string]any{{"role": "user", "content": "hi"}}, "max_tokens": 4,
			"temperature": 0, "ignore_eos": true, "stream": true, "stream_options": tc.options, "conversation_id": fmt.Sprint("opts-", i)})
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%v: status %d %s", tc.options, resp.StatusCode, raw)
		}
		rec.mu.Lock()
		got, _ := json.Marshal(rec.bodies[len(rec.bodies)-1]["stream_options"])
		rec.mu.Unlock()
		if string(got) != tc.toD {
			t.Errorf("%v: D was asked for stream_options %s, want %s", tc.options, got, tc.toD)
		}
		chunks, withUsage := 0, 0
		for _, data := range sseData(raw) {
			var m struct {
				Choices []struct {
					Delta struct{ Role string } `json:"delta"`
				} `json:"choices"`
				Usage any `json:"usage"`
			}
			if err := json.Unmarshal([]byte(data), &m); err != nil {
				t.Fatalf("bad event %q", data)
			}
			if len(m.Choices) > 0 && m.Choices[0].Delta.Role == "" {
				chunks++
				if m.Usage != nil {
					withUsage++
				}
			} else if m.Usage != nil && !tc.usageEach {
				t.Errorf("%v: a usage chunk the client did not ask for: %s", tc.options, data)
			}
		}
		if chunks == 0 || (tc.usageEach && withUsage != chunks) || (!tc.usageEach && withUsage != 0) {
			t.Errorf("%v: %d of %d chunks with usage\n%s", tc.options, withUsage, chunks, raw)
		}
	}
}

// sseData returns the data of each event of a streamed answer, without the final [DONE].
func sseData(raw []byte) []string {
	var out []string
	for _, line := range strings.Split(string(raw), "\n") {
		if data, ok := strings.CutPrefix(line, "data: "); ok && data != "[DONE]" {
			out = append(out, data)
		}
	}
	return out
}
