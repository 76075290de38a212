package reliability

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/model"
)

// TestAttackOversizeFieldsRefused: request lists beyond their bounds (openai/limits.go) — stop
// strings, stop_token_ids, logit_bias, allowed_token_ids, a /tokenize text, /detokenize ids —
// get a 400 naming the field, from an engine directly and through the proxy, instead of being
// held once per sequence or scanned on every token; the engines' pools come back full.
func TestAttackOversizeFieldsRefused(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	s := startStack(t, stackOptions{})
	m, err := model.Open(t.Context(), model.Tiny, model.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vocab := m.Tokenizer().VocabSize()
	m.Close()
	ids := make([]int, vocab+1)
	many := make([]string, 1025)
	for i := range many {
		many[i] = "s"
	}
	bias := map[string]any{"00": 1}
	for i := range vocab {
		bias[fmt.Sprint(i)] = 1
	}
	cases := []struct {
		name, route string
		body        map[string]any
		param       string
	}{
		{"stop count", "/v1/completions", completion("x", 4, "stop", many), "stop"},
		{"stop length", "/v1/completions", completion("x", 4, "stop", []string{strings.Repeat("s", 100000)}), "stop"},
		{"stop_token_ids", "/v1/completions", completion("x", 4, "stop_token_ids", ids, "n", 4), "stop_token_ids"},
		{"logit_bias", "/v1/completions", completion("x", 4, "logit_bias", bias), "logit_bias"},
		{"allowed_token_ids", "/v1/chat/completions", chat([]map[string]any{user("x")}, 4, "allowed_token_ids", ids), "allowed_token_ids"},
	}
	for _, c := range cases {
		for _, base := range []string{s.px.URL, s.p.URL, s.d.URL} {
			r := post(t, s.hc, base+c.route, "", c.body)
			if r.status != 400 || r.err["param"] != c.param {
				t.Errorf("%s via %s: %d %.300s, want 400 naming %s", c.name, base, r.status, r.raw, c.param)
			}
		}
	}
	long := map[string]any{"model": model.Tiny, "prompt": strings.Repeat("the quick brown fox ", maxModelLen)}
	if r := post(t, s.hc, s.p.URL+"/tokenize", "", long); r.status != 400 || r.err["param"] != "prompt" {
		t.Errorf("/tokenize of more than max_model_len tokens: %d %.300s", r.status, r.raw)
	}
	detok := map[string]any{"model": model.Tiny, "tokens": make([]int, maxModelLen+1)}
	if r := post(t, s.hc, s.d.URL+"/detokenize", "", detok); r.status != 400 || r.err["param"] != "tokens" {
		t.Errorf("/detokenize of more than max_model_len ids: %d %.300s", r.status, r.raw)
	}
	s.p.waitPoolFull(t)
	s.d.waitPoolFull(t)
}

// TestAttackStopStringsSpareBystanders: the stop-string attack within the bounds — requests
// of n=4 long sequences (ignore_eos) with the most stop strings admitted — sent through the
// proxy does not slow a bystander's streamed tokens beyond 2× their pace beside the same
// requests without stop strings (its whole time over its tokens; medians of runs alternating
// between the two, in this test).
// Before the automaton, each such token rescanned 4 KiB of text per stop string.
func TestAttackStopStringsSpareBystanders(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	s := startStack(t, stackOptions{})
	const loadTokens, bystanderTokens, runs, rounds = 500, 64, 3, 4
	bystander := completion("a bystander asks a short question", bystanderTokens, "ignore_eos", true, "stream", true,
		"stream_options", map[string]any{"include_usage": true})
	perToken := func() time.Duration {
		ctx, cancel := context.WithTimeout(t.Context(), requestDeadline)
		defer cancel()
		r, err := apiclient.Post(ctx, s.hc, s.px.URL+"/v1/completions", bystander, nil)
		// Its tokens, as its usage counts them: a stream may carry several tokens in one event
		// (outputs a reader has not taken yet are merged), so events are no count of tokens.
		if err != nil || r.Status != 200 || r.CompletionTokens != bystanderTokens {
			t.Fatalf("bystander: %v %d, %d tokens: %.300s", err, r.Status, r.CompletionTokens, r.Raw)
		}
		// The whole request's time per token: chunks may reach the client in bursts, so the
		// gaps between them mean little.
		return r.Latency / bystanderTokens
	}
	measure := func(stops []string) []time.Duration {
		// The load ends by finishing its last request, not by an abort (which would leave P's
		// blocks to their lease).
		stop := make(chan struct{})
		var wg sync.WaitGroup
		defer func() { close(stop); wg.Wait() }()
		started := make(chan struct{})
		var once sync.Once
		body := completion("the attacker", loadTokens, "n", 4, "ignore_eos", true, "stream", true)
		if stops != nil {
			body["stop"] = stops
		}
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(t.Context(), requestDeadline)
				r, err := apiclient.PostWatching(ctx, s.hc, s.px.URL+"/v1/completions", body, nil,
					func(apiclient.Reply) { once.Do(func() { close(started) }) })
				cancel()
				if err != nil || r.Status != 200 || r.FinishReason != "length" {
					t.Errorf("load request: %v %d %s: %.300s", err, r.Status, r.FinishReason, r.Raw)
					once.Do(func() { close(started) })
					return
				}
			}
		})
		select {
		case <-started:
		case <-time.After(requestDeadline):
			t.Fatal("the load produced no token")
		}
		var out []time.Duration
		for range runs {
			out = append(out, perToken())
		}
		return out
	}
	// Each round measures both ways back to back and gives their ratio; the verdict is the
	// median ratio, so that a change of the machine's load between rounds (this test runs in
	// parallel with others) moves both sides of a ratio alike.
	var plain, attacked []time.Duration
	var ratios []float64
	for range rounds {
		p, a := medianOf(measure(nil)), medianOf(measure(fixture.AttackStops()))
		plain, attacked = append(plain, p), append(attacked, a)
		ratios = append(ratios, float64(a)/float64(p))
	}
	slices.Sort(ratios)
	ratio := ratios[len(ratios)/2]
	t.Logf("bystander per-token latency through the proxy beside n=4 long requests, per round: %v without stop strings, %v with the attack's; median ratio %.2f×",
		plain, attacked, ratio)
	if ratio > 2 {
		t.Errorf("the stop-string attack slowed the bystander more than 2× (median ratio of the rounds %.2f×: %v without, %v with)", ratio, plain, attacked)
	}
	s.p.waitPoolFull(t)
	s.d.waitPoolFull(t)
}

// medianOf returns the median of d.
func medianOf(d []time.Duration) time.Duration {
	d = slices.Clone(d)
	slices.Sort(d)
	return d[len(d)/2]
}
