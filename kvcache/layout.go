package kvcache

import (
	"fmt"
	"unsafe"
)

// BlockRatio checks that KV in the remote geometry can be received into the local one, with
// vLLM's rules (docs/architecture.md, "Heterogeneous KV geometry"), and returns the block-size
// ratio r = local.BlockSize / remote.BlockSize: local block b is filled from the r consecutive
// remote-sized sub-blocks b×r … b×r+r−1.
//
//   - layers, KV heads, head size and dtype must be equal;
//   - the remote block size must not be larger than the local one and must divide it;
//   - the layouts must be equal, except that with permute (enable_permute_local_kv) an HND remote
//     may feed an NHD local pool; the permutation never converts into HND.
//
// Violations wrap ErrIncompatible (or ErrGeometry for an invalid geometry).
func BlockRatio(local, remote Geometry, permute bool) (int, error) {
	if err := local.Validate(); err != nil {
		return 0, fmt.Errorf("kvcache: local %w", err)
	}
	if err := remote.Validate(); err != nil {
		return 0, fmt.Errorf("kvcache: remote %w", err)
	}
	if local.DType != remote.DType {
		return 0, fmt.Errorf("kvcache: remote KV dtype %v differs from local %v: %w", remote.DType, local.DType, ErrIncompatible)
	}
	if local.NumLayers != remote.NumLayers || local.NumKVHeads != remote.NumKVHeads || local.HeadDim != remote.HeadDim {
		return 0, fmt.Errorf("kvcache: remote KV shape (%d layers, %d KV heads, head size %d) differs from local (%d, %d, %d): %w",
			remote.NumLayers, remote.NumKVHeads, remote.HeadDim, local.NumLayers, local.NumKVHeads, local.HeadDim, ErrIncompatible)
	}
	if remote.BlockSize > local.BlockSize {
		return 0, fmt.Errorf("kvcache: remote block size %d is larger than local %d; only a smaller remote block size is supported: %w",
			remote.BlockSize, local.BlockSize, ErrIncompatible)
	}
	if local.BlockSize%remote.BlockSize != 0 {
		return 0, fmt.Errorf("kvcache: local block size %d is not a multiple of remote %d: %w",
			local.BlockSize, remote.BlockSize, ErrIncompatible)
	}
	if remote.Layout != local.Layout {
		if remote.Layout != HND || local.Layout != NHD {
			return 0, fmt.Errorf("kvcache: remote layout %v into local %v: the permutation only converts HND into NHD: %w",
				remote.Layout, local.Layout, ErrIncompatible)
		}
		if !permute {
			return 0, fmt.Errorf("kvcache: Heterogeneous TP expects same kv_cache_layout (remote %v, local %v; set enable_permute_local_kv to permute HND into NHD): %w",
				remote.Layout, local.Layout, ErrIncompatible)
		}
	}
	return local.BlockSize / remote.BlockSize, nil
}

// ConvertLayout permutes whole blocks of geometry g (its Layout field is ignored) from layout
// from into layout to: len(dst) == len(src) == k × BlockBytes for some k ≥ 1. Both directions are
// allowed (it is a pure permutation; the receive-side rules live in BlockRatio). dst and src may
// overlap, for an in-place conversion; src is then copied to a temporary buffer first.
func ConvertLayout(dst, src []byte, g Geometry, from, to Layout) error {
	g.Layout = from
	if err := g.Validate(); err != nil {
		return err
	}
	if !to.Valid() {
		return fmt.Errorf("kvcache: convert into layout %v: %w", to, ErrGeometry)
	}
	bb := g.BlockBytes()
	if len(src) != len(dst) || len(src) == 0 || len(src)%bb != 0 {
		return fmt.Errorf("kvcache: convert %v→%v: dst %d bytes, src %d bytes, block %d bytes: %w",
			from, to, len(dst), len(src), bb, ErrBufferSize)
	}
	if from == to {
		copy(dst, src)
		return nil
	}
	src = detach(dst, src)
	dg := g
	dg.Layout = to
	for off := 0; off < len(src); off += bb {
		moveVectors(dst[off:off+bb], dg, src[off:off+bb], g, g.BlockSize)
	}
	return nil
}

