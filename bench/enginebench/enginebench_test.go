package enginebench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/model"
)

func TestRunTiny(t *testing.T) {
	r, err := Run(t.Context(), Options{Model: "kvbridge/tiny", PromptLen: 40, DecodeTokens: 3, Chunk: 16, Batches: []int{1, 3},
		DecodeContexts: []int{8, 20}, KVCacheDTypes: []string{"float32", "bfloat16", "fp8"}, DecodeSteps: 2, Repeat: 3, PeakDuration: 10 * time.Millisecond,
		ProbeBytes: 4 << 20, ProbeWindow: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	type run struct{ dtype, kv string }
	var runs []run
	for _, d := range r.Runs {
		runs = append(runs, run{d.DType, d.KVCacheDType})
	}
	if want := []run{{"float32", "float32"}, {"float32", "bfloat16"}, {"float32", "fp8_e4m3"}, {"bfloat16", "float32"}, {"bfloat16", "bfloat16"}, {"bfloat16", "fp8_e4m3"}}; !slices.Equal(runs, want) {
		t.Fatalf("runs %v, want %v", runs, want)
	}
	m, err := model.Open(t.Context(), "kvbridge/tiny", model.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
	for _, d := range r.Runs {
		checkRunFigures(t, r, d, m.Config())
	}
	if r.Runs[3].WeightBytes >= r.Runs[0].WeightBytes {
		t.Fatalf("bfloat16 weights %d bytes, float32 %d", r.Runs[3].WeightBytes, r.Runs[0].WeightBytes)
	}
	var table bytes.Buffer
	if err := r.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"prefill compute", "decode batch 3 (context 8)", "decode batch 3 (context 20)", "VDPBF16PS peak", "bf16 peak",
		"float32, KV bfloat16", "bfloat16, KV float32", "bfloat16, KV fp8_e4m3", "step bound", "roofline",
		"summary: batch-1 decode", "batch 1 after the prompt", "batch 3 ctx 20", "probed beside each run"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}
	// Every figure of the summary says how much CPU the process had while it ran, so that
	// figures of one run are compared at like CPU (docs/performance.md, "kvbridge at one thread").
	if runtime.GOOS == "linux" {
		cell := regexp.MustCompile(`(after the prompt|ctx \d+) \d+\.\d\d \[\d+\.\d\d\] \([^)]*CPU \d+\.\d\d[^)]*\)`)
		for _, line := range strings.Split(table.String(), "\n") {
			if !strings.Contains(line, "batch 1 after the prompt ") {
				continue
			}
			if n := len(cell.FindAllString(line, -1)); n != 5 {
				t.Errorf("summary line has %d cells with their CPU, want 5 (after the prompt, 2 contexts × 2 batches):\n%s", n, line)
			}
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
	var js struct {
		PeakGFLOPS float64 `json:"peak_gflops"`
		Runs       []struct {
			PrefillTokensPerS float64 `json:"prefill_tokens_per_s"`
			Batched           []struct {
				StepBoundTokensPerS float64 `json:"step_bound_tokens_per_s"`
			} `json:"batched"`
		} `json:"runs"`
	}
	if err := json.Unmarshal(b, &js); err != nil || js.PeakGFLOPS <= 0 || len(js.Runs) != 6 || js.Runs[1].Batched[3].StepBoundTokensPerS <= 0 {
		t.Fatalf("json: %v %+v", err, js)
	}
}

// checkRunFigures checks one run's KV bytes, step bounds and ratios against the model's
// configuration, computed by hand.
func checkRunFigures(t *testing.T, r *Result, d DTypeResult, c model.Config) {
	t.Helper()
	// By hand from the configuration: multiply-adds of one token's products (q, k, v, o, gate,
	// up, down per layer, lm_head) and of its attention over n positions.
	products := float64(c.NumLayers*(c.HiddenSize*(c.NumHeads+2*c.NumKVHeads)*c.HeadDim+c.NumHeads*c.HeadDim*c.HiddenSize+3*c.HiddenSize*c.IntermediateSize)) +
		float64(c.VocabSize*c.HiddenSize)
	attention := func(n int) float64 { return float64(2 * c.NumLayers * c.NumHeads * c.HeadDim * n) }
	if d.PrefillTokensPerS <= 0 || d.PrefillGFLOPS <= 0 || d.DecodeTokensPerS <= 0 || len(d.Batched) != 4 {
		t.Fatalf("non-positive figure in %+v", d)
	}
	size := map[string]int{"float32": 4, "bfloat16": 2, "fp8_e4m3": 1}[d.KVCacheDType] // the weights+KV bound counts these
	if want := int64(c.NumLayers * 2 * c.NumKVHeads * c.HeadDim * size); d.KVBytesPerTok != want {
		t.Fatalf("%s/%s: %d KV bytes a token, want %d", d.DType, d.KVCacheDType, d.KVBytesPerTok, want)
	}
	peak := r.PeakGFLOPS * 1e9
	if d.DType == "bfloat16" {
		peak = r.PeakBF16GFLOPS * 1e9
	}
	bw := r.ReadGBps * 1e9
	for i, b := range d.Batched {
		if wantCtx, wantBatch := []int{8, 20}[i/2], []int{1, 3}[i%2]; b.Context != wantCtx || b.Batch != wantBatch {
			t.Fatalf("batched result %d: batch %d at context %d, want %d at %d", i, b.Batch, b.Context, wantBatch, wantCtx)
		}
		if b.TokensPerS <= 0 || b.BoundTokensPerS <= 0 || b.OverBatch1 <= 0 {
			t.Fatalf("batch figure %+v", b)
		}
		// Steps attend to context+1 and context+2 positions.
		n := float64(b.Batch)
		var kv, attn float64
		for s := 1; s <= 2; s++ {
			kv += n * float64(b.Context+s) * float64(d.KVBytesPerTok) / 2
			attn += n * 2 * attention(b.Context+s) / 2
		}
		step := max(float64(d.WeightBytes)/bw, n*2*products/peak) + max(kv/bw, attn/(r.PeakGFLOPS*1e9))
		if got := b.StepBoundTokensPerS; math.Abs(got-n/step) > 1e-9*got {
			t.Fatalf("%s/%s batch %d context %d: step bound %g tok/s, want %g", d.DType, d.KVCacheDType, b.Batch, b.Context, got, n/step)
		}
		if b.StepBoundTokensPerS > b.RooflineTokensPerS*(1+1e-12) || b.StepBoundTokensPerS > b.BoundWithKVTokensPerS*(1+1e-12) {
			t.Fatalf("step bound %g above the roofline %g or the weights+KV bound %g", b.StepBoundTokensPerS, b.RooflineTokensPerS, b.BoundWithKVTokensPerS)
		}
	}
	if b0, b1 := d.Batched[0].BoundTokensPerS, d.Batched[1].BoundTokensPerS; math.Abs(b1-3*b0) > 1e-9*b1 {
		t.Fatalf("batch 3 bound %g is not 3 × batch 1's %g", d.Batched[1].BoundTokensPerS, d.Batched[0].BoundTokensPerS)
	}
	if one, three := d.Batched[2], d.Batched[3]; math.Abs(three.OverBatch1-three.TokensPerS/one.TokensPerS) > 1e-9 {
		t.Fatalf("context 20: batch 3 over batch 1 %g, want %g (batch 1 at the same context)", three.OverBatch1, three.TokensPerS/one.TokensPerS)
	}
	if d.DecodeBoundRatio <= 0 || math.Abs(d.DecodeBoundRatio-d.DecodeTokensPerS/d.DecodeBoundWithKVTokensPerS) > 1e-9 {
		t.Fatalf("%s: batch-1 decode ratio %g, want %g ÷ %g", d.name(), d.DecodeBoundRatio, d.DecodeTokensPerS, d.DecodeBoundWithKVTokensPerS)
	}
	// Each repetition is divided by the bound at the mean of the bandwidths probed beside it,
	// the figure is the median of those ratios, and the best repetition is the best-of figure.
	meanCtx := float64(r.PromptLen) + float64(r.DecodeTokens)/2
	checkProbed(t, d.name()+" after the prompt", d.DecodeReps, d.DecodeProbedRatio, d.DecodeTokensPerS, d.DecodeCPUCores, r.Repeat,
		func(bw float64) float64 { return bw / (float64(d.WeightBytes) + meanCtx*float64(d.KVBytesPerTok)) })
	for _, b := range d.Batched {
		n := float64(b.Batch)
		bound := func(bw float64) float64 { return n * bw / (float64(d.WeightBytes) + b.kvBytes) }
		if b.Batch > 1 {
			bound = func(bw float64) float64 {
				return n / (max(float64(d.WeightBytes)/bw, b.productFLOPs/peak) + max(b.kvBytes/bw, b.attnFLOPs/(r.PeakGFLOPS*1e9)))
			}
		}
		checkProbed(t, fmt.Sprintf("%s batch %d ctx %d", d.name(), b.Batch, b.Context), b.Reps, b.ProbedRatio, b.TokensPerS, b.CPUCores, r.Repeat, bound)
	}
}

// checkProbed checks a decode figure's repetitions against bound (tokens/s at a bandwidth in
// bytes a second): one per run, each with its probes' mean inside their range, each ratio
// against the bound at that mean, ratio their median, best the fastest repetition and cores its
// CPU (read on Linux).
func checkProbed(t *testing.T, name string, reps []Rep, ratio, best, cores float64, repeat int, bound func(bw float64) float64) {
	t.Helper()
	if len(reps) != repeat {
		t.Fatalf("%s: %d repetitions, want %d", name, len(reps), repeat)
	}
	var ratios []float64
	var fastest Rep
	for _, rep := range reps {
		if !(rep.ReadGBpsMin > 0 && rep.ReadGBpsMin <= rep.ReadGBps*(1+1e-12) && rep.ReadGBps <= rep.ReadGBpsMax*(1+1e-12) && rep.TokensPerS > 0) {
			t.Fatalf("%s: repetition %+v", name, rep)
		}
		want := rep.TokensPerS / bound(rep.ReadGBps*1e9)
		if math.Abs(rep.Ratio-want) > 1e-9*want {
			t.Fatalf("%s: repetition %+v: ratio %g, want %g", name, rep, rep.Ratio, want)
		}
		ratios = append(ratios, want)
		if rep.TokensPerS > fastest.TokensPerS {
			fastest = rep
		}
	}
	slices.Sort(ratios)
	if want := ratios[len(ratios)/2]; math.Abs(ratio-want) > 1e-9*want {
		t.Fatalf("%s: probed ratio %g, want the median %g of %v", name, ratio, want, ratios)
	}
	if fastest.TokensPerS != best || fastest.CPUCores != cores {
		t.Fatalf("%s: best %g tok/s at CPU %g, want the fastest repetition's %+v", name, best, cores, fastest)
	}
	if runtime.GOOS == "linux" && cores <= 0 {
		t.Fatalf("%s: no CPU figure on Linux", name)
	}
}

func TestRunRejectsTooLong(t *testing.T) {
	if _, err := Run(t.Context(), Options{Model: "kvbridge/tiny", PromptLen: 40000, PeakDuration: time.Millisecond}); err == nil {
		t.Fatal("no error for a prompt beyond max_position_embeddings")
	}
}

// TestVerdictDistrustsStarvedProbes: a batch-1 figure whose probes read less than the decode
// itself moved (probed ratio above 1) is judged by its bracketed ratio, so a starved probe
// cannot make a cell pass; a batched step bound, whose compute terms can be beaten, keeps its
// probed ratio.
func TestVerdictDistrustsStarvedProbes(t *testing.T) {
	for _, c := range []struct {
		probed, old, target float64
		memory              bool
		want                string
	}{
		{0.95, 0.80, 0.9, true, "ok"},
		{0.85, 0.95, 0.9, true, "below"},
		{1.12, 0.54, 0.9, true, "below, by the bracket: probe starved"},
		{1.12, 0.93, 0.9, true, "ok, by the bracket: probe starved"},
		{1.24, 1.16, 0.8, false, "ok"},
		{0.76, 0.72, 0.8, false, "below"},
	} {
		if got := verdict(c.probed, c.old, c.target, c.memory); got != c.want {
			t.Errorf("verdict(%v, %v, %v, %v) = %q, want %q", c.probed, c.old, c.target, c.memory, got, c.want)
		}
	}
}
