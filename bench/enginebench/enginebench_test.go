package enginebench

import (
	"bytes"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestRunTiny(t *testing.T) {
	r, err := Run(t.Context(), Options{Model: "kvbridge/tiny", PromptLen: 40, DecodeTokens: 3, Chunk: 16, Batches: []int{1, 3},
		DecodeContext: 8, DecodeSteps: 2, Repeat: 1, PeakDuration: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Runs) != 2 || r.Runs[0].DType != "float32" || r.Runs[1].DType != "bfloat16" {
		t.Fatalf("runs %+v, want float32 then bfloat16", r.Runs)
	}
	for _, d := range r.Runs {
		if d.PrefillTokensPerS <= 0 || d.PrefillGFLOPS <= 0 || d.DecodeTokensPerS <= 0 || len(d.Batched) != 2 {
			t.Fatalf("non-positive figure in %+v", d)
		}
		for _, b := range d.Batched {
			if b.TokensPerS <= 0 || b.BoundTokensPerS <= 0 || b.OverBatch1 <= 0 {
				t.Fatalf("batch figure %+v", b)
			}
		}
		if b0, b1 := d.Batched[0].BoundTokensPerS, d.Batched[1].BoundTokensPerS; math.Abs(b1-3*b0) > 1e-9*b1 {
			t.Fatalf("batch 3 bound %g is not 3 × batch 1's %g", d.Batched[1].BoundTokensPerS, d.Batched[0].BoundTokensPerS)
		}
	}
	if r.Runs[1].WeightBytes >= r.Runs[0].WeightBytes {
		t.Fatalf("bfloat16 weights %d bytes, float32 %d", r.Runs[1].WeightBytes, r.Runs[0].WeightBytes)
	}
	var table bytes.Buffer
	if err := r.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"prefill compute", "decode batch 3 (context 8)", "VDPBF16PS peak", "bf16 peak"} {
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
	var m struct {
		PeakGFLOPS float64 `json:"peak_gflops"`
		Runs       []struct {
			PrefillTokensPerS float64 `json:"prefill_tokens_per_s"`
			Batched           []struct {
				TokensPerS float64 `json:"tokens_per_s"`
			} `json:"batched"`
		} `json:"runs"`
	}
	if err := json.Unmarshal(b, &m); err != nil || m.PeakGFLOPS <= 0 || len(m.Runs) != 2 || m.Runs[1].Batched[1].TokensPerS <= 0 {
		t.Fatalf("json: %v %+v", err, m)
	}
}

func TestRunRejectsTooLong(t *testing.T) {
	if _, err := Run(t.Context(), Options{Model: "kvbridge/tiny", PromptLen: 40000, PeakDuration: time.Millisecond}); err == nil {
		t.Fatal("no error for a prompt beyond max_position_embeddings")
	}
}
