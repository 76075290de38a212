package enginebench

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestRunTiny(t *testing.T) {
	r, err := Run(t.Context(), Options{Model: "kvbridge/tiny", PromptLen: 40, DecodeTokens: 3, Chunk: 16, PeakDuration: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if r.PrefillTokensPerS <= 0 || r.PrefillGFLOPS <= 0 || r.PeakGFLOPS <= 0 || r.DecodeTokensPerS <= 0 || r.DecodeBoundTokensPerS <= 0 {
		t.Fatalf("non-positive figure in %+v", r)
	}
	var table bytes.Buffer
	if err := r.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"prefill compute", "decode 3 tokens", "FP32 peak"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}
	path := filepath.Join(t.TempDir(), "r.json")
	if err := r.WriteJSON(path); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"prefill_tokens_per_s", "prefill_gflops", "peak_gflops", "decode_tokens_per_s", "decode_bound_tokens_per_s"} {
		if v, ok := m[k].(float64); !ok || v <= 0 {
			t.Errorf("json %s = %v", k, m[k])
		}
	}
}

func TestRunRejectsTooLong(t *testing.T) {
	if _, err := Run(t.Context(), Options{Model: "kvbridge/tiny", PromptLen: 40000, PeakDuration: time.Millisecond}); err == nil {
		t.Fatal("no error for a prompt beyond max_position_embeddings")
	}
}
