package enginebench

import (
	"bytes"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/model"
)

// TestRunTinyInt8: --quantization int8 adds a run whose bound counts one byte a weight plus a
// float32 scale per 32, and the table names it.
func TestRunTinyInt8(t *testing.T) {
	r, err := Run(t.Context(), Options{Model: "kvbridge/tiny", DTypes: []string{"float32"}, Quantizations: []string{"", "int8"}, PromptLen: 24,
		DecodeTokens: 2, Batches: []int{1}, DecodeContexts: []int{8}, DecodeSteps: 2, Repeat: 1, PeakDuration: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Runs) != 2 || r.Runs[0].Quantization != "" || r.Runs[1].Quantization != "int8" {
		t.Fatalf("runs %+v", r.Runs)
	}
	m, err := model.Open(t.Context(), "kvbridge/tiny", model.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c := m.Config()
	m.Close()
	// By hand: every matrix holds out × in bytes plus 4 bytes per group of 32 inputs of each
	// row; the norms stay float32.
	h, q, kv, in := c.HiddenSize, c.NumHeads*c.HeadDim, c.NumKVHeads*c.HeadDim, c.IntermediateSize
	mat := func(out, in int) int64 { return int64(out) * int64(in+4*((in+31)/32)) }
	var want int64
	for range c.NumLayers {
		want += mat(q+2*kv, h) + mat(h, q) + mat(2*in, h) + mat(h, in) + 4*int64(2*h)
		if c.QKNorm {
			want += 4 * int64(2*c.HeadDim)
		}
	}
	want += mat(c.VocabSize, h) + 4*int64(h)
	d := r.Runs[1]
	if d.WeightBytes != want {
		t.Errorf("int8 weight bytes %d, want %d", d.WeightBytes, want)
	}
	if b := d.Batched[0]; math.Abs(b.BoundTokensPerS-r.ReadGBps*1e9/float64(want)) > 1e-9*b.BoundTokensPerS || b.TokensPerS <= 0 {
		t.Errorf("int8 batch 1: bound %g tok/s, want %g; measured %g", b.BoundTokensPerS, r.ReadGBps*1e9/float64(want), b.TokensPerS)
	}
	var table bytes.Buffer
	if err := r.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(table.String(), "float32, int8 weights") || !strings.Contains(table.String(), "int8 products: "+r.Int8Products) {
		t.Errorf("table lacks the int8 run:\n%s", table.String())
	}
	// The int8 run's products are held to the VPDPBUSD peak where the instruction runs them.
	if peak, name := r.productPeak(&r.Runs[1]); r.Int8Products == "VPDPBUSD" && (r.PeakInt8GOPS <= 0 || peak != r.PeakInt8GOPS || name != "int8 peak") {
		t.Errorf("int8 products held to %s %g GOP/s; VPDPBUSD peak measured %g", name, peak, r.PeakInt8GOPS)
	}
	if !strings.Contains(table.String(), "VPDPBUSD peak") {
		t.Errorf("table lacks the VPDPBUSD peak:\n%s", table.String())
	}
}
