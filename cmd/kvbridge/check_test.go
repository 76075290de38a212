package main

import (
	"testing"

	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
)

// TestCheckExitStatus: `kvbridge check` exits 0 for a working P/D stack (the real engines
// behind the real proxy) and 1 when it is told the engines the other way round, naming the
// swap; the check package's TestCheck covers each misconfiguration.
func TestCheckExitStatus(t *testing.T) {
	m, err := stack.OpenModel(t.Context(), model.Tiny, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	s, err := stack.Start(t.Context(), stack.Config{Model: m, NumBlocks: 256, MaxModelLen: 2048})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if code := run([]string{"check", "--proxy", s.URL, "--prefill", s.P.URL(), "--decode", s.D.URL()}); code != 0 {
		t.Errorf("kvbridge check of a working stack: exit status %d, want 0", code)
	}
	if code := run([]string{"check", "--proxy", s.URL, "--prefill", s.D.URL(), "--decode", s.P.URL()}); code != 1 {
		t.Errorf("kvbridge check told P and D the other way round: exit status %d, want 1", code)
	}
	if err := s.CheckPools(); err != nil {
		t.Error(err)
	}
}
