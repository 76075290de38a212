package kernel

import "runtime"

// fmaLoopGeneric runs n iterations of 8 independent scalar multiply-adds and returns the FLOPs
// per iteration.
func fmaLoopGeneric(n int) float64 {
	var a0, a1, a2, a3, a4, a5, a6, a7 float32 = 1, 2, 3, 4, 5, 6, 7, 8
	const x, y = 0.999999, 1e-7
	for range n {
		a0 = a0*x + y
		a1 = a1*x + y
		a2 = a2*x + y
		a3 = a3*x + y
		a4 = a4*x + y
		a5 = a5*x + y
		a6 = a6*x + y
		a7 = a7*x + y
	}
	runtime.KeepAlive(a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7)
	return 16
}

// readSumGeneric reads every element of x.
func readSumGeneric(x []float32) float32 {
	var s0, s1, s2, s3 float32
	i := 0
	for ; i+4 <= len(x); i += 4 {
		s0 += x[i]
		s1 += x[i+1]
		s2 += x[i+2]
		s3 += x[i+3]
	}
	return s0 + s1 + s2 + s3
}
