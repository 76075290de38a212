package openai

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/internal/fixture"
)

// TestRequestListBounds: every list a request may send has a bound (limits.go); beyond it the
// request gets a 400 naming the field and the bound, and at the bound it is served.
func TestRequestListBounds(t *testing.T) {
	e := newEnv(t)
	tok := e.model.Tokenizer()
	vocab := tok.VocabSize()
	repeat := func(n int, s string) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = s
		}
		return out
	}
	ids := func(n int) []int {
		out := make([]int, n)
		for i := range out {
			out[i] = i % vocab
		}
		return out
	}
	bias := map[string]any{"00": 1} // one more entry than the vocabulary: "0" and "00" both
	for i := range vocab {
		bias[fmt.Sprint(i)] = 1
	}
	// A text of more than max_model_len tokens, yet short enough to be encoded.
	long := strings.Repeat("the quick brown fox ", testMaxModelLen)
	if n := len(tok.Encode(long)); n <= testMaxModelLen || len(long) > e.server.promptBytes {
		t.Fatalf("test text: %d tokens, %d bytes (encoded up to %d)", n, len(long), e.server.promptBytes)
	}
	huge := strings.Repeat("x", e.server.promptBytes+1)
	for _, c := range []struct {
		name, path string
		body       map[string]any
		param      string
		bound      int
	}{
		{"stop count", "/v1/completions", map[string]any{"prompt": "x", "stop": repeat(maxStopStrings+1, "s")}, "stop", maxStopStrings},
		{"stop length", "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": "x"}},
			"stop": []string{strings.Repeat("s", maxStopStringBytes+1)}}, "stop", maxStopStringBytes},
		{"stop bytes", "/v1/completions", map[string]any{"prompt": "x", "stop": repeat(maxStopBytes/maxStopStringBytes+1, strings.Repeat("s", maxStopStringBytes))}, "stop", maxStopBytes},
		{"stop_token_ids", "/v1/completions", map[string]any{"prompt": "x", "stop_token_ids": ids(vocab + 1)}, "stop_token_ids", vocab},
		{"logit_bias", "/v1/completions", map[string]any{"prompt": "x", "logit_bias": bias}, "logit_bias", vocab},
		{"allowed_token_ids", "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": "x"}},
			"allowed_token_ids": ids(vocab + 1)}, "allowed_token_ids", vocab},
		{"tokenize tokens", "/tokenize", map[string]any{"prompt": long}, "prompt", testMaxModelLen},
		{"tokenize bytes", "/tokenize", map[string]any{"prompt": huge}, "prompt", testMaxModelLen},
		{"tokenize messages", "/tokenize", map[string]any{"messages": []map[string]any{{"role": "user", "content": long}}}, "messages", testMaxModelLen},
		{"completion prompt bytes", "/v1/completions", map[string]any{"prompt": huge}, "prompt", testMaxModelLen},
		{"chat prompt bytes", "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": huge}}}, "messages", testMaxModelLen},
		{"detokenize", "/detokenize", map[string]any{"tokens": ids(testMaxModelLen + 1)}, "tokens", testMaxModelLen},
	} {
		resp, b := e.post(t, c.path, c.body, nil)
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("%s: status %d, want 400: %.300s", c.name, resp.StatusCode, b)
			continue
		}
		eo := errorOf(t, b, http.StatusBadRequest)
		if eo["param"] != c.param || !strings.Contains(eo["message"].(string), fmt.Sprint(c.bound)) {
			t.Errorf("%s: error %v, want param %s and the bound %d", c.name, eo, c.param, c.bound)
		}
	}

	// At the bounds, requests are served.
	for _, c := range []struct {
		name, path string
		body       map[string]any
	}{
		{"stop at the bounds", "/v1/completions", map[string]any{"prompt": "x", "max_tokens": 2,
			"stop": append(repeat(maxStopBytes/maxStopStringBytes, strings.Repeat("s", maxStopStringBytes)), repeat(maxStopStrings-maxStopBytes/maxStopStringBytes, "")...)}},
		{"stop_token_ids at the bound", "/v1/completions", map[string]any{"prompt": "x", "max_tokens": 2, "stop_token_ids": ids(vocab)}},
		{"detokenize at the bound", "/detokenize", map[string]any{"tokens": ids(testMaxModelLen)}},
	} {
		if resp, b := e.post(t, c.path, c.body, nil); resp.StatusCode != http.StatusOK {
			t.Errorf("%s: status %d: %.300s", c.name, resp.StatusCode, b)
		}
	}
}

