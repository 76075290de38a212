package openai

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/model"
)

// realTokenizerModel writes a one-layer random-weight model directory around a real tokenizer:
// "qwen3" (Qwen3's tokenizer and chat template) or "llama3_1" (Llama 3.1's, whose
// post-processor adds <|begin_of_text|>), from the tokenizer package's test fixtures.
func realTokenizerModel(t *testing.T, tok string) string {
	t.Helper()
	return realTokenizerModelWith(t, tok, "")
}

// realTokenizerModelWith is realTokenizerModel with tokConfig, if not empty, as its
// tokenizer_config.json.
func realTokenizerModelWith(t *testing.T, tok, tokConfigOverride string) string {
	t.Helper()
	cfg := model.Qwen3_0_6B()
	cfg.NumLayers, cfg.HiddenSize, cfg.IntermediateSize, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = 1, 32, 64, 2, 1, 16
	tokConfig := `{"bos_token": null, "eos_token": "<|im_end|>", "chat_template": ` + jsonString(t, "../model/tokenizer/testdata/qwen3_chat_template.jinja") + `}`
	if tok == "llama3_1" {
		cfg.VocabSize = 128256
		tokConfig = `{"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}`
	}
	if tokConfigOverride != "" {
		tokConfig = tokConfigOverride
	}
	dir := t.TempDir()
	if _, err := model.WriteRandomCheckpoint(dir, model.RandomCheckpoint{Config: cfg}); err != nil {
		t.Fatal(err)
	}
	tj := fixture.Gunzip(t, filepath.Join("../model/tokenizer/testdata/hf", "base-"+tok+".json.gz"))
	for name, data := range map[string][]byte{"tokenizer.json": tj, "tokenizer_config.json": []byte(tokConfig)} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// jsonString returns the contents of a file as a JSON string literal.
func jsonString(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var sb strings.Builder
	sb.WriteByte('"')
	for _, r := range string(b) {
		switch r {
		case '"', '\\':
			sb.WriteByte('\\')
			sb.WriteRune(r)
		case '\n':
			sb.WriteString(`\n`)
		default:
			sb.WriteRune(r)
		}
	}
	sb.WriteByte('"')
	return sb.String()
}

// promptTokens posts body to path and returns usage.prompt_tokens and the response.
func promptTokens(t *testing.T, e *env, path string, body map[string]any) (int, map[string]any) {
	t.Helper()
	body["max_tokens"], body["temperature"], body["ignore_eos"] = 2, 0, true
	resp, b := e.post(t, path, body, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s %v: status %d: %s", path, body, resp.StatusCode, b)
	}
	m := decode(t, b)
	return usageOf(t, m).PromptTokens, m
}

// TestCompletionAddsBOS: a Llama 3.1 tokenizer's post-processor adds <|begin_of_text|>, so a
// completion prompt gets it (vLLM's add_special_tokens, default true) unless the request says
// add_special_tokens false. "Hello world" is [9906, 1917] in Llama 3's vocabulary.
func TestCompletionAddsBOS(t *testing.T) {
	e := newEnv(t, envModel(realTokenizerModel(t, "llama3_1")))
	if n, _ := promptTokens(t, e, "/v1/completions", map[string]any{"prompt": "Hello world"}); n != 3 {
		t.Errorf("prompt_tokens %d, want 3 (<|begin_of_text|> Hello ␣world)", n)
	}
	if n, _ := promptTokens(t, e, "/v1/completions", map[string]any{"prompt": "Hello world", "add_special_tokens": false}); n != 2 {
		t.Errorf("add_special_tokens false: prompt_tokens %d, want 2", n)
	}
	if n, _ := promptTokens(t, e, "/v1/completions", map[string]any{"prompt": []int{9906, 1917}}); n != 2 {
		t.Errorf("token-id prompt: prompt_tokens %d, want the 2 ids as given", n)
	}
}

// TestChatTemplateOptions: chat_template_kwargs reach Qwen3's template (enable_thinking false
// adds <think>\n\n</think>\n\n, 4 tokens: 151667, 271, 151668, 271), continue_final_message
// leaves the assistant's message open (no <|im_end|>\n: 2 tokens fewer than the closed turn
// without a generation prompt), and echo prefixes the response with that message.
func TestChatTemplateOptions(t *testing.T) {
	e := newEnv(t, envModel(realTokenizerModel(t, "qwen3")))
	user := []any{map[string]any{"role": "user", "content": "Hi"}}
	plain, _ := promptTokens(t, e, "/v1/chat/completions", map[string]any{"messages": user})
	noThink, _ := promptTokens(t, e, "/v1/chat/completions", map[string]any{"messages": user, "chat_template_kwargs": map[string]any{"enable_thinking": false}})
	if noThink != plain+4 {
		t.Errorf("enable_thinking false: %d prompt tokens, want %d + 4", noThink, plain)
	}
	partial := append(user, map[string]any{"role": "assistant", "content": "The answer is"})
	closed, _ := promptTokens(t, e, "/v1/chat/completions", map[string]any{"messages": partial, "add_generation_prompt": false})
	open, m := promptTokens(t, e, "/v1/chat/completions", map[string]any{"messages": partial, "continue_final_message": true, "echo": true})
	if open != closed-2 {
		t.Errorf("continue_final_message: %d prompt tokens, want %d − 2", open, closed)
	}
	content := m["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
	if !strings.HasPrefix(content, "The answer is") || len(content) == len("The answer is") {
		t.Errorf("echo: content %q does not continue the echoed message", content)
	}
	resp, b := e.post(t, "/v1/chat/completions", map[string]any{"messages": partial, "continue_final_message": true, "add_generation_prompt": true}, nil)
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), "continue_final_message") {
		t.Errorf("both flags: %d %s, want 400 naming continue_final_message", resp.StatusCode, b)
	}
}

// TestChatEchoStream: with stream and echo, the chunk after the role chunk carries the echoed
// final assistant message, and the generated deltas follow it.
func TestChatEchoStream(t *testing.T) {
	e := newEnv(t)
	resp, b := e.post(t, "/v1/chat/completions", map[string]any{
		"messages":               []any{map[string]any{"role": "user", "content": "Hi"}, map[string]any{"role": "assistant", "content": "Sure,"}},
		"continue_final_message": true, "echo": true, "stream": true, "max_tokens": 2, "ignore_eos": true,
	}, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	events := sseEvents(t, b)
	if len(events) < 4 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("events %q", events)
	}
	delta := decode(t, []byte(events[1]))["choices"].([]any)[0].(map[string]any)["delta"].(map[string]any)
	if delta["content"] != "Sure," {
		t.Fatalf("second chunk delta %v, want the echoed message", delta)
	}
}
