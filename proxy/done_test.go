package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/proxy"
)

// logRecorder is a slog handler that keeps every message, for tests that assert what a proxy
// logged.
type logRecorder struct {
	mu   sync.Mutex
	msgs []string
}

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *logRecorder) WithGroup(string) slog.Handler            { return l }
func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	l.msgs = append(l.msgs, r.Level.String()+" "+r.Message)
	l.mu.Unlock()
	return nil
}

// count returns how many messages contain s.
func (l *logRecorder) count(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, m := range l.msgs {
		if strings.Contains(m, s) {
			n++
		}
	}
	return n
}

// closeAtDone posts a streaming request and reads its events until data: [DONE], then closes
// the connection at once, as the OpenAI SDKs and vLLM's benchmark do. It returns the status, the
// response headers and the text of the content deltas.
func closeAtDone(t *testing.T, client *http.Client, url string, body map[string]any) (int, http.Header, string) {
	t.Helper()
	data, _ := json.Marshal(body)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return resp.StatusCode, resp.Header, ""
	}
	var text strings.Builder
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		payload, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if payload == "[DONE]" {
			return resp.StatusCode, resp.Header, text.String() // Body.Close drops the connection
		}
		var ev struct {
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			KV any `json:"kv_transfer_params"`
		}
		if err := json.Unmarshal([]byte(payload), &ev); err != nil {
			t.Errorf("bad event %q", payload)
		}
		if ev.KV != nil {
			t.Errorf("kv_transfer_params reached the client: %s", payload)
		}
		for _, c := range ev.Choices {
			text.WriteString(c.Text + c.Delta.Content)
		}
	}
	t.Errorf("the stream ended without [DONE]: %v", sc.Err())
	return resp.StatusCode, resp.Header, text.String()
}

// TestMultiTurnClientClosesAtDone: 20 conversations of 4 turns whose client closes the
// connection the moment it reads [DONE]. The proxy stores each turn before it writes [DONE], so
// every turn after the first is a hit, and nothing is logged as a stream that ended early.
func TestMultiTurnClientClosesAtDone(t *testing.T) {
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	logs := &logRecorder{}
	mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: proxy.Config{
		Prefill: []proxy.Instance{instanceOf(t, p.URL)}, Decode: []proxy.Instance{instanceOf(t, d.URL)}, Logger: slog.New(logs)}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mt)
	t.Cleanup(func() { srv.Close(); mt.Close() })
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	const convs, turns, workers = 20, 4, 4
	work := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for c := range work {
				msgs := []map[string]any{{"role": "system", "content": "Be brief. " + strings.Repeat("Shared context. ", 8)}}
				for turn := 1; turn <= turns; turn++ {
					msgs = append(msgs, map[string]any{"role": "user", "content": fmt.Sprintf("conversation %d, turn %d", c, turn)})
					status, hdr, text := closeAtDone(t, client, srv.URL+"/v1/chat/completions", map[string]any{
						"model": "kvbridge/tiny", "messages": msgs, "max_tokens": 8, "temperature": 0, "stream": true,
						"conversation_id": fmt.Sprintf("conv-%d", c)})
					if status != http.StatusOK {
						t.Errorf("conversation %d turn %d: status %d", c, turn, status)
						return
					}
					if got := hdr.Get(proxy.HeaderCache); turn > 1 && got != "hit" {
						t.Errorf("conversation %d turn %d: cache %s, want hit", c, turn, got)
					}
					msgs = append(msgs, map[string]any{"role": "assistant", "content": text})
				}
			}
		})
	}
	for c := range convs {
		work <- c
	}
	close(work)
	wg.Wait()
	if n := logs.count("ended early"); n != 0 {
		t.Errorf("%d decode streams logged as ended early", n)
	}
}

