//go:build amd64 && !purego

package kernel

//go:generate go run int8peakgen.go

//go:noescape
func vnniLoop512(n int)

// vnniLoop runs n iterations of the independent VPDPBUSD of vnniLoop512 and returns the
// operations per iteration: 24 instructions × 64 multiply-adds × 2 (a multiply and an add, as
// a FLOP pair is counted for the float peaks).
func vnniLoop(n int) float64 {
	vnniLoop512(n)
	return 24 * 64 * 2
}

// int8PeakLoop returns the loop PeakInt8GOPS runs (nil without AVX-512 VNNI).
func int8PeakLoop() func(n int) float64 {
	if !hasInt8Asm() {
		return nil
	}
	return vnniLoop
}
