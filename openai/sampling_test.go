package openai

import (
	"encoding/json"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// refLogprobs runs tokens through the model on a private pool and returns, for every position
// i, the test's own float64 log-softmax of the logits that predict token i+1.
func refLogprobs(t *testing.T, m *model.Model, tokens []int32) [][]float64 {
	t.Helper()
	geo := engine.KVGeometry(m, testBlockSize) // the model's KV cache dtype: bfloat16 for a bf16 checkpoint
	nb := (len(tokens) + testBlockSize - 1) / testBlockSize
	pool, err := kvcache.NewPool(kvcache.AlignedMemory(geo.BlockBytes()*nb), kvcache.PoolConfig{Geometry: geo, NumBlocks: nb})
	if err != nil {
		t.Fatal(err)
	}
	blocks := make([]int32, nb)
	for i := range blocks {
		blocks[i] = int32(i)
	}
	out := make([][]float64, len(tokens))
	seq := model.Seq{Tokens: tokens, Blocks: blocks, RowLogits: func(i int, lg []float32) {
		out[i] = fixture.LogSoftmax(lg)
	}}
	if err := m.Forward(t.Context(), pool, testBlockSize, []model.Seq{seq}); err != nil {
		t.Fatal(err)
	}
	return out
}

// topIDs returns the ids of the k largest entries of row, ties by id.
func topIDs(row []float64, k int) []int32 {
	ids := make([]int32, len(row))
	for i := range ids {
		ids[i] = int32(i)
	}
	slices.SortStableFunc(ids, func(a, b int32) int {
		switch {
		case row[a] > row[b]:
			return -1
		case row[a] < row[b]:
			return 1
		}
		return 0
	})
	return ids[:k]
}

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) }

// completionLP is the completions logprobs object as a client reads it.
type completionLP struct {
	TextOffset    []int                `json:"text_offset"`
	TokenLogprobs []*float64           `json:"token_logprobs"`
	Tokens        []string             `json:"tokens"`
	TopLogprobs   []map[string]float64 `json:"top_logprobs"`
}

