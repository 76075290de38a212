//go:build amd64 && !purego

package kernel

import "golang.org/x/sys/cpu"

//go:generate go run fp8gen.go

// hasFP8Asm reports AVX-512F, which the computing FP8 kernels need.
func hasFP8Asm() bool { return hasAVX512() }

// hasFP8VBMI reports AVX-512 VBMI and BW, which the byte-table widening needs.
func hasFP8VBMI() bool { return hasAVX512() && cpu.X86.HasAVX512VBMI && cpu.X86.HasAVX512BW }

//go:noescape
func widenFP8VBMI(dst *float32, src *uint8, n int, planes *[4][128]uint8)

//go:noescape
func widenE4M3(dst *float32, src *uint8, n int, scale float32)

//go:noescape
func widenE5M2(dst *float32, src *uint8, n int, scale float32)

//go:noescape
func narrowE4M3(dst *uint8, src *float32, n int, scale float32)

//go:noescape
func narrowE5M2(dst *uint8, src *float32, n int, scale float32)

// widenFP8 is WidenFP8 after its length check: the fastest kernel the CPU and t allow.
func widenFP8(dst []float32, src []uint8, t *FP8Table) {
	switch {
	case hasFP8VBMI() && t.mirrored:
		widenFP8Planes(dst, src, t)
	case hasFP8Asm():
		widenFP8Computed(dst, src, t)
	default:
		widenFP8Generic(dst, src, t)
	}
}

// widenFP8Planes runs the VBMI kernel: t's values' bytes looked up 64 codes at a time.
func widenFP8Planes(dst []float32, src []uint8, t *FP8Table) {
	if len(src) > 0 {
		_ = dst[len(src)-1]
		widenFP8VBMI(&dst[0], &src[0], len(src), &t.planes)
	}
}

// widenFP8Computed runs the AVX-512F kernel of t's format, which computes each value of t (the
// exact value, then times the scale) rather than loading it.
func widenFP8Computed(dst []float32, src []uint8, t *FP8Table) {
	if len(src) == 0 {
		return
	}
	_ = dst[len(src)-1]
	k := widenE4M3
	if t.format == E5M2 {
		k = widenE5M2
	}
	k(&dst[0], &src[0], len(src), t.scale)
}

// fp8Widens names the widening kernels usable here, portable Go among them (for tests; "vbmi"
// takes mirrored tables only).
func fp8Widens() map[string]func(dst []float32, src []uint8, t *FP8Table) {
	ks := map[string]func(dst []float32, src []uint8, t *FP8Table){"generic": widenFP8Generic}
	if hasFP8Asm() {
		ks["avx512"] = widenFP8Computed
	}
	if hasFP8VBMI() {
		ks["vbmi"] = widenFP8Planes
	}
	return ks
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
