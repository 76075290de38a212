package kvcache

import (
	"encoding/binary"
	"errors"
	"math"
	"slices"
	"testing"
)

// distinctBlocks returns n blocks of geometry g whose float32 values are all different.
func distinctBlocks(g Geometry, n int, seed int) []byte {
	b := make([]byte, n*g.BlockBytes())
	for i := 0; i < len(b); i += 4 {
		binary.LittleEndian.PutUint32(b[i:], math.Float32bits(float32(seed*1_000_000+i/4+1)))
	}
	return b
}

// floatAt reads float32 number i of b (little-endian).
func floatAt(b []byte, i int) float32 {
	return math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
}

var layoutGeos = []Geometry{
	{NumLayers: 1, NumKVHeads: 1, HeadDim: 1, BlockSize: 1},
	{NumLayers: 2, NumKVHeads: 3, HeadDim: 4, BlockSize: 5},
	{NumLayers: 3, NumKVHeads: 4, HeadDim: 8, BlockSize: 16},
}

func TestConvertLayout(t *testing.T) {
	for _, g := range layoutGeos {
		for _, from := range []Layout{HND, NHD} {
			to := NHD
			if from == NHD {
				to = HND
			}
			const nb = 2
			src := distinctBlocks(g, nb, 1)
			dst := make([]byte, len(src))
			if err := ConvertLayout(dst, src, g, from, to); err != nil {
				t.Fatal(err)
			}
			bf := g.BlockBytes() / 4
			for b := range nb {
				for layer := range g.NumLayers {
					for kv := range 2 {
						for h := range g.NumKVHeads {
							for s := range g.BlockSize {
								for d := range g.HeadDim {
									want := floatAt(src, b*bf+naiveIndex(g, from, layer, kv, h, s, d))
									got := floatAt(dst, b*bf+naiveIndex(g, to, layer, kv, h, s, d))
									if got != want {
										t.Fatalf("%+v %v→%v: (b%d l%d kv%d h%d s%d d%d) = %v, want %v",
											g, from, to, b, layer, kv, h, s, d, got, want)
									}
								}
							}
						}
					}
				}
			}
			// Round trip, and in place.
			back := make([]byte, len(src))
			if err := ConvertLayout(back, dst, g, to, from); err != nil || !slices.Equal(back, src) {
				t.Fatalf("%+v: round trip %v→%v→%v differs (%v)", g, from, to, from, err)
			}
			if err := ConvertLayout(dst, dst, g, to, from); err != nil || !slices.Equal(dst, src) {
				t.Fatalf("%+v: in-place round trip differs (%v)", g, err)
			}
			same := make([]byte, len(src))
			if err := ConvertLayout(same, src, g, from, from); err != nil || !slices.Equal(same, src) {
				t.Fatal("identity conversion changed the bytes")
			}
		}
	}
	g := layoutGeos[1]
	buf := make([]byte, g.BlockBytes())
	if err := ConvertLayout(buf, buf[:len(buf)-4], g, HND, NHD); !errors.Is(err, ErrBufferSize) {
		t.Fatalf("mismatched sizes: %v", err)
	}
	if err := ConvertLayout(nil, nil, g, HND, NHD); !errors.Is(err, ErrBufferSize) {
		t.Fatalf("empty buffers: %v", err)
	}
	if err := ConvertLayout(buf, buf, g, HND, Layout(5)); !errors.Is(err, ErrGeometry) {
		t.Fatalf("bad layout: %v", err)
	}
	if err := ConvertLayout(buf, buf, Geometry{}, HND, NHD); !errors.Is(err, ErrGeometry) {
		t.Fatalf("bad geometry: %v", err)
	}
}

