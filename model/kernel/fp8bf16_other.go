//go:build !amd64 || purego

package kernel

// widenFP8BF16 is WidenFP8BF16 after its checks: portable Go.
func widenFP8BF16(dst []uint16, src []uint8, t *FP8Table) { widenFP8BF16Generic(dst, src, t) }

// fp8BF16Widens lists the bfloat16 widening kernels usable here (for tests).
func fp8BF16Widens() map[string]func(dst []uint16, src []uint8, t *FP8Table) {
	return map[string]func(dst []uint16, src []uint8, t *FP8Table){"generic": widenFP8BF16Generic}
}
