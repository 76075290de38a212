//go:build amd64 && !purego

package kernel

//go:generate go run probegen.go

//go:noescape
func readStreams2x512(x0, x1 *float32, n int) float32

//go:noescape
func readStreams4x512(x0, x1, x2, x3 *float32, n int) float32

// readSideBySide reads x as streams (2 or 4) equal stretches side by side, a few cache lines of
// each in turn within one loop (probegen.go), then the tail past the last whole stretch, and
// returns the sum of x; ok is false where the kernels are missing (no AVX-512) or streams is
// neither 2 nor 4.
func readSideBySide(x []float32, streams int) (sum float32, ok bool) {
	if !hasAVX512() || streams != 2 && streams != 4 {
		return 0, false
	}
	const grain = 64 // floats: 4 lines a stream (2 streams), 2 lines (4 streams), times two
	per := len(x) / streams / grain * grain
	if per > 0 {
		if streams == 2 {
			sum = readStreams2x512(&x[0], &x[per], per)
		} else {
			sum = readStreams4x512(&x[0], &x[per], &x[2*per], &x[3*per], per)
		}
	}
	return sum + readSumGeneric(x[streams*per:]), true
}