func TestBlockRatio(t *testing.T) {
	base := Geometry{NumLayers: 2, NumKVHeads: 4, HeadDim: 8, BlockSize: 16}
	with := func(f func(*Geometry)) Geometry { g := base; f(&g); return g }
	cases := []struct {
		name          string
		local, remote Geometry
		permute       bool
		want          int // 0 = rejected
	}{
		{"same", base, base, false, 1},
		{"smaller remote", base, with(func(g *Geometry) { g.BlockSize = 4 }), false, 4},
		{"larger remote", base, with(func(g *Geometry) { g.BlockSize = 32 }), false, 0},
		{"non-integer ratio", base, with(func(g *Geometry) { g.BlockSize = 6 }), false, 0},
		{"heads differ", base, with(func(g *Geometry) { g.NumKVHeads = 2 }), false, 0},
		{"layers differ", base, with(func(g *Geometry) { g.NumLayers = 3 }), false, 0},
		{"head dim differs", base, with(func(g *Geometry) { g.HeadDim = 4 }), false, 0},
		{"HND into NHD without permute", with(func(g *Geometry) { g.Layout = NHD }), base, false, 0},
		{"HND into NHD with permute", with(func(g *Geometry) { g.Layout = NHD }), base, true, 1},
		{"HND into NHD, smaller blocks", with(func(g *Geometry) { g.Layout = NHD }), with(func(g *Geometry) { g.BlockSize = 8 }), true, 2},
		{"NHD into HND never", base, with(func(g *Geometry) { g.Layout = NHD }), true, 0},
		{"NHD into NHD", with(func(g *Geometry) { g.Layout = NHD }), with(func(g *Geometry) { g.Layout = NHD; g.BlockSize = 1 }), false, 16},
		{"invalid remote", base, Geometry{}, true, 0},
	}
	for _, c := range cases {
		got, err := BlockRatio(c.local, c.remote, c.permute)
		if c.want == 0 {
			if err == nil || !(errors.Is(err, ErrIncompatible) || errors.Is(err, ErrGeometry)) {
				t.Errorf("%s: ratio %d, err %v; want rejection", c.name, got, err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("%s: ratio %d, err %v; want %d", c.name, got, err, c.want)
		}
	}
}

// TestRegroupBlocks checks regrouping against a per-element reference for every accepted layout
// pair and several ratios, then the inverse split and the in-place form.
func TestRegroupBlocks(t *testing.T) {
	shapes := []Geometry{
		{NumLayers: 2, NumKVHeads: 3, HeadDim: 4, BlockSize: 12},
		{NumLayers: 1, NumKVHeads: 1, HeadDim: 1, BlockSize: 4},
	}
	pairs := [][2]Layout{{HND, HND}, {NHD, NHD}, {HND, NHD}} // {remote, local}
	for _, shape := range shapes {
		for _, pair := range pairs {
			for _, rbs := range []int{1, 2, 3, 4, 6, 12} {
				if shape.BlockSize%rbs != 0 {
					continue
				}
				local := shape
				local.Layout = pair[1]
				remote := shape
				remote.BlockSize, remote.Layout = rbs, pair[0]
				r := local.BlockSize / rbs
				const nLocal = 2
				src := distinctBlocks(remote, nLocal*r, 3) // raw read: r remote blocks per local block
				dst := make([]byte, len(src))
				if err := RegroupBlocks(dst, src, local, remote); err != nil {
					t.Fatal(err)
				}
				lbf, rbf := local.BlockBytes()/4, remote.BlockBytes()/4
				for b := range nLocal {
					for layer := range shape.NumLayers {
						for kv := range 2 {
							for h := range shape.NumKVHeads {
								for s := range local.BlockSize {
									for d := range shape.HeadDim {
										sub, rs := s/rbs, s%rbs
										want := floatAt(src, (b*r+sub)*rbf+naiveIndex(remote, remote.Layout, layer, kv, h, rs, d))
										got := floatAt(dst, b*lbf+naiveIndex(local, local.Layout, layer, kv, h, s, d))
										if got != want {
											t.Fatalf("%v→%v bs %d→%d: (b%d l%d kv%d h%d s%d d%d) = %v, want %v",
												remote.Layout, local.Layout, rbs, local.BlockSize, b, layer, kv, h, s, d, got, want)
										}
									}
								}
							}
						}
					}
				}
				back := make([]byte, len(src))
				if err := SplitBlocks(back, dst, local, remote); err != nil || !slices.Equal(back, src) {
					t.Fatalf("%v→%v bs %d: split does not invert regroup (%v)", remote.Layout, local.Layout, rbs, err)
				}
				if err := RegroupBlocks(back, back, local, remote); err != nil || !slices.Equal(back, dst) {
					t.Fatalf("%v→%v bs %d: in-place regroup differs (%v)", remote.Layout, local.Layout, rbs, err)
				}
			}
		}
	}
}

func TestRegroupRejects(t *testing.T) {
	local := Geometry{NumLayers: 1, NumKVHeads: 2, HeadDim: 2, BlockSize: 8}
	buf := make([]byte, local.BlockBytes())
	bad := []Geometry{
		{NumLayers: 1, NumKVHeads: 2, HeadDim: 2, BlockSize: 16},             // larger remote
		{NumLayers: 1, NumKVHeads: 2, HeadDim: 2, BlockSize: 3},              // ratio not an integer
		{NumLayers: 1, NumKVHeads: 1, HeadDim: 2, BlockSize: 4},              // other shape
		{NumLayers: 1, NumKVHeads: 2, HeadDim: 2, BlockSize: 4, Layout: NHD}, // NHD into HND
	}
	for _, remote := range bad {
		if err := RegroupBlocks(buf, buf, local, remote); !errors.Is(err, ErrIncompatible) {
			t.Errorf("remote %+v: %v, want ErrIncompatible", remote, err)
		}
		if err := SplitBlocks(buf, buf, local, remote); !errors.Is(err, ErrIncompatible) {
			t.Errorf("split, remote %+v: %v, want ErrIncompatible", remote, err)
		}
	}
	remote := local
	remote.BlockSize = 4
	if err := RegroupBlocks(buf, buf[:len(buf)/2], local, remote); !errors.Is(err, ErrBufferSize) {
		t.Errorf("half buffer: %v", err)
	}
}

// TestRegroupIntoPool runs the connector's receive path: raw remote bytes land in a local block
// (consecutive sub-blocks), are regrouped in place, and the model's view of the block matches.
func TestRegroupIntoPool(t *testing.T) {
	local := Geometry{NumLayers: 2, NumKVHeads: 2, HeadDim: 3, BlockSize: 8, Layout: NHD}
	remote := local
	remote.BlockSize, remote.Layout = 2, HND
	r, err := BlockRatio(local, remote, true)
	if err != nil {
		t.Fatal(err)
	}
	p := newTestPool(t, local, 3, false)
	ids, _ := p.Allocate(1)
	raw := distinctBlocks(remote, r, 9)
	copy(p.Bytes(ids[0]), raw) // what r READs of remote-sized sub-blocks would leave
	if err := RegroupBlocks(p.Bytes(ids[0]), p.Bytes(ids[0]), local, remote); err != nil {
		t.Fatal(err)
	}
	rbf := remote.BlockBytes() / 4
	for layer := range local.NumLayers {
		for h := range local.NumKVHeads {
			k, v, stride := p.HeadView(layer, int(ids[0]), h)
			for s := range local.BlockSize {
				for d := range local.HeadDim {
					sub, rs := s/remote.BlockSize, s%remote.BlockSize
					wk := floatAt(raw, sub*rbf+naiveIndex(remote, HND, layer, 0, h, rs, d))
					wv := floatAt(raw, sub*rbf+naiveIndex(remote, HND, layer, 1, h, rs, d))
					if k[s*stride+d] != wk || v[s*stride+d] != wv {
						t.Fatalf("layer %d head %d slot %d dim %d: k %v v %v, want %v %v", layer, h, s, d, k[s*stride+d], v[s*stride+d], wk, wv)
					}
				}
			}
		}
	}
	_ = p.Free(ids...)
	checkAllFree(t, p)
}
