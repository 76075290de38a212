package connector_test

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sync/errgroup"
)

// accuracyCase is one request of the accuracy test.
type accuracyCase struct {
	path string
	body map[string]any
}

// accuracyCases returns 56 greedy requests: token-id prompts of lengths around the block size
// (shorter than a block, exact multiples, one past) and long ones, text completions, and chats;
// half of them streaming.
func accuracyCases() []accuracyCase {
	rng := rand.New(rand.NewPCG(1, 2))
	var cases []accuracyCase
	for i, n := range []int{1, 2, 7, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 300, 400, 511, 512, 513} {
		ids := make([]int, n)
		for j := range ids {
			ids[j] = 300 + rng.IntN(3000)
		}
		cases = append(cases, accuracyCase{"/v1/completions", map[string]any{"prompt": ids, "max_tokens": 8 + i%5, "stream": i%2 == 0}})
	}
	words := strings.Fields("the KV cache of a prompt moves from the prefill engine to the decode engine over shared memory or TCP and every block returns to its pool")
	for i := range 14 {
		n := 1 + i*i*2
		var b strings.Builder
		for j := range n {
			b.WriteString(words[(i+j)%len(words)])
			b.WriteByte(' ')
		}
		cases = append(cases, accuracyCase{"/v1/completions", map[string]any{"prompt": b.String(), "max_tokens": 12, "stream": i%2 == 1}})
	}
	for i := range 14 {
		msgs := []map[string]any{{"role": "system", "content": "You are terse."}}
		for j := range i%4 + 1 {
			msgs = append(msgs, map[string]any{"role": "user", "content": strings.Repeat(words[(i+j)%len(words)]+" ", 1+i*3)})
			msgs = append(msgs, map[string]any{"role": "assistant", "content": words[j]})
		}
		msgs = append(msgs, map[string]any{"role": "user", "content": fmt.Sprintf("question %d", i)})
		body := map[string]any{"messages": msgs, "max_tokens": 10, "stream": i%2 == 0}
		if i%2 == 0 {
			body["stream_options"] = map[string]any{"include_usage": true}
		}
		cases = append(cases, accuracyCase{"/v1/chat/completions", body})
	}
	for _, c := range cases {
		c.body["model"] = "kvbridge/tiny"
		c.body["temperature"] = 0
	}
	return cases
}

// runAll sends every case to base with up to 8 in flight and returns the texts.
func runAll(t *testing.T, base string, cases []accuracyCase) []result {
	t.Helper()
	out := make([]result, len(cases))
	var g errgroup.Group
	g.SetLimit(8)
	var mu sync.Mutex
	for i, c := range cases {
		g.Go(func() error {
			status, r := post(t, base+c.path, c.body)
			if status != 200 {
				return fmt.Errorf("case %d (%s): status %d: %s", i, c.path, status, r.Raw)
			}
			mu.Lock()
			out[i] = r
			mu.Unlock()
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestAccuracy is the accuracy test of disaggregation: through the proxy, P prefills, D pulls
// the KV and decodes, and the greedy output is token for token that of a single engine — over
// both transfer backends, with and without an auth token (every TCP read then names its
// lease), for completions and chat, streaming or not.
func TestAccuracy(t *testing.T) {
	cases := accuracyCases()
	single := startNode(t, "single", nodeOptions{prefix: true})
	want := runAll(t, single.srv.URL, cases)
	for _, run := range []struct{ backend, token string }{{"SHM", ""}, {"TCP", ""}, {"SHM", "tok-0123456789abcdef"}, {"TCP", "tok-0123456789abcdef"}} {
		name := run.backend
		if run.token != "" {
			name += "/auth_token"
		}
		t.Run(name, func(t *testing.T) {
			backend := run.backend
			cfg := func(role string) string {
				return fmt.Sprintf(`{"kv_connector":"NixlConnector","kv_role":%q,"kv_connector_extra_config":{"backends":[%q],"auth_token":%q}}`, role, backend, run.token)
			}
			p := startNode(t, "P", nodeOptions{kvConfig: cfg("kv_producer"), prefix: true})
			d := startNode(t, "D", nodeOptions{kvConfig: cfg("kv_consumer"), prefix: true})
			px := startProxy(t, p, d)
			got := runAll(t, px.URL, cases)
			pulled := 0
			for i := range cases {
				if got[i].Text != want[i].Text || got[i].FinishReason != want[i].FinishReason {
					t.Errorf("case %d: P/D output %q (%s), single %q (%s)", i, got[i].Text, got[i].FinishReason, want[i].Text, want[i].FinishReason)
				}
				pulled += cachedTokens(got[i])
			}
			if pulled == 0 {
				t.Error("no request reported transferred prompt tokens in usage.prompt_tokens_details.cached_tokens")
			}
			if st := d.eng.Stats(); st.ExternalHits == 0 {
				t.Errorf("D loaded no external tokens: %+v", st)
			}
			p.waitPoolFull(t) // every lease ended by D's notification, none by expiry
			d.waitPoolFull(t)
			if iv := d.em.Nixl().TakeInterval(); iv.Empty() {
				t.Error("D recorded no transfer statistics")
			}
			if rp, rd := p.conn.AuthRefusals(), d.conn.AuthRefusals(); rp.Total() != 0 || rd.Total() != 0 {
				t.Errorf("refusals in a normal P/D flow: P %+v, D %+v", rp, rd)
			}
		})
	}
}
