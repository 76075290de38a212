package openai

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
)

func TestErrors(t *testing.T) {
	e := newEnv(t)
	long := make([]int, testMaxModelLen+10)
	for i := range long {
		long[i] = 10 + i%50
	}
	chat := func(extra string) string {
		return `{"model":"tiny","messages":[{"role":"user","content":"hi"}]` + extra + `}`
	}
	tests := []struct {
		name, path, body string
		status           int
		typ, contains    string
	}{
		{"bad JSON", "/v1/completions", `{"prompt": "x",`, 400, "BadRequestError", "JSON"},
		{"trailing garbage", "/v1/chat/completions", chat("") + "x", 400, "BadRequestError", ""},
		{"not an object", "/v1/completions", `["prompt"]`, 400, "BadRequestError", "object"},
		{"empty body", "/v1/completions", ``, 400, "BadRequestError", "empty"},
		{"max_tokens string", "/v1/completions", `{"prompt":"x","max_tokens":"ten"}`, 400, "BadRequestError", ""},
		{"max_tokens fraction", "/v1/completions", `{"prompt":"x","max_tokens":1.5}`, 400, "BadRequestError", "integer"},
		{"temperature string", "/v1/chat/completions", chat(`,"temperature":"hot"`), 400, "BadRequestError", "temperature"},
		{"messages string", "/v1/chat/completions", `{"messages":"hi"}`, 400, "BadRequestError", "messages"},
		{"messages empty", "/v1/chat/completions", `{"messages":[]}`, 400, "BadRequestError", "messages"},
		{"message without role", "/v1/chat/completions", `{"messages":[{"content":"hi"}]}`, 400, "BadRequestError", "role"},
		{"image part", "/v1/chat/completions", `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`, 400, "BadRequestError", "image_url"},
		{"prompt number", "/v1/completions", `{"prompt":5}`, 400, "BadRequestError", "prompt"},
		{"prompt missing", "/v1/completions", `{"max_tokens":3}`, 400, "BadRequestError", "prompt"},
		{"prompt empty", "/v1/completions", `{"prompt":""}`, 400, "BadRequestError", "empty"},
		{"prompt batch", "/v1/completions", `{"prompt":["a","b"]}`, 400, "BadRequestError", "batch"},
		{"token out of vocab", "/v1/completions", `{"prompt":[1,2,99999999]}`, 400, "BadRequestError", "vocabulary"},
		{"stop wrong type", "/v1/completions", `{"prompt":"x","stop":5}`, 400, "BadRequestError", ""},
		{"kv_transfer_params not object", "/v1/completions", `{"prompt":"x","kv_transfer_params":[1]}`, 400, "BadRequestError", "kv_transfer_params"},
		{"unknown model", "/v1/chat/completions", `{"model":"nope","messages":[{"role":"user","content":"hi"}]}`, 404, "NotFoundError", "The model `nope` does not exist."},
		{"negative max_tokens", "/v1/completions", `{"prompt":"x","max_tokens":-1}`, 400, "BadRequestError", "max_tokens"},
		{"zero max_tokens", "/v1/chat/completions", chat(`,"max_tokens":0`), 400, "BadRequestError", "max_tokens"},
		{"negative max_completion_tokens", "/v1/chat/completions", chat(`,"max_completion_tokens":-5`), 400, "BadRequestError", "max_completion_tokens"},
		{"negative temperature", "/v1/completions", `{"prompt":"x","temperature":-0.5}`, 400, "BadRequestError", "temperature"},
		{"top_p zero", "/v1/completions", `{"prompt":"x","top_p":0}`, 400, "BadRequestError", "top_p"},
		{"min_tokens above max", "/v1/completions", `{"prompt":"x","max_tokens":2,"min_tokens":3}`, 400, "BadRequestError", "min_tokens"},
		{"too-long prompt", "/v1/completions", fmt.Sprintf(`{"prompt":%s}`, intsJSON(long)), 400, "BadRequestError",
			fmt.Sprintf("maximum context length is %d tokens. However, your request has %d input tokens", testMaxModelLen, len(long))},
		{"prompt plus max_tokens too long", "/v1/completions", fmt.Sprintf(`{"prompt":%s,"max_tokens":%d}`, intsJSON(long[:100]), testMaxModelLen),
			400, "BadRequestError", "too large"},
		{"n above limit", "/v1/chat/completions", chat(`,"n":1000`), 400, "BadRequestError", "n must be at most 256"},
		{"n=0", "/v1/completions", `{"prompt":"x","n":0}`, 400, "BadRequestError", "n must be at least 1"},
		{"best_of below n", "/v1/completions", `{"prompt":"x","n":2,"best_of":1}`, 400, "BadRequestError", "best_of must be greater than or equal to n"},
		{"best_of above n streaming", "/v1/completions", `{"prompt":"x","n":1,"best_of":2,"stream":true}`, 400, "BadRequestError", "best_of must equal n to stream"},
		{"logprobs negative", "/v1/completions", `{"prompt":"x","logprobs":-2}`, 400, "BadRequestError", "`logprobs` must be a positive value or -1."},
		{"logprobs above max", "/v1/completions", `{"prompt":"x","logprobs":21}`, 400, "BadRequestError", "Requested sample logprobs of 21, which is greater than max allowed: 20"},
		{"logprobs all", "/v1/completions", `{"prompt":"x","logprobs":-1}`, 400, "BadRequestError", "greater than max allowed: 20"},
		{"top_logprobs without logprobs", "/v1/chat/completions", chat(`,"top_logprobs":2`), 400, "BadRequestError", "when using `top_logprobs`, `logprobs` must be set to true."},
		{"top_logprobs above max", "/v1/chat/completions", chat(`,"logprobs":true,"top_logprobs":30`), 400, "BadRequestError", "max allowed: 20"},
		{"prompt_logprobs streaming", "/v1/completions", `{"prompt":"x","prompt_logprobs":1,"stream":true}`, 400, "BadRequestError", "`prompt_logprobs` are not available when `stream=True`."},
		{"prompt_logprobs above max", "/v1/chat/completions", chat(`,"prompt_logprobs":25`), 400, "BadRequestError", "Requested prompt logprobs of 25"},
		{"tools", "/v1/chat/completions", chat(`,"tools":[{"type":"function","function":{"name":"f"}}]`), 400, "BadRequestError", "tool"},
		{"presence_penalty", "/v1/completions", `{"prompt":"x","presence_penalty":2.5}`, 400, "BadRequestError", "presence_penalty must be in [-2, 2], got 2.5."},
		{"frequency_penalty", "/v1/completions", `{"prompt":"x","frequency_penalty":-3}`, 400, "BadRequestError", "frequency_penalty must be in [-2, 2]"},
		{"repetition_penalty", "/v1/completions", `{"prompt":"x","repetition_penalty":0}`, 400, "BadRequestError", "repetition_penalty must be greater than zero"},
		{"min_p", "/v1/completions", `{"prompt":"x","min_p":1.5}`, 400, "BadRequestError", "min_p must be in [0, 1], got 1.5."},
		{"logit_bias key", "/v1/completions", `{"prompt":"x","logit_bias":{"a":1}}`, 400, "BadRequestError", "not an integer"},
		{"logit_bias out of vocab", "/v1/completions", `{"prompt":"x","logit_bias":{"99999999":1,"5":2}}`, 400, "BadRequestError", "token_id(s) [99999999] in logit_bias contain out-of-vocab token ids"},
		{"allowed_token_ids empty", "/v1/completions", `{"prompt":"x","allowed_token_ids":[]}`, 400, "BadRequestError", "allowed_token_ids is not None and empty!"},
		{"stream_options without stream", "/v1/completions", `{"prompt":"x","stream_options":{"include_usage":true}}`, 400, "BadRequestError", "Stream options can only be defined when `stream=True`."},
		{"allowed_token_ids out of vocab", "/v1/completions", `{"prompt":"x","allowed_token_ids":[3,99999999]}`, 400, "BadRequestError", "allowed_token_ids contains out-of-vocab token id!"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, b := e.post(t, tt.path, tt.body, nil)
			if resp.StatusCode != tt.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tt.status, b)
			}
			if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type %q", ct)
			}
			eo := errorOf(t, b, tt.status)
			if eo["type"] != tt.typ {
				t.Errorf("type %v, want %s", eo["type"], tt.typ)
			}
			if msg := eo["message"].(string); !strings.Contains(msg, tt.contains) {
				t.Errorf("message %q does not contain %q", msg, tt.contains)
			}
		})
	}
}

