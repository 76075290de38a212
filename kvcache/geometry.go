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

// DType is the type of the keys and values a block holds. The zero value is Float32.
type DType uint8

const (
	// Float32 stores each key and value channel as a little-endian float32 (4 bytes).
	Float32 DType = iota
	// BFloat16 stores each channel as a little-endian bfloat16 (2 bytes): vLLM's
	// --kv-cache-dtype bfloat16.
	BFloat16
	// FP8E4M3 stores each channel as one byte of OCP FP8 E4M3 (torch.float8_e4m3fn), divided
	// by its layer's key or value scale: vLLM's --kv-cache-dtype fp8 and fp8_e4m3.
	FP8E4M3
	// FP8E5M2 stores each channel as one byte of OCP FP8 E5M2 (torch.float8_e5m2), divided by
	// its layer's scale: vLLM's --kv-cache-dtype fp8_e5m2.
	FP8E5M2
)

// String returns "float32", "bfloat16", "fp8_e4m3" or "fp8_e5m2" (vLLM's names), or
// "DType(n)" for an invalid value.
func (d DType) String() string {
	switch d {
	case Float32:
		return "float32"
	case BFloat16:
		return "bfloat16"
	case FP8E4M3:
		return "fp8_e4m3"
	case FP8E5M2:
		return "fp8_e5m2"
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// Size returns the bytes of one value (0 for an invalid type).
func (d DType) Size() int {
	switch d {
	case Float32:
		return 4
	case BFloat16:
		return 2
	case FP8E4M3, FP8E5M2:
		return 1
	}
	return 0
}

// ParseDType parses vLLM's --kv-cache-dtype values kvbridge supports: "float32", "fp32",
// "bfloat16", "bf16", "fp8" and "fp8_e4m3" (both FP8E4M3, as in vLLM), "fp8_e5m2", and "auto",
// which the model resolves to its compute dtype (model.OpenOptions.KVCacheDType) and which
// parses here as Float32 for checking a flag only.
func ParseDType(s string) (DType, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "auto", "float32", "fp32", "float":
		return Float32, nil
	case "bfloat16", "bf16":
		return BFloat16, nil
	case "fp8", "fp8_e4m3":
		return FP8E4M3, nil
	case "fp8_e5m2":
		return FP8E5M2, nil
	}
	return 0, fmt.Errorf("kvcache: unknown KV cache dtype %q (want auto, float32, bfloat16, fp8, fp8_e4m3 or fp8_e5m2): %w", s, ErrGeometry)
}

// Geometry is the shape of one KV block. Blocks hold the keys and values of every layer.
type Geometry struct {
	NumLayers  int    // transformer layers
	NumKVHeads int    // KV heads per layer (after any TP split)
	HeadDim    int    // channels per head
	BlockSize  int    // token slots per block
	Layout     Layout // slot/head order inside a layer's K or V part
	DType      DType  // type of each channel (default Float32)
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
	if g.DType.Size() == 0 {
		return fmt.Errorf("kvcache: geometry dtype %v: %w", g.DType, ErrGeometry)
	}
	n := float64(g.NumLayers) * 2 * float64(g.NumKVHeads) * float64(g.BlockSize) * float64(g.HeadDim) * float64(g.DType.Size())
	if n > maxBlockBytes || n > math.MaxInt/2 {
		return fmt.Errorf("kvcache: geometry %+v: block of %.0f bytes is too large: %w", g, n, ErrGeometry)
	}
	return nil
}

// BlockBytes returns the size of one block: NumLayers × 2 × NumKVHeads × BlockSize × HeadDim ×
// the value size (4 for float32, 2 for bfloat16, 1 for FP8).
func (g Geometry) BlockBytes() int {
	return g.blockValues() * g.DType.Size()
}

// blockValues returns the number of values in one block.
func (g Geometry) blockValues() int { return g.NumLayers * 2 * g.partValues() }

// partValues returns the number of values in one layer's K (or V) part of a block.
func (g Geometry) partValues() int { return g.NumKVHeads * g.BlockSize * g.HeadDim }

// vecIndex returns the value index, inside one block of geometry g with layout l, of the first
// channel of head h at slot s of layer layer's K (kv = 0) or V (kv = 1) part.
func (g Geometry) vecIndex(l Layout, layer, kv, h, s int) int {
	base := (layer*2 + kv) * g.partValues()
	if l == NHD {
		return base + (s*g.NumKVHeads+h)*g.HeadDim
	}
	return base + (h*g.BlockSize+s)*g.HeadDim
}
