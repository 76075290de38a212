package kernel

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestWidenBF16 checks the vector widening against the definition (the bits shifted into the
// upper half of a float32) for every length up to 70, leaving dst past len(src) untouched.
func TestWidenBF16(t *testing.T) {
	r := rand.New(rand.NewPCG(51, 52))
	for n := range 70 {
		src := make([]uint16, n)
		for i := range src {
			src[i] = uint16(r.Uint32())
		}
		dst := make([]float32, n+1)
		dst[n] = 7
		WidenBF16(dst, src)
		for i, h := range src {
			if math.Float32bits(dst[i]) != uint32(h)<<16 {
				t.Fatalf("n %d: element %d = %08x, want %08x", n, i, math.Float32bits(dst[i]), uint32(h)<<16)
			}
		}
		if dst[n] != 7 {
			t.Fatalf("n %d: wrote past len(src)", n)
		}
	}
}
