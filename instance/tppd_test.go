package instance_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
	"github.com/kvbridge/kvbridge/stack"
)

// openTP opens kvbridge/tiny (2 KV heads) on each of the tensor-parallel sizes 1, 2 and 4 (4
// replicates its KV heads), closed with the test.
func openTP(t *testing.T) map[int]*model.Model {
	t.Helper()
	ms := map[int]*model.Model{}
	for _, tp := range []int{1, 2, 4} {
		m, err := model.Open(t.Context(), model.Tiny, model.OpenOptions{TensorParallelSize: tp})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		ms[tp] = m
	}
	return ms
}

// tpPrompt is request i's prompt: long enough to fill several blocks, so that a load reads many
// blocks of every rank.
func tpPrompt(i int) string {
	return fmt.Sprintf("Request %d moves its KV between tensor-parallel ranks: %s", i, strings.Repeat("heads go to the rank that owns them. ", 3+i%3))
}

// askTP sends request i to url, greedy with the logprob of each token, and returns the answer's
// choice (text and logprobs, which move with any change in the KV).
func askTP(t *testing.T, hc *http.Client, url string, i int) string {
	t.Helper()
	body := map[string]any{"model": model.Tiny, "prompt": tpPrompt(i), "max_tokens": 8, "temperature": 0, "logprobs": 1}
	r, err := apiclient.Post(t.Context(), hc, url+"/v1/completions", body, nil)
	if err == nil {
		err = r.Check(url)
	}
	if err != nil {
		t.Fatalf("request %d to %s: %v", i, url, err)
	}
	var resp struct {
		Choices []struct {
			Text     string
			Logprobs struct {
				TokenLogprobs []float64 `json:"token_logprobs"`
			} `json:"logprobs"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(r.Raw, &resp); err != nil || len(resp.Choices) != 1 || len(resp.Choices[0].Logprobs.TokenLogprobs) == 0 {
		t.Fatalf("request %d to %s: %v: %s", i, url, err, r.Raw)
	}
	return fmt.Sprintf("%q %v", resp.Choices[0].Text, resp.Choices[0].Logprobs.TokenLogprobs)
}

// startTPStack starts P at TP p and D at TP d (models from ms) behind the proxy of mode, the
// transfers on backend; it is closed with the test, and every pool of every rank must then be
// full.
func startTPStack(t *testing.T, ms map[int]*model.Model, p, d int, mode stack.Mode, backend string, log *slog.Logger) *stack.Stack {
	t.Helper()
	return startStack(t, stack.Config{
		Mode: mode, Backend: backend, NumBlocks: 96, MaxModelLen: 1024, Logger: log,
		P: stack.EngineConfig{Model: ms[p], EngineID: fmt.Sprintf("P-tp%d", p)},
		D: stack.EngineConfig{Model: ms[d], EngineID: fmt.Sprintf("D-tp%d", d), PrefixCaching: true},
	})
}

// startStack starts cfg's stack for the test, which closes it when it ends and then requires
// every pool of it to be full again. The models must outlive it (openTP closes them in an
// earlier-registered cleanup).
func startStack(t *testing.T, cfg stack.Config) *stack.Stack {
	t.Helper()
	s, err := stack.Start(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
		if err := s.CheckPools(); err != nil {
			t.Error(err)
		}
	})
	return s
}

// TestPDAcrossTensorParallelSizes: for every pair of TP sizes in {1, 2, 4} for P and D, over
// SHM and over TCP, completions through the one-way proxy answer exactly what a single TP 1
// engine answers (text and logprobs), with D pulling the prompt's KV (not recomputing it): each
// D rank reads its heads from the P rank(s) holding them — one P rank's slice when D's TP is
// larger, several P ranks' heads when it is smaller, a replica at TP 4 (tiny has 2 KV heads).
// D's transfer metrics count one READ per pair of D rank and P rank it reads from:
// max(D TP, min(P TP, 2)) per request.
func TestPDAcrossTensorParallelSizes(t *testing.T) {
	ms := openTP(t)
	single, err := stack.StartEngine(t.Context(), stack.EngineConfig{Name: "single", Model: ms[1], NumBlocks: 96, MaxModelLen: 1024})
	if err != nil {
		t.Fatal(err)
	}
	defer single.Close()
	hc := &http.Client{Transport: stack.NewTransport(4)}
	defer hc.CloseIdleConnections()
	const n = 3
	var want [n]string
	for i := range n {
		want[i] = askTP(t, hc, single.URL(), i)
	}
	for _, backend := range []string{"SHM", "TCP"} {
		for _, p := range []int{1, 2, 4} {
			for _, d := range []int{1, 2, 4} {
				t.Run(fmt.Sprintf("%s/P%d-D%d", backend, p, d), func(t *testing.T) {
					logs := new(fixture.LogBuffer)
					s := startTPStack(t, ms, p, d, stack.OneWay, backend, slog.New(slog.NewTextHandler(logs, nil)))
					before, err := s.D.Stats()
					if err != nil {
						t.Fatal(err)
					}
					for i := range n {
						if got := askTP(t, hc, s.URL, i); got != want[i] {
							t.Errorf("request %d: P TP %d → D TP %d answered %q, a single TP 1 engine %q", i, p, d, got, want[i])
						}
					}
					st, err := s.D.Stats()
					if err != nil {
						t.Fatal(err)
					}
					if st.PulledTokens == 0 {
						t.Errorf("D pulled no KV:\n%s", logs)
					}
					if got, want := st.Transfers-before.Transfers, int64(n*max(d, min(p, 2))); got != want {
						t.Errorf("D counted %d transfers for %d requests, want %d (one per pair of D rank and P rank)", got, n, want)
					}
					if !logs.HasLine("NIXL handshake done", "engine_name=D", "backend="+backend) {
						t.Errorf("D's handshake did not use %s:\n%s", backend, logs)
					}
				})
			}
		}
	}
}

// TestBidirectionalAcrossTensorParallelSizes: through the multi-turn proxy, P and D of every pair
// of TP sizes in {1, 2, 4}, over SHM and over TCP, and 2 → 1 with two data-parallel engines on
// each side, pull a conversation's KV both ways and answer every turn as a single TP 1 engine
// does.
func TestBidirectionalAcrossTensorParallelSizes(t *testing.T) {
	ms := openTP(t)
	type pair struct {
		p, d, dp int
		backend  string
	}
	cases := []pair{{2, 1, 2, ""}}
	for _, backend := range []string{"SHM", "TCP"} {
		for _, p := range []int{1, 2, 4} {
			for _, d := range []int{1, 2, 4} {
				cases = append(cases, pair{p, d, 1, backend})
			}
		}
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%sP%d-D%d-DP%d", c.backend, c.p, c.d, c.dp), func(t *testing.T) {
			s := startStack(t, stack.Config{
				Mode: stack.Bidirectional, Single: true, NumBlocks: 128, MaxModelLen: 1024, Model: ms[1], Backend: c.backend,
				P: stack.EngineConfig{Model: ms[c.p], DataParallelSize: c.dp},
				D: stack.EngineConfig{Model: ms[c.d], PrefixCaching: true, DataParallelSize: c.dp},
			})
			hc := &http.Client{Transport: stack.NewTransport(4)}
			defer hc.CloseIdleConnections()
			multiTurn(t, s, hc)
		})
	}
}

// TestPushThroughProxyAcrossTPSizes: push P/D (NixlPushConnector, the proxy sending both legs
// at once, --transfer-mode push) between engines of 2 ranks each, and from TP 2 into TP 1 and
// TP 1 into TP 2, answers as a single TP 1 engine does. P writes one WRITE per pair of P rank
// and D rank that moves heads (the tiny model has 2 KV heads): rank r into D's rank r at equal
// sizes; P ranks 0 and 1 into D's one rank (heads 0 and 1 at their offsets); P's one rank into D
// ranks 0 and 1 (head 0 to one, head 1 to the other): two WRITEs per request in each case.
func TestPushThroughProxyAcrossTPSizes(t *testing.T) {
	ms := openTP(t)
	push := []byte(`{"kv_connector":"NixlPushConnector"}`)
	for _, sizes := range [][2]int{{2, 2}, {2, 1}, {1, 2}} {
		pTP, dTP := sizes[0], sizes[1]
		t.Run(fmt.Sprintf("TP %d → %d", pTP, dTP), func(t *testing.T) {
			s := startStack(t, stack.Config{
				Single: true, Model: ms[1], NumBlocks: 96, MaxModelLen: 1024,
				P:     stack.EngineConfig{Model: ms[pTP], KVTransferConfig: push},
				D:     stack.EngineConfig{Model: ms[dTP], KVTransferConfig: push},
				Proxy: stack.ProxyConfig{TransferMode: proxy.TransferPush},
			})
			hc := &http.Client{Transport: stack.NewTransport(4)}
			defer hc.CloseIdleConnections()
			before, err := s.P.Stats()
			if err != nil {
				t.Fatal(err)
			}
			const n = 3
			for i := range n {
				if got, want := askTP(t, hc, s.URL, i), askTP(t, hc, s.Single.URL(), i); got != want {
					t.Errorf("request %d: push P/D from TP %d into TP %d answered %s, a single TP 1 engine %s", i, pTP, dTP, got, want)
				}
			}
			// P counts its last WRITE before it lets go of the blocks, maybe after D answered.
			var after instance.Stats
			deadline := time.Now().Add(10 * time.Second)
			for after.Held = -1; after.Held != 0; {
				if after, err = s.P.Stats(); err != nil {
					t.Fatal(err)
				}
				if time.Now().After(deadline) {
					t.Fatalf("P still holds %d blocks after the answers", after.Held)
				}
				select {
				case <-t.Context().Done():
					t.Fatal("test ended")
				case <-time.After(time.Millisecond):
				}
			}
			if got := after.Transfers - before.Transfers; got != 2*n {
				t.Errorf("P counted %d writes for %d requests, want %d (two pairs of ranks each)", got, n, 2*n)
			}
		})
	}
}
