package quality

import (
	"bytes"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/model"
)

// TestRunTiny runs the comparison small on kvbridge/tiny: the float32 variant is the reference
// itself (KL 0, full agreement), int8 and the Q8_0 simulation move the distributions a little
// (KL > 0 but small, nearly full agreement), as does an fp8 KV cache through the same options,
// and the table and JSON carry every row.
func TestRunTiny(t *testing.T) {
	r, err := Run(t.Context(), Options{Model: model.Tiny, Prompts: 5, Positions: 6, Batch: 2, Variants: []Variant{
		{Name: "float32", Open: model.OpenOptions{DType: "float32"}},
		{Name: "int8", Open: model.OpenOptions{Quantization: "int8"}},
		Q8_0(),
		{Name: "fp8 KV", Open: model.OpenOptions{DType: "float32", KVCacheDType: "fp8"}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Rows) != 4 || r.Prompts != 5 || r.Positions != 6 {
		t.Fatalf("result %+v", r)
	}
	if f := r.Rows[0]; f.MeanKL != 0 || f.MaxKL != 0 || f.Top1 != 1 || f.Quantization != "none" {
		t.Errorf("float32 against the float32 reference: %+v", f)
	}
	for _, row := range r.Rows[1:] {
		if !(row.MeanKL > 0 && row.MeanKL < 1e-3) || row.Top1 < 0.9 || row.P99KL < row.MeanKL || row.MaxKL < row.P99KL || row.total != 30 {
			t.Errorf("%s: %+v", row.Name, row)
		}
	}
	if r.Rows[1].Quantization != "int8" || r.Rows[2].Quantization != "Q8_0 (simulated)" || r.Rows[1].WeightBytes >= r.Rows[0].WeightBytes/3 ||
		r.Rows[3].KVCacheDType != "fp8_e4m3" || r.Rows[3].Quantization != "none" {
		t.Errorf("rows %+v", r.Rows)
	}
	var table bytes.Buffer
	if err := r.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"mean KL", "top-1 agreement", "Q8_0 (simulated llama.cpp)", "llama.cpp itself did not run"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}
	if err := r.WriteJSON(filepath.Join(t.TempDir(), "q.json")); err != nil {
		t.Fatal(err)
	}
}

// TestBatchDoesNotMatter: the figures do not depend on how many prompts share a forward pass.
func TestBatchDoesNotMatter(t *testing.T) {
	run := func(batch int) Row {
		r, err := Run(t.Context(), Options{Model: model.Tiny, Prompts: 4, Positions: 5, Batch: batch, Variants: []Variant{{Name: "int8", Open: model.OpenOptions{Quantization: "int8"}}}})
		if err != nil {
			t.Fatal(err)
		}
		return r.Rows[0]
	}
	a, b := run(1), run(3)
	if math.Float64bits(a.MeanKL) != math.Float64bits(b.MeanKL) || a.Top1 != b.Top1 {
		t.Errorf("batch 1: KL %g top-1 %g; batch 3: KL %g top-1 %g", a.MeanKL, a.Top1, b.MeanKL, b.Top1)
	}
}

// TestKLDivergence pins the divergence on a case computed by hand.
func TestKLDivergence(t *testing.T) {
	p := []float64{math.Log(0.5), math.Log(0.5)}
	q := []float64{math.Log(0.25), math.Log(0.75)}
	want := 0.5*math.Log(0.5/0.25) + 0.5*math.Log(0.5/0.75)
	if got := klDivergence(p, q); math.Abs(got-want) > 1e-15 {
		t.Errorf("KL = %g, want %g", got, want)
	}
	dst := make([]float64, 3)
	logSoftmax(dst, []float32{1, 2, 3})
	var s float64
	for _, v := range dst {
		s += math.Exp(v)
	}
	if math.Abs(s-1) > 1e-12 || argmax(dst) != 2 {
		t.Errorf("log-softmax %v", dst)
	}
}
