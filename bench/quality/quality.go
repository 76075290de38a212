// Package quality measures how far a model's reduced-precision variants (--quantization,
// --dtype, --kv-cache-dtype) move its next-token distributions from a float32 reference on the
// same weights, as llama.cpp's `llama-perplexity --kl-divergence` does: the mean (and the 99th
// percentile and maximum) KL divergence KL(reference ‖ variant) over every position of random
// prompts, and how often both pick the same most likely token. A simulation of llama.cpp's Q8_0
// quantization (blocks of 32 with a float16 scale, products on Q8_0 activations) on the same
// weights is reported alongside as a baseline. It backs `kvbridge bench quality`.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package quality

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"text/tabwriter"

	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/model/kernel"
	"github.com/kvbridge/kvbridge/stack"
)

// Variant is one way of running the model, compared with the float32 reference.
type Variant struct {
	// Name labels the variant's row.
	Name string
	// Open are the options the variant's model is opened with.
	Open model.OpenOptions
	// Quantization labels the row's quantization (default: the opened model's, "none" for
	// unquantized weights).
	Quantization string
}

// Q8_0 returns the simulation of llama.cpp's Q8_0: GGUF's block_q8_0 (32 weights, one float16
// scale d = amax/127, q = round(x/d)) applied to every weight matrix, and the activations
// quantized to Q8_0 blocks as ggml does for a Q8_0 matrix product (ggml_vec_dot_q8_0_q8_0:
// Σ blocks sumi · d_w · d_x). It runs kvbridge's int8 kernels with both scales rounded to
// float16 — bit for bit ggml's reference arithmetic (kernel's TestInt8SimulatesQ8_0) — not
// llama.cpp itself.
func Q8_0() Variant {
	return Variant{
		Name:         "Q8_0 (simulated llama.cpp)",
		Quantization: "Q8_0 (simulated)",
		Open:         model.OpenOptions{DType: "float32", KVCacheDType: "float32", Quantization: "int8", Int8RoundScale: roundF16},
	}
}

// roundF16 rounds a scale to GGUF's ggml_half (IEEE float16, nearest even).
func roundF16(d float32) float32 { return kernel.F16ToF32(kernel.F32ToF16(d)) }

// Options configure a run. Zero values take the defaults noted on each field.
type Options struct {
	// Model is the model to load (default kvbridge/small): a built-in model, a Hugging Face
	// directory (such as `kvbridge dev random-checkpoint`'s) or a cached repo id.
	Model string
	// Variants are compared with the reference (default: --quantization int8, then Q8_0()).
	Variants []Variant
	// Prompts is the number of random prompts (default 200); Positions their length in tokens
	// (default 32): every position's next-token distribution is compared.
	Prompts, Positions int
	// Batch is the number of prompts computed in one forward pass (default 8; the outputs do
	// not depend on it: the forward pass is batch-invariant).
	Batch int
	// Seed chooses the prompts (default 1).
	Seed uint64
	// Progress, if non-nil, receives one line per phase.
	Progress io.Writer
}

