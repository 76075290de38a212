package enginebench

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// TestRunTinyTensorParallel: TensorParallelSizes 1 and 2 give a run each, at that size (the
// same weights: TP splits them, it adds none), and the table names the TP 2 run.
func TestRunTinyTensorParallel(t *testing.T) {
	r, err := Run(t.Context(), Options{Model: "kvbridge/tiny", DTypes: []string{"float32"}, TensorParallelSizes: []int{1, 2}, PromptLen: 24,
		DecodeTokens: 2, Batches: []int{1, 2}, DecodeContexts: []int{8}, DecodeSteps: 2, Repeat: 1, PeakDuration: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Runs) != 2 || r.Runs[0].TensorParallelSize != 1 || r.Runs[1].TensorParallelSize != 2 {
		t.Fatalf("runs %+v", r.Runs)
	}
	// Each rank reads the norm vectors: a few more bytes, no more matrices.
	if one, two := r.Runs[0], r.Runs[1]; two.WeightBytes < one.WeightBytes || two.WeightBytes > one.WeightBytes*101/100 || one.KVBytesPerTok != two.KVBytesPerTok ||
		two.PrefillTokensPerS <= 0 || two.DecodeTokensPerS <= 0 || len(two.Batched) != 2 {
		t.Errorf("TP 1 %+v\nTP 2 %+v", one, two)
	}
	var table bytes.Buffer
	if err := r.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(table.String(), "float32, TP 2") {
		t.Errorf("table lacks the TP 2 run:\n%s", table.String())
	}
}
