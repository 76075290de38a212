//go:build amd64 && !purego

package kernel

//go:generate go run fp8gen.go

// hasFP8Asm reports AVX-512F, all the FP8 conversion kernels need.
func hasFP8Asm() bool { return hasAVX512() }

//go:noescape
func widenE4M3(dst *float32, src *uint8, n int, scale float32)

//go:noescape
func widenE5M2(dst *float32, src *uint8, n int, scale float32)

//go:noescape
func narrowE4M3(dst *uint8, src *float32, n int, scale float32)

//go:noescape
func narrowE5M2(dst *uint8, src *float32, n int, scale float32)

// widenFP8 is WidenFP8 after its length check: the AVX-512 kernel of t's format, which computes
// each entry of t (the exact value, then times the scale) rather than loading it.
func widenFP8(dst []float32, src []uint8, t *FP8Table) {
	if !hasFP8Asm() || len(src) == 0 {
		widenFP8Generic(dst, src, t)
		return
	}
	_ = dst[len(src)-1]
	k := widenE4M3
	if t.format == E5M2 {
		k = widenE5M2
	}
	k(&dst[0], &src[0], len(src), t.scale)
}

// narrowFP8 is NarrowFP8 after its length check: the AVX-512 kernel of format f.
func narrowFP8(dst []uint8, src []float32, f FP8, scale float32) {
	if !hasFP8Asm() || len(src) == 0 {
		narrowFP8Generic(dst, src, f, scale)
		return
	}
	_ = dst[len(src)-1]
	k := narrowE4M3
	if f == E5M2 {
		k = narrowE5M2
	}
	k(&dst[0], &src[0], len(src), scale)
}
