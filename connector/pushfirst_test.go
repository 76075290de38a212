package connector_test

import (
	"fmt"
	"maps"
	"sync"
	"testing"
)

// pushFlow runs one push request through P and D as a proxy would, with the client's body on
// both legs (P's with max_tokens 1): serially (vLLM's toy push proxy) or both legs at once
// (push_id). It returns D's answer.
type pushFlow struct {
	name string
	run  func(t *testing.T, p, d *node, pbody, dbody map[string]any) result
}

// pushFlows are the serial and the concurrent flow.
var pushFlows = []pushFlow{
	{"serial", func(t *testing.T, p, d *node, pbody, dbody map[string]any) result {
		t.Helper()
		pbody["kv_transfer_params"] = template()
		status, pr := post(t, p.srv.URL+"/v1/completions", pbody)
		if status != 200 || pr.KVParams == nil {
			t.Fatalf("prefill: %d %s", status, pr.Raw)
		}
		dbody["kv_transfer_params"] = pushDecodeParams(pr.KVParams)
		status, r := post(t, d.srv.URL+"/v1/completions", dbody)
		if status != 200 {
			t.Fatalf("decode: %d %s", status, r.Raw)
		}
		return r
	}},
	{"concurrent", pushBothLegs},
}

// completionBody is a /v1/completions body of prompt with the sampling fields of sampling.
func completionBody(prompt []int, maxTokens int, sampling map[string]any) map[string]any {
	b := maps.Clone(sampling)
	b["model"], b["prompt"], b["max_tokens"] = "kvbridge/tiny", prompt, maxTokens
	if b["stream"] == true {
		b["stream_options"] = map[string]any{"include_usage": true}
	}
	return b
}

// completionTokens returns the usage's completion_tokens.
func completionTokens(r result) int {
	f, _ := r.Usage["completion_tokens"].(float64)
	return int(f)
}

// TestPushFirstTokenFromProducer: a push decoder starts from the token its producer sampled —
// it computes no prompt position (the whole prompt counts as external_cached_tokens) — and its
// answer is a single engine's, token for token: greedy and seeded sampling with top-p/top-k and
// penalties, streaming or not, one token or several, over SHM and TCP, serial and both legs at
// once, written whole or layer by layer. A request that needs logits (logprobs) computes its
// last prompt position as before, with the same answer. Every pool is full afterwards.
func TestPushFirstTokenFromProducer(t *testing.T) {
	cases := []struct {
		name      string
		sampling  map[string]any
		maxTokens int
		logits    bool // D needs the logits: it computes its last prompt position
	}{
		{"greedy", map[string]any{"temperature": 0}, 6, false},
		{"seeded", map[string]any{"temperature": 1, "seed": 11, "top_p": 0.9, "top_k": 40}, 8, false},
		{"penalties-streamed", map[string]any{"temperature": 1, "seed": 5, "frequency_penalty": 0.7, "presence_penalty": 0.3,
			"repetition_penalty": 1.2, "stream": true}, 8, false},
		{"one-token", map[string]any{"temperature": 1, "seed": 9}, 1, false},
		{"logprobs", map[string]any{"temperature": 1, "seed": 3, "logprobs": 2}, 4, true},
	}
	single := startNode(t, "single", nodeOptions{})
	for _, backend := range []string{"SHM", "TCP"} {
		for _, layerwise := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/layerwise=%v", backend, layerwise), func(t *testing.T) {
				p := startNode(t, "P", nodeOptions{kvConfig: fmt.Sprintf(`{"kv_connector":"NixlPushConnector","kv_role":"kv_producer","kv_connector_extra_config":{"push_layerwise":%v,"backends":["%s"]}}`, layerwise, backend)})
				d := startNode(t, "D", nodeOptions{kvConfig: pushCfg("kv_consumer", backend)})
				for i, flow := range pushFlows {
					for j, tc := range cases {
						n := 40 + 97*j + 13*i // partial last blocks of every size
						prompt := tokens(n, 60+10*i+j)
						_, want := post(t, single.srv.URL+"/v1/completions", completionBody(prompt, tc.maxTokens, tc.sampling))
						got := flow.run(t, p, d, completionBody(prompt, 1, tc.sampling), completionBody(prompt, tc.maxTokens, tc.sampling))
						if got.Text != want.Text || got.FinishReason != want.FinishReason || completionTokens(got) != completionTokens(want) {
							t.Errorf("%s, %s, %d tokens: D answered %q (%s, %d tokens), a single engine %q (%s, %d tokens)", flow.name, tc.name, n,
								got.Text, got.FinishReason, completionTokens(got), want.Text, want.FinishReason, completionTokens(want))
						}
						wantExt := n
						if tc.logits {
							wantExt = n - 1
						}
						if ext := external(got); ext != wantExt {
							t.Errorf("%s, %s, %d tokens: %d prompt tokens came from P, want %d", flow.name, tc.name, n, ext, wantExt)
						}
					}
				}
				p.waitPoolFull(t)
				d.waitPoolFull(t)
			})
		}
	}
}

