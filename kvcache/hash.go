package kvcache

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
)

// BlockHash identifies the content of a full block together with everything before it: each hash
// is SHA-256(parent hash ‖ the block's token ids as int32 little-endian), truncated to 16 bytes.
// The first block's parent is the zero BlockHash. Hashes are deterministic across processes, so
// two engines agree on the chain of the same tokens and block size.
type BlockHash [16]byte

// String returns the hash in hex.
func (h BlockHash) String() string { return hex.EncodeToString(h[:]) }

// NextHash extends a chain by one block: it returns SHA-256(parent ‖ tokens LE)[:16]. Use the zero
// BlockHash as the parent of the first block. tokens is normally one full block.
func NextHash(parent BlockHash, tokens []int32) BlockHash {
	var stack [len(BlockHash{}) + 4*64]byte
	var buf []byte
	if n := len(parent) + 4*len(tokens); n <= len(stack) {
		buf = stack[:n]
	} else {
		buf = make([]byte, n)
	}
	return hashInto(buf, parent, tokens)
}

// hashInto computes NextHash(parent, tokens) using buf (len ≥ 16 + 4×len(tokens)) as scratch.
func hashInto(buf []byte, parent BlockHash, tokens []int32) BlockHash {
	n := copy(buf, parent[:])
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(buf[n:], uint32(t))
		n += 4
	}
	sum := sha256.Sum256(buf[:n])
	var h BlockHash
	copy(h[:], sum[:])
	return h
}

// ChainHashes returns the hash chain of the full blocks of tokens: one hash per complete block of
// blockSize tokens, each chained to the previous one. A trailing partial block has no hash.
// It returns nil when blockSize ≤ 0 or there is no full block.
func ChainHashes(tokens []int32, blockSize int) []BlockHash {
	return AppendChainHashes(nil, BlockHash{}, tokens, blockSize)
}

// AppendChainHashes appends to dst the hashes of the full blocks of tokens, chained from parent
// (the hash of the block just before tokens[0], or the zero BlockHash at the start of a sequence),
// and returns the extended slice.
func AppendChainHashes(dst []BlockHash, parent BlockHash, tokens []int32, blockSize int) []BlockHash {
	if blockSize <= 0 {
		return dst
	}
	n := len(tokens) / blockSize
	if n == 0 {
		return dst
	}
	dst = growHashes(dst, n)
	buf := make([]byte, len(parent)+4*blockSize)
	for i := range n {
		parent = hashInto(buf, parent, tokens[i*blockSize:(i+1)*blockSize])
		dst = append(dst, parent)
	}
	return dst
}

// growHashes makes room for n more hashes in dst.
func growHashes(dst []BlockHash, n int) []BlockHash {
	if cap(dst)-len(dst) >= n {
		return dst
	}
	grown := make([]BlockHash, len(dst), len(dst)+n)
	copy(grown, dst)
	return grown
}
