package kvcache

import "fmt"

// HeadViewFP8 is HeadView for a pool of FP8 values (FP8E4M3 or FP8E5M2: one byte a value, the
// codes as stored). It panics on a pool of any other dtype.
func (p *Pool) HeadViewFP8(layer, block, head int) (k, v []uint8, stride int) {
	if p.geo.DType.Size() != 1 {
		panic(fmt.Sprintf("kvcache: HeadViewFP8 on a pool of %v values", p.geo.DType))
	}
	ko, vo, n, stride := p.headView(p.geo.DType, "HeadViewFP8", layer, block, head)
	return p.mem[ko : ko+n : ko+n], p.mem[vo : vo+n : vo+n], stride
}
