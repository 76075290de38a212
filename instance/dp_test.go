package instance_test

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
)

// TestDataParallelThroughBothProxies: P and D each run two data-parallel ranks behind one HTTP
// port. Every rank's side channel listens on the base port + its rank and its engine id ends in
// _dp<rank>; through the one-way proxy every answer equals a single engine's, each D rank pulls
// KV, and a D rank pulls from the P rank the params name even when it is the other one (P's turn
// is shifted by a direct request); through the multi-turn proxy (bidirectional) P pulls the
// history back from whichever D rank holds it and the answers still equal the single engine's.
// Every pool of every rank is full at the end.
func TestDataParallelThroughBothProxies(t *testing.T) {
	m, err := stack.OpenModel(t.Context(), model.Tiny, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for _, mode := range []stack.Mode{stack.OneWay, stack.Bidirectional} {
		t.Run(string(mode), func(t *testing.T) {
			logs := &fixture.LogBuffer{}
			s, pBase, dBase := startDP(t, m, mode, slog.New(slog.NewTextHandler(logs, nil)))
			defer func() {
				if err := s.Close(); err != nil {
					t.Error(err)
				}
				for _, e := range []*stack.Engine{s.P, s.D} {
					for _, rk := range e.Instance().Ranks {
						if free, n := rk.Pool.NumFree(), rk.Pool.NumBlocks(); free != n {
							t.Errorf("%s rank %d: %d of %d blocks free after Close", e.Name, rk.Index, free, n)
						}
					}
				}
			}()
			for _, e := range []struct {
				eng  *stack.Engine
				id   string
				base int
			}{{s.P, "P-dp", pBase}, {s.D, "D-dp", dBase}} {
				ranks := e.eng.Instance().Ranks
				if len(ranks) != 2 {
					t.Fatalf("%s runs %d ranks, want 2", e.eng.Name, len(ranks))
				}
				for i, rk := range ranks {
					if got, want := rk.Connector.EngineID(), fmt.Sprintf("%s_dp%d", e.id, i); got != want {
						t.Errorf("%s rank %d: engine id %q, want %q", e.eng.Name, i, got, want)
					}
					_, port, _ := net.SplitHostPort(rk.Connector.SideChannelAddr())
					if got := mustAtoi(t, port); got != e.base+i {
						t.Errorf("%s rank %d: side channel on port %d, want %d (base + rank)", e.eng.Name, i, got, e.base+i)
					}
				}
			}
			hc := &http.Client{Transport: stack.NewTransport(4)}
			defer hc.CloseIdleConnections()
			if mode == stack.OneWay {
				oneWay(t, s, hc, logs)
			} else {
				multiTurn(t, s, hc)
			}
		})
	}
}

// oneWay sends completions through the one-way proxy, shifting P's turn halfway with a direct
// request so that D's ranks also pull from the other P rank.
func oneWay(t *testing.T, s *stack.Stack, hc *http.Client, logs *fixture.LogBuffer) {
	t.Helper()
	ask := func(url string, i int) string {
		body := map[string]any{"model": model.Tiny, "prompt": fmt.Sprintf("Request %d of the data-parallel test reads its KV from a rank.", i),
			"max_tokens": 6, "temperature": 0}
		r, err := apiclient.Post(t.Context(), hc, url+"/v1/completions", body, nil)
		if err == nil {
			err = r.Check(url)
		}
		if err != nil {
			t.Fatalf("request %d to %s: %v", i, url, err)
		}
		return r.Text
	}
	for i := range 9 {
		if i == 4 {
			ask(s.P.URL(), 100)
			continue
		}
		if got, want := ask(s.URL, i), ask(s.Single.URL(), i); got != want {
			t.Errorf("request %d: P/D %q, single engine %q", i, got, want)
		}
	}
	for _, e := range []*stack.Engine{s.P, s.D} {
		for _, rk := range e.Instance().Ranks {
			st := rk.Engine.Stats()
			if st.PromptTokens == 0 {
				t.Errorf("%s rank %d served no request", e.Name, rk.Index)
			}
			if e == s.D && st.ExternalHits == 0 {
				t.Errorf("D rank %d pulled no KV", rk.Index)
			}
		}
	}
	// Each D rank handshook with both P ranks: the params named the rank that held the KV.
	for d := range 2 {
		for p := range 2 {
			if !logs.HasLine("NIXL handshake done", "engine_name=D", fmt.Sprintf("dp_rank=%d", d), fmt.Sprintf("remote_engine_id=P-dp_dp%d", p)) {
				t.Errorf("D rank %d never handshook with P rank %d:\n%s", d, p, logs)
			}
		}
	}
}

// multiTurn runs two conversations of three turns, interleaved, through the multi-turn proxy.
// Each turn adds more new tokens than kv_recompute_threshold, so D pulls them from P.
func multiTurn(t *testing.T, s *stack.Stack, hc *http.Client) {
	t.Helper()
	p0, err := s.P.Stats()
	if err != nil {
		t.Fatal(err)
	}
	convs := map[string][]map[string]string{}
	for turn := range 3 {
		for _, id := range []string{"conv-a", "conv-b"} {
			convs[id] = append(convs[id], map[string]string{"role": "user",
				"content": fmt.Sprintf("Turn %d of conversation %s: %s", turn, id, strings.Repeat("tell me more about data-parallel ranks and their KV caches. ", 8))})
			body := map[string]any{"model": model.Tiny, "messages": convs[id], "max_tokens": 6, "temperature": 0}
			want, err := apiclient.Post(t.Context(), hc, s.Single.URL()+"/v1/chat/completions", body, nil)
			if err == nil {
				err = want.Check(s.Single.URL())
			}
			if err != nil {
				t.Fatal(err)
			}
			body["conversation_id"] = id
			got, err := apiclient.Post(t.Context(), hc, s.URL+"/v1/chat/completions", body, nil)
			if err == nil {
				err = got.Check(s.URL)
			}
			if err != nil {
				t.Fatalf("%s turn %d: %v", id, turn, err)
			}
			if got.Text != want.Text {
				t.Errorf("%s turn %d: P/D %q, single engine %q", id, turn, got.Text, want.Text)
			}
			convs[id] = append(convs[id], map[string]string{"role": "assistant", "content": got.Text})
		}
	}
	p1, err := s.P.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if p1.PulledTokens == p0.PulledTokens {
		t.Error("P pulled no conversation history back from D")
	}
	for _, rk := range s.D.Instance().Ranks {
		if rk.Engine.Stats().ExternalHits == 0 {
			t.Errorf("D rank %d pulled no KV", rk.Index)
		}
	}
}

// startDP starts a single engine and P and D with two ranks each, P's side channels on pBase and
// pBase+1 and D's on dBase and dBase+1: free ports found here, tried again if another process
// takes one meanwhile.
func startDP(t *testing.T, m *model.Model, mode stack.Mode, log *slog.Logger) (s *stack.Stack, pBase, dBase int) {
	t.Helper()
	for attempt := 0; ; attempt++ {
		pBase, dBase = freePortPair(t), freePortPair(t)
		if pBase == dBase || pBase == dBase+1 || dBase == pBase+1 {
			continue
		}
		var err error
		s, err = stack.Start(t.Context(), stack.Config{
			Model: m, Mode: mode, Single: true, NumBlocks: 128, MaxModelLen: 1024, Logger: log,
			P: stack.EngineConfig{EngineID: "P-dp", DataParallelSize: 2, SideChannelPort: pBase},
			D: stack.EngineConfig{EngineID: "D-dp", DataParallelSize: 2, SideChannelPort: dBase, PrefixCaching: true},
		})
		if err == nil {
			return s, pBase, dBase
		}
		if !errors.Is(err, syscall.EADDRINUSE) || attempt == 4 {
			t.Fatal(err)
		}
	}
}

// freePortPair returns a port p such that p and p+1 were both free on 127.0.0.1 a moment ago.
func freePortPair(t *testing.T) int {
	t.Helper()
	for range 20 {
		a, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		p := a.Addr().(*net.TCPAddr).Port
		b, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p+1)))
		a.Close()
		if err == nil {
			b.Close()
			return p
		}
	}
	t.Fatal("no two consecutive free ports on 127.0.0.1")
	return 0
}

func mustAtoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatal(err)
	}
	return n
}
