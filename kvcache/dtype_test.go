package kvcache

import (
	"encoding/binary"
	"errors"
	"testing"
)

func TestParseDType(t *testing.T) {
	for in, want := range map[string]DType{"": Float32, "auto": Float32, "float32": Float32, "BF16": BFloat16, " bfloat16 ": BFloat16} {
		if got, err := ParseDType(in); err != nil || got != want {
			t.Errorf("ParseDType(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"fp8", "half", "int8"} {
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
	local := Geometry{NumLayers: 2, NumKVHeads: 2, HeadDim: 3, BlockSize: 8, Layout: NHD, DType: BFloat16}
	f32 := local
	f32.DType = Float32
	if local.BlockBytes()*2 != f32.BlockBytes() || local.BlockBytes() != 2*2*2*8*3*2 {
		t.Fatalf("BlockBytes %d (float32 %d)", local.BlockBytes(), f32.BlockBytes())
	}
	remote := local
	remote.BlockSize, remote.Layout = 2, HND
	if _, err := BlockRatio(local, f32, true); !errors.Is(err, ErrIncompatible) {
		t.Fatalf("float32 remote into a bfloat16 pool: %v", err)
	}
	r, err := BlockRatio(local, remote, true)
	if err != nil {
		t.Fatal(err)
	}
	p := newTestPool(t, local, 3, false)
	ids, _ := p.Allocate(1)
	raw := make([]byte, r*remote.BlockBytes())
	for i := 0; i < len(raw); i += 2 {
		binary.LittleEndian.PutUint16(raw[i:], uint16(i/2+1))
	}
	copy(p.Bytes(ids[0]), raw)
	if err := RegroupBlocks(p.Bytes(ids[0]), p.Bytes(ids[0]), local, remote); err != nil {
		t.Fatal(err)
	}
	rbv := remote.BlockBytes() / 2
	for layer := range local.NumLayers {
		for h := range local.NumKVHeads {
			k, v, stride := p.HeadViewBF16(layer, int(ids[0]), h)
			for s := range local.BlockSize {
				for d := range local.HeadDim {
					sub, rs := s/remote.BlockSize, s%remote.BlockSize
					wk := uint16(sub*rbv + naiveIndex(remote, HND, layer, 0, h, rs, d) + 1)
					wv := uint16(sub*rbv + naiveIndex(remote, HND, layer, 1, h, rs, d) + 1)
					if k[s*stride+d] != wk || v[s*stride+d] != wv {
						t.Fatalf("layer %d head %d slot %d dim %d: k %d v %d, want %d %d", layer, h, s, d, k[s*stride+d], v[s*stride+d], wk, wv)
					}
				}
			}
		}
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("HeadView on a bfloat16 pool did not panic")
			}
		}()
		p.HeadView(0, int(ids[0]), 0)
	}()
	_ = p.Free(ids...)
	checkAllFree(t, p)
}