// TestPushFirstTokenFingerprintMismatch: P sampled its token with other parameters than D's
// request (the proxy sent P temperature 0, D temperature 1 with a seed; or both seeded, with
// other seeds): D does not use P's token, computes its last prompt position, and answers as a
// single engine given D's request.
func TestPushFirstTokenFingerprintMismatch(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: pushCfg("kv_producer")})
	d := startNode(t, "D", nodeOptions{kvConfig: pushCfg("kv_consumer")})
	single := startNode(t, "single", nodeOptions{})
	for i, tc := range []struct {
		name   string
		ps, ds map[string]any
	}{
		{"greedy P, seeded D", map[string]any{"temperature": 0}, map[string]any{"temperature": 1, "seed": 5}},
		{"other seeds", map[string]any{"temperature": 1, "seed": 6}, map[string]any{"temperature": 1, "seed": 5}},
		{"other penalty", map[string]any{"temperature": 0, "presence_penalty": 1}, map[string]any{"temperature": 0}},
	} {
		for j, flow := range pushFlows {
			n := 70 + 9*i + j
			prompt := tokens(n, 90+i)
			_, want := post(t, single.srv.URL+"/v1/completions", completionBody(prompt, 6, tc.ds))
			got := flow.run(t, p, d, completionBody(prompt, 1, tc.ps), completionBody(prompt, 6, tc.ds))
			if got.Text != want.Text {
				t.Errorf("%s, %s: D answered %q, a single engine %q", tc.name, flow.name, got.Text, want.Text)
			}
			if ext := external(got); ext != n-1 {
				t.Errorf("%s, %s: %d prompt tokens came from P, want %d (D computes its last one)", tc.name, flow.name, ext, n-1)
			}
		}
	}
	p.waitPoolFull(t)
	d.waitPoolFull(t)
}

// TestPushFirstTokenAcrossTPSizes: between engines of different TP sizes too, D starts from P's
// first token (the whole prompt came from P) and answers as a single TP 1 engine, greedy and
// seeded.
func TestPushFirstTokenAcrossTPSizes(t *testing.T) {
	single := startNode(t, "single", nodeOptions{})
	for _, backend := range []string{"SHM", "TCP"} {
		for _, sizes := range [][2]int{{1, 2}, {2, 1}, {2, 4}} {
			t.Run(fmt.Sprintf("%s TP %d → %d", backend, sizes[0], sizes[1]), func(t *testing.T) {
				p := startNode(t, "P", nodeOptions{kvConfig: pushCfg("kv_producer", backend), tp: sizes[0]})
				d := startNode(t, "D", nodeOptions{kvConfig: pushCfg("kv_consumer", backend), tp: sizes[1]})
				for i, flow := range pushFlows {
					for j, sampling := range []map[string]any{{"temperature": 0}, {"temperature": 1, "seed": 21, "top_k": 30}} {
						n := 50 + 17*i + 5*j
						prompt := tokens(n, 130+i+j)
						_, want := post(t, single.srv.URL+"/v1/completions", completionBody(prompt, 5, sampling))
						got := flow.run(t, p, d, completionBody(prompt, 1, sampling), completionBody(prompt, 5, sampling))
						if got.Text != want.Text {
							t.Errorf("%s, %v: D answered %q, a single engine %q", flow.name, sampling, got.Text, want.Text)
						}
						if ext := external(got); ext != n {
							t.Errorf("%s, %v: %d prompt tokens came from P, want all %d", flow.name, sampling, ext, n)
						}
					}
				}
				p.waitPoolFull(t)
				d.waitPoolFull(t)
			})
		}
	}
}

// pushBothLegs sends both legs at once (kvbridge's proxies): D learns P's coordinates from P's
// GET /v1/kv_transfer report, both legs carry the same push_id. pbody and dbody are the legs'
// bodies without kv_transfer_params; it returns D's answer.
func pushBothLegs(t *testing.T, p, d *node, pbody, dbody map[string]any) result {
	t.Helper()
	info := p.conn.Info()
	id := newPushID(t)
	dbody["kv_transfer_params"] = map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": info.EngineID,
		"remote_host": info.RemoteHost, "remote_port": info.RemotePort, "tp_size": info.TPSize, "push_id": id}
	pkv := template()
	pkv["push_id"] = id
	pbody["kv_transfer_params"] = pkv
	var wg sync.WaitGroup
	var pstatus int
	var pr result
	wg.Go(func() { pstatus, pr = post(t, p.srv.URL+"/v1/completions", pbody) })
	status, r := post(t, d.srv.URL+"/v1/completions", dbody)
	wg.Wait()
	if pstatus != 200 || pr.KVParams["transfer_mode"] != "push" {
		t.Fatalf("prefill leg: %d %s", pstatus, pr.Raw)
	}
	if status != 200 {
		t.Fatalf("decode leg: %d %s", status, r.Raw)
	}
	return r
}