func (o *Options) defaults() {
	if o.Model == "" {
		o.Model = model.Small
	}
	if len(o.Variants) == 0 {
		o.Variants = []Variant{{Name: "int8", Open: model.OpenOptions{DType: "float32", KVCacheDType: "float32", Quantization: "int8"}}, Q8_0()}
	}
	if o.Prompts <= 0 {
		o.Prompts = 200
	}
	if o.Positions <= 0 {
		o.Positions = 32
	}
	if o.Batch <= 0 {
		o.Batch = 8
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
}

// Result is one run's figures. JSON names are the `--json` file's keys.
type Result struct {
	Model     string `json:"model"`
	Prompts   int    `json:"prompts"`
	Positions int    `json:"positions"`
	// Reference describes the reference's precision.
	Reference string `json:"reference"`
	// Int8Products is how int8 products ran: "VPDPBUSD" or "portable Go" (the same bits).
	Int8Products string `json:"int8_products"`
	Rows         []Row  `json:"rows"`
}

// Row is one variant's figures over all positions of all prompts.
type Row struct {
	Name         string `json:"name"`
	DType        string `json:"dtype"`
	KVCacheDType string `json:"kv_cache_dtype"`
	Quantization string `json:"quantization"`
	WeightBytes  int64  `json:"weight_bytes"`
	// MeanKL is the mean of KL(reference ‖ variant) in nats; StdErrKL its standard error;
	// P99KL and MaxKL the 99th percentile and the largest.
	MeanKL   float64 `json:"mean_kl"`
	StdErrKL float64 `json:"stderr_kl"`
	P99KL    float64 `json:"p99_kl"`
	MaxKL    float64 `json:"max_kl"`
	// Top1 is the fraction of positions where the variant's most likely token is the
	// reference's.
	Top1 float64 `json:"top1"`

	kl    []float64
	same  int
	total int
}

// runner is one opened model with a KV pool for a batch of prompts.
type runner struct {
	m      *model.Model
	pool   *kvcache.Pool
	blocks []int32
	per    int // blocks per prompt
}

// open opens the model with opts and a pool for batch prompts of positions tokens.
func open(ctx context.Context, name string, opts model.OpenOptions, batch, positions int) (*runner, error) {
	m, err := model.Open(ctx, name, opts)
	if err != nil {
		return nil, err
	}
	c := m.Config()
	if positions > c.MaxPositionEmbeddings {
		m.Close()
		return nil, fmt.Errorf("quality: %d positions exceed the model's %d", positions, c.MaxPositionEmbeddings)
	}
	dt, err := kvcache.ParseDType(m.KVCacheDType())
	if err != nil {
		m.Close()
		return nil, fmt.Errorf("quality: %w", err)
	}
	geo := kvcache.Geometry{NumLayers: c.NumLayers, NumKVHeads: c.NumKVHeads, HeadDim: c.HeadDim, BlockSize: kvcache.DefaultBlockSize, DType: dt}
	per := (positions + geo.BlockSize - 1) / geo.BlockSize
	pool, err := kvcache.NewPool(kvcache.AlignedMemory(batch*per*geo.BlockBytes()), kvcache.PoolConfig{Geometry: geo, NumBlocks: batch * per})
	if err != nil {
		m.Close()
		return nil, fmt.Errorf("quality: %w", err)
	}
	blocks, err := pool.Allocate(batch * per)
	if err != nil {
		m.Close()
		return nil, fmt.Errorf("quality: %w", err)
	}
	return &runner{m: m, pool: pool, blocks: blocks, per: per}, nil
}

// close returns the blocks and closes the model.
func (r *runner) close() {
	r.pool.Free(r.blocks...)
	r.m.Close()
}

// logProbs computes every position's log-softmax for the prompts (at most the runner's batch)
// into out[prompt][position] (float64, vocabulary-sized).
func (r *runner) logProbs(ctx context.Context, prompts [][]int32, out [][][]float64) error {
	seqs := make([]model.Seq, len(prompts))
	for i, p := range prompts {
		seqs[i] = model.Seq{Tokens: p, Blocks: r.blocks[i*r.per : (i+1)*r.per], RowLogits: func(pos int, logits []float32) {
			logSoftmax(out[i][pos], logits)
		}}
	}
	return r.m.Forward(ctx, r.pool, kvcache.DefaultBlockSize, seqs)
}

// logSoftmax writes log(softmax(x)) into dst, in float64.
func logSoftmax(dst []float64, x []float32) {
	m := float64(slices.Max(x))
	var s float64
	for _, v := range x {
		s += math.Exp(float64(v) - m)
	}
	l := m + math.Log(s)
	for i, v := range x {
		dst[i] = float64(v) - l
	}
}

// klDivergence returns KL(p ‖ q) = Σ p (log p − log q) for log-probabilities lp and lq.
func klDivergence(lp, lq []float64) float64 {
	var kl float64
	for i, a := range lp {
		if p := math.Exp(a); p > 0 {
			kl += p * (a - lq[i])
		}
	}
	return max(kl, 0)
}

// Run opens the float32 reference and every variant on the same weights, runs the same random
// prompts through each and compares every position's distribution with the reference's.
func Run(ctx context.Context, opts Options) (*Result, error) {
	opts.defaults()
	progress := stack.Printer(opts.Progress)
	progress("loading %s: float32 reference and %d variants", opts.Model, len(opts.Variants))
	ref, err := open(ctx, opts.Model, model.OpenOptions{DType: "float32", KVCacheDType: "float32"}, opts.Batch, opts.Positions)
	if err != nil {
		return nil, err
	}
	defer ref.close()
	res := &Result{Model: ref.m.Name(), Prompts: opts.Prompts, Positions: opts.Positions, Int8Products: kernel.Int8Products(),
		Reference: "float32 products, float32 KV cache, unquantized weights"}
	runners := make([]*runner, len(opts.Variants))
	for i, v := range opts.Variants {
		r, err := open(ctx, opts.Model, v.Open, opts.Batch, opts.Positions)
		if err != nil {
			return nil, fmt.Errorf("quality: variant %s: %w", v.Name, err)
		}
		defer r.close()
		runners[i] = r
		q := cmp.Or(v.Quantization, r.m.Quantization(), "none")
		res.Rows = append(res.Rows, Row{Name: v.Name, DType: r.m.DType(), KVCacheDType: r.m.KVCacheDType(), Quantization: q, WeightBytes: r.m.WeightBytes()})
	}
	vocab := ref.m.Config().VocabSize
	rng := rand.New(rand.NewPCG(opts.Seed, 0))
	tokens := ref.m.Tokenizer().VocabSize()
	buffer := func() [][][]float64 {
		b := make([][][]float64, opts.Batch)
		for i := range b {
			b[i] = make([][]float64, opts.Positions)
			for j := range b[i] {
				b[i][j] = make([]float64, vocab)
			}
		}
		return b
	}
	want, got := buffer(), buffer()
	for start := 0; start < opts.Prompts; start += opts.Batch {
		prompts := make([][]int32, min(opts.Batch, opts.Prompts-start))
		for i := range prompts {
			prompts[i] = make([]int32, opts.Positions)
			for j := range prompts[i] {
				prompts[i][j] = int32(rng.IntN(tokens))
			}
		}
		progress("prompts %d–%d of %d", start+1, start+len(prompts), opts.Prompts)
		if err := ref.logProbs(ctx, prompts, want); err != nil {
			return nil, err
		}
		for v, r := range runners {
			if err := r.logProbs(ctx, prompts, got); err != nil {
				return nil, err
			}
			row := &res.Rows[v]
			for i := range prompts {
				for pos := range opts.Positions {
					row.kl = append(row.kl, klDivergence(want[i][pos], got[i][pos]))
					if argmax(want[i][pos]) == argmax(got[i][pos]) {
						row.same++
					}
					row.total++
				}
			}
		}
	}
	for i := range res.Rows {
		res.Rows[i].summarize()
	}
	return res, nil
}

// argmax returns the index of the largest value (the first of equal ones).
func argmax(x []float64) int {
	best := 0
	for i, v := range x {
		if v > x[best] {
			best = i
		}
	}
	return best
}

// summarize fills the row's statistics from its per-position divergences.
func (r *Row) summarize() {
	n := float64(len(r.kl))
	if n == 0 {
		return
	}
	var sum, sq float64
	for _, v := range r.kl {
		sum += v
		sq += v * v
	}
	r.MeanKL = sum / n
	if n > 1 {
		r.StdErrKL = math.Sqrt(max(0, sq/n-r.MeanKL*r.MeanKL) / (n - 1))
	}
	sorted := slices.Sorted(slices.Values(r.kl))
	r.P99KL = sorted[min(len(sorted)-1, int(math.Ceil(0.99*n))-1)]
	r.MaxKL = sorted[len(sorted)-1]
	r.Top1 = float64(r.same) / float64(r.total)
}

// WriteTable prints the result as a table, one row per variant.
func (r *Result) WriteTable(w io.Writer) error {
	fmt.Fprintf(w, "kvbridge bench quality: %s, %d random prompts × %d positions against the reference (%s); int8 products: %s\n",
		r.Model, r.Prompts, r.Positions, r.Reference, r.Int8Products)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "variant\tdtype\tKV cache\tquantization\tweights\tmean KL (nats)\t± std err\tKL p99\tKL max\ttop-1 agreement\t\n")
	for _, row := range r.Rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.1f MB\t%.3g\t%.2g\t%.3g\t%.3g\t%.2f%%\t\n", row.Name, row.DType, row.KVCacheDType, row.Quantization,
			float64(row.WeightBytes)/1e6, row.MeanKL, row.StdErrKL, row.P99KL, row.MaxKL, 100*row.Top1)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprint(w, "KL = KL(reference ‖ variant) of each position's next-token distribution, as llama-perplexity --kl-divergence reports it\n"+
		"Q8_0 (simulated llama.cpp): GGUF block_q8_0 (32 weights, float16 d = amax/127, q = round(x/d)) on every weight matrix and Q8_0 activations, computed by kvbridge's int8 kernels with float16 scales; llama.cpp itself did not run\n")
	return err
}

// WriteJSON writes the result to path as indented JSON.
func (r *Result) WriteJSON(path string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("quality: %w", err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("quality: %w", err)
	}
	return nil
}
