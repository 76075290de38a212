//go:build !amd64 || purego

package kernel

// widenFP8 is WidenFP8 after its length check: portable Go.
func widenFP8(dst []float32, src []uint8, t *FP8Table) { widenFP8Generic(dst, src, t) }

// fp8Widens lists the widening kernels usable here (for tests).
func fp8Widens() map[string]func(dst []float32, src []uint8, t *FP8Table) {
	return map[string]func(dst []float32, src []uint8, t *FP8Table){"generic": widenFP8Generic}
}

// narrowFP8 is NarrowFP8 after its length check: portable Go.
func narrowFP8(dst []uint8, src []float32, f FP8, scale float32) {
	narrowFP8Generic(dst, src, f, scale)
}
