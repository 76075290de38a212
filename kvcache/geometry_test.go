package kvcache

import (
	"encoding/json"
	"errors"
	"testing"
)

func TestLayoutStringParse(t *testing.T) {
	var zero Layout
	if zero != HND {
		t.Fatalf("zero Layout = %v, want HND", zero)
	}
	for _, l := range []Layout{HND, NHD} {
		got, err := ParseLayout(l.String())
		if err != nil || got != l {
			t.Fatalf("ParseLayout(%q) = %v, %v", l.String(), got, err)
		}
	}
	if got, err := ParseLayout(" nhd "); err != nil || got != NHD {
		t.Fatalf("ParseLayout(nhd) = %v, %v", got, err)
	}
	if _, err := ParseLayout("LBHNC"); !errors.Is(err, ErrGeometry) {
		t.Fatalf("ParseLayout(LBHNC) error %v, want ErrGeometry", err)
	}
	if s := Layout(7).String(); s != "Layout(7)" {
		t.Fatalf("Layout(7).String() = %q", s)
	}
}

func TestLayoutJSON(t *testing.T) {
	type wrap struct{ L Layout }
	b, err := json.Marshal(wrap{NHD})
	if err != nil || string(b) != `{"L":"NHD"}` {
		t.Fatalf("marshal = %s, %v", b, err)
	}
	var w wrap
	if err := json.Unmarshal([]byte(`{"L":"HND"}`), &w); err != nil || w.L != HND {
		t.Fatalf("unmarshal = %v, %v", w, err)
	}
	if err := json.Unmarshal([]byte(`{"L":"XYZ"}`), &w); err == nil {
		t.Fatal("unmarshal of a bad layout succeeded")
	}
	if _, err := json.Marshal(wrap{Layout(9)}); err == nil {
		t.Fatal("marshal of an invalid layout succeeded")
	}
}

func TestGeometryValidate(t *testing.T) {
	good := Geometry{NumLayers: 2, NumKVHeads: 3, HeadDim: 4, BlockSize: 5}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	if got, want := good.BlockBytes(), 2*2*3*5*4*4; got != want {
		t.Fatalf("BlockBytes = %d, want %d", got, want)
	}
	bad := []Geometry{
		{NumKVHeads: 3, HeadDim: 4, BlockSize: 5, NumLayers: 0},
		{NumLayers: 2, NumKVHeads: -1, HeadDim: 4, BlockSize: 5},
		{NumLayers: 2, NumKVHeads: 3, HeadDim: 0, BlockSize: 5},
		{NumLayers: 2, NumKVHeads: 3, HeadDim: 4, BlockSize: 0},
		{NumLayers: 2, NumKVHeads: 3, HeadDim: 4, BlockSize: 5, Layout: 2},
		{NumLayers: 1 << 20, NumKVHeads: 1 << 10, HeadDim: 1 << 10, BlockSize: 1 << 10},
	}
	for _, g := range bad {
		if err := g.Validate(); !errors.Is(err, ErrGeometry) {
			t.Errorf("Validate(%+v) = %v, want ErrGeometry", g, err)
		}
	}
}
