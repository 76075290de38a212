package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/proxy"
)

// The push flows are tested against real engines of the connector the engines implement:
// NixlPushConnector once they do, NixlConnector until then. Engines without push take the push
// legs all the same — P prefills and holds its blocks under a lease, D (params without
// remote_block_ids) computes the prompt itself — so what the proxy sends, when, and what it
// does when a leg fails are tested either way. A gate in front of an engine records the legs, as
// recorder does, lets a test hold or break a leg at an explicit point, and fills in the push
// fields of P's GET /v1/kv_transfer (transfer_mode, remote_host, remote_port, tp_size) that an
// engine without push does not report; an engine's own values win.

// pushSetup returns the kv_connector the push tests' engines run (NixlPushConnector where the
// engines have it) and the shortest kv_lease_duration, in seconds, it accepts: P's blocks that
// no decoder collects (an engine without push, a D cancelled by the proxy) are freed that soon,
// within the tests' deadlines.
func pushSetup(t *testing.T) (string, int) {
	t.Helper()
	for _, c := range []string{"NixlPushConnector", "NixlConnector"} {
		for _, lease := range []int{1, 15} {
			cfg := `{"kv_connector":"` + c + `","kv_role":"kv_producer","kv_connector_extra_config":{"kv_lease_duration":` + strconv.Itoa(lease) + `}}`
			if _, err := connector.ParseConfig([]byte(cfg), nil); err == nil {
				return c, lease
			}
		}
	}
	t.Fatal("the engines accept neither NixlPushConnector nor NixlConnector with a lease of 15 s")
	return "", 0
}

// startPushEngine starts an engine of role with the push connector.
func startPushEngine(t *testing.T, role string, maxLen int, extra string, opts ...func(*instance.Config)) *instance.Instance {
	t.Helper()
	name, lease := pushSetup(t)
	cfg := `{"kv_connector":"` + name + `","kv_role":"` + role + `","kv_connector_extra_config":{"kv_lease_duration":` + strconv.Itoa(lease) + extra + `}}`
	kv, err := connector.ParseConfig([]byte(cfg), nil)
	if err != nil {
		t.Fatal(err)
	}
	c := instance.Config{OpenedModel: openTiny(t), Host: "127.0.0.1", NumBlocks: 512, MaxModelLen: maxLen, PrefixCaching: true,
		SideChannelPort: -1, KVTransfer: kv, PromptTokensDetails: true}
	for _, o := range opts {
		o(&c)
	}
	return startInstance(t, c)
}

// gate is a recorder that can also hold or break a leg.
type gate struct {
	mu       sync.Mutex
	bodies   []map[string]any
	arrived  chan struct{} // closed when the first leg arrives
	once     sync.Once
	infoGets atomic.Int32 // GET /v1/kv_transfer asked
	srv      *httptest.Server
}

// gateOpts say what a gate does besides recording.
type gateOpts struct {
	// info edits the engine's GET /v1/kv_transfer answer.
	info func(map[string]any)
	// leg, if set, handles a leg (after it was recorded) instead of forwarding it; forward
	// forwards it.
	leg func(w http.ResponseWriter, r *http.Request, forward func(http.ResponseWriter, *http.Request))
}