func TestRoutingErrors(t *testing.T) {
	e := newEnv(t)
	resp, b := e.do(t, http.MethodGet, "/v1/completions", nil, nil)
	if resp.StatusCode != http.StatusMethodNotAllowed || !strings.Contains(resp.Header.Get("Allow"), "POST") {
		t.Errorf("GET /v1/completions: %d Allow=%q", resp.StatusCode, resp.Header.Get("Allow"))
	}
	errorOf(t, b, http.StatusMethodNotAllowed)
	resp, b = e.do(t, http.MethodPost, "/v1/models", []byte(`{}`), nil)
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /v1/models: %d", resp.StatusCode)
	}
	errorOf(t, b, http.StatusMethodNotAllowed)
	resp, b = e.do(t, http.MethodGet, "/v1/nothing", nil, nil)
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET /v1/nothing: %d", resp.StatusCode)
	}
	errorOf(t, b, http.StatusNotFound)
}

func TestBodyLimit(t *testing.T) {
	e := newEnv(t, func(c *Config) { c.MaxBodyBytes = 1024 })
	body := `{"prompt":"` + strings.Repeat("a", 2048) + `"}`
	resp, b := e.post(t, "/v1/completions", body, nil)
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	errorOf(t, b, http.StatusRequestEntityTooLarge)
}

