package openai

import (
	"encoding/json"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/internal/buildinfo"
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// TestTokenizeDetokenize: /tokenize answers vLLM's {count, max_model_len, tokens, token_strs}
// for a prompt and for chat messages (rendered as /v1/chat/completions renders them), and
// /detokenize turns the tokens back into the text.
func TestTokenizeDetokenize(t *testing.T) {
	e := newEnv(t)
	tok := e.model.Tokenizer()
	type tokenized struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []int32  `json:"tokens"`
		TokenStrs   []string `json:"token_strs"`
	}
	post := func(path string, body any) []byte {
		resp, b := e.post(t, path, body, nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", path, resp.StatusCode, b)
		}
		return b
	}
	var got tokenized
	text := "Tokenize me, please: naïve café"
	if err := json.Unmarshal(post("/tokenize", map[string]any{"model": testModelName, "prompt": text, "return_token_strs": true}), &got); err != nil {
		t.Fatal(err)
	}
	if want := tok.Encode(text); !slices.Equal(got.Tokens, want) || got.Count != len(want) || got.MaxModelLen != testMaxModelLen {
		t.Errorf("tokenize = %+v, want tokens %v", got, want)
	}
	if len(got.TokenStrs) != got.Count || got.TokenStrs[0] == "" {
		t.Errorf("token_strs = %q", got.TokenStrs)
	}
	var plain map[string]any
	_ = json.Unmarshal(post("/tokenize", map[string]any{"prompt": text}), &plain)
	if plain["token_strs"] != nil {
		t.Errorf("token_strs without return_token_strs: %v", plain["token_strs"])
	}
	// Chat: the same tokens as the chat route's prompt (usage.prompt_tokens).
	msgs := []map[string]any{{"role": "system", "content": "be brief"}, {"role": "user", "content": "count my tokens"}}
	var chat tokenized
	_ = json.Unmarshal(post("/tokenize", map[string]any{"messages": msgs}), &chat)
	rendered, _ := renderChat(e.model.ChatTemplate(), []tokenizer.Message{{Role: "system", Content: "be brief"}, {Role: "user", Content: "count my tokens"}}, tokenizer.RenderOptions{AddGenerationPrompt: true})
	if !slices.Equal(chat.Tokens, tok.Encode(rendered)) {
		t.Errorf("chat tokenize = %v", chat.Tokens)
	}
	var resp struct{ Usage usage }
	_ = json.Unmarshal(post("/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 1}), &resp)
	if resp.Usage.PromptTokens != chat.Count {
		t.Errorf("chat tokenize count %d, chat prompt_tokens %d", chat.Count, resp.Usage.PromptTokens)
	}
	var de struct{ Prompt string }
	_ = json.Unmarshal(post("/detokenize", map[string]any{"tokens": got.Tokens}), &de)
	if de.Prompt != text {
		t.Errorf("detokenize = %q, want %q", de.Prompt, text)
	}
	for _, bad := range []struct {
		path string
		body any
	}{{"/detokenize", map[string]any{"tokens": []int{1, 99999999}}}, {"/tokenize", map[string]any{}}, {"/tokenize", map[string]any{"model": "nope", "prompt": "x"}}} {
		if resp, b := e.post(t, bad.path, bad.body, nil); resp.StatusCode/100 != 4 {
			t.Errorf("%s %v: %d %s", bad.path, bad.body, resp.StatusCode, b)
		}
	}
}

// TestPingVersionModels: /ping answers GET and POST like /health; /version reports the build's
// version; /v1/models carries vLLM's fields.
func TestPingVersionModels(t *testing.T) {
	e := newEnv(t, func(c *Config) { c.Version = "" })
	for _, m := range []string{http.MethodGet, http.MethodPost} {
		if resp, b := e.do(t, m, "/ping", nil, nil); resp.StatusCode != http.StatusOK || len(b) != 0 {
			t.Errorf("%s /ping: %d %q", m, resp.StatusCode, b)
		}
	}
	_, b := e.do(t, http.MethodGet, "/version", nil, nil)
	if v := decode(t, b)["version"]; v != buildinfo.Version() || v == "" {
		t.Errorf("version %v, want %q", v, buildinfo.Version())
	}
	_, b = e.do(t, http.MethodGet, "/v1/models", nil, nil)
	card := decode(t, b)["data"].([]any)[0].(map[string]any)
	wantKeys(t, card, "id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission")
	if card["max_model_len"] != float64(testMaxModelLen) || card["root"] != e.model.Name() || card["parent"] != nil {
		t.Errorf("model card %v", card)
	}
}

// TestTokenizeSpecialTokens: /tokenize with add_special_tokens adds every special token the
// tokenizer adds (here BOS and, by add_eos_token, EOS), as the completions and chat routes do,
// so its count is their prompt_tokens.
func TestTokenizeSpecialTokens(t *testing.T) {
	e := newEnv(t, envModel(realTokenizerModelWith(t, "llama3_1",
		`{"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": true, "add_eos_token": true}`)))
	tok := e.model.Tokenizer()
	bos, _ := tok.BOSTokenID()
	eos, _ := tok.EOSTokenID()
	tokenize := func(body map[string]any) []int32 { return tokenizeIDs(t, e, body) }
	text := "Hello world"
	ids := tokenize(map[string]any{"prompt": text})
	if want := tok.EncodeSpecial(text); !slices.Equal(ids, want) || ids[0] != bos || ids[len(ids)-1] != eos {
		t.Errorf("tokenize %v, want %v (BOS … EOS)", ids, want)
	}
	if n, _ := promptTokens(t, e, "/v1/completions", map[string]any{"prompt": text}); n != len(ids) {
		t.Errorf("completion prompt_tokens %d, /tokenize count %d", n, len(ids))
	}
	if plain := tokenize(map[string]any{"prompt": text, "add_special_tokens": false}); !slices.Equal(plain, tok.Encode(text)) {
		t.Errorf("add_special_tokens false: %v", plain)
	}
	msgs := []any{map[string]any{"role": "user", "content": "count my tokens"}}
	chat := tokenize(map[string]any{"messages": msgs, "add_special_tokens": true})
	if chat[len(chat)-1] != eos {
		t.Errorf("chat tokenize with add_special_tokens: %v, want EOS last", chat)
	}
	if n, _ := promptTokens(t, e, "/v1/chat/completions", map[string]any{"messages": msgs, "add_special_tokens": true}); n != len(chat) {
		t.Errorf("chat prompt_tokens %d, /tokenize count %d", n, len(chat))
	}
}

// TestTokenizeChatTemplateFields: /tokenize with messages takes the chat request's template
// fields and gives exactly the prompt a chat completion with the same fields computes — its
// count is usage.prompt_tokens and its ids are the ones prompt_logprobs names — for Qwen3's
// template with enable_thinking false (the empty think block: 4 more ids) and with
// continue_final_message. A chat_template or tools in the request are refused as the chat
// completion refuses them.
func TestTokenizeChatTemplateFields(t *testing.T) {
	e := newEnv(t, envModel(realTokenizerModel(t, "qwen3")))
	tokenize := func(body map[string]any) []int32 { return tokenizeIDs(t, e, body) }
	// chatPrompt returns the number of prompt tokens of a chat completion and the ids after the
	// first (prompt_logprobs 0 names each prompt token but the first).
	chatPrompt := func(body map[string]any) (int, []int32) {
		t.Helper()
		body = maps.Clone(body)
		body["prompt_logprobs"] = 0
		n, m := promptTokens(t, e, "/v1/chat/completions", body)
		raw, err := json.Marshal(m["prompt_logprobs"]) // top level in a chat response, as in vLLM
		if err != nil {
			t.Fatal(err)
		}
		var positions []map[string]any
		if err := json.Unmarshal(raw, &positions); err != nil || len(positions) != n || positions[0] != nil {
			t.Fatalf("prompt_logprobs %s for %d prompt tokens", raw, n)
		}
		var ids []int32
		for i, pos := range positions[1:] {
			if len(pos) != 1 {
				t.Fatalf("prompt_logprobs[%d] = %v, want the prompt token alone", i+1, pos)
			}
			for k := range pos {
				id, err := strconv.Atoi(k)
				if err != nil {
					t.Fatal(err)
				}
				ids = append(ids, int32(id))
			}
		}
		return n, ids
	}
	user := []any{map[string]any{"role": "user", "content": "Hi"}}
	noThink := map[string]any{"enable_thinking": false}
	plain := tokenize(map[string]any{"messages": user})
	for name, body := range map[string]map[string]any{
		"enable_thinking false": {"messages": user, "chat_template_kwargs": noThink},
		"continue_final_message": {
			"messages":               append(slices.Clone(user), map[string]any{"role": "assistant", "content": "The answer is"}),
			"continue_final_message": true, "chat_template_kwargs": noThink,
		},
		"add_generation_prompt false": {"messages": user, "add_generation_prompt": false},
	} {
		ids := tokenize(body)
		n, chatIDs := chatPrompt(body)
		if len(ids) != n || !slices.Equal(ids[1:], chatIDs) {
			t.Errorf("%s: /tokenize gives %v, the chat completion's prompt is %d tokens ending %v", name, ids, n, chatIDs)
		}
		if name == "enable_thinking false" {
			if think := []int32{151667, 271, 151668, 271}; len(ids) != len(plain)+4 || !slices.Equal(ids[len(ids)-4:], think) {
				t.Errorf("enable_thinking false: %v, want %v then <think>\\n\\n</think>\\n\\n %v", ids, plain, think)
			}
		}
	}
	for field, body := range map[string]map[string]any{
		"chat_template": {"messages": user, "chat_template": "{{ messages[0].content }}"},
		"tools":         {"messages": user, "tools": []any{map[string]any{"type": "function", "function": map[string]any{"name": "f"}}}},
	} {
		for _, path := range []string{"/tokenize", "/v1/chat/completions"} {
			resp, b := e.post(t, path, body, nil)
			if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), `"param":"`+field+`"`) {
				t.Errorf("%s with %s: %d %s, want 400 naming %s", path, field, resp.StatusCode, b, field)
			}
		}
	}
}

// tokenizeIDs posts body to /tokenize and returns the ids, checking the status and the count.
func tokenizeIDs(t *testing.T, e *env, body map[string]any) []int32 {
	t.Helper()
	resp, b := e.post(t, "/tokenize", body, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/tokenize %v: %d %s", body, resp.StatusCode, b)
	}
	var got struct {
		Count  int     `json:"count"`
		Tokens []int32 `json:"tokens"`
	}
	if err := json.Unmarshal(b, &got); err != nil || got.Count != len(got.Tokens) {
		t.Fatalf("/tokenize %v: %s", body, b)
	}
	return got.Tokens
}
