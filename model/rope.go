package model

import "math"

// rope holds the rotary position embedding's inverse frequencies.
type rope struct {
	invFreq []float64 // HeadDim/2
}

// newRope computes inv_freq[i] = theta^(-2i/HeadDim), with the config's scaling applied.
func newRope(c Config) rope {
	half := c.HeadDim / 2
	r := rope{invFreq: make([]float64, half)}
	for i := range half {
		r.invFreq[i] = 1 / math.Pow(c.RopeTheta, float64(2*i)/float64(c.HeadDim))
	}
	if s := c.RopeScaling; s != nil && s.Factor > 0 {
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
		}
	}
	return r
}

// angles fills cos and sin (HeadDim/2 each) for position pos.
func (r rope) angles(pos int, cos, sin []float32) {
	for i, f := range r.invFreq {
		s, c := math.Sincos(float64(pos) * f)
		cos[i], sin[i] = float32(c), float32(s)
	}
}

// applyRope rotates one head vector x in place with the Hugging Face "rotate_half" convention:
// x[i] and x[i+half] form the pair rotated by angle i.
func applyRope(x, cos, sin []float32) {
	half := len(cos)
	x1, x2 := x[:half], x[half:2*half]
	for i := range half {
		a, b := x1[i], x2[i]
		x1[i] = a*cos[i] - b*sin[i]
		x2[i] = b*cos[i] + a*sin[i]
	}
}