// TestOneWayClientClosesAtDone: 100 streaming requests whose client closes at [DONE] through the
// one-way proxy: none is logged as a stream that ended early, and no params reach the client.
func TestOneWayClientClosesAtDone(t *testing.T) {
	p, d := startEngine(t, "kv_producer", 4096), startEngine(t, "kv_consumer", 4096)
	logs := &logRecorder{}
	px := startProxy(t, proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)}, Decode: []proxy.Instance{instanceOf(t, d.URL)}, Logger: slog.New(logs)})
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := range 25 {
				status, _, _ := closeAtDone(t, client, px.URL+"/v1/completions", map[string]any{
					"model": "kvbridge/tiny", "prompt": fmt.Sprintf("request %d of worker %d", i, w), "max_tokens": 4, "stream": true})
				if status != http.StatusOK {
					t.Errorf("status %d", status)
				}
			}
		})
	}
	wg.Wait()
	if n := logs.count("ended early"); n != 0 {
		t.Errorf("%d of 100 decode streams logged as ended early", n)
	}
}

// holdAfterDone is a relay in front of an engine that forwards its answers but, once it has
// passed data: [DONE] on, holds the end of the response until the test releases it: the engine
// side of the race between a proxy reading the rest of D's stream and a client that has closed
// at [DONE], made deterministic.
type holdAfterDone struct {
	target  string
	release chan struct{}
	srv     *httptest.Server
}

func newHoldAfterDone(t *testing.T, target string) *holdAfterDone {
	h := &holdAfterDone{target: target, release: make(chan struct{})}
	h.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, _ := http.NewRequestWithContext(r.Context(), r.Method, h.target+r.URL.Path, r.Body)
		req.Header = r.Header.Clone()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
		w.WriteHeader(resp.StatusCode)
		rc := http.NewResponseController(w)
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			fmt.Fprintf(w, "%s\n", sc.Text())
			_ = rc.Flush()
			if sc.Text() == "data: [DONE]" {
				fmt.Fprint(w, "\n")
				_ = rc.Flush()
				select {
				case <-h.release:
				case <-time.After(10 * time.Second):
					t.Error("the test never released the end of a stream")
				}
				return
			}
		}
	}))
	t.Cleanup(h.srv.Close)
	return h
}

// TestMultiTurnStoresTurnBeforeDone: an 8-turn conversation whose client closes at [DONE] while
// D's stream has not ended yet (its end is held until the client has gone): every turn from 2
// to 8 is a hit, because the proxy stores the turn before it writes [DONE].
func TestMultiTurnStoresTurnBeforeDone(t *testing.T) {
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	held := newHoldAfterDone(t, d.URL)
	logs := &logRecorder{}
	mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: proxy.Config{
		Prefill: []proxy.Instance{instanceOf(t, p.URL)}, Decode: []proxy.Instance{instanceOf(t, held.srv.URL)}, Logger: slog.New(logs)}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mt)
	t.Cleanup(func() { srv.Close(); mt.Close() })
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	msgs := []map[string]any{{"role": "system", "content": "Be brief. " + strings.Repeat("Shared context. ", 8)}}
	for turn := 1; turn <= 8; turn++ {
		msgs = append(msgs, map[string]any{"role": "user", "content": fmt.Sprintf("turn %d", turn)})
		status, hdr, text := closeAtDone(t, client, srv.URL+"/v1/chat/completions", map[string]any{
			"model": "kvbridge/tiny", "messages": msgs, "max_tokens": 8, "temperature": 0, "stream": true, "conversation_id": "eight"})
		select {
		case held.release <- struct{}{}:
		case <-time.After(10 * time.Second):
			t.Fatalf("turn %d: D's stream never reached [DONE]", turn)
		}
		if status != http.StatusOK {
			t.Fatalf("turn %d: status %d", turn, status)
		}
		cache := hdr.Get(proxy.HeaderCache)
		t.Logf("turn %d: cache %s, prompt %s tokens, pulled %s, computed %s", turn, cache,
			hdr.Get(proxy.HeaderPromptTokens), hdr.Get(proxy.HeaderPulledTokens), hdr.Get(proxy.HeaderComputedTokens))
		if turn > 1 && cache != "hit" {
			t.Errorf("turn %d: cache %s, want hit", turn, cache)
		}
		msgs = append(msgs, map[string]any{"role": "assistant", "content": text})
	}
	if n := logs.count("ended early"); n != 0 {
		t.Errorf("%d decode streams logged as ended early", n)
	}
}
