package connector_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/kvcache"
)

// answerWithLogprobs is a greedy completion of prompt on n (with kv, when not nil), as its text
// and the logprob of each token: what moves with any change in the KV.
func answerWithLogprobs(t *testing.T, n *node, prompt []int, kv map[string]any) (int, string) {
	t.Helper()
	body := map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
	if kv != nil {
		body["kv_transfer_params"] = kv
	}
	status, r := post(t, n.srv.URL+"/v1/completions", body)
	var resp struct {
		Choices []struct {
			Logprobs struct {
				TokenLogprobs []float64 `json:"token_logprobs"`
			} `json:"logprobs"`
		} `json:"choices"`
	}
	if status != 200 {
		return status, r.Raw
	}
	if err := json.Unmarshal([]byte(r.Raw), &resp); err != nil || len(resp.Choices) != 1 {
		t.Fatalf("%v: %s", err, r.Raw)
	}
	return status, fmt.Sprintf("%q %v (cached %d)", r.Text, resp.Choices[0].Logprobs.TokenLogprobs, min(1, cachedTokens(r)))
}

// TestTPBlocksAndLayouts: between engines of equal TP sizes each rank's blocks are regrouped
// (smaller remote blocks) and permuted (HND → NHD) on their own, and the answer is the single
// TP 1 engine's, logprobs included; across TP sizes, P TP 4 (replicated heads) feeds D TP 1,
// and different block sizes or an NHD layout fail the handshake (500) with an error naming
// both TP sizes.
func TestTPBlocksAndLayouts(t *testing.T) {
	prompt := tokens(75, 14)
	single := startNode(t, "single", nodeOptions{})
	_, want := answerWithLogprobs(t, single, prompt, nil)
	want = strings.Replace(want, "(cached 0)", "(cached 1)", 1) // D's answer must come from pulled KV
	for _, tc := range []struct {
		name           string
		pTP, dTP       int
		pBlock, dBlock int
		layout         kvcache.Layout // D's (P's is HND), or both's with bothLayout
		bothLayout     bool
		permute        bool
		refusal        string // "" when it must work
	}{
		{"TP 2 → 2, P 8 → D 16", 2, 2, 8, 16, kvcache.HND, false, false, ""},
		{"TP 2 → 2, HND → NHD with permute", 2, 2, 16, 16, kvcache.NHD, false, true, ""},
		{"TP 4 → 1", 4, 1, 16, 16, kvcache.HND, false, false, ""},
		{"TP 2 → 1, P 8 → D 16", 2, 1, 8, 16, kvcache.HND, false, false, "heterogeneous TP needs equal block sizes and the HND layout"},
		{"TP 1 → 2, HND → NHD with permute", 1, 2, 16, 16, kvcache.NHD, false, true, "heterogeneous TP needs equal block sizes and the HND layout"},
		{"TP 2 → 1, NHD on both", 2, 1, 16, 16, kvcache.NHD, true, false, "heterogeneous TP needs equal block sizes and the HND layout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pLayout := kvcache.HND
			if tc.bothLayout {
				pLayout = tc.layout
			}
			p := startNode(t, "P", nodeOptions{kvConfig: producerCfg, blockSize: tc.pBlock, numBlocks: 512, tp: tc.pTP, layout: pLayout})
			logs := new(fixture.LogBuffer)
			dcfg := fmt.Sprintf(`{"kv_connector":"NixlConnector","kv_role":"kv_consumer","enable_permute_local_kv":%v}`, tc.permute)
			d := startNode(t, "D", nodeOptions{kvConfig: dcfg, blockSize: tc.dBlock, tp: tc.dTP, layout: tc.layout, logw: logs})
			status, got := answerWithLogprobs(t, d, prompt, prefill(t, p, prompt))
			if tc.refusal == "" {
				if status != 200 || got != want {
					t.Fatalf("%d %s, want 200 %s", status, got, want)
				}
				return
			}
			if status != 500 {
				t.Fatalf("%d %s, want 500", status, got)
			}
			if !logs.HasLine("handshake_setup_failed", tc.refusal, fmt.Sprintf("runs TP %d", tc.pTP), fmt.Sprintf("this engine TP %d", tc.dTP)) {
				t.Errorf("D's log does not name the refusal %q with both TP sizes:\n%s", tc.refusal, logs)
			}
		})
	}
}

