package kvcache

// HeadViewFP8 is HeadView for a pool of FP8 values (FP8E4M3 or FP8E5M2: one byte a value, the
// codes as stored). It panics on a pool of any other dtype.
func (p *Pool) HeadViewFP8(layer, block, head int) (k, v []uint8, stride int) {
	return p.shards[0].HeadViewFP8(layer, block, head)
}
