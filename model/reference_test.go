package model

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// referenceLogits is a naive forward pass: contiguous KV, straightforward loops, float64
// accumulation everywhere. It returns the logits of every position.
func referenceLogits(c Config, w *weights, tokens []int32) [][]float64 {
	h, hd, nh, nkv := c.HiddenSize, c.HeadDim, c.NumHeads, c.NumKVHeads
	eps := c.RMSNormEps
	matvec := func(wt []float32, x []float64, out int) []float64 {
		in := len(x)
		y := make([]float64, out)
		for n := range out {
			s := 0.0
			for k := range in {
				s += float64(wt[n*in+k]) * x[k]
			}
			y[n] = s
		}
		return y
	}
	rmsnorm := func(x []float64, wt []float32) []float64 {
		ss := 0.0
		for _, v := range x {
			ss += v * v
		}
		inv := 1 / math.Sqrt(ss/float64(len(x))+eps)
		y := make([]float64, len(x))
		for i, v := range x {
			y[i] = v * inv * float64(wt[i])
		}
		return y
	}
	addBias := func(y []float64, b []float32) {
		for i := range b {
			y[i] += float64(b[i])
		}
	}
	r := newRope(c)
	ropeApply := func(x []float64, pos int) {
		half := hd / 2
		for i := range half {
			s, co := math.Sincos(float64(pos) * r.invFreq[i])
			s, co = s*r.scale, co*r.scale
			a, b := x[i], x[i+half]
			x[i] = a*co - b*s
			x[i+half] = b*co + a*s
		}
	}

	T := len(tokens)
	x := make([][]float64, T)
	for t, id := range tokens {
		x[t] = make([]float64, h)
		for i := range h {
			x[t][i] = float64(w.embed.data[int(id)*h+i])
		}
	}
	for _, l := range w.layers {
		K := make([][]float64, T) // nkv*hd per position
		V := make([][]float64, T)
		Q := make([][]float64, T)
		for t := range T {
			hn := rmsnorm(x[t], l.inNorm)
			q, k, v := matvec(l.q.data, hn, nh*hd), matvec(l.k.data, hn, nkv*hd), matvec(l.v.data, hn, nkv*hd)
			addBias(q, l.qb)
			addBias(k, l.kb)
			addBias(v, l.vb)
			for hh := range nh {
				qh := q[hh*hd : (hh+1)*hd]
				if l.qNorm != nil {
					copy(qh, rmsnorm(qh, l.qNorm))
				}
				ropeApply(qh, t)
			}
			for g := range nkv {
				kh := k[g*hd : (g+1)*hd]
				if l.kNorm != nil {
					copy(kh, rmsnorm(kh, l.kNorm))
				}
				ropeApply(kh, t)
			}
			Q[t], K[t], V[t] = q, k, v
		}
		for t := range T {
			attn := make([]float64, nh*hd)
			for hh := range nh {
				g := hh / (nh / nkv)
				q := Q[t][hh*hd : (hh+1)*hd]
				scores := make([]float64, t+1)
				mx := math.Inf(-1)
				for j := 0; j <= t; j++ {
					s := 0.0
					for d := range hd {
						s += q[d] * K[j][g*hd+d]
					}
					scores[j] = s / math.Sqrt(float64(hd))
					mx = max(mx, scores[j])
				}
				sum := 0.0
				for j := range scores {
					scores[j] = math.Exp(scores[j] - mx)
					sum += scores[j]
				}
				for j := range scores {
					for d := range hd {
						attn[hh*hd+d] += scores[j] / sum * V[j][g*hd+d]
					}
				}
			}
			o := matvec(l.o.data, attn, h)
			for i := range h {
				x[t][i] += o[i]
			}
			hn := rmsnorm(x[t], l.postNorm)
			in := c.IntermediateSize
			gate, up := matvec(l.gate.data, hn, in), matvec(l.up.data, hn, in)
			act := make([]float64, in)
			for i := range in {
				act[i] = gate[i] / (1 + math.Exp(-gate[i])) * up[i]
			}
			d := matvec(l.down.data, act, h)
			for i := range h {
				x[t][i] += d[i]
			}
		}
	}
	head := w.lmHead.data
	if head == nil {
		head = w.embed.data
	}
	out := make([][]float64, T)
	for t := range T {
		out[t] = matvec(head, rmsnorm(x[t], w.norm), c.VocabSize)
	}
	return out
}

// randomTokens returns n token ids in [0, vocab) from a fixed seed.
func randomTokens(n, vocab int, seed uint64) []int32 {
	rng := rand.New(rand.NewPCG(seed, 1))
	t := make([]int32, n)
	for i := range t {
		t[i] = int32(rng.IntN(vocab))
	}
	return t
}

