//go:build amd64 && !purego

package kernel

// widenFP8BF16VBMI is in fp8_amd64.s (fp8gen.go's widenPlanes).
//
//go:noescape
func widenFP8BF16VBMI(dst *uint16, src *uint8, n int, planes *[4][128]uint8)

// widenFP8BF16 is WidenFP8BF16 after its checks: the VBMI kernel where the CPU and t allow it.
func widenFP8BF16(dst []uint16, src []uint8, t *FP8Table) {
	if hasFP8VBMI() && t.mirrored {
		widenFP8BF16Planes(dst, src, t)
		return
	}
	widenFP8BF16Generic(dst, src, t)
}

// widenFP8BF16Planes runs the VBMI kernel: the upper two bytes of t's values looked up 64 codes
// at a time.
func widenFP8BF16Planes(dst []uint16, src []uint8, t *FP8Table) {
	if len(src) > 0 {
		_ = dst[len(src)-1]
		widenFP8BF16VBMI(&dst[0], &src[0], len(src), &t.planes)
	}
}

// fp8BF16Widens names the bfloat16 widening kernels usable here, portable Go among them (for
// tests; "vbmi" takes mirrored tables only).
func fp8BF16Widens() map[string]func(dst []uint16, src []uint8, t *FP8Table) {
	ks := map[string]func(dst []uint16, src []uint8, t *FP8Table){"generic": widenFP8BF16Generic}
	if hasFP8VBMI() {
		ks["vbmi"] = widenFP8BF16Planes
	}
	return ks
}