func newGate(t *testing.T, target string, o gateOpts) *gate {
	t.Helper()
	u, _ := url.Parse(target)
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.FlushInterval = -1
	rp.ModifyResponse = func(resp *http.Response) error {
		if resp.Request.URL.Path != "/v1/kv_transfer" || o.info == nil || resp.StatusCode != http.StatusOK {
			return nil
		}
		data, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return err
		}
		var m map[string]any
		if err := json.Unmarshal(data, &m); err != nil {
			return err
		}
		o.info(m)
		data, _ = json.Marshal(m)
		resp.Body = io.NopCloser(bytes.NewReader(data))
		resp.ContentLength = int64(len(data))
		resp.Header.Set("Content-Length", strconv.Itoa(len(data)))
		return nil
	}
	g := &gate{arrived: make(chan struct{})}
	g.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method != http.MethodPost {
			if req.URL.Path == "/v1/kv_transfer" {
				g.infoGets.Add(1)
			}
			rp.ServeHTTP(w, req)
			return
		}
		data, _ := io.ReadAll(req.Body)
		var m map[string]any
		_ = json.Unmarshal(data, &m)
		g.mu.Lock()
		g.bodies = append(g.bodies, m)
		g.mu.Unlock()
		g.once.Do(func() { close(g.arrived) })
		req.Body = io.NopCloser(bytes.NewReader(data))
		if o.leg != nil {
			o.leg(w, req, rp.ServeHTTP)
			return
		}
		rp.ServeHTTP(w, req)
	}))
	t.Cleanup(g.srv.Close)
	return g
}

func (g *gate) legs() []map[string]any {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]map[string]any(nil), g.bodies...)
}

func (g *gate) instance(t *testing.T) proxy.Instance { return instanceOf(t, g.srv.URL) }

// pushInfo fills in what an engine with push reports at GET /v1/kv_transfer, where p does not:
// the coordinates P puts into its params (its side channel's configured host, the default here).
func pushInfo(p *instance.Instance) func(map[string]any) {
	n := sidePort(p)
	return func(m map[string]any) {
		for k, v := range map[string]any{"transfer_mode": "push", "remote_host": connector.DefaultSideChannelHost, "remote_port": n, "tp_size": 1} {
			if _, ok := m[k]; !ok {
				m[k] = v
			}
		}
	}
}

// sidePort is p's side channel port.
func sidePort(p *instance.Instance) int {
	_, port, _ := net.SplitHostPort(p.Connector.SideChannelAddr())
	n, _ := strconv.Atoi(port)
	return n
}

// waitFor waits for ch to close, failing the test after 30 s with what.
func waitFor(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(30 * time.Second):
		t.Fatalf("timed out after 30s waiting for %s", what)
	}
}

// holdUntilCancelled forwards a leg to the engine under the leg's own context (the proxy's
// cancel reaches the engine), relays the engine's first event when first is set, and then
// relays nothing more until the proxy closes the leg, which it reports on cancelled.
func holdUntilCancelled(target string, first bool, cancelled chan struct{}) func(http.ResponseWriter, *http.Request, func(http.ResponseWriter, *http.Request)) {
	return func(w http.ResponseWriter, r *http.Request, _ func(http.ResponseWriter, *http.Request)) {
		defer close(cancelled)
		out, _ := http.NewRequestWithContext(r.Context(), http.MethodPost, target+r.URL.Path, r.Body)
		out.Header = r.Header.Clone()
		resp, err := http.DefaultClient.Do(out)
		if err != nil {
			return
		}
		defer resp.Body.Close()
		if first {
			w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
			w.WriteHeader(resp.StatusCode)
			br := bufio.NewReader(resp.Body)
			for {
				line, err := br.ReadString('\n')
				_, _ = io.WriteString(w, line)
				if err != nil || strings.HasPrefix(line, "data:") {
					break
				}
			}
			_, _ = io.WriteString(w, "\n")
			_ = http.NewResponseController(w).Flush()
		}
		select {
		case <-r.Context().Done():
		case <-time.After(30 * time.Second): // the test fails on its own waits
		}
	}
}

// dieOnLeg closes a leg's connection without an answer, as an engine that dies does.
func dieOnLeg(after <-chan struct{}) func(http.ResponseWriter, *http.Request, func(http.ResponseWriter, *http.Request)) {
	return func(w http.ResponseWriter, r *http.Request, _ func(http.ResponseWriter, *http.Request)) {
		select {
		case <-after:
		case <-r.Context().Done():
		}
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close()
		}
	}
}