// TestSequencesShareStops: the sequences of one request (n, best_of) carry one compiled stop
// matcher and stop-id set, not one each.
func TestSequencesShareStops(t *testing.T) {
	e := newEnv(t)
	p := genParams{n: 4, bestOf: 6, maxTokens: 4, stop: []string{"a", "bc"}, stopTokenIDs: []int32{3, 5}}
	reqs := e.server.engineRequests("cmpl-x", []int32{1, 2, 3}, p)
	if len(reqs) != 6 || reqs[0].Stops == nil {
		t.Fatalf("%d requests, first Stops %v", len(reqs), reqs[0].Stops)
	}
	for i, r := range reqs {
		if r.Stops != reqs[0].Stops {
			t.Errorf("sequence %d has its own Stops", i)
		}
	}
}

// unknownFieldCounts returns kvbridge:request_unknown_fields_total by field label.
func (e *env) unknownFieldCounts(t *testing.T) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, x := range fixture.Scrape(t, e.http.Client(), e.http.URL)["kvbridge:request_unknown_fields_total"] {
		_, rest, _ := strings.Cut(x.Labels, `field="`)
		field, _, _ := strings.Cut(rest, `"`)
		out[field] = x.Value
	}
	return out
}

// TestUnknownFieldsWarned: a field the API does not know (a max_token typo) is logged as vLLM
// logs it, once per name per interval however many requests carry it, and counted per name; a
// client sending many distinct names gets only a bounded set of labels.
func TestUnknownFieldsWarned(t *testing.T) {
	var logs fixture.LogBuffer
	e := newEnv(t, func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(&logs, nil)) })
	for range 2 {
		resp, b := e.post(t, "/v1/completions", `{"prompt":"x","max_token":3,"max_tokens":1,"nested":{"max_tokens":{"a":[1,"}"]}}}`, nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
	}
	const warning = "The following fields were present in the request but ignored"
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	var warned []string
	for _, l := range lines {
		if strings.Contains(l, warning) {
			warned = append(warned, l)
		}
	}
	if len(warned) != 1 || !strings.Contains(warned[0], "'max_token'") || !strings.Contains(warned[0], "'nested'") || strings.Contains(warned[0], "'max_tokens'") || strings.Contains(warned[0], "'prompt'") {
		t.Fatalf("want one warning naming max_token and nested, got %q", warned)
	}
	if got := e.unknownFieldCounts(t); got["max_token"] != 2 || got["nested"] != 2 || len(got) != 2 {
		t.Fatalf("counts %v, want max_token and nested twice", got)
	}

	// /tokenize and chat notice them too.
	if resp, b := e.post(t, "/tokenize", `{"prompt":"x","max_token":1,"tokenize_typo":1}`, nil); resp.StatusCode != http.StatusOK {
		t.Fatalf("tokenize: %d %s", resp.StatusCode, b)
	}
	if resp, b := e.post(t, "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_tokens":1,"chat_typo":1}`, nil); resp.StatusCode != http.StatusOK {
		t.Fatalf("chat: %d %s", resp.StatusCode, b)
	}
	if l := logs.String(); strings.Count(l, "'max_token'") != 1 || !strings.Contains(l, "'tokenize_typo'") || !strings.Contains(l, "'chat_typo'") {
		t.Fatalf("logs:\n%s", l)
	}

	// Many distinct names: a bounded label set, the rest counted as "other".
	var body strings.Builder
	body.WriteString(`{"prompt":"x","max_tokens":1`)
	for i := range 3 * maxFieldLabels {
		fmt.Fprintf(&body, `,"f%d":0`, i)
	}
	body.WriteString("}")
	if resp, b := e.post(t, "/v1/completions", body.String(), nil); resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	got := e.unknownFieldCounts(t)
	if len(got) != maxFieldLabels+1 || got["other"] == 0 {
		t.Fatalf("%d labels (want %d and other): %v", len(got), maxFieldLabels+1, got)
	}
}

// FuzzTopLevelKeys: on any valid JSON object, the key scanner finds exactly the keys
// encoding/json finds, in order of appearance (duplicates included).
func FuzzTopLevelKeys(f *testing.F) {
	f.Add(`{"a":1,"b":{"c":[1,"}\"",{"d":null}]},"e\u00e9":"x\\","f" : true }`)
	f.Add(`{}`)
	f.Add(" {\n\t\"a\\\"b\" :[[[]],{}] ,\"\":-1.5e3,\"c\":\"\\\\\"}\r\n")
	f.Add(`{"a":{"a":{"a":"]}"}},"a":[]}`)
	f.Fuzz(func(t *testing.T, body string) {
		var m map[string]json.RawMessage
		if json.Unmarshal([]byte(body), &m) != nil || m == nil {
			return
		}
		var got []string
		topLevelKeys([]byte(body), func(raw []byte) { got = append(got, jsonKey(raw)) })
		dec := json.NewDecoder(strings.NewReader(body))
		var want []string
		dec.Token() // {
		for dec.More() {
			k, _ := dec.Token()
			want = append(want, k.(string))
			var v json.RawMessage
			if err := dec.Decode(&v); err != nil {
				t.Fatal(err)
			}
		}
		if !slices.Equal(got, want) {
			t.Fatalf("keys %q, want %q", got, want)
		}
	})
}
