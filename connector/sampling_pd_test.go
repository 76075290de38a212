package connector_test

import (
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"sort"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/proxy"
)

// samplingCases are requests using what P's one-token leg leaves to D: several choices, seeds,
// logprobs, echo, prompt logprobs, best_of, and every logit processor.
func samplingCases() []accuracyCase {
	long := strings.Repeat("the decode engine pulls the prompt's blocks from the prefill engine ", 4)
	chat := func(s string) []map[string]any { return []map[string]any{{"role": "user", "content": s}} }
	cases := []accuracyCase{
		{"/v1/completions", map[string]any{"prompt": long, "max_tokens": 8, "temperature": 0, "logprobs": 3, "echo": true,
			"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3}},
		{"/v1/completions", map[string]any{"prompt": long + "sampled", "max_tokens": 8, "temperature": 0.8, "min_p": 0.05, "top_k": 50,
			"seed": 7, "n": 3, "logprobs": 1, "logit_bias": map[string]any{"300": 2.5, "301": -100}}},
		{"/v1/completions", map[string]any{"prompt": long + "best", "max_tokens": 6, "temperature": 1, "seed": 9, "n": 1, "best_of": 3}},
		{"/v1/completions", map[string]any{"prompt": long + "scored", "max_tokens": 3, "temperature": 0.7, "seed": 1, "prompt_logprobs": 2,
			"allowed_token_ids": []int{300, 301, 302, 303, 400}}},
		{"/v1/completions", map[string]any{"prompt": long + "only the prompt", "max_tokens": 0, "echo": true, "logprobs": 1}},
		{"/v1/chat/completions", map[string]any{"messages": chat(long + "chat"), "max_tokens": 6, "temperature": 0.9, "seed": 5, "n": 2,
			"logprobs": true, "top_logprobs": 2, "bad_words": []string{"the", " engine"}}},
		{"/v1/chat/completions", map[string]any{"messages": chat(long + "prompt logprobs"), "max_tokens": 4, "temperature": 0, "prompt_logprobs": 1}},
	}
	for _, c := range cases {
		c.body["model"] = "kvbridge/tiny"
		c.body["ignore_eos"] = true
	}
	return cases
}

// streamed returns the case as a streaming request, or false for one vLLM does not stream.
func streamed(c accuracyCase) (accuracyCase, bool) {
	if _, ok := c.body["prompt_logprobs"]; ok {
		return c, false // prompt_logprobs are refused with stream=true, as in vLLM
	}
	if b, ok := c.body["best_of"]; ok && b != c.body["n"] {
		return c, false
	}
	body := map[string]any{"stream": true}
	for k, v := range c.body {
		body[k] = v
	}
	return accuracyCase{c.path, body}, true
}

// answer is what a client saw of the choices, without ids, times and usage: the choices and
// prompt_logprobs of a response, or per choice index the text, the logprobs of its tokens and
// the finish reason of a stream. A stream's logprobs are joined token by token across its
// events (completions' text_offset, token_logprobs, tokens, top_logprobs; chat's content): how
// many tokens one event carries depends on how fast its reader takes them (outputs not yet
// taken are merged), not on what was sampled.
func answer(t *testing.T, r result) string {
	t.Helper()
	if !strings.HasPrefix(r.Raw, "data: ") {
		var m map[string]any
		if err := json.Unmarshal([]byte(r.Raw), &m); err != nil {
			t.Fatalf("not JSON: %s", r.Raw)
		}
		b, _ := json.Marshal(map[string]any{"choices": m["choices"], "prompt_logprobs": m["prompt_logprobs"]})
		return string(b)
	}
	type choice struct {
		Text     string
		Logprobs map[string][]json.RawMessage
		Finish   any
	}
	byIndex := map[int]*choice{}
	for _, line := range strings.Split(r.Raw, "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk struct {
			Choices []struct {
				Index    int    `json:"index"`
				Text     string `json:"text"`
				Delta    struct{ Content string }
				Logprobs json.RawMessage `json:"logprobs"`
				Finish   any             `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatalf("bad event %s", data)
		}
		for _, c := range chunk.Choices {
			ch := byIndex[c.Index]
			if ch == nil {
				ch = &choice{}
				byIndex[c.Index] = ch
			}
			ch.Text += c.Text + c.Delta.Content
			if len(c.Logprobs) > 0 && string(c.Logprobs) != "null" {
				var lists map[string][]json.RawMessage
				if err := json.Unmarshal(c.Logprobs, &lists); err != nil {
					t.Fatalf("logprobs not lists of tokens: %s", c.Logprobs)
				}
				if ch.Logprobs == nil {
					ch.Logprobs = map[string][]json.RawMessage{}
				}
				for k, l := range lists {
					ch.Logprobs[k] = append(ch.Logprobs[k], l...)
				}
			}
			if c.Finish != nil {
				ch.Finish = c.Finish
			}
		}
	}
	idx := make([]int, 0, len(byIndex))
	for i := range byIndex {
		idx = append(idx, i)
	}
	sort.Ints(idx)
	var b strings.Builder
	for _, i := range idx {
		cj, _ := json.Marshal(byIndex[i])
		fmt.Fprintf(&b, "%d:%s\n", i, cj)
	}
	return b.String()
}

// TestSamplingThroughPD: requests with n, seeds, logprobs, echo, prompt logprobs, best_of,
// penalties, min_p, logit_bias, allowed_token_ids and bad_words get, through the one-way proxy
// and the multi-turn proxy (streamed or not), exactly the answer of a single engine:
// same texts, same logprobs to the last bit. P prefills one sequence; D pulls it and computes
// the rest, and recomputes the prompt itself for prompt logprobs (telling P to free). Every
// block comes back to both pools.
func TestSamplingThroughPD(t *testing.T) {
	var cases []accuracyCase
	for _, c := range samplingCases() {
		cases = append(cases, c)
		if s, ok := streamed(c); ok {
			cases = append(cases, s)
		}
	}
	single := startNode(t, "single", nodeOptions{prefix: true})
	want := runAll(t, single.srv.URL, cases)
	for _, w := range []string{`"token_logprobs"`, `"top_logprobs"`, `"prompt_logprobs":[null,{`, `"index":2`} {
		if !strings.Contains(strings.Join(func() []string {
			var s []string
			for _, r := range want {
				s = append(s, r.Raw)
			}
			return s
		}(), "\n"), w) {
			t.Fatalf("no single-engine answer contains %s: the cases do not exercise it", w)
		}
	}
	p := startNode(t, "P", nodeOptions{kvConfig: `{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`, prefix: true})
	d := startNode(t, "D", nodeOptions{kvConfig: `{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}`, prefix: true})
	oneWay := startProxy(t, p, d)
	got := runAll(t, oneWay.URL, cases)
	for i := range cases {
		if a, b := answer(t, got[i]), answer(t, want[i]); a != b {
			t.Errorf("case %d (%s %v) through the one-way proxy:\n got %s\nwant %s", i, cases[i].path, cases[i].body["stream"], a, b)
		}
	}
	if st := d.eng.Stats(); st.ExternalHits == 0 {
		t.Errorf("D pulled nothing from P: %+v", st)
	}

	// Through the multi-turn proxy (with a conversation id): streamed requests pass event for
	// event, the others get D's own JSON answer — every choice, logprobs, prompt logprobs.
	pi, _ := proxy.NewInstance(p.host, p.port)
	di, _ := proxy.NewInstance(d.host, d.port)
	mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: proxy.Config{Prefill: []proxy.Instance{pi}, Decode: []proxy.Instance{di}}})
	if err != nil {
		t.Fatal(err)
	}
	mtSrv := httptest.NewServer(mt)
	t.Cleanup(func() { mtSrv.Close(); mt.Close() })
	var viaMT []accuracyCase
	for i, c := range cases {
		body := map[string]any{"conversation_id": fmt.Sprintf("conv-%d", i)}
		for k, v := range c.body {
			body[k] = v
		}
		viaMT = append(viaMT, accuracyCase{c.path, body})
	}
	gotMT := runAll(t, mtSrv.URL, viaMT)
	for i := range viaMT {
		if a, b := answer(t, gotMT[i]), answer(t, want[i]); a != b {
			t.Errorf("case %d (%s %v) through the multi-turn proxy:\n got %s\nwant %s", i, viaMT[i].path, viaMT[i].body["stream"], a, b)
		}
		if strings.Contains(gotMT[i].Raw, "kv_transfer_params") {
			t.Errorf("case %d: D's params reached the client", i)
		}
	}
	p.waitPoolFull(t)
	d.waitPoolFull(t)
	single.waitPoolFull(t)
}
