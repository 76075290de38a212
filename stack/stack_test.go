package stack_test

import (
	"net/http"
	"testing"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
)

// TestStackThroughFaultProxies: a one-way stack on TCP with fault proxies in every path of P
// and D and a single engine. A completion through the proxy equals the single engine's, its KV
// went through P's side-channel and transfer fault proxies, and D counted the read. After P
// restarts (same side-channel port) the next request goes the same way. Close, twice, leaves
// every pool full.
func TestStackThroughFaultProxies(t *testing.T) {
	m, err := stack.OpenModel(t.Context(), model.Tiny, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	s, err := stack.Start(t.Context(), stack.Config{
		Model: m, Backend: "TCP", NumBlocks: 128, MaxModelLen: 1024, Single: true,
		P: stack.EngineConfig{Faults: stack.FaultAll, KeepSideChannelPort: true}, D: stack.EngineConfig{Faults: stack.FaultAll},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	hc := &http.Client{Transport: stack.NewTransport(4)}
	defer hc.CloseIdleConnections()
	ask := func(prompt string) {
		t.Helper()
		body := map[string]any{"model": model.Tiny, "prompt": prompt, "max_tokens": 8, "temperature": 0}
		d0, err := s.D.Stats()
		if err != nil {
			t.Fatal(err)
		}
		side0, xfer0 := s.P.Faults.SideChannel.Stats().Accepted, s.P.Faults.Transfer.Stats().Forwarded[1]
		pd, err := apiclient.Post(t.Context(), hc, s.URL+"/v1/completions", body, nil)
		if err != nil || pd.Check(s.URL) != nil {
			t.Fatalf("through the proxy: %v %v", err, pd.Check(s.URL))
		}
		single, err := apiclient.Post(t.Context(), hc, s.Single.URL()+"/v1/completions", body, nil)
		if err != nil || single.Check(s.Single.URL()) != nil {
			t.Fatalf("single engine: %v %v", err, single.Check(s.Single.URL()))
		}
		if pd.Text != single.Text {
			t.Errorf("P/D %q, single engine %q", pd.Text, single.Text)
		}
		d1, err := s.D.Stats()
		if err != nil {
			t.Fatal(err)
		}
		if d1.Transfers <= d0.Transfers || d1.PulledTokens <= d0.PulledTokens || d1.TransferBytes <= d0.TransferBytes {
			t.Errorf("D counted no read: before %+v, after %+v", d0, d1)
		}
		if s.P.Faults.Transfer.Stats().Forwarded[1] <= xfer0 {
			t.Error("P's KV did not pass its transfer fault proxy")
		}
		if s.P.Faults.SideChannel.Stats().Accepted <= side0 {
			t.Error("D did not handshake with P through its side-channel fault proxy")
		}
	}
	ask("The KV cache of this prompt moves from one engine to the other through fault proxies.")
	port := s.P.SideChannelPort()
	if err := s.Restart(t.Context(), s.P); err != nil {
		t.Fatal(err)
	}
	if got := s.P.SideChannelPort(); got != port {
		t.Errorf("P's side channel moved from %d to %d across the restart", port, got)
	}
	ask("After the restart, D handshakes with the new P through the same fault proxies again.")
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := s.CheckPools(); err != nil {
		t.Error(err)
	}
}
