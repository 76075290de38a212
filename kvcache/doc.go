// Package kvcache is kvbridge's paged KV cache: a pool of fixed-size KV blocks in caller-owned
// memory (a registered transfer arena), with reference counting, a free list, block-level prefix
// caching through a token-hash chain, and the block copies the connector needs (whole-block reads
// and writes, HND↔NHD permutation, regrouping of smaller remote blocks).
//
// # Block layout
//
// KV is float32 (or, with Geometry.DType BFloat16, bfloat16), little-endian, or one byte of FP8
// a value (FP8E4M3, FP8E5M2: the codes, each a key or value divided by its layer's scale, which
// the model keeps). One block holds BlockSize token slots of every layer, keys then values, and
// is one contiguous byte range:
//
//	[layer][k, v][HND: head, slot, dim | NHD: slot, head, dim]
//
// Block id i lives at byte offset i × BlockBytes, so a run of consecutive ids is one contiguous
// range: one transfer descriptor.
//
// # Block life cycle
//
// Allocate hands out blocks with reference count 1 and bumps their generation. Match takes a
// further reference on blocks found in the prefix cache. Free drops references; a block whose
// count reaches zero goes back to the free list, keeping its hash (and so staying matchable) if it
// was cached. Allocation prefers blocks that hold no cached prefix and reuses cached free blocks
// least recently freed first, dropping their hash. Evict removes blocks from the prefix cache
// (after a failed KV load) without touching their reference counts.
//
// The package does no I/O and starts no goroutines.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package kvcache
