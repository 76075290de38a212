package kvcache

import "errors"

// Sentinel errors; the pool wraps them with the block id or sizes involved, so test with errors.Is.
var (
	// ErrNoSpace reports that the pool has fewer free blocks than an allocation asked for.
	ErrNoSpace = errors.New("kvcache: not enough free blocks")
	// ErrBadBlock reports a block id outside [0, NumBlocks).
	ErrBadBlock = errors.New("kvcache: block id out of range")
	// ErrNotAllocated reports an operation on a block whose reference count is zero, such as a
	// double free.
	ErrNotAllocated = errors.New("kvcache: block not allocated")
	// ErrHashConflict reports an attempt to cache a block that is already cached under another hash.
	ErrHashConflict = errors.New("kvcache: block already cached under a different hash")
	// ErrGeometry reports an invalid block geometry or pool configuration.
	ErrGeometry = errors.New("kvcache: invalid geometry")
	// ErrMemory reports pool memory that is too small or not 64-byte aligned.
	ErrMemory = errors.New("kvcache: unusable pool memory")
	// ErrBufferSize reports a source or destination buffer whose length does not match the block
	// geometry.
	ErrBufferSize = errors.New("kvcache: buffer size does not match the block geometry")
	// ErrIncompatible reports a remote block geometry that cannot be converted into the local one
	// (different model shape, a larger remote block size, a non-integer ratio, or a layout change
	// other than HND into NHD; docs/architecture.md, "Heterogeneous KV geometry").
	ErrIncompatible = errors.New("kvcache: incompatible remote KV geometry")
)
