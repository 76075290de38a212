// Package blockhash computes the prefix-cache block hashes vLLM computes (hash_block_tokens in
// vllm/v1/core/kv_cache_utils.py) and publishes in its KV cache events, so that a consumer of
// kvbridge's events — a kvbridge proxy, llm-d's indexer, Dynamo's router — can hash a prompt's
// tokens and find which engine holds its blocks, exactly as it would with vLLM engines.
//
// Each full block's hash is hash_fn((parent, tokens, extra_keys)): parent is the previous block's
// hash (NONE_HASH for the first block), tokens the block's token ids as a tuple, extra_keys None
// (kvbridge has no LoRA, multimodal input or cache salt). hash_fn is SHA-256 of the tuple's
// canonical CBOR (`sha256_cbor`) or of its pickle at the highest protocol (`sha256`, vLLM's
// default --prefix-caching-hash-algo). NONE_HASH is hash_fn(PYTHONHASHSEED) when that variable is
// set, else 32 random bytes (vLLM's init_none_hash): engines and their consumers agree on hashes
// only when they share PYTHONHASHSEED. Consumers get the hash as an unsigned 64-bit integer
// (External: vLLM's maybe_convert_block_hash).
//
// docs/kv-events.md says where this differs from vLLM, and docs/architecture.md which packages use it.
package blockhash

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
)

// Algo is a --prefix-caching-hash-algo value.
type Algo string

// The hash functions kvbridge computes. vLLM's xxhash and xxhash_cbor are not offered.
const (
	// SHA256 hashes the pickle of the tuple (protocol 5): vLLM's default.
	SHA256 Algo = "sha256"
	// SHA256CBOR hashes the tuple's canonical CBOR: what llm-d asks vLLM to use.
	SHA256CBOR Algo = "sha256_cbor"
)

// ErrAlgo reports a --prefix-caching-hash-algo value kvbridge does not compute.
var ErrAlgo = errors.New("unsupported prefix caching hash algorithm")

// ParseAlgo checks s against the algorithms kvbridge computes.
func ParseAlgo(s string) (Algo, error) {
	switch a := Algo(s); a {
	case SHA256, SHA256CBOR:
		return a, nil
	case "xxhash", "xxhash_cbor":
		return "", fmt.Errorf("%w: %q (kvbridge computes \"sha256\" and \"sha256_cbor\")", ErrAlgo, s)
	}
	return "", fmt.Errorf("%w: %q (choose \"sha256\" or \"sha256_cbor\")", ErrAlgo, s)
}

// Hash is a block's 32-byte hash.
type Hash [32]byte

// External is the hash as vLLM's events carry it with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES at its
// default: the bytes read as a big-endian integer masked to 64 bits, that is the last 8 bytes.
func (h Hash) External() uint64 { return binary.BigEndian.Uint64(h[len(h)-8:]) }

// Hasher hashes blocks with one algorithm from one NONE_HASH. Its methods are safe for
// concurrent use. The zero Hasher is not usable: make one with New.
type Hasher struct {
	algo   Algo
	none   Hash
	seeded bool
}

// New returns a Hasher for algo whose NONE_HASH derives from seed when seeded (PYTHONHASHSEED's
// value), else is random, as vLLM's init_none_hash does.
func New(algo Algo, seed string, seeded bool) (*Hasher, error) {
	if _, err := ParseAlgo(string(algo)); err != nil {
		return nil, err
	}
	h := &Hasher{algo: algo, seeded: seeded}
	if seeded {
		var buf []byte
		if algo == SHA256CBOR {
			buf = cborText(nil, seed)
		} else {
			buf = pickleText(seed)
		}
		h.none = sha256.Sum256(buf)
	} else if _, err := rand.Read(h.none[:]); err != nil {
		return nil, fmt.Errorf("blockhash: random NONE_HASH: %w", err)
	}
	return h, nil
}

// FromEnv returns a Hasher for algo seeded from PYTHONHASHSEED as getenv (os.LookupEnv) reports it.
func FromEnv(algo Algo, getenv func(string) (string, bool)) (*Hasher, error) {
	seed, ok := getenv("PYTHONHASHSEED")
	return New(algo, seed, ok)
}

// Algo returns the hash function's name.
func (h *Hasher) Algo() Algo { return h.algo }

// Seeded reports whether NONE_HASH came from PYTHONHASHSEED; when not, no other process can
// compute the same hashes.
func (h *Hasher) Seeded() bool { return h.seeded }

// First returns the hash of a sequence's first block.
func (h *Hasher) First(tokens []int32) Hash { return h.Next(h.none, tokens) }

// Next returns the hash of the block of tokens that follows the block hashed parent.
func (h *Hasher) Next(parent Hash, tokens []int32) Hash {
	var stack [256]byte
	if h.algo == SHA256CBOR {
		return sha256.Sum256(cborBlock(stack[:0], parent, tokens))
	}
	return sha256.Sum256(pickleBlock(stack[:0], parent, tokens))
}

// Chain returns the hashes of the full blocks of tokens, each chained to the one before, from
// NONE_HASH; a trailing partial block has none. It returns nil when blockSize ≤ 0.
func (h *Hasher) Chain(tokens []int32, blockSize int) []Hash {
	if blockSize <= 0 || len(tokens) < blockSize {
		return nil
	}
	out := make([]Hash, 0, len(tokens)/blockSize)
	parent := h.none
	for i := 0; i+blockSize <= len(tokens); i += blockSize {
		parent = h.Next(parent, tokens[i:i+blockSize])
		out = append(out, parent)
	}
	return out
}