func TestAPIKey(t *testing.T) {
	e := newEnv(t, func(c *Config) { c.APIKey = "sekret" })
	body := `{"prompt":"x","max_tokens":1}`
	for _, hdr := range []map[string]string{nil, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}} {
		resp, b := e.post(t, "/v1/completions", body, hdr)
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("auth %v: status %d", hdr, resp.StatusCode)
			continue
		}
		errorOf(t, b, http.StatusUnauthorized)
	}
	if resp, b := e.post(t, "/v1/completions", body, map[string]string{"Authorization": "Bearer sekret"}); resp.StatusCode != http.StatusOK {
		t.Errorf("with the key: %d %s", resp.StatusCode, b)
	}
	if resp, _ := e.do(t, http.MethodGet, "/health", nil, nil); resp.StatusCode != http.StatusOK {
		t.Errorf("/health needs no key, got %d", resp.StatusCode)
	}
	if resp, _ := e.do(t, http.MethodGet, "/v1/models", nil, nil); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("/v1/models without the key: %d", resp.StatusCode)
	}
}

func intsJSON(a []int) string {
	var b strings.Builder
	b.WriteByte('[')
	for i, v := range a {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprint(&b, v)
	}
	b.WriteByte(']')
	return b.String()
}

// TestEmptyStreamOptionsWithoutStream: vLLM refuses stream_options without stream only when
// the object sets something ({} is falsy in Python); so does kvbridge.
func TestEmptyStreamOptionsWithoutStream(t *testing.T) {
	e := newEnv(t)
	for body, want := range map[string]int{
		`{"prompt":"x","max_tokens":2,"stream_options":{}}`:                                              http.StatusOK,
		`{"prompt":"x","max_tokens":2,"stream_options":null}`:                                            http.StatusOK,
		`{"prompt":"x","max_tokens":2,"stream":false,"stream_options":{"continuous_usage_stats":false}}`: http.StatusBadRequest,
	} {
		if resp, b := e.post(t, "/v1/completions", body, nil); resp.StatusCode != want {
			t.Errorf("%s: status %d, want %d: %s", body, resp.StatusCode, want, b)
		}
	}
}

// TestBadWordsAndLogitBiasBounds: bad_words is bounded in words and in tokens (400 naming
// bad_words beyond either bound), and a logit_bias error lists at most maxListedIDs of its
// out-of-vocabulary ids.
func TestBadWordsAndLogitBiasBounds(t *testing.T) {
	e := newEnv(t)
	tok := e.model.Tokenizer()
	refused := func(name string, body map[string]any, param, contains string) {
		t.Helper()
		resp, b := e.post(t, "/v1/completions", body, nil)
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("%s: status %d, want 400: %.300s", name, resp.StatusCode, b)
		}
		eo := errorOf(t, b, http.StatusBadRequest)
		if eo["param"] != param || !strings.Contains(eo["message"].(string), contains) {
			t.Errorf("%s: error %v, want param %s and %q", name, eo, param, contains)
		}
		if len(b) > 2000 {
			t.Errorf("%s: a %d-byte error", name, len(b))
		}
	}
	words := func(n int, w string) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = w
		}
		return out
	}
	refused("too many words", map[string]any{"prompt": "x", "max_tokens": 1, "bad_words": words(maxBadWords+1, "a")},
		"bad_words", fmt.Sprint(maxBadWords))
	long := strings.Repeat("zebra crossing ", 40)
	per := len(tok.Encode(long))
	if n := maxBadWordTokens/per + 1; n > maxBadWords {
		t.Fatalf("%d tokens a word: the token bound cannot be reached within %d words", per, maxBadWords)
	}
	refused("too many tokens", map[string]any{"prompt": "x", "max_tokens": 1, "bad_words": words(maxBadWordTokens/per+1, long)},
		"bad_words", fmt.Sprint(maxBadWordTokens))
	if resp, b := e.post(t, "/v1/completions", map[string]any{"prompt": "x", "max_tokens": 1, "bad_words": words(maxBadWords, "a")}, nil); resp.StatusCode != http.StatusOK {
		t.Errorf("%d one-token words: %d %.300s", maxBadWords, resp.StatusCode, b)
	}

	bias := map[string]any{}
	const badIDs = 40
	for i := range badIDs {
		bias[fmt.Sprint(100000000+i)] = 1
	}
	refused("logit_bias", map[string]any{"prompt": "x", "logit_bias": bias}, "logit_bias",
		fmt.Sprintf("(and %d more)", badIDs-maxListedIDs))
	resp, b := e.post(t, "/v1/completions", map[string]any{"prompt": "x", "logit_bias": bias}, nil)
	if msg := errorOf(t, b, resp.StatusCode)["message"].(string); strings.Contains(msg, fmt.Sprint(100000000+maxListedIDs)) {
		t.Errorf("logit_bias error lists more than %d ids: %s", maxListedIDs, msg)
	}
}
