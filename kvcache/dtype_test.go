package kvcache

import (
	"encoding/binary"
	"errors"
	"testing"
)

func TestParseDType(t *testing.T) {
	for in, want := range map[string]DType{"": Float32, "auto": Float32, "float32": Float32, "BF16": BFloat16, " bfloat16 ": BFloat16,
		"fp8": FP8E4M3, "FP8_E4M3": FP8E4M3, "fp8_e5m2": FP8E5M2} {
		if got, err := ParseDType(in); err != nil || got != want {
			t.Errorf("ParseDType(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"fp8_inc", "half", "int8"} {
		if _, err := ParseDType(bad); !errors.Is(err, ErrGeometry) {
			t.Errorf("ParseDType(%q): err = %v", bad, err)
		}
	}
	if err := (Geometry{NumLayers: 1, NumKVHeads: 1, HeadDim: 1, BlockSize: 1, DType: 7}).Validate(); !errors.Is(err, ErrGeometry) {
		t.Errorf("invalid dtype validates: %v", err)
	}
}

// TestBFloat16Blocks: a bfloat16 pool's blocks are half the bytes, HeadViewBF16 addresses the
// layout byte for byte (2 bytes a value), HeadView refuses a bfloat16 pool, and the connector's
// receive path (raw remote sub-blocks regrouped and permuted in place) moves 2-byte values.
func TestBFloat16Blocks(t *testing.T) {
	narrowBlocks(t, BFloat16, func(p *Pool, layer, block, head int) (k, v func(i int) int, stride int) {
		k16, v16, stride := p.HeadViewBF16(layer, block, head)
		return func(i int) int { return int(k16[i]) }, func(i int) int { return int(v16[i]) }, stride
	})
}

// TestFP8Blocks: an FP8 pool's blocks are a quarter of float32's bytes and half of bfloat16's,
// HeadViewFP8 addresses the layout byte for byte, HeadView refuses an FP8 pool, the receive path
// moves 1-byte values, and the two FP8 formats, of equal size, never mix.
func TestFP8Blocks(t *testing.T) {
	for _, dt := range []DType{FP8E4M3, FP8E5M2} {
		t.Run(dt.String(), func(t *testing.T) {
			narrowBlocks(t, dt, func(p *Pool, layer, block, head int) (k, v func(i int) int, stride int) {
				k8, v8, stride := p.HeadViewFP8(layer, block, head)
				return func(i int) int { return int(k8[i]) }, func(i int) int { return int(v8[i]) }, stride
			})
		})
	}
	a := Geometry{NumLayers: 1, NumKVHeads: 1, HeadDim: 4, BlockSize: 4, DType: FP8E4M3}
	b := a
	b.DType = FP8E5M2
	if _, err := BlockRatio(a, b, true); !errors.Is(err, ErrIncompatible) {
		t.Fatalf("fp8_e5m2 remote into an fp8_e4m3 pool: %v", err)
	}
	bf := a
	bf.DType = BFloat16
	if a.BlockBytes()*2 != bf.BlockBytes() {
		t.Fatalf("fp8 block %d bytes, bfloat16 %d", a.BlockBytes(), bf.BlockBytes())
	}
	p := newTestPool(t, bf, 1, false)
	func() {
		defer func() {
			if recover() == nil {
				t.Error("HeadViewFP8 on a bfloat16 pool did not panic")
			}
		}()
		p.HeadViewFP8(0, 0, 0)
	}()
}

// narrowBlocks checks a pool of dtype dt, a narrower type than float32 read through view: its
// block bytes, and that a remote's raw sub-blocks of another block size and layout regrouped and
// permuted in place land where view finds them, value by value (each value of the remote blocks
// numbered in dt's width).
func narrowBlocks(t *testing.T, dt DType, view func(p *Pool, layer, block, head int) (k, v func(i int) int, stride int)) {
	local := Geometry{NumLayers: 2, NumKVHeads: 2, HeadDim: 3, BlockSize: 8, Layout: NHD, DType: dt}
	f32 := local
	f32.DType = Float32
	size := dt.Size()
	if local.BlockBytes()*4 != f32.BlockBytes()*size || local.BlockBytes() != 2*2*2*8*3*size {
		t.Fatalf("BlockBytes %d (float32 %d)", local.BlockBytes(), f32.BlockBytes())
	}
	remote := local
	remote.BlockSize, remote.Layout = 2, HND
	if _, err := BlockRatio(local, f32, true); !errors.Is(err, ErrIncompatible) {
		t.Fatalf("float32 remote into a %v pool: %v", dt, err)
	}
	r, err := BlockRatio(local, remote, true)
	if err != nil {
		t.Fatal(err)
	}
	p := newTestPool(t, local, 3, false)
	ids, _ := p.Allocate(1)
	raw := make([]byte, r*remote.BlockBytes())
	for i := 0; i < len(raw); i += size {
		if size == 1 {
			raw[i] = byte(i + 1) // 192 values: each number fits a byte
		} else {
			binary.LittleEndian.PutUint16(raw[i:], uint16(i/2+1))
		}
	}
	copy(p.Bytes(ids[0]), raw)
	if err := RegroupBlocks(p.Bytes(ids[0]), p.Bytes(ids[0]), local, remote); err != nil {
		t.Fatal(err)
	}
	rbv := remote.BlockBytes() / size
	for layer := range local.NumLayers {
		for h := range local.NumKVHeads {
			k, v, stride := view(p, layer, int(ids[0]), h)
			for s := range local.BlockSize {
				for d := range local.HeadDim {
					sub, rs := s/remote.BlockSize, s%remote.BlockSize
					wk := sub*rbv + naiveIndex(remote, HND, layer, 0, h, rs, d) + 1
					wv := sub*rbv + naiveIndex(remote, HND, layer, 1, h, rs, d) + 1
					if k(s*stride+d) != wk || v(s*stride+d) != wv {
						t.Fatalf("layer %d head %d slot %d dim %d: k %d v %d, want %d %d", layer, h, s, d, k(s*stride+d), v(s*stride+d), wk, wv)
					}
				}
			}
		}
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Errorf("HeadView on a %v pool did not panic", dt)
			}
		}()
		p.HeadView(0, int(ids[0]), 0)
	}()
	_ = p.Free(ids...)
	checkAllFree(t, p)
}