// forwardAll runs the whole prompt through m in one step on a fresh store and returns the
// logits of every position (one step per position, chunk of 1, to collect them all).
func forwardAll(t *testing.T, m *Model, tokens []int32, blockSize int) [][]float32 {
	t.Helper()
	c := m.Config()
	nb := (len(tokens) + blockSize - 1) / blockSize
	kv := newTestKVFor(m, blockSize, nb, false)
	blocks := blockRange(0, nb)
	out := make([][]float32, len(tokens))
	for i := range tokens {
		out[i] = make([]float32, c.VocabSize)
		if err := m.Forward(t.Context(), kv, blockSize, []Seq{{Tokens: tokens[i : i+1], Start: i, Blocks: blocks, Logits: out[i]}}); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// compareReference checks m's logits against the naive reference within tol at every position.
func compareReference(t *testing.T, m *Model, w *weights, tokens []int32, tol float64) {
	t.Helper()
	want := referenceLogits(m.cfg, w, tokens)
	got := forwardAll(t, m, tokens, 16)
	worst := 0.0
	for p := range tokens {
		for i, v := range got[p] {
			d := math.Abs(float64(v) - want[p][i])
			if !(d <= tol) {
				t.Fatalf("position %d logit %d: got %g, reference %g (|diff| %g > %g)", p, i, v, want[p][i], d, tol)
			}
			worst = max(worst, d)
		}
	}
	// The whole prompt in one step (the packed prefill path) matches too.
	nb := (len(tokens) + 15) / 16
	last := prefillChunked(t, m, newTestKV(m.cfg, 16, nb, false), 16, blockRange(0, nb), tokens, len(tokens))
	for i, v := range last {
		if d := math.Abs(float64(v) - want[len(tokens)-1][i]); !(d <= tol) {
			t.Fatalf("one-step prefill logit %d: got %g, reference %g", i, v, want[len(tokens)-1][i])
		}
	}
	t.Logf("%s: max |logit - reference| = %.3g over %d positions", m.cfg.Architecture, worst, len(tokens))
}

func TestForwardMatchesReferenceTiny(t *testing.T) {
	m := openTiny(t)
	spec, _ := builtinSpecs(Tiny)
	w := randomWeights(builtinConfig(spec, m.cfg.VocabSize), spec.seed)
	compareReference(t, m, w, randomTokens(37, m.cfg.VocabSize, 1), 1e-4)
}

// variantConfigs are Llama/Qwen2-style configurations run through the same forward pass.
func variantConfigs(vocab int) []Config {
	base := Config{
		VocabSize: vocab, HiddenSize: 48, IntermediateSize: 96, NumLayers: 2, NumHeads: 6, NumKVHeads: 2,
		HeadDim: 8, RMSNormEps: 1e-5, RopeTheta: 10000, MaxPositionEmbeddings: 4096, DType: "float32", BOSTokenID: -1,
	}
	llama := base
	llama.Architecture = "LlamaForCausalLM"
	llama.RopeScaling = &RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositionEmbeddings: 64}
	qwen2 := base
	qwen2.Architecture, qwen2.AttentionBias, qwen2.TieWordEmbeddings, qwen2.NumKVHeads = "Qwen2ForCausalLM", true, true, 6
	qwen3 := base
	qwen3.Architecture, qwen3.QKNorm, qwen3.HeadDim, qwen3.NumKVHeads = "Qwen3ForCausalLM", true, 16, 3
	// YaRN scales cos and sin as well as the frequencies (attention factor 0.1·ln 4 + 1).
	yarn := qwen3
	yarn.RopeScaling = &RopeScaling{Type: "yarn", Factor: 4, OriginalMaxPositionEmbeddings: 32, BetaFast: 32, BetaSlow: 1}
	return []Config{llama, qwen2, qwen3, yarn}
}

// variantWeights draws random weights for c, with biases when c has them and non-unit norms.
func variantWeights(c Config, seed uint64) *weights {
	w := randomWeights(c, seed)
	rng := rand.New(rand.NewPCG(seed, 2))
	jitter := func(s []float32) {
		for i := range s {
			s[i] = 1 + float32(rng.NormFloat64()*0.1)
		}
	}
	bias := func(n int) []float32 {
		s := make([]float32, n)
		for i := range s {
			s[i] = float32(rng.NormFloat64() * 0.1)
		}
		return s
	}
	for i := range w.layers {
		l := &w.layers[i]
		jitter(l.inNorm)
		jitter(l.postNorm)
		jitter(l.qNorm)
		jitter(l.kNorm)
		if c.AttentionBias {
			l.qb, l.kb, l.vb = bias(c.NumHeads*c.HeadDim), bias(c.NumKVHeads*c.HeadDim), bias(c.NumKVHeads*c.HeadDim)
		}
	}
	jitter(w.norm)
	return w
}

func TestForwardMatchesReferenceVariants(t *testing.T) {
	tok := tokenizer.Builtin(builtinVocab)
	for i, c := range variantConfigs(tok.VocabSize()) {
		name := c.Architecture
		if c.RopeScaling != nil {
			name += "-" + c.RopeScaling.Type
		}
		t.Run(name, func(t *testing.T) {
			w := variantWeights(c, uint64(10+i))
			m, err := newModel("variant", c, w, tok, tokenizer.ChatML(), GenerationConfig{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { m.Close() })
			// 70 positions reach past the llama3 scaling's original context of 64.
			compareReference(t, m, w, randomTokens(70, c.VocabSize, uint64(i)), 1e-4)
		})
	}
}

// TestForwardMatchesReferenceBF16 compares bfloat16 mode against the float64 reference computed
// with the same (bfloat16) weights, within a tolerance derived from the rounding the mode adds:
//
// Every matrix product's input x is rounded to bfloat16, x_k(1+δ_k) with |δ_k| ≤ u = 2⁻⁹ (nearest
// even with 8 significant bits); the products and their sums are exact or float32-accurate
// (2⁻²⁴, negligible). The output y = Σ x_k w_k gains e = Σ δ_k x_k w_k: with δ_k spread uniformly,
// e has standard deviation u/√3 · √(Σ (x_k w_k)²) ≈ u/√3 · |y| for terms of random sign, a
// relative error of u/√3 ≈ 1.13·10⁻³ per product. A token's logits pass through P such
// products — qkv, o, gate/up and down in each of L layers, and lm_head: P = 4L + 1 — and a
// bfloat16 KV cache rounds keys and values too (P = 6L + 1). The residual stream carries these
// errors forward without amplifying them (norms rescale, softmax and SiLU are contractive to
// first order), so they add in quadrature: σ ≈ u/√3 · √P relative to the logits' size (measured:
// 0.77σ RMS). The tolerance is 8σ times the RMS of the reference logits at that position — the
// largest of ~10⁵ logits sits in the tail, at 5–7σ here: for kvbridge/tiny (L = 2), 0.027
// (P = 9) and 0.033 (P = 13) of the logits' RMS. The test also requires the logits to differ
// from float32 mode's, so it fails if the rounding does not happen.
func TestForwardMatchesReferenceBF16(t *testing.T) {
	spec, _ := builtinSpecs(Tiny)
	for _, p := range testPrecisions[1:] {
		if p.prec.kvFP8 || p.prec.int8 {
			continue // FP8 KV's error is TestFP8KVQuality's, int8's TestInt8MatchesReference's
		}
		t.Run(p.name, func(t *testing.T) {
			m := openTinyWith(t, p.prec)
			c := m.cfg
			w := randomWeights(c, spec.seed)
			roundTo("BF16", w.embed.data)
			for i := range w.layers {
				l := &w.layers[i]
				for _, x := range []*matrix{&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down} {
					roundTo("BF16", x.data)
				}
			}
			products := 4*c.NumLayers + 1
			if p.prec.kvBF16 {
				products = 6*c.NumLayers + 1
			}
			sigma := math.Ldexp(1, -9) / math.Sqrt(3) * math.Sqrt(float64(products))
			tolRel := 8 * sigma
			tokens := randomTokens(37, c.VocabSize, 1)
			want := referenceLogits(c, w, tokens)
			got := forwardAll(t, m, tokens, 16)
			f32 := forwardAll(t, openTiny(t), tokens, 16)
			worst, differs, sq, n := 0.0, false, 0.0, 0
			for pos := range tokens {
				rms := 0.0
				for _, v := range want[pos] {
					rms += v * v
				}
				rms = math.Sqrt(rms / float64(len(want[pos])))
				for i, v := range got[pos] {
					d := math.Abs(float64(v)-want[pos][i]) / rms
					if !(d <= tolRel) {
						t.Fatalf("position %d logit %d: %g, reference %g: |diff| = %.3g × RMS %.3g > %.3g", pos, i, v, want[pos][i], d, rms, tolRel)
					}
					worst = max(worst, d)
					sq, n = sq+d*d, n+1
					differs = differs || v != f32[pos][i]
				}
			}
			if !differs {
				t.Fatal("bfloat16 logits equal float32 mode's: the activations were not rounded")
			}
			t.Logf("|logit − reference| / logits' RMS: RMS %.3g (σ estimate %.3g), max %.3g (tolerance %.3g, %d rounded products)",
				math.Sqrt(sq/float64(n)), sigma, worst, tolRel, products)
		})
	}
}
