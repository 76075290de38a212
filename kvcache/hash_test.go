package kvcache

import (
	"crypto/sha256"
	"encoding/binary"
	"testing"
)

func seqTokens(n int, seed int32) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = seed*7919 + int32(i)*31 - 5 // includes negative ids: hashed as uint32 LE
	}
	return t
}

func TestChainHashesDefinition(t *testing.T) {
	toks := seqTokens(10, 1)
	hs := ChainHashes(toks, 4)
	if len(hs) != 2 {
		t.Fatalf("%d hashes for 10 tokens in blocks of 4, want 2 (full blocks only)", len(hs))
	}
	var parent BlockHash
	for i, h := range hs {
		buf := append([]byte(nil), parent[:]...)
		for _, tok := range toks[i*4 : i*4+4] {
			buf = binary.LittleEndian.AppendUint32(buf, uint32(tok))
		}
		sum := sha256.Sum256(buf)
		var want BlockHash
		copy(want[:], sum[:16])
		if h != want {
			t.Fatalf("hash %d = %v, want %v", i, h, want)
		}
		parent = want
	}
	if ChainHashes(toks[:3], 4) != nil || ChainHashes(toks, 0) != nil {
		t.Fatal("want nil for no full block or a bad block size")
	}
	if len(hs[0].String()) != 32 {
		t.Fatalf("String() = %q", hs[0].String())
	}
}

func TestChainHashesChaining(t *testing.T) {
	const bs = 16
	a := seqTokens(6*bs+3, 1)
	ha := ChainHashes(a, bs)
	if len(ha) != 6 {
		t.Fatalf("%d hashes, want 6", len(ha))
	}
	// A change in block 0 changes every later hash.
	b := append([]int32(nil), a...)
	b[3]++
	hb := ChainHashes(b, bs)
	for i := range ha {
		if ha[i] == hb[i] {
			t.Fatalf("block %d hash unchanged after editing block 0", i)
		}
	}
	// A change in block 2 keeps blocks 0 and 1 and changes 2 onwards.
	c := append([]int32(nil), a...)
	c[2*bs+5] = -1
	hc := ChainHashes(c, bs)
	for i := range ha {
		if (i < 2) != (ha[i] == hc[i]) {
			t.Fatalf("block %d: equal=%v after editing block 2", i, ha[i] == hc[i])
		}
	}
	// The same block content after different prefixes hashes differently.
	d := append(append([]int32(nil), a[bs:2*bs]...), a[bs:2*bs]...)
	hd := ChainHashes(d, bs)
	if hd[0] == hd[1] {
		t.Fatal("identical blocks at different positions share a hash")
	}
	// The partial tail block is ignored.
	if got := ChainHashes(a[:6*bs], bs); len(got) != 6 || got[5] != ha[5] {
		t.Fatal("trailing partial block changed the chain")
	}
}

func TestNextHashIncremental(t *testing.T) {
	for _, bs := range []int{1, 16, 64, 100} {
		toks := seqTokens(5*bs, int32(bs))
		want := ChainHashes(toks, bs)
		var parent BlockHash
		var got []BlockHash
		for i := range 5 {
			parent = NextHash(parent, toks[i*bs:(i+1)*bs])
			got = append(got, parent)
		}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("bs %d: NextHash chain differs at %d", bs, i)
			}
		}
		// AppendChainHashes continues a chain from a parent.
		ext := AppendChainHashes(append([]BlockHash(nil), want[:2]...), want[1], toks[2*bs:], bs)
		for i := range want {
			if ext[i] != want[i] {
				t.Fatalf("bs %d: AppendChainHashes differs at %d", bs, i)
			}
		}
	}
}

// TestBlockHashExternal: vLLM's int.from_bytes(h, "big") & (2**64-1) keeps the last 8 bytes.
func TestBlockHashExternal(t *testing.T) {
	var h BlockHash
	for i := range h {
		h[i] = byte(i + 1)
	}
	if got, want := h.External(), uint64(0x090a0b0c0d0e0f10); got != want {
		t.Fatalf("External = %#x, want %#x", got, want)
	}
}
