package kvcache

import (
	"fmt"
	"math"
	"strings"
)

// Layout is the order of a block's token slots and KV heads inside each layer's K and V parts.
// The zero value is HND.
type Layout uint8

const (
	// HND orders each layer's keys (then values) as [head][slot][dim]: one head's slots are
	// contiguous. vLLM's connector requires it for heterogeneous TP (LBHNC).
	HND Layout = iota
	// NHD orders each layer's keys (then values) as [slot][head][dim]: one slot's heads are
	// contiguous (LBNHC).
	NHD
)

// String returns "HND" or "NHD" (or "Layout(n)" for an invalid value).
func (l Layout) String() string {
	switch l {
	case HND:
		return "HND"
	case NHD:
		return "NHD"
	}
	return fmt.Sprintf("Layout(%d)", uint8(l))
}

// Valid reports whether l is HND or NHD.
func (l Layout) Valid() bool { return l == HND || l == NHD }

// ParseLayout parses "HND" or "NHD" (case-insensitive, surrounding spaces ignored).
func ParseLayout(s string) (Layout, error) {
	switch strings.ToUpper(strings.TrimSpace(s)) {
	case "HND":
		return HND, nil
	case "NHD":
		return NHD, nil
	}
	return 0, fmt.Errorf("kvcache: unknown KV cache layout %q (want HND or NHD): %w", s, ErrGeometry)
}

// MarshalText implements encoding.TextMarshaler ("HND" or "NHD").
func (l Layout) MarshalText() ([]byte, error) {
	if !l.Valid() {
		return nil, fmt.Errorf("kvcache: marshal %v: %w", l, ErrGeometry)
	}
	return []byte(l.String()), nil
}

// UnmarshalText implements encoding.TextUnmarshaler with ParseLayout.
func (l *Layout) UnmarshalText(b []byte) error {
	v, err := ParseLayout(string(b))
	if err != nil {
		return err
	}
	*l = v
	return nil
}

// Geometry is the shape of one KV block. Blocks hold float32 keys and values for every layer.
type Geometry struct {
	NumLayers  int    // transformer layers
	NumKVHeads int    // KV heads per layer (after any TP split)
	HeadDim    int    // channels per head
	BlockSize  int    // token slots per block
	Layout     Layout // slot/head order inside a layer's K or V part
}

// Block sizes in tokens: the default of --block-size (vLLM's on CUDA) and the largest an engine
// accepts.
const (
	DefaultBlockSize = 16
	MaxBlockSize     = 1024
)

// maxBlockBytes bounds a block so that offsets of many blocks stay far from int overflow.
const maxBlockBytes = 1 << 40

// Validate reports whether every dimension is positive, the layout is known and a block is not
// absurdly large.
func (g Geometry) Validate() error {
	if g.NumLayers <= 0 || g.NumKVHeads <= 0 || g.HeadDim <= 0 || g.BlockSize <= 0 {
		return fmt.Errorf("kvcache: geometry %+v: every dimension must be positive: %w", g, ErrGeometry)
	}
	if !g.Layout.Valid() {
		return fmt.Errorf("kvcache: geometry layout %v: %w", g.Layout, ErrGeometry)
	}
	n := float64(g.NumLayers) * 2 * float64(g.NumKVHeads) * float64(g.BlockSize) * float64(g.HeadDim) * 4
	if n > maxBlockBytes || n > math.MaxInt/2 {
		return fmt.Errorf("kvcache: geometry %+v: block of %.0f bytes is too large: %w", g, n, ErrGeometry)
	}
	return nil
}

// BlockBytes returns the size of one block: NumLayers × 2 × NumKVHeads × BlockSize × HeadDim × 4.
func (g Geometry) BlockBytes() int {
	return g.NumLayers * 2 * g.NumKVHeads * g.BlockSize * g.HeadDim * 4
}

// blockFloats returns the number of float32 values in one block.
func (g Geometry) blockFloats() int { return g.BlockBytes() / 4 }

// partFloats returns the number of float32 values in one layer's K (or V) part of a block.
func (g Geometry) partFloats() int { return g.NumKVHeads * g.BlockSize * g.HeadDim }

// vecIndex returns the float32 index, inside one block of geometry g with layout l, of the first
// channel of head h at slot s of layer layer's K (kv = 0) or V (kv = 1) part.
func (g Geometry) vecIndex(l Layout, layer, kv, h, s int) int {
	base := (layer*2 + kv) * g.partFloats()
	if l == NHD {
		return base + (s*g.NumKVHeads+h)*g.HeadDim
	}
	return base + (h*g.BlockSize+s)*g.HeadDim
}
