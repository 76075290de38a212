package model

import (
	"fmt"
	"math"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// An FP8 KV cache (OpenOptions.KVCacheDType "fp8", "fp8_e4m3" or "fp8_e5m2") follows vLLM:
//
//   - Each layer has a key scale and a value scale (vLLM's per-tensor k_scale and v_scale). A key
//     k is stored as the FP8 code of k / k_scale (float32 division, then kernel.FP8.FromF32:
//     saturated to the format's largest finite value and rounded to nearest, ties to even, as
//     vLLM's kernels write it); attention reads it back as code · k_scale (a kernel.FP8Table,
//     exact for the default scale 1). Values likewise with v_scale.
//   - The scales are 1.0 unless the checkpoint has them, as in vLLM: the scalar tensors
//     model.layers.N.self_attn.k_scale and v_scale (or the same under k_proj/v_proj or attn, the
//     names vLLM remaps), or a single kv_scale used for both. A checkpoint scale that is not a
//     positive finite number fails the load.
//   - vLLM's --calculate-kv-scales (scales from the first batch's keys and values) is not
//     offered: scales that depend on the first request would make a prefill and a decode engine
//     quantize the same KV differently.
//
// Everything else is as for bfloat16 KV: attention widens each key and value row before its
// products, which stay the same FMA chains, so the forward pass stays batch-invariant and P/D
// gives a single engine's bits. Where a layer's key table is bfloat16-exact (every code times the
// scale a bfloat16 value: scale 1, or a power of two — kernel.FP8Table.BF16), the in-place scores
// get the keys widened to bfloat16 (half the scratch bytes) and run the bfloat16 kernels,
// gathered over the KV heads as bfloat16 KV's are (scoreSet), which widen each element to float32
// exactly before the same chains: the bits of the float32 kernels on keys widened to float32,
// which the other tables (and the values, where the float32 kernel is the faster) take.

// KVBlocksFP8 is a KV store of FP8 values, which a model with an FP8 KV cache needs:
// HeadViewFP8 is HeadView for the values' codes (one byte each).
type KVBlocksFP8 interface {
	HeadViewFP8(layer, block, head int) (k, v []uint8, stride int)
}

// fp8Layer is one layer's FP8 KV quantization: its scales and the dequantization tables they
// give.
type fp8Layer struct {
	kScale, vScale float32
	kTab, vTab     *kernel.FP8Table
}

// kvScaleNames returns the checkpoint names vLLM reads a layer's key scale, value scale and
// shared scale from (prefix "model.layers.N."), in the order a later one overrides.
func kvScaleNames(prefix string) (k, v, kv []string) {
	for _, at := range []string{"self_attn.", "self_attn.attn.", "self_attn.k_proj.", "self_attn.v_proj."} {
		kv = append(kv, prefix+at+"kv_scale")
	}
	p := prefix + "self_attn."
	return []string{p + "k_scale", p + "attn.k_scale", p + "k_proj.k_scale"},
		[]string{p + "v_scale", p + "attn.v_scale", p + "v_proj.v_scale"}, kv
}

// newFP8Layers returns the FP8 quantization of every layer of w in format f: the checkpoint's
// scales (layerWeights.kScale, vScale, kvScale; each nil when absent), else 1.
func newFP8Layers(w *weights, f kernel.FP8) ([]fp8Layer, error) {
	ls := make([]fp8Layer, len(w.layers))
	for i, l := range w.layers {
		k, v := float32(1), float32(1)
		if l.kvScale != nil {
			k, v = l.kvScale[0], l.kvScale[0]
		}
		if l.kScale != nil {
			k = l.kScale[0]
		}
		if l.vScale != nil {
			v = l.vScale[0]
		}
		for _, s := range []float32{k, v} {
			if !(s > 0) || math.IsInf(float64(s), 0) {
				return nil, fmt.Errorf("%w: layer %d: KV cache scale %v (want a positive finite number)", ErrBadWeights, i, s)
			}
		}
		ls[i] = fp8Layer{kScale: k, vScale: v, kTab: kernel.NewFP8Table(f, k), vTab: kernel.NewFP8Table(f, v)}
	}
	return ls, nil
}

// KVScales returns each layer's key and value scales of an FP8 KV cache (nil for any other KV
// cache dtype).
func (m *Model) KVScales() (k, v []float32) {
	for _, l := range m.fp8Layers {
		k, v = append(k, l.kScale), append(v, l.vScale)
	}
	return k, v
}

// kvValueBytes returns the bytes of one key or value channel in the KV cache.
func (m *Model) kvValueBytes() int {
	switch {
	case m.kvFP8:
		return 1
	case m.kvBF16:
		return 2
	}
	return 4
}

// storeFP8 writes the key k and value v of one token and KV head into the FP8 view at offset o.
func (m *Model) storeFP8(view headView, o int, k, v []float32) {
	hd := len(k)
	kernel.NarrowFP8(view.k8[o:o+hd], k, m.fp8, view.fp8.kScale)
	kernel.NarrowFP8(view.v8[o:o+hd], v, m.fp8, view.fp8.vScale)
}

// widenFP8 writes the dequantized key and value at offset o of an FP8 view into k and v.
func (view *headView) widenFP8(k, v []float32, o int) {
	hd := len(k)
	kernel.WidenFP8(k, view.k8[o:o+hd], view.fp8.kTab)
	kernel.WidenFP8(v, view.v8[o:o+hd], view.fp8.vTab)
}

// widenRows widens n keys (or values) of an FP8 view from offset o, stride apart in the block,
// into sc's scratch, hd apart, for the in-place float32 kernels: the same float32 rows a packed
// chunk holds, so the same products.
func (view *headView) widenRows(sc *attnScratch, values bool, o, n, hd int) []float32 {
	src, tab := view.k8, view.fp8.kTab
	if values {
		src, tab = view.v8, view.fp8.vTab
	}
	sc.wide = grow(sc.wide, n*hd)
	if view.stride == hd { // HND: the rows are adjacent
		kernel.WidenFP8(sc.wide, src[o:o+n*hd], tab)
		return sc.wide
	}
	for r := range n {
		kernel.WidenFP8(sc.wide[r*hd:(r+1)*hd], src[o+r*view.stride:o+r*view.stride+hd], tab)
	}
	return sc.wide
}

// keysBF16 reports whether the view's keys go to the bfloat16 scores kernels, widened to
// bfloat16 (scoreSet): their table is bfloat16-exact, and no test asks for the float32 kernels.
// The values stay on the float32 kernels: from L1, widening them to float32 and running
// AccumulateRows costs 0.78 of widening them to bfloat16 and running AccumulateRowsBF16
// (kernel.BenchmarkFP8BlockProducts: 121 ns a block of 16 against 155), where the bfloat16
// scores kernels gathered over several heads cost half the float32 ones.
func (view *headView) keysBF16() bool { return view.fp8.kTab.BF16() && !view.fp8F32 }

// widenKeysBF16 is widenRows for the keys of a bfloat16-exact table (keysBF16): the n keys from
// offset o widened to bfloat16 into dst (len ≥ n·hd), hd apart, for the bfloat16 kernels.
func (view *headView) widenKeysBF16(dst []uint16, o, n, hd int) {
	src, tab := view.k8, view.fp8.kTab
	dst = dst[:n*hd]
	if view.stride == hd { // HND: the rows are adjacent
		kernel.WidenFP8BF16(dst, src[o:o+n*hd], tab)
		return
	}
	for r := range n {
		kernel.WidenFP8BF16(dst[r*hd:(r+1)*hd], src[o+r*view.stride:o+r*view.stride+hd], tab)
	}
}