// TestCompletionLogprobsEcho: a greedy completion with echo and logprobs reports the prompt
// and output tokens with the model's logprobs — equal to the test's own log-softmax of the
// logits of the same tokens — the top alternatives, and text offsets in characters.
func TestCompletionLogprobsEcho(t *testing.T) {
	e := newEnv(t)
	tok := e.model.Tokenizer()
	prompt := []int32{40, 41, 300, 301, 302, 77, 1000, 5, 6, 7}
	const k = 3
	resp, b := e.post(t, "/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 6, "temperature": 0,
		"ignore_eos": true, "echo": true, "logprobs": k}, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	var body struct {
		Choices []struct {
			Text           string          `json:"text"`
			Logprobs       completionLP    `json:"logprobs"`
			PromptLogprobs json.RawMessage `json:"prompt_logprobs"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(b, &body); err != nil {
		t.Fatal(err)
	}
	c := body.Choices[0]
	lp := c.Logprobs
	if len(lp.Tokens) != len(prompt)+6 {
		t.Fatalf("%d logprob tokens, want %d prompt + 6 output", len(lp.Tokens), len(prompt))
	}
	// The output tokens: the greedy choice at each position is the reference's argmax among
	// the tokens the model may generate (the built-in models suppress unprintable ones).
	suppressed := e.model.Generation().SuppressTokens
	all := slices.Clone(prompt)
	ref := refLogprobs(t, e.model, prompt)
	for i := len(prompt); i < len(lp.Tokens); i++ {
		row := slices.Clone(ref[i-1])
		for _, id := range suppressed {
			row[id] = math.Inf(-1)
		}
		all = append(all, topIDs(row, 1)[0])
		ref = refLogprobs(t, e.model, all)
	}
	offset := 0
	for i, id := range all {
		if want := tok.Decode([]int32{id}); lp.Tokens[i] != want {
			t.Errorf("token %d = %q, want %q", i, lp.Tokens[i], want)
		}
		if lp.TextOffset[i] != offset {
			t.Errorf("text_offset[%d] = %d, want %d", i, lp.TextOffset[i], offset)
		}
		offset += utf8.RuneCountInString(lp.Tokens[i])
		if i == 0 {
			if lp.TokenLogprobs[0] != nil || lp.TopLogprobs[0] != nil {
				t.Errorf("first prompt token has logprobs %v %v, want null", lp.TokenLogprobs[0], lp.TopLogprobs[0])
			}
			continue
		}
		want := ref[i-1][id]
		if lp.TokenLogprobs[i] == nil || !near(*lp.TokenLogprobs[i], want) {
			t.Errorf("token_logprobs[%d] = %v, want %v", i, lp.TokenLogprobs[i], want)
		}
		// top_logprobs: the token itself and the k best, keyed by their text.
		wantTop := map[string]float64{tok.Decode([]int32{id}): want}
		for _, alt := range topIDs(ref[i-1], k) {
			wantTop[tok.Decode([]int32{alt})] = ref[i-1][alt]
		}
		if len(lp.TopLogprobs[i]) != len(wantTop) {
			t.Errorf("top_logprobs[%d] = %v, want %v", i, lp.TopLogprobs[i], wantTop)
		}
		for s, v := range wantTop {
			if got, ok := lp.TopLogprobs[i][s]; !ok || !near(got, v) {
				t.Errorf("top_logprobs[%d][%q] = %v, want %v", i, s, got, v)
			}
		}
	}
	if !strings.HasPrefix(c.Text, tok.Decode(prompt)) {
		t.Errorf("echoed text %q does not start with the prompt", c.Text)
	}
	// As in vLLM, echo with logprobs asks for the prompt's logprobs, and the choice has them.
	var plp []map[string]struct{ Logprob float64 }
	if err := json.Unmarshal(c.PromptLogprobs, &plp); err != nil || len(plp) != len(prompt) || plp[0] != nil {
		t.Errorf("prompt_logprobs = %s, want null then %d positions", c.PromptLogprobs, len(prompt)-1)
	} else if got := plp[2][strconv.Itoa(int(prompt[2]))].Logprob; !near(got, ref[1][prompt[2]]) {
		t.Errorf("prompt_logprobs[2] = %v, want %v", got, ref[1][prompt[2]])
	}

	// echo with max_tokens 0: the prompt alone, with its logprobs.
	_, b = e.post(t, "/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 0}, nil)
	body.Choices = nil
	if err := json.Unmarshal(b, &body); err != nil {
		t.Fatal(err)
	}
	c = body.Choices[0]
	if c.Text != tok.Decode(prompt) || len(c.Logprobs.Tokens) != len(prompt) || len(c.Logprobs.TopLogprobs[1]) != 1 {
		t.Errorf("echo with max_tokens 0: text %q, %d tokens, top %v", c.Text, len(c.Logprobs.Tokens), c.Logprobs.TopLogprobs)
	}
	if got, want := *c.Logprobs.TokenLogprobs[4], ref[3][prompt[4]]; !near(got, want) {
		t.Errorf("prompt token 4 logprob %v, want %v", got, want)
	}
}

// TestChatLogprobsAndPromptLogprobs: chat logprobs.content carries token, logprob, bytes and
// top_logprobs; prompt_logprobs (vLLM's extra) scores every prompt token after the first. The
// logprobs are the model's even when a logit_bias forces the sampled token.
func TestChatLogprobsAndPromptLogprobs(t *testing.T) {
	e := newEnv(t)
	tok := e.model.Tokenizer()
	forced := int32(400)
	req := map[string]any{"messages": []map[string]any{{"role": "user", "content": "logprobs please"}}, "max_tokens": 4,
		"temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 2, "prompt_logprobs": 2,
		"logit_bias": map[string]any{strconv.Itoa(int(forced)): 100}}
	resp, b := e.post(t, "/v1/chat/completions", req, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	var body struct {
		Choices []struct {
			Logprobs struct {
				Content []struct {
					Token       string  `json:"token"`
					Logprob     float64 `json:"logprob"`
					Bytes       []int   `json:"bytes"`
					TopLogprobs []struct {
						Token   string  `json:"token"`
						Logprob float64 `json:"logprob"`
						Bytes   []int   `json:"bytes"`
					} `json:"top_logprobs"`
				} `json:"content"`
			} `json:"logprobs"`
		} `json:"choices"`
		PromptLogprobs []map[string]struct {
			Logprob      float64 `json:"logprob"`
			Rank         int     `json:"rank"`
			DecodedToken string  `json:"decoded_token"`
		} `json:"prompt_logprobs"`
		Usage usage `json:"usage"`
	}
	if err := json.Unmarshal(b, &body); err != nil {
		t.Fatal(err)
	}
	content := body.Choices[0].Logprobs.Content
	if len(content) != 4 {
		t.Fatalf("%d logprobs entries, want 4", len(content))
	}
	n := body.Usage.PromptTokens
	if len(body.PromptLogprobs) != n || body.PromptLogprobs[0] != nil {
		t.Fatalf("prompt_logprobs has %d entries (first %v), want %d starting with null", len(body.PromptLogprobs), body.PromptLogprobs[0], n)
	}
	for i, pos := range body.PromptLogprobs[1:] {
		if len(pos) < 2 || len(pos) > 3 {
			t.Errorf("position %d has %d entries, want the token and the 2 best", i+1, len(pos))
		}
	}
	all := append(tok.Encode(mustRender(t, e, "logprobs please")), forced, forced, forced, forced)
	if len(all) != n+4 {
		t.Fatalf("rendered prompt has %d tokens, usage says %d", len(all)-4, n)
	}
	ref := refLogprobs(t, e.model, all)
	for i := 1; i < n; i++ {
		e, ok := body.PromptLogprobs[i][strconv.Itoa(int(all[i]))]
		if !ok || !near(e.Logprob, ref[i-1][all[i]]) || e.DecodedToken != tok.Decode(all[i:i+1]) {
			t.Errorf("prompt_logprobs[%d] = %+v, want token %d logprob %v", i, body.PromptLogprobs[i], all[i], ref[i-1][all[i]])
		}
		if ok {
			rank := 1
			for _, v := range ref[i-1] {
				if v > ref[i-1][all[i]] {
					rank++
				}
			}
			if e.Rank < rank {
				t.Errorf("prompt_logprobs[%d] rank %d, want at least %d", i, e.Rank, rank)
			}
		}
	}
	for j, c := range content {
		pos := n - 1 + j
		text := tok.Decode([]int32{forced})
		if c.Token != text || !near(c.Logprob, ref[pos][forced]) || string(runesOf(c.Bytes)) != text {
			t.Errorf("content[%d] = %q %v %v, want %q with the model's logprob %v", j, c.Token, c.Logprob, c.Bytes, text, ref[pos][forced])
		}
		// vLLM's list: the sampled token first, then the best ones not already listed.
		want := []int32{forced}
		for _, id := range topIDs(ref[pos], 2) {
			if id != forced {
				want = append(want, id)
			}
		}
		want = want[:2]
		if len(c.TopLogprobs) != 2 {
			t.Fatalf("content[%d].top_logprobs = %+v, want 2 entries", j, c.TopLogprobs)
		}
		for k, id := range want {
			if got := c.TopLogprobs[k]; got.Token != tok.Decode([]int32{id}) || !near(got.Logprob, ref[pos][id]) {
				t.Errorf("content[%d].top_logprobs[%d] = %+v, want %q %v", j, k, got, tok.Decode([]int32{id}), ref[pos][id])
			}
		}
	}
}

// runesOf turns a bytes list back into bytes.
func runesOf(b []int) []byte {
	out := make([]byte, len(b))
	for i, v := range b {
		out[i] = byte(v)
	}
	return out
}

// mustRender renders one user message with the model's chat template.
func mustRender(t *testing.T, e *env, content string) string {
	t.Helper()
	s, err := renderChat(e.model.ChatTemplate(), []tokenizer.Message{{Role: "user", Content: content}}, tokenizer.RenderOptions{AddGenerationPrompt: true})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestStreamedLogprobsMatch: streamed chunks carry the logprobs of their tokens; put together
// they equal the non-streamed ones, text offsets included, for completions with echo and chat.
func TestStreamedLogprobsMatch(t *testing.T) {
	e := newEnv(t)
	base := map[string]any{"prompt": "stream my logprobs", "max_tokens": 8, "temperature": 0, "ignore_eos": true, "logprobs": 2, "echo": true}
	_, b := e.post(t, "/v1/completions", base, nil)
	var whole struct {
		Choices []struct {
			Logprobs completionLP `json:"logprobs"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(b, &whole); err != nil {
		t.Fatal(err)
	}
	base["stream"] = true
	_, body := e.post(t, "/v1/completions", base, nil)
	var got completionLP
	for _, ev := range sseEvents(t, body) {
		if ev == "[DONE]" {
			continue
		}
		var chunk struct {
			Choices []struct {
				Logprobs *completionLP `json:"logprobs"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(ev), &chunk); err != nil {
			t.Fatal(err)
		}
		if c := chunk.Choices; len(c) == 1 && c[0].Logprobs != nil {
			got.Tokens = append(got.Tokens, c[0].Logprobs.Tokens...)
			got.TextOffset = append(got.TextOffset, c[0].Logprobs.TextOffset...)
			got.TokenLogprobs = append(got.TokenLogprobs, c[0].Logprobs.TokenLogprobs...)
			got.TopLogprobs = append(got.TopLogprobs, c[0].Logprobs.TopLogprobs...)
		}
	}
	want := whole.Choices[0].Logprobs
	wj, _ := json.Marshal(want)
	gj, _ := json.Marshal(got)
	if string(wj) != string(gj) {
		t.Errorf("streamed logprobs\n%s\nnon-streamed\n%s", gj, wj)
	}
}

// TestNChoicesAndSeeds: n choices come back with indices 0..n-1; with a seed, choice i is what
// a single request with seed+i gives (vLLM's parallel sampling), streamed or not, and best_of
// returns the sequence with the highest cumulative logprob. Every block is back in the pool
// (the env checks it).
func TestNChoicesAndSeeds(t *testing.T) {
	e := newEnv(t)
	req := func(extra map[string]any) map[string]any {
		r := map[string]any{"prompt": "many ways to continue", "max_tokens": 6, "temperature": 1.0, "ignore_eos": true, "seed": 11}
		for k, v := range extra {
			r[k] = v
		}
		return r
	}
	texts := func(b []byte) []string {
		var body struct {
			Choices []struct {
				Index int    `json:"index"`
				Text  string `json:"text"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(b, &body); err != nil {
			t.Fatal(err)
		}
		out := make([]string, len(body.Choices))
		for i, c := range body.Choices {
			if c.Index != i {
				t.Errorf("choice %d has index %d", i, c.Index)
			}
			out[i] = c.Text
		}
		return out
	}
	var single []string
	cum := make([]float64, 3)
	for i := range 3 {
		_, b := e.post(t, "/v1/completions", req(map[string]any{"seed": 11 + i, "logprobs": 0}), nil)
		single = append(single, texts(b)[0])
		var lp struct {
			Choices []struct{ Logprobs completionLP } `json:"choices"`
		}
		_ = json.Unmarshal(b, &lp)
		for _, v := range lp.Choices[0].Logprobs.TokenLogprobs {
			cum[i] += *v
		}
	}
	if single[0] == single[1] && single[1] == single[2] {
		t.Fatalf("three seeds gave the same text %q: the test cannot tell them apart", single[0])
	}
	_, b := e.post(t, "/v1/completions", req(map[string]any{"n": 3}), nil)
	if got := texts(b); !slices.Equal(got, single) {
		t.Errorf("n=3 choices %q, want the single requests' %q", got, single)
	}
	var u struct{ Usage usage }
	_ = json.Unmarshal(b, &u)
	if u.Usage.CompletionTokens != 18 {
		t.Errorf("completion_tokens = %d, want 3 × 6", u.Usage.CompletionTokens)
	}
	// Streaming: chunks carry each choice's index.
	_, body := e.post(t, "/v1/completions", req(map[string]any{"n": 3, "stream": true}), nil)
	streamed := make([]string, 3)
	for _, ev := range sseEvents(t, body) {
		if ev == "[DONE]" {
			continue
		}
		var chunk struct {
			Choices []struct {
				Index int    `json:"index"`
				Text  string `json:"text"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(ev), &chunk); err != nil {
			t.Fatal(err)
		}
		for _, c := range chunk.Choices {
			streamed[c.Index] += c.Text
		}
	}
	if !slices.Equal(streamed, single) {
		t.Errorf("streamed n=3 choices %q, want %q", streamed, single)
	}
	best := 0
	for i := range cum {
		if cum[i] > cum[best] {
			best = i
		}
	}
	_, b = e.post(t, "/v1/completions", req(map[string]any{"n": 1, "best_of": 3}), nil)
	if got := texts(b); len(got) != 1 || got[0] != single[best] {
		t.Errorf("best_of 3 returned %q, want seed %d's %q (cumulative logprobs %v)", got, 11+best, single[best], cum)
	}
	// Chat n=2 streaming: a role chunk per choice, then both choices' text.
	_, body = e.post(t, "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": "hi"}},
		"n": 2, "stream": true, "max_tokens": 3, "seed": 3}, nil)
	roles := map[int]bool{}
	for _, ev := range sseEvents(t, body) {
		var chunk struct {
			Choices []struct {
				Index int `json:"index"`
				Delta struct {
					Role string `json:"role"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if ev != "[DONE]" && json.Unmarshal([]byte(ev), &chunk) == nil && len(chunk.Choices) == 1 && chunk.Choices[0].Delta.Role == "assistant" {
			roles[chunk.Choices[0].Index] = true
		}
	}
	if !roles[0] || !roles[1] {
		t.Errorf("role chunks for choices %v, want 0 and 1", roles)
	}
}

// TestSamplingProcessorsThroughAPI: allowed_token_ids and bad_words shape what is generated.
func TestSamplingProcessorsThroughAPI(t *testing.T) {
	e := newEnv(t)
	tok := e.model.Tokenizer()
	tokensOf := func(body map[string]any) []string {
		body["logprobs"] = 0
		body["ignore_eos"] = true
		resp, b := e.post(t, "/v1/completions", body, nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
		var r struct {
			Choices []struct{ Logprobs completionLP } `json:"choices"`
		}
		_ = json.Unmarshal(b, &r)
		return r.Choices[0].Logprobs.Tokens
	}
	allowed := []string{tok.Decode([]int32{500}), tok.Decode([]int32{501})}
	for _, s := range tokensOf(map[string]any{"prompt": "only two", "max_tokens": 8, "temperature": 1, "seed": 5, "allowed_token_ids": []int{500, 501}}) {
		if !slices.Contains(allowed, s) {
			t.Errorf("generated %q outside allowed_token_ids %q", s, allowed)
		}
	}
	free := tokensOf(map[string]any{"prompt": "ban this", "max_tokens": 4, "temperature": 0})
	banned := tokensOf(map[string]any{"prompt": "ban this", "max_tokens": 4, "temperature": 0, "bad_words": []string{free[0]}})
	if banned[0] == free[0] {
		t.Errorf("bad_words %q still generated first: %q", free[0], banned)
	}
	// A presence penalty breaks a greedy continuation that repeats one token.
	rep := tokensOf(map[string]any{"prompt": strings.Repeat("again ", 20), "max_tokens": 6, "temperature": 0})
	pen := tokensOf(map[string]any{"prompt": strings.Repeat("again ", 20), "max_tokens": 6, "temperature": 0, "presence_penalty": 2})
	if rep[1] != rep[0] || pen[1] == pen[0] {
		t.Errorf("presence_penalty 2: greedy %q, penalized %q; want a repeat broken", rep, pen)
	}
}

// TestUsageFlags: prompt_tokens_details appear only with --enable-prompt-tokens-details, and
// --enable-force-include-usage ends every stream with the usage chunk.
func TestUsageFlags(t *testing.T) {
	e := newEnv(t, func(c *Config) { c.PromptTokensDetails = false; c.ForceIncludeUsage = true })
	_, b := e.post(t, "/v1/completions", map[string]any{"prompt": "x", "max_tokens": 2}, nil)
	if u := decode(t, b)["usage"].(map[string]any); u["prompt_tokens_details"] != nil {
		t.Errorf("prompt_tokens_details without the flag: %v", u)
	}
	_, body := e.post(t, "/v1/completions", map[string]any{"prompt": "x", "max_tokens": 2, "stream": true}, nil)
	events := sseEvents(t, body)
	last := decode(t, []byte(events[len(events)-2]))
	if len(last["choices"].([]any)) != 0 || last["usage"] == nil {
		t.Errorf("forced usage: last chunk %s", events[len(events)-2])
	}
	for _, ev := range events[:len(events)-2] {
		if strings.Contains(ev, `"usage"`) {
			t.Errorf("usage before the usage chunk: %s", ev)
		}
	}
}