// poolsFull waits until every engine's pool is full again.
func poolsFull(t *testing.T, engines ...*instance.Instance) {
	t.Helper()
	eventually(t, "every pool to be full again", func() bool {
		for _, e := range engines {
			if e.Pool.NumFree() != e.Pool.NumBlocks() {
				return false
			}
		}
		return true
	})
}

func startPushProxy(t *testing.T, mode proxy.TransferMode, p, d *gate) *httptest.Server {
	t.Helper()
	return startProxy(t, proxy.Config{Prefill: []proxy.Instance{p.instance(t)}, Decode: []proxy.Instance{d.instance(t)}, TransferMode: mode})
}

// proxyKinds runs f with the one-way proxy and with the multi-turn proxy (whose requests then
// carry a conversation id: a first turn, pushed).
func proxyKinds(t *testing.T, f func(t *testing.T, serve func(proxy.Config) *httptest.Server, body func(map[string]any) map[string]any)) {
	t.Run("one-way", func(t *testing.T) {
		f(t, func(c proxy.Config) *httptest.Server { return startProxy(t, c) }, func(b map[string]any) map[string]any { return b })
	})
	t.Run("multi-turn", func(t *testing.T) {
		f(t, func(c proxy.Config) *httptest.Server {
			srv, _ := serveMultiTurn(t, proxy.MultiTurnConfig{Config: c})
			return srv
		}, func(b map[string]any) map[string]any { b["conversation_id"] = "conv-" + t.Name(); return b })
	})
}

