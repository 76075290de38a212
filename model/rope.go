package model

import "math"

// rope holds the rotary position embedding's inverse frequencies and the factor applied to its
// cos and sin (1 except for YaRN).
type rope struct {
	invFreq []float64 // HeadDim/2
	scale   float64
}

// newRope computes inv_freq[i] = theta^(-2i/HeadDim) with the config's scaling applied, as
// transformers' rope initialisation functions (modeling_rope_utils.py) compute them:
//
//   - linear: every frequency divided by factor;
//   - llama3: long wavelengths divided by factor, short ones kept, a smooth blend between;
//   - yarn: interpolated (÷ factor) and extrapolated frequencies blended by a linear ramp over
//     the dimensions between the beta_fast and beta_slow corrections, and cos/sin scaled by the
//     attention factor (0.1·ln(factor)+1 unless given);
//   - dynamic: NTK-aware scaling with the base enlarged for a context of factor ×
//     original_max_position_embeddings, fixed for every position, as vLLM computes it.
//     (transformers recomputes the base from each forward's sequence length, which would make a
//     token's result depend on the batch it is computed in.)
func newRope(c Config) rope {
	half := c.HeadDim / 2
	dim := float64(c.HeadDim)
	theta := c.RopeTheta
	s := c.RopeScaling
	if s != nil && s.Type == "dynamic" {
		orig := float64(s.OriginalMaxPositionEmbeddings)
		maxLen := orig * s.Factor
		theta *= math.Pow(s.Factor*maxLen/orig-(s.Factor-1), dim/(dim-2))
	}
	r := rope{invFreq: make([]float64, half), scale: 1}
	for i := range half {
		r.invFreq[i] = 1 / math.Pow(theta, float64(2*i)/dim)
	}
	if s == nil {
		return r
	}
	switch s.Type {
	case "linear":
		for i := range r.invFreq {
			r.invFreq[i] /= s.Factor
		}
	case "llama3":
		old := float64(s.OriginalMaxPositionEmbeddings)
		lowWave, highWave := old/s.LowFreqFactor, old/s.HighFreqFactor
		for i, f := range r.invFreq {
			wave := 2 * math.Pi / f
			switch {
			case wave < highWave:
			case wave > lowWave:
				r.invFreq[i] = f / s.Factor
			default:
				smooth := (old/wave - s.LowFreqFactor) / (s.HighFreqFactor - s.LowFreqFactor)
				r.invFreq[i] = (1-smooth)*f/s.Factor + smooth*f
			}
		}
	case "yarn":
		r.yarn(c, s)
	}
	return r
}

// yarn applies YaRN scaling (transformers' _compute_yarn_parameters).
func (r *rope) yarn(c Config, s *RopeScaling) {
	dim := float64(c.HeadDim)
	base := c.RopeTheta
	orig := float64(s.OriginalMaxPositionEmbeddings)
	correction := func(rotations float64) float64 {
		return dim * math.Log(orig/(rotations*2*math.Pi)) / (2 * math.Log(base))
	}
	low, high := correction(s.BetaFast), correction(s.BetaSlow)
	if !s.NoTruncate {
		low, high = math.Floor(low), math.Ceil(high)
	}
	low, high = max(low, 0), min(high, dim-1)
	if low == high {
		high += 0.001
	}
	for i, f := range r.invFreq {
		ramp := min(max((float64(i)-low)/(high-low), 0), 1)
		extrapolation := 1 - ramp
		r.invFreq[i] = f/s.Factor*(1-extrapolation) + f*extrapolation
	}
	mscale := func(scale, m float64) float64 {
		if scale <= 1 {
			return 1
		}
		return 0.1*m*math.Log(scale) + 1
	}
	switch {
	case s.AttentionFactor > 0:
		r.scale = s.AttentionFactor
	case s.Mscale != 0 && s.MscaleAllDim != 0:
		r.scale = mscale(s.Factor, s.Mscale) / mscale(s.Factor, s.MscaleAllDim)
	default:
		r.scale = mscale(s.Factor, 1)
	}
}

// angles fills cos and sin (HeadDim/2 each) for position pos, times the attention factor.
func (r rope) angles(pos int, cos, sin []float32) {
	for i, f := range r.invFreq {
		s, c := math.Sincos(float64(pos) * f)
		cos[i], sin[i] = float32(c*r.scale), float32(s*r.scale)
	}
}
