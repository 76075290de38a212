package model

import (
	"fmt"
	"strings"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// ParseQuantization checks a weight quantization (OpenOptions.Quantization, vLLM's
// --quantization), case-insensitively, and returns its canonical name: "" for "" and "none",
// "int8" for "int8". Anything else is an error wrapping ErrUnsupported.
func ParseQuantization(s string) (string, error) {
	switch strings.ToLower(s) {
	case "", "none":
		return "", nil
	case "int8":
		return "int8", nil
	}
	return "", fmt.Errorf("%w: quantization %q (want int8, or none)", ErrUnsupported, s)
}

// parseInt8 reports whether s (OpenOptions.Quantization) asks for int8 weights.
func parseInt8(s string) (bool, error) {
	q, err := ParseQuantization(s)
	return q == "int8", err
}

// Quantization returns how the weight matrices are stored: "int8" (OpenOptions.Quantization)
// or "" (as DType says).
func (m *Model) Quantization() string {
	if m.int8 {
		return "int8"
	}
	return ""
}

// newFusedInt8 is newFused for int8 weights: the parts' rows are widened to float32 and
// quantized in groups of kernel.Int8Group (see kernel.NewLinearInt8ScaledFrom; roundScale nil:
// float32 scales).
func newFusedInt8(pool *kernel.Pool, roundScale func(float32) float32, out, in int, parts ...part) *kernel.Linear {
	return kernel.NewLinearInt8ScaledFrom(pool, out, in, roundScale, func(n int, dst []float32) {
		for _, p := range parts {
			if n < p.at+p.n {
				p.m.fill(p.row(n), dst)
				return
			}
		}
		panic("model: fused row out of range")
	})
}