// completionText joins the text of a completion's choices, streamed or not.
func completionText(t *testing.T, raw []byte) string {
	t.Helper()
	var s strings.Builder
	events := sseData(raw)
	if len(events) == 0 {
		events = []string{string(raw)}
	}
	for _, data := range events {
		var m struct {
			Choices []struct{ Text string } `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &m); err != nil {
			t.Fatalf("not a completion: %q", data)
		}
		for _, c := range m.Choices {
			s.WriteString(c.Text)
		}
	}
	return s.String()
}

// TestPushLegsOverlap: with a P that reports transfer_mode "push", the one-way proxy (transfer
// mode auto) sends both legs at once — D's leg reaches D while P's answer is held back, so they
// overlap — with exactly the contract's JSON on each leg, tied by one fresh push_id; the client
// gets the single engine's answer, and both pools are full again.
func TestPushLegsOverlap(t *testing.T) {
	single := startEngine(t, "", 4096)
	p, d := startPushEngine(t, "kv_producer", 4096, ""), startPushEngine(t, "kv_consumer", 4096, "")
	var dg *gate // set before the proxy sends anything
	var sawD atomic.Bool
	pg := newGate(t, p.URL, gateOpts{info: pushInfo(p), leg: func(w http.ResponseWriter, r *http.Request, forward func(http.ResponseWriter, *http.Request)) {
		// P's answer goes out only once D's leg has arrived.
		rec := httptest.NewRecorder()
		forward(rec, r)
		select {
		case <-dg.arrived:
			sawD.Store(true)
		case <-time.After(30 * time.Second):
		}
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
	}})
	dg = newGate(t, d.URL, gateOpts{})
	px := startPushProxy(t, "", pg, dg)
	body := map[string]any{"model": "kvbridge/tiny", "prompt": "the legs of a push run side by side", "max_tokens": 6, "temperature": 0,
		"stream": true, "stream_options": map[string]any{"include_usage": true}}
	resp, raw := do(t, http.MethodPost, px.URL+"/v1/completions", body, "X-Request-Id", "push-1")
	if resp.StatusCode != 200 || !strings.Contains(string(raw), "data: [DONE]") {
		t.Fatalf("%d %s", resp.StatusCode, raw)
	}
	if !sawD.Load() {
		t.Fatal("D's leg did not arrive while P's answer was held: the legs ran one after the other")
	}
	_, want := do(t, http.MethodPost, single.URL+"/v1/completions", body)
	if got, w := completionText(t, raw), completionText(t, want); got != w {
		t.Errorf("answer through the push proxy %q, single engine %q", got, w)
	}

	pl, dl := pg.legs(), dg.legs()
	if len(pl) != 1 || len(dl) != 1 {
		t.Fatalf("%d P legs and %d D legs, want 1 and 1", len(pl), len(dl))
	}
	id, _ := pl[0]["kv_transfer_params"].(map[string]any)["push_id"].(string)
	if _, err := uuid.Parse(id); err != nil || id == "push-1" {
		t.Fatalf("push_id %q: want a fresh random id", id)
	}
	wantP := map[string]any{"model": "kvbridge/tiny", "prompt": body["prompt"], "max_tokens": 1, "temperature": 0, "stream": false,
		"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
			"remote_block_ids": nil, "remote_host": nil, "remote_port": nil, "push_id": id}}
	wantD := map[string]any{"model": "kvbridge/tiny", "prompt": body["prompt"], "max_tokens": 6, "temperature": 0, "stream": true,
		"stream_options": map[string]any{"include_usage": true},
		"kv_transfer_params": map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": p.Connector.EngineID(),
			"remote_host": connector.DefaultSideChannelHost, "remote_port": sidePort(p), "tp_size": 1, "push_id": id}}
	if g, w := mustJSON(pl[0]), mustJSON(wantP); g != w {
		t.Errorf("P's leg:\n got %s\nwant %s", g, w)
	}
	if g, w := mustJSON(dl[0]), mustJSON(wantD); g != w {
		t.Errorf("D's leg:\n got %s\nwant %s", g, w)
	}
	// A second request draws another push_id and asks P's coordinates from the cache.
	if resp, raw := do(t, http.MethodPost, px.URL+"/v1/completions", body); resp.StatusCode != 200 {
		t.Fatalf("second request: %d %s", resp.StatusCode, raw)
	}
	if id2 := pg.legs()[1]["kv_transfer_params"].(map[string]any)["push_id"]; id2 == id || id2 != dg.legs()[1]["kv_transfer_params"].(map[string]any)["push_id"] {
		t.Errorf("second request's push_id: P %v, D %v, first %v", id2, dg.legs()[1]["kv_transfer_params"].(map[string]any)["push_id"], id)
	}
	if n := pg.infoGets.Load(); n != 1 {
		t.Errorf("P's GET /v1/kv_transfer asked %d times for two requests, want 1 (cached)", n)
	}
	poolsFull(t, p, d)
}

// TestPushPrefillFailsFirst, through both proxies: P's leg fails while D holds the request and
// has relayed nothing —
// P dies (its connection closes without an answer), or P refuses the prompt with a 400. The
// proxy closes D's leg (D aborts the request), the client gets P's failure as its status (a
// 502 prefill_request_failed, or P's own 400), and both pools are full again.
func TestPushPrefillFailsFirst(t *testing.T) {
	proxyKinds(t, func(t *testing.T, serve func(proxy.Config) *httptest.Server, withID func(map[string]any) map[string]any) {
		for _, tc := range []struct {
			name   string
			pLen   int // P's max_model_len
			dies   bool
			status int
			code   string
		}{
			{name: "P dies", pLen: 4096, dies: true, status: http.StatusBadGateway, code: "prefill_request_failed"},
			{name: "P refuses", pLen: 64, status: http.StatusBadRequest},
		} {
			t.Run(tc.name, func(t *testing.T) {
				p, d := startPushEngine(t, "kv_producer", tc.pLen, ""), startPushEngine(t, "kv_consumer", 4096, "")
				dCancelled := make(chan struct{})
				dg := newGate(t, d.URL, gateOpts{leg: holdUntilCancelled(d.URL, false, dCancelled)})
				var leg func(http.ResponseWriter, *http.Request, func(http.ResponseWriter, *http.Request))
				if tc.dies {
					leg = dieOnLeg(dg.arrived)
				} else {
					leg = func(w http.ResponseWriter, r *http.Request, forward func(http.ResponseWriter, *http.Request)) {
						select { // P answers once D holds the request
						case <-dg.arrived:
						case <-time.After(30 * time.Second):
						}
						forward(w, r)
					}
				}
				pg := newGate(t, p.URL, gateOpts{info: pushInfo(p), leg: leg})
				px := serve(proxy.Config{Prefill: []proxy.Instance{pg.instance(t)}, Decode: []proxy.Instance{dg.instance(t)}, TransferMode: proxy.TransferPush})
				prompt := make([]int, 100) // longer than the refusing P's max_model_len
				for i := range prompt {
					prompt[i] = 300 + i
				}
				resp, raw := do(t, http.MethodPost, px.URL+"/v1/completions", withID(map[string]any{"model": "kvbridge/tiny", "prompt": prompt,
					"max_tokens": 3000, "ignore_eos": true, "stream": true}))
				var e struct {
					Error struct {
						Code    any    `json:"code"`
						Message string `json:"message"`
					} `json:"error"`
				}
				if resp.StatusCode != tc.status || json.Unmarshal(raw, &e) != nil || e.Error.Message == "" || (tc.code != "" && e.Error.Code != tc.code) {
					t.Fatalf("client got %d %s; want %d with an error JSON", resp.StatusCode, raw, tc.status)
				}
				if dkv := dg.legs()[0]["kv_transfer_params"].(map[string]any); dkv["push_id"] == nil {
					t.Errorf("D's leg was no push: %v", dkv)
				}
				waitFor(t, dCancelled, "the proxy to close D's leg")
				poolsFull(t, p, d)
			})
		}
	})
}

// TestPushPrefillFailsMidStream: P's leg dies after D's first event reached the client. The proxy
// closes D's leg and ends the client's stream with an error event and [DONE], not a truncated
// success; both pools are full again.
func TestPushPrefillFailsMidStream(t *testing.T) {
	p, d := startPushEngine(t, "kv_producer", 4096, ""), startPushEngine(t, "kv_consumer", 4096, "")
	dCancelled, clientGotFirst := make(chan struct{}), make(chan struct{})
	dg := newGate(t, d.URL, gateOpts{leg: holdUntilCancelled(d.URL, true, dCancelled)})
	// P prefills (an engine with push writes D's KV then), and dies before its answer reaches
	// the proxy, once the client has D's first event.
	die := dieOnLeg(clientGotFirst)
	pg := newGate(t, p.URL, gateOpts{info: pushInfo(p), leg: func(w http.ResponseWriter, r *http.Request, forward func(http.ResponseWriter, *http.Request)) {
		forward(httptest.NewRecorder(), r)
		die(w, r, forward)
	}})
	px := startPushProxy(t, proxy.TransferPush, pg, dg)
	data, _ := json.Marshal(map[string]any{"model": "kvbridge/tiny", "prompt": "a stream cut short", "max_tokens": 3000, "ignore_eos": true, "stream": true})
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, px.URL+"/v1/completions", bytes.NewReader(data))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	first, err := br.ReadString('\n')
	if err != nil || resp.StatusCode != 200 || !strings.HasPrefix(first, "data: {") {
		t.Fatalf("%d, first line %q, %v", resp.StatusCode, first, err)
	}
	close(clientGotFirst)
	rest, _ := io.ReadAll(br)
	events := sseData(rest)
	if len(events) == 0 || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") || !strings.Contains(events[len(events)-1], "prefill leg failed") {
		t.Errorf("the rest of the stream: %q; want an error event naming the prefill leg, then [DONE]", rest)
	}
	waitFor(t, dCancelled, "the proxy to close D's leg")
	poolsFull(t, p, d)
}

// TestPushDecodeFailsFirst, through both proxies: D refuses the request (429: its one slot is
// taken) or dies while P's leg is pending. The proxy cancels P's leg, and the client gets D's
// answer (its own 429) or a 502 decode_request_failed; both pools are full again.
func TestPushDecodeFailsFirst(t *testing.T) {
	proxyKinds(t, func(t *testing.T, serve func(proxy.Config) *httptest.Server, withID func(map[string]any) map[string]any) {
		for _, tc := range []struct {
			name   string
			dies   bool
			status int
		}{
			{name: "D refuses", status: http.StatusTooManyRequests},
			{name: "D dies", dies: true, status: http.StatusBadGateway},
		} {
			t.Run(tc.name, func(t *testing.T) {
				p := startPushEngine(t, "kv_producer", 4096, "")
				d := startPushEngine(t, "kv_consumer", 4096, "", func(c *instance.Config) { c.MaxConcurrentRequests = 1 })
				pCancelled := make(chan struct{})
				pg := newGate(t, p.URL, gateOpts{info: pushInfo(p), leg: func(w http.ResponseWriter, r *http.Request, _ func(http.ResponseWriter, *http.Request)) {
					select { // P's leg stays pending until the proxy gives it up
					case <-r.Context().Done():
						close(pCancelled)
					case <-time.After(30 * time.Second):
					}
				}})
				// D answers only once P's leg is pending: it refuses (a 429 of its own: its one
				// slot is taken), or dies (its connection closes without an answer).
				dleg := func(w http.ResponseWriter, r *http.Request, forward func(http.ResponseWriter, *http.Request)) {
					select {
					case <-pg.arrived:
					case <-time.After(30 * time.Second):
					}
					forward(w, r)
				}
				stopOccupying := func() {}
				if tc.dies {
					dleg = dieOnLeg(pg.arrived)
				} else {
					ctx, cancel := context.WithCancel(t.Context())
					defer cancel()
					stopOccupying = cancel
					data, _ := json.Marshal(map[string]any{"model": "kvbridge/tiny", "prompt": "occupy", "max_tokens": 3000, "ignore_eos": true, "stream": true})
					req, _ := http.NewRequestWithContext(ctx, http.MethodPost, d.URL+"/v1/completions", bytes.NewReader(data))
					resp, err := http.DefaultClient.Do(req)
					if err != nil {
						t.Fatal(err)
					}
					defer resp.Body.Close()
					if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
						t.Fatal(err)
					}
				}
				dg := newGate(t, d.URL, gateOpts{leg: dleg})
				px := serve(proxy.Config{Prefill: []proxy.Instance{pg.instance(t)}, Decode: []proxy.Instance{dg.instance(t)}, TransferMode: proxy.TransferPush})
				resp, raw := do(t, http.MethodPost, px.URL+"/v1/completions", withID(map[string]any{"model": "kvbridge/tiny", "prompt": "refused", "max_tokens": 4, "stream": true}))
				if resp.StatusCode != tc.status || !strings.Contains(string(raw), `"error"`) {
					t.Fatalf("client got %d %s, want %d", resp.StatusCode, raw, tc.status)
				}
				waitFor(t, pCancelled, "the proxy to cancel P's leg")
				if tc.dies && !strings.Contains(string(raw), "decode_request_failed") {
					t.Errorf("D died: %s", raw)
				}
				stopOccupying()
				poolsFull(t, p, d)
			})
		}
	})
}

// TestPushSerialLegs: the serial push flow (vLLM's toy push proxy's) — forced, or push forced
// with a P that does not report its coordinates (an engine without push, vLLM's) — sends D,
// after P's answer, exactly P's coordinates and no remote_block_ids.
func TestPushSerialLegs(t *testing.T) {
	for _, mode := range []proxy.TransferMode{proxy.TransferPushSerial, proxy.TransferPush} {
		t.Run(string(mode), func(t *testing.T) {
			p, d := startPushEngine(t, "kv_producer", 4096, ""), startPushEngine(t, "kv_consumer", 4096, "")
			info := pushInfo(p)
			if mode == proxy.TransferPush {
				info = func(m map[string]any) { delete(m, "remote_port") } // no coordinates
			}
			pg, dg := newGate(t, p.URL, gateOpts{info: info}), newGate(t, d.URL, gateOpts{})
			px := startPushProxy(t, mode, pg, dg)
			resp, raw := do(t, http.MethodPost, px.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": "one after the other", "max_tokens": 4})
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, raw)
			}
			pkv := pg.legs()[0]["kv_transfer_params"].(map[string]any)
			if _, ok := pkv["push_id"]; ok {
				t.Errorf("P's leg of the serial flow carries a push_id: %v", pkv)
			}
			dkv := dg.legs()[0]["kv_transfer_params"].(map[string]any)
			rid, _ := dkv["remote_request_id"].(string)
			want := map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": p.Connector.EngineID(),
				"remote_request_id": rid, "remote_host": connector.DefaultSideChannelHost, "remote_port": sidePort(p), "tp_size": 1}
			if g, w := mustJSON(dkv), mustJSON(want); g != w || rid == "" {
				t.Errorf("D's kv_transfer_params:\n got %s\nwant %s", g, w)
			}
			poolsFull(t, p, d)
		})
	}
}

// TestMultiTurnPush: through the multi-turn proxy with P pushing, the first turn runs both legs
// at once (push_id on both, D told P's HTTP host as the pull flow tells it); the second turn
// pulls the conversation from D and stays the pull flow, on the same decoder. Both answers are
// the single engine's; both pools are full again.
func TestMultiTurnPush(t *testing.T) {
	single := startEngine(t, "", 8192)
	p := startPushEngine(t, "kv_producer", 8192, `,"bidirectional_kv_xfer":true`)
	// D holds a finished turn's blocks for P for a second, so that its pool is full again soon.
	d := startPushEngine(t, "kv_consumer", 8192, `,"bidirectional_kv_xfer":true,"decoder_kv_blocks_ttl":1`)
	pg, dg := newGate(t, p.URL, gateOpts{info: pushInfo(p)}), newGate(t, d.URL, gateOpts{})
	srv, _ := serveMultiTurn(t, proxy.MultiTurnConfig{Config: proxy.Config{Prefill: []proxy.Instance{pg.instance(t)}, Decode: []proxy.Instance{dg.instance(t)}}})
	c, ref := chatClient{t: t, url: srv.URL}, chatClient{t: t, url: single.URL}
	msgs := []map[string]any{{"role": "user", "content": "tell me about pushing KV caches across the network"}}
	for turn := range 2 {
		r := c.send("conv-push", msgs, turn == 0, 8)
		if r.status != 200 {
			t.Fatalf("turn %d: %d %s", turn, r.status, r.raw)
		}
		if want := ref.send("", msgs, false, 8); r.text != want.text {
			t.Errorf("turn %d: %q, single engine %q", turn, r.text, want.text)
		}
		pkv := pg.legs()[turn]["kv_transfer_params"].(map[string]any)
		dkv := dg.legs()[turn]["kv_transfer_params"].(map[string]any)
		switch turn {
		case 0:
			if r.header.Get(proxy.HeaderCache) != "miss" || pkv["push_id"] == nil || pkv["push_id"] != dkv["push_id"] ||
				dkv["remote_host"] != pg.instance(t).Host || dkv["remote_block_ids"] != nil {
				t.Errorf("turn 1 (%s): P %v, D %v; want a push with P's HTTP host", r.header.Get(proxy.HeaderCache), pkv, dkv)
			}
		case 1:
			if r.header.Get(proxy.HeaderCache) != "hit" || pkv["push_id"] != nil || dkv["push_id"] != nil || pkv["remote_block_ids"] == nil {
				t.Errorf("turn 2 (%s): P %v, D %v; want P pulling from D, no push", r.header.Get(proxy.HeaderCache), pkv, dkv)
			}
		}
		msgs = append(msgs, map[string]any{"role": "assistant", "content": r.text}, map[string]any{"role": "user", "content": "and then?"})
	}
	poolsFull(t, p, d)
}

// TestPushRefreshesCoordinates: P's coordinates are cached, and asked again once P's answer
// names another engine id than the cached one (P restarted since).
func TestPushRefreshesCoordinates(t *testing.T) {
	p, d := startPushEngine(t, "kv_producer", 4096, ""), startPushEngine(t, "kv_consumer", 4096, "")
	var stale atomic.Bool
	stale.Store(true)
	fill := pushInfo(p)
	pg := newGate(t, p.URL, gateOpts{info: func(m map[string]any) {
		fill(m)
		if stale.Load() {
			m["engine_id"] = "an-engine-before-its-restart"
		}
	}})
	dg := newGate(t, d.URL, gateOpts{})
	px := startPushProxy(t, proxy.TransferPush, pg, dg)
	body := map[string]any{"model": "kvbridge/tiny", "prompt": "coordinates", "max_tokens": 2}
	for i, wantGets := range []int32{1, 2, 2} {
		if i == 1 {
			stale.Store(false)
		}
		// The first request's D registers with an engine id P no longer has: an engine with
		// push may fail it, which is what the refresh is for.
		if resp, raw := do(t, http.MethodPost, px.URL+"/v1/completions", body); resp.StatusCode != 200 && i > 0 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, raw)
		}
		if n := pg.infoGets.Load(); n != wantGets {
			t.Errorf("after request %d: P's GET /v1/kv_transfer asked %d times, want %d", i, n, wantGets)
		}
	}
	if id := dg.legs()[2]["kv_transfer_params"].(map[string]any)["remote_engine_id"]; id != p.Connector.EngineID() {
		t.Errorf("D's remote_engine_id after the refresh: %v, want %s", id, p.Connector.EngineID())
	}
	poolsFull(t, p, d)
}

// TestTransferModes: the modes a proxy accepts, a bad one refused naming itself, and a
// client's kv_transfer_params (a push_id of its choosing included) refused by both proxies in
// every mode, no leg sent.
func TestTransferModes(t *testing.T) {
	for _, s := range []string{"", "auto", "pull", "push", "push-serial"} {
		if _, err := proxy.ParseTransferMode(s); err != nil {
			t.Errorf("%q: %v", s, err)
		}
	}
	if _, err := proxy.NewOneWay(proxy.Config{Prefill: []proxy.Instance{{Host: "h", Port: 1}}, Decode: []proxy.Instance{{Host: "h", Port: 2}}, TransferMode: "pushy"}); err == nil || !strings.Contains(err.Error(), `"pushy"`) {
		t.Errorf("transfer mode pushy: %v", err)
	}
	p, d := startPushEngine(t, "kv_producer", 4096, ""), startPushEngine(t, "kv_consumer", 4096, "")
	pg, dg := newGate(t, p.URL, gateOpts{info: pushInfo(p)}), newGate(t, d.URL, gateOpts{})
	for _, mode := range proxy.TransferModes {
		cfg := proxy.Config{Prefill: []proxy.Instance{pg.instance(t)}, Decode: []proxy.Instance{dg.instance(t)}, TransferMode: mode}
		mt, _ := serveMultiTurn(t, proxy.MultiTurnConfig{Config: cfg})
		for _, px := range []*httptest.Server{startProxy(t, cfg), mt} {
			resp, raw := do(t, http.MethodPost, px.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": "x", "max_tokens": 2,
				"conversation_id": "c", "kv_transfer_params": map[string]any{"do_remote_prefill": true, "push_id": "someone-elses"}})
			if resp.StatusCode != 400 || !strings.Contains(string(raw), "kv_transfer_params") {
				t.Errorf("%s: a client's params: %d %s", mode, resp.StatusCode, raw)
			}
		}
	}
	if n := len(pg.legs()) + len(dg.legs()); n != 0 {
		t.Errorf("%d legs sent for refused requests", n)
	}
}
