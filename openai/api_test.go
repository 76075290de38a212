package openai

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

func TestCompletionNonStream(t *testing.T) {
	e := newEnv(t)
	resp, b := e.post(t, "/v1/completions", map[string]any{
		"model": testModelName, "prompt": "Hello world", "max_tokens": 5, "temperature": 0, "ignore_eos": true,
	}, map[string]string{"X-Request-Id": "abc-123"})
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	if got := resp.Header.Get("X-Request-Id"); got != "abc-123" {
		t.Errorf("X-Request-Id echoed as %q", got)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
	m := decode(t, b)
	wantKeys(t, m, "id", "object", "created", "model", "choices", "usage", "kv_transfer_params")
	if m["id"] != "cmpl-abc-123" || m["object"] != "text_completion" || m["model"] != testModelName {
		t.Errorf("id/object/model = %v/%v/%v", m["id"], m["object"], m["model"])
	}
	if _, ok := m["created"].(float64); !ok {
		t.Errorf("created = %v", m["created"])
	}
	if m["kv_transfer_params"] != nil {
		t.Errorf("kv_transfer_params = %v without a connector", m["kv_transfer_params"])
	}
	choices := m["choices"].([]any)
	if len(choices) != 1 {
		t.Fatalf("%d choices", len(choices))
	}
	c := choices[0].(map[string]any)
	wantKeys(t, c, "index", "text", "logprobs", "finish_reason")
	if c["index"] != 0.0 || c["finish_reason"] != "length" || c["logprobs"] != nil {
		t.Errorf("choice = %v", c)
	}
	if _, ok := c["text"].(string); !ok {
		t.Errorf("text = %v", c["text"])
	}
	u := usageOf(t, m)
	if u.PromptTokens <= 0 || u.CompletionTokens != 5 || u.TotalTokens != u.PromptTokens+5 {
		t.Errorf("usage = %+v", u)
	}
}

func TestChatNonStream(t *testing.T) {
	e := newEnv(t)
	resp, b := e.post(t, "/v1/chat/completions", map[string]any{
		"model": "alias",
		"messages": []any{
			map[string]any{"role": "system", "content": "Be brief."},
			map[string]any{"role": "user", "content": []any{
				map[string]any{"type": "text", "text": "Hi"}, map[string]any{"type": "text", "text": "there"},
			}},
		},
		"max_completion_tokens": 4, "temperature": 0, "ignore_eos": true, "seed": 0,
	}, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	m := decode(t, b)
	wantKeys(t, m, "id", "object", "created", "model", "choices", "usage", "kv_transfer_params")
	id, _ := m["id"].(string)
	if !strings.HasPrefix(id, "chatcmpl-") || m["object"] != "chat.completion" || m["model"] != testModelName {
		t.Errorf("id/object/model = %v/%v/%v", m["id"], m["object"], m["model"])
	}
	if rid := resp.Header.Get("X-Request-Id"); rid == "" || id != "chatcmpl-"+rid {
		t.Errorf("generated X-Request-Id %q does not match id %q", rid, id)
	}
	c := m["choices"].([]any)[0].(map[string]any)
	wantKeys(t, c, "index", "message", "logprobs", "finish_reason")
	msg := c["message"].(map[string]any)
	if msg["role"] != "assistant" || c["finish_reason"] != "length" {
		t.Errorf("choice = %v", c)
	}
	if _, ok := msg["content"].(string); !ok {
		t.Errorf("content = %v", msg["content"])
	}
	if u := usageOf(t, m); u.CompletionTokens != 4 || u.PromptTokens <= 0 {
		t.Errorf("usage = %+v", u)
	}
}

func TestChatStreamShapeAndGreedyDeterminism(t *testing.T) {
	e := newEnv(t)
	req := map[string]any{
		"model":      testModelName,
		"messages":   []any{map[string]any{"role": "user", "content": "Tell me a story."}},
		"max_tokens": 12, "temperature": 0, "ignore_eos": true,
	}
	_, b := e.post(t, "/v1/chat/completions", req, nil)
	want := decode(t, b)["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
	_, b2 := e.post(t, "/v1/chat/completions", req, nil)
	if again := decode(t, b2)["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string); again != want {
		t.Errorf("greedy output differs between runs: %q vs %q", want, again)
	}

	req["stream"] = true
	req["stream_options"] = map[string]any{"include_usage": true}
	resp, body := e.post(t, "/v1/chat/completions", req, map[string]string{"X-Request-Id": "s1"})
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Errorf("Content-Type %q", ct)
	}
	events := sseEvents(t, body)
	var (
		text      strings.Builder
		finish    []string
		usageSeen bool
	)
	for i, ev := range events[:len(events)-1] {
		m := decode(t, []byte(ev))
		if m["id"] != "chatcmpl-s1" || m["object"] != "chat.completion.chunk" || m["model"] != testModelName {
			t.Errorf("chunk %d header = %v/%v/%v", i, m["id"], m["object"], m["model"])
		}
		choices := m["choices"].([]any)
		if len(choices) == 0 {
			if i != len(events)-2 {
				t.Errorf("empty-choices chunk %d is not the last: %s", i, ev)
			}
			u := usageOf(t, m)
			if u.CompletionTokens != 12 || u.PromptTokens <= 0 || u.TotalTokens != u.PromptTokens+12 {
				t.Errorf("usage chunk = %+v", u)
			}
			usageSeen = true
			continue
		}
		if _, has := m["usage"]; has {
			t.Errorf("chunk %d carries usage without continuous_usage_stats: %s", i, ev)
		}
		c := choices[0].(map[string]any)
		delta := c["delta"].(map[string]any)
		if i == 0 && delta["role"] != "assistant" {
			t.Errorf("first chunk delta = %v, want the assistant role", delta)
		}
		if s, ok := delta["content"].(string); ok {
			text.WriteString(s)
		}
		if f, ok := c["finish_reason"].(string); ok {
			finish = append(finish, f)
		}
	}
	if !usageSeen {
		t.Error("no usage chunk with include_usage")
	}
	if len(finish) != 1 || finish[0] != "length" {
		t.Errorf("finish reasons in stream = %v, want one \"length\"", finish)
	}
	if text.String() != want {
		t.Errorf("streamed text %q differs from non-streamed %q", text.String(), want)
	}
}

func TestCompletionStreamShape(t *testing.T) {
	e := newEnv(t)
	req := map[string]any{"model": testModelName, "prompt": []int{5, 6, 7, 8}, "max_tokens": 6,
		"temperature": 0, "ignore_eos": true}
	_, b := e.post(t, "/v1/completions", req, nil)
	want := decode(t, b)["choices"].([]any)[0].(map[string]any)["text"].(string)

	req["stream"] = true
	req["stream_options"] = map[string]any{"include_usage": true, "continuous_usage_stats": true}
	resp, body := e.post(t, "/v1/completions", req, map[string]string{"X-Request-Id": "c1"})
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	events := sseEvents(t, body)
	var text strings.Builder
	last := decode(t, []byte(events[len(events)-2]))
	if len(last["choices"].([]any)) != 0 {
		t.Errorf("last chunk is not the usage chunk: %s", events[len(events)-2])
	}
	if u := usageOf(t, last); u.PromptTokens != 4 || u.CompletionTokens != 6 {
		t.Errorf("usage = %+v", u)
	}
	for i, ev := range events[:len(events)-2] {
		m := decode(t, []byte(ev))
		if m["id"] != "cmpl-c1" || m["object"] != "text_completion" {
			t.Errorf("chunk %d header = %v/%v", i, m["id"], m["object"])
		}
		usageOf(t, m) // continuous_usage_stats: every chunk has usage
		c := m["choices"].([]any)[0].(map[string]any)
		wantKeys(t, c, "index", "text", "logprobs", "finish_reason")
		text.WriteString(c["text"].(string))
		if f := c["finish_reason"]; (f != nil) != (i == len(events)-3) {
			t.Errorf("chunk %d finish_reason = %v", i, f)
		}
	}
	if text.String() != want {
		t.Errorf("streamed %q, non-streamed %q", text.String(), want)
	}
}

func TestPrefixCacheHitReportsCachedTokens(t *testing.T) {
	e := newEnv(t)
	prompt := make([]int, 3*testBlockSize+5)
	for i := range prompt {
		prompt[i] = 10 + i
	}
	req := map[string]any{"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": true}
	_, b1 := e.post(t, "/v1/completions", req, nil)
	u1 := usageOf(t, decode(t, b1))
	_, b2 := e.post(t, "/v1/completions", req, nil)
	u2 := usageOf(t, decode(t, b2))
	if u1.PromptTokens != len(prompt) || u2.PromptTokens != len(prompt) {
		t.Errorf("prompt_tokens = %d, %d; want %d", u1.PromptTokens, u2.PromptTokens, len(prompt))
	}
	if u2.PromptTokensDetails.CachedTokens <= 0 || u2.PromptTokensDetails.CachedTokens >= len(prompt) {
		t.Errorf("cached_tokens on the repeated prompt = %d, want in (0, %d)", u2.PromptTokensDetails.CachedTokens, len(prompt))
	}
	if decode(t, b1)["choices"].([]any)[0].(map[string]any)["text"] != decode(t, b2)["choices"].([]any)[0].(map[string]any)["text"] {
		t.Error("a prefix-cache hit changed the greedy output")
	}
}

func TestEchoAndStopAndUnknownFields(t *testing.T) {
	e := newEnv(t)
	resp, b := e.post(t, "/v1/completions", map[string]any{
		"prompt": "abc", "echo": true, "max_tokens": 3, "temperature": 0, "ignore_eos": true,
		"conversation_id": "conv-1", "some_future_field": map[string]any{"x": 1}, "user": "u", "n": 1,
		"stop": "zzzz-never", "top_k": -1, "top_p": 1, "seed": 7, "min_tokens": 1,
	}, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	text := decode(t, b)["choices"].([]any)[0].(map[string]any)["text"].(string)
	if !strings.HasPrefix(text, "abc") {
		t.Errorf("echo text %q does not start with the prompt", text)
	}
}

func TestInfoRoutes(t *testing.T) {
	e := newEnv(t)
	resp, b := e.do(t, http.MethodGet, "/v1/models", nil, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("models: %d %s", resp.StatusCode, b)
	}
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID, Object string
		} `json:"data"`
	}
	if err := json.Unmarshal(b, &list); err != nil {
		t.Fatal(err)
	}
	if list.Object != "list" || len(list.Data) != 2 || list.Data[0].ID != testModelName || list.Data[1].ID != "alias" || list.Data[0].Object != "model" {
		t.Errorf("models = %s", b)
	}
	resp, b = e.do(t, http.MethodGet, "/health", nil, nil)
	if resp.StatusCode != http.StatusOK || len(b) != 0 {
		t.Errorf("health: %d %q", resp.StatusCode, b)
	}
	resp, b = e.do(t, http.MethodGet, "/version", nil, nil)
	if resp.StatusCode != http.StatusOK || decode(t, b)["version"] != "test" {
		t.Errorf("version: %d %s", resp.StatusCode, b)
	}
}

// usage mirrors the usage object for assertions.
type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func usageOf(t testing.TB, m map[string]any) usage {
	t.Helper()
	raw, ok := m["usage"].(map[string]any)
	if !ok {
		t.Fatalf("no usage object in %v", m)
	}
	wantKeys(t, raw, "prompt_tokens", "completion_tokens", "total_tokens")
	b, _ := json.Marshal(raw)
	var u usage
	if err := json.Unmarshal(b, &u); err != nil {
		t.Fatal(err)
	}
	if d, ok := raw["prompt_tokens_details"]; ok {
		if _, ok := d.(map[string]any)["cached_tokens"].(float64); !ok {
			t.Errorf("prompt_tokens_details = %v", d)
		}
	}
	return u
}

func wantKeys(t testing.TB, m map[string]any, keys ...string) {
	t.Helper()
	for _, k := range keys {
		if _, ok := m[k]; !ok {
			t.Errorf("key %q missing in %v", k, m)
		}
	}
}

func TestConfigDefaults(t *testing.T) {
	e := newEnv(t)
	s := NewServer(Config{}, e.engine, e.model)
	if s.cfg.MaxModelLen != testMaxModelLen {
		t.Errorf("default MaxModelLen = %d, want the engine's %d", s.cfg.MaxModelLen, testMaxModelLen)
	}
	if len(s.cfg.ServedModelNames) != 1 || s.cfg.ServedModelNames[0] != e.model.Name() {
		t.Errorf("default served names = %v", s.cfg.ServedModelNames)
	}
	if s.Metrics() == nil || s.cfg.MaxBodyBytes != DefaultMaxBodyBytes {
		t.Errorf("defaults: metrics %v, body limit %d", s.Metrics(), s.cfg.MaxBodyBytes)
	}
}