// RegroupBlocks assembles local blocks from smaller remote blocks (docs/architecture.md,
// "Heterogeneous KV geometry"; vLLM's kv_postprocess_blksize[_and_layout]_on_receive): src holds, for each local block, the r =
// local.BlockSize/remote.BlockSize consecutive remote blocks in the remote geometry (as a raw read
// places them); dst receives the same KV in the local geometry, local slot k×remote.BlockSize+s
// coming from sub-block k, slot s. len(dst) == len(src) == m × local.BlockBytes() for m ≥ 1. The
// geometries must pass BlockRatio with permute allowed; check the connector's own
// enable_permute_local_kv with BlockRatio first. dst and src may be the same memory (in place,
// through a temporary copy): the connector reads the r remote blocks raw into the local block at
// Offset(b) + k × remote.BlockBytes() and then regroups Bytes(b) onto itself.
func RegroupBlocks(dst, src []byte, local, remote Geometry) error {
	return regroup(dst, src, local, remote, false)
}

// SplitBlocks is the inverse of RegroupBlocks: it splits local blocks (src, local geometry) into
// r consecutive remote-sized blocks each (dst, remote geometry). The same rules and sizes apply.
func SplitBlocks(dst, src []byte, local, remote Geometry) error {
	return regroup(dst, src, local, remote, true)
}

// regroup implements RegroupBlocks (split = false) and SplitBlocks (split = true).
func regroup(dst, src []byte, local, remote Geometry, split bool) error {
	if _, err := BlockRatio(local, remote, true); err != nil {
		return err
	}
	lbb := local.BlockBytes()
	if len(src) != len(dst) || len(src) == 0 || len(src)%lbb != 0 {
		return fmt.Errorf("kvcache: regroup: dst %d bytes, src %d bytes, local block %d bytes: %w",
			len(dst), len(src), lbb, ErrBufferSize)
	}
	if local.BlockSize == remote.BlockSize && local.Layout == remote.Layout {
		copy(dst, src)
		return nil
	}
	src = detach(dst, src)
	for off := 0; off < len(src); off += lbb {
		d, s := dst[off:off+lbb], src[off:off+lbb]
		if split {
			moveVectors(d, remote, s, local, local.BlockSize)
		} else {
			moveVectors(d, local, s, remote, local.BlockSize)
		}
	}
	return nil
}

// detach returns src, or a copy of it when it shares memory with dst.
func detach(dst, src []byte) []byte {
	d0 := uintptr(unsafe.Pointer(unsafe.SliceData(dst)))
	s0 := uintptr(unsafe.Pointer(unsafe.SliceData(src)))
	if d0 < s0+uintptr(len(src)) && s0 < d0+uintptr(len(dst)) {
		return append([]byte(nil), src...)
	}
	return src
}

// vecOffset returns the byte offset of (layer, kv, head, slot) in a buffer of consecutive blocks
// of geometry g, slot counting across the blocks.
func vecOffset(g Geometry, layer, kv, h, slot int) int {
	sub, s := slot/g.BlockSize, slot%g.BlockSize
	return sub*g.BlockBytes() + g.DType.Size()*g.vecIndex(g.Layout, layer, kv, h, s)
}

// moveVectors copies every head vector of slots slots from src (consecutive blocks of geometry sg)
// to dst (consecutive blocks of geometry dg); the two geometries share layers, heads and head size.
// It walks dst in order and merges vectors that are contiguous on both sides into one copy.
func moveVectors(dst []byte, dg Geometry, src []byte, sg Geometry, slots int) {
	vec := dg.DType.Size() * dg.HeadDim
	runD, runS, runN := 0, 0, 0
	emit := func(layer, kv, h, s int) {
		do, so := vecOffset(dg, layer, kv, h, s), vecOffset(sg, layer, kv, h, s)
		if runN > 0 && do == runD+runN && so == runS+runN {
			runN += vec
			return
		}
		if runN > 0 {
			copy(dst[runD:runD+runN], src[runS:runS+runN])
		}
		runD, runS, runN = do, so, vec
	}
	for layer := range dg.NumLayers {
		for kv := range 2 {
			if dg.Layout == NHD {
				for s := range slots {
					for h := range dg.NumKVHeads {
						emit(layer, kv, h, s)
					}
				}
			} else {
				for h := range dg.NumKVHeads {
					for s := range slots {
						emit(layer, kv, h, s)
					}
				}
			}
		}
	}
	if runN > 0 {
		copy(dst[runD:runD+runN], src[runS:runS+runN])
	}
}
