//go:build amd64 && !purego

package kernel

//go:generate go run tile8gen.go

// tallRows is the rows of the tall whole-panel tile (tileDot512t7).
const tallRows = 7

func tileDot512t7(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)

// tileDotTallKernels are the tall whole-panel tiles by rows − 1 (nil below 7 rows).
var tileDotTallKernels = []tileKernel16[uint32]{6: tileDot512t7}

// tileDotTallAVX512 is tileDotAVX512 for 7 rows: one call reads each line of the panel once,
// in order, and prefetches nothing (tileDot512t7).
func tileDotTallAVX512(c []float32, ldc int, a []uint32, lda int, w []uint16, kp, mr, ncols int, pf []uint16, cont bool) {
	if mr != tallRows {
		panic("kernel: bad tall tile height")
	}
	runTile16(tileDotTallKernels, panelWidth, 2*panelWidth, c, ldc, a, lda, w, kp, kp, mr, ncols, nil, cont)
}
