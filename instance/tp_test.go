package instance_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"testing"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/model"
)

// tpAnswer is what a completion answered: its text and the logprob of each token.
type tpAnswer struct {
	Text     string
	Logprobs []float64
}

// askAll sends the same requests to url, in two waves of four at once (so the engine batches
// them): greedy and seeded sampling at temperature 1, each with the logprobs of its tokens,
// prompts long enough to be prefilled in chunks, the second wave's sharing the first's prefixes
// (prefix-cache hits).
func askAll(t *testing.T, url string) []tpAnswer {
	t.Helper()
	hc := &http.Client{}
	defer hc.CloseIdleConnections()
	const n = 8
	out := make([]tpAnswer, n)
	var wg sync.WaitGroup
	for i := range n {
		if i == n/2 {
			wg.Wait() // the second half finds the first half's prefixes in the cache
		}
		wg.Go(func() {
			body := map[string]any{"model": model.Tiny, "max_tokens": 12, "logprobs": 1,
				"prompt": fmt.Sprintf("The ranks of a tensor-parallel engine share one prefix here; request %d then goes its own way %d.", i%4, i)}
			if i%2 == 0 {
				body["temperature"] = 0
			} else {
				body["temperature"], body["seed"] = 1, i
			}
			r, err := apiclient.Post(t.Context(), hc, url+"/v1/completions", body, nil)
			if err == nil {
				err = r.Check(url)
			}
			if err != nil {
				t.Errorf("request %d: %v", i, err)
				return
			}
			var resp struct {
				Choices []struct {
					Logprobs struct {
						TokenLogprobs []float64 `json:"token_logprobs"`
					} `json:"logprobs"`
				} `json:"choices"`
			}
			if err := json.Unmarshal(r.Raw, &resp); err != nil || len(resp.Choices) != 1 {
				t.Errorf("request %d: %v: %s", i, err, r.Raw)
				return
			}
			if len(resp.Choices[0].Logprobs.TokenLogprobs) == 0 {
				t.Errorf("request %d: no logprobs: %s", i, r.Raw)
			}
			out[i] = tpAnswer{Text: r.Text, Logprobs: resp.Choices[0].Logprobs.TokenLogprobs}
		})
	}
	wg.Wait()
	return out
}

// TestTensorParallelServesTheSameTokens: engines serving kvbridge/tiny on 2 and 4
// tensor-parallel ranks (4 replicates its 2 KV heads), and 2 data-parallel engines of 2 ranks
// each, answer batched greedy and seeded requests with TP 1's tokens and logprobs; each rank's
// KV lives in an arena of its own, and every pool is full after Close.
func TestTensorParallelServesTheSameTokens(t *testing.T) {
	var want []tpAnswer
	for _, c := range []struct{ tp, dp int }{{1, 1}, {2, 1}, {4, 1}, {2, 2}} {
		logs := new(fixture.LogBuffer)
		in, err := instance.Start(t.Context(), instance.Config{Model: model.Tiny, Host: "127.0.0.1", NumBlocks: 64,
			MaxNumBatchedTokens: 16, PrefixCaching: true, TensorParallelSize: c.tp, DataParallelSize: c.dp, Logger: slog.New(slog.NewTextHandler(logs, nil))})
		if err != nil {
			t.Fatalf("TP %d DP %d: %v", c.tp, c.dp, err)
		}
		if got := in.Model.TensorParallelSize(); got != c.tp {
			t.Errorf("TP %d: the model runs on %d ranks", c.tp, got)
		}
		for _, rk := range in.Ranks {
			if got := rk.Pool.TensorParallelSize(); got != c.tp {
				t.Errorf("TP %d: DP rank %d's pool holds %d ranks' KV", c.tp, rk.Index, got)
			}
			if got, want := rk.Pool.Geometry().NumKVHeads, max(1, 2/c.tp); got != want {
				t.Errorf("TP %d: a rank's blocks hold %d KV heads, want %d", c.tp, got, want)
			}
			for r := 1; r < c.tp; r++ {
				if a, b := rk.Pool.Shard(r-1).Bytes(0), rk.Pool.Shard(r).Bytes(0); &a[0] == &b[0] {
					t.Errorf("TP %d: ranks %d and %d share their KV memory", c.tp, r-1, r)
				}
			}
		}
		got := askAll(t, in.URL)
		if st, err := in.Stats(); err != nil || st.PrefixHitTokens == 0 {
			t.Errorf("TP %d DP %d: no prefix-cache hit (%v)", c.tp, c.dp, err)
		}
		if err := in.Close(); err != nil {
			t.Error(err)
		}
		for _, rk := range in.Ranks {
			if free, n := rk.Pool.NumFree(), rk.Pool.NumBlocks(); free != n {
				t.Errorf("TP %d DP %d: rank %d has %d of %d blocks free after Close", c.tp, c.dp, rk.Index, free, n)
			}
		}
		if c.tp == 1 {
			want = got
			continue
		}
		for i := range want {
			if got[i].Text != want[i].Text || !slices.Equal(got[i].Logprobs, want[i].Logprobs) {
				t.Errorf("TP %d DP %d: request %d answered %q %v, TP 1 %q %v", c.tp, c.dp, i, got[i].Text, got[i].Logprobs, want[i].Text, want[i].Logprobs)
			}
		}
	}
}