// TestPushAcrossTPSizes: a push prefiller and decoder at every pair of TP sizes in {1, 2, 4}
// (over SHM and TCP, serial and both legs at once): P's ranks WRITE each D rank's heads (the
// inverse of a pull's reads: several P ranks into one D rank's blocks at head offsets, or one P
// rank into several D ranks', a head P replicates written from one replica), the completion
// after them, and D answers as the single TP 1 engine does (logprobs included) from P's KV, and
// again from its prefix cache; the params and GET /v1/kv_transfer carry P's tp_size. Different
// TP sizes with different block sizes are refused at the handshake, naming both TP sizes.
func TestPushAcrossTPSizes(t *testing.T) {
	single := startNode(t, "single", nodeOptions{})
	for _, backend := range []string{"SHM", "TCP"} {
		for _, sizes := range [][2]int{{1, 1}, {1, 2}, {1, 4}, {2, 1}, {2, 2}, {2, 4}, {4, 1}, {4, 2}, {4, 4}} {
			pTP, dTP := sizes[0], sizes[1]
			t.Run(fmt.Sprintf("%s TP %d → %d", backend, pTP, dTP), func(t *testing.T) {
				p := startNode(t, "P", nodeOptions{kvConfig: pushCfg("kv_producer", backend), tp: pTP})
				d := startNode(t, "D", nodeOptions{kvConfig: pushCfg("kv_consumer", backend), tp: dTP, prefix: true})
				if got := p.conn.Info().TPSize; got != pTP {
					t.Errorf("P reports tp_size %d, want %d", got, pTP)
				}
				for i, flow := range []func(*testing.T, *node, *node, []int, int) result{pushSerial, pushConcurrent} {
					prompt := tokens(70, 7+i)
					_, want := answerWithLogprobs(t, single, prompt, nil)
					r := flow(t, p, d, prompt, 6)
					if got := external(r); got != len(prompt)-1 {
						t.Errorf("flow %d: %d tokens came from P, want %d", i, got, len(prompt)-1)
					}
					// D's prefix cache now holds the pushed blocks: a plain request is answered from them.
					_, got := answerWithLogprobs(t, d, prompt, nil)
					if got != strings.Replace(want, "(cached 0)", "(cached 1)", 1) {
						t.Errorf("flow %d: D answers %s from the pushed KV, a single TP 1 engine %s", i, got, want)
					}
				}
				p.waitPoolFull(t)
			})
		}
	}
	t.Run("TP 2 → TP 1 with other block sizes refused", func(t *testing.T) {
		logs := new(fixture.LogBuffer)
		p := startNode(t, "P", nodeOptions{kvConfig: pushCfg("kv_producer"), tp: 2, blockSize: 8})
		d := startNode(t, "D", nodeOptions{kvConfig: pushCfg("kv_consumer"), logw: logs})
		pkv := prefill(t, p, tokens(40, 9))
		if status, r := decode(t, d, tokens(40, 9), pushDecodeParams(pkv), 4); status != 500 {
			t.Fatalf("status %d, want 500: %s", status, r.Raw)
		}
		if !strings.Contains(logs.String(), "heterogeneous TP needs equal block sizes") || !strings.Contains(logs.String(), "runs TP 2 (block size 8") {
			t.Errorf("D's log does not name both TP sizes:\n%s", logs)
		}
		// D never registered: P holds the blocks until its lease expires, as vLLM's does.
	})
}
