package tokenizer

import (
	"math"
	"unicode/utf8"
)

// merge is one BPE merge rule: the pair it applies to ranks rank (lower merges first) and
// produces token id.
type merge struct {
	rank int32
	id   int32
}

// noMerge is the rank of a pair that has no merge rule.
const noMerge = math.MaxInt32

// pairKey packs an adjacent token pair into a map key.
func pairKey(left, right int32) uint64 { return uint64(uint32(left))<<32 | uint64(uint32(right)) }

// bpeModel holds the BPE tables. It is immutable after construction.
//
// A byte-level model (GPT-2, Qwen, Llama 3) starts every piece from one symbol per byte. A
// character-level model (SentencePiece-style: Llama 2, Mistral) starts from one symbol per
// character; a character missing from the vocabulary becomes its UTF-8 bytes' <0xXX> tokens
// (byte_fallback), else the unknown token (consecutive ones fused into one with fuse_unk).
type bpeModel struct {
	byteIDs      [256]int32       // byte-level: token of each single byte, -1 if the vocabulary lacks it
	charLevel    bool             // start from characters (byBytes) instead of bytes
	fallbackIDs  [256]int32       // character-level byte_fallback: the <0xXX> tokens, -1 where missing
	byteFallback bool             // character-level: spell unknown characters in <0xXX> tokens
	fuseUnk      bool             // consecutive unknown characters become one unknown token
	merges       map[uint64]merge // pairKey(left, right) → rule
	byBytes      map[string]int32 // raw bytes of every vocabulary token → id
	ignoreMerges bool             // a piece that is itself a token is emitted whole
	unk          int32            // emitted for bytes without a token; -1 to drop them
}

// lookup returns the rule for the pair, or rank noMerge.
func (m *bpeModel) lookup(left, right int32) merge {
	if left < 0 || right < 0 {
		return merge{rank: noMerge, id: -1}
	}
	if r, ok := m.merges[pairKey(left, right)]; ok {
		return r
	}
	return merge{rank: noMerge, id: -1}
}

// smallPiece is the longest piece merged with the quadratic scan; longer pieces use a heap so
// that a pathological piece (a megabyte without spaces) stays O(n log n).
const smallPiece = 48

// encodePiece appends the tokens of one pre-tokenized piece to dst.
func (m *bpeModel) encodePiece(piece string, dst []int32) []int32 {
	switch {
	case piece == "":
		return dst
	case m.charLevel:
		if id, ok := m.byBytes[piece]; ok && m.ignoreMerges {
			return append(dst, id)
		}
		return m.merge(m.charSymbols(piece), dst)
	case len(piece) == 1:
		return m.emit(dst, m.byteIDs[piece[0]])
	case m.ignoreMerges:
		if id, ok := m.byBytes[piece]; ok {
			return append(dst, id)
		}
	}
	var buf [smallPiece]int32
	ids := buf[:0]
	if len(piece) > smallPiece {
		ids = make([]int32, 0, len(piece))
	}
	for i := range len(piece) {
		ids = append(ids, m.byteIDs[piece[i]])
	}
	return m.merge(ids, dst)
}

// charSymbols returns the initial symbols of a character-level piece.
func (m *bpeModel) charSymbols(piece string) []int32 {
	ids := make([]int32, 0, len(piece))
	unkRun := false // the last symbol is an unknown token that fuse_unk may extend
	for i := 0; i < len(piece); {
		_, w := utf8.DecodeRuneInString(piece[i:]) // an invalid byte is a character of its own
		c := piece[i : i+w]
		i += w
		if id, ok := m.byBytes[c]; ok {
			ids, unkRun = append(ids, id), false
			continue
		}
		if m.byteFallback && m.fallbackFor(c) {
			for j := range len(c) {
				ids = append(ids, m.fallbackIDs[c[j]])
			}
			unkRun = false
			continue
		}
		if m.unk >= 0 && !(unkRun && m.fuseUnk) {
			ids = append(ids, m.unk)
		}
		unkRun = m.unk >= 0
	}
	return ids
}

// fallbackFor reports whether every byte of c has a <0xXX> token.
func (m *bpeModel) fallbackFor(c string) bool {
	for j := range len(c) {
		if m.fallbackIDs[c[j]] < 0 {
			return false
		}
	}
	return true
}

// merge applies the merges to the initial symbols ids (which it may overwrite) and appends the
// result to dst.
func (m *bpeModel) merge(ids []int32, dst []int32) []int32 {
	if len(ids) <= smallPiece {
		return m.mergeScan(ids, dst)
	}
	return m.mergeHeap(ids, dst)
}

// emit appends id, or the unknown token for a byte the vocabulary lacks.
func (m *bpeModel) emit(dst []int32, id int32) []int32 {
	if id >= 0 {
		return append(dst, id)
	}
	if m.unk >= 0 {
		return append(dst, m.unk)
	}
	return dst
}

// mergeScan applies merges to a short symbol list: repeatedly merge the lowest-ranked adjacent
// pair, leftmost first.
func (m *bpeModel) mergeScan(ids []int32, dst []int32) []int32 {
	if len(ids) == 0 {
		return dst
	}
	var ruleBuf [smallPiece]merge
	rules := ruleBuf[:len(ids)-1]
	for i := range rules {
		rules[i] = m.lookup(ids[i], ids[i+1])
	}
	for len(rules) > 0 {
		best := -1
		bestRank := int32(noMerge)
		for i, r := range rules {
			if r.rank < bestRank {
				best, bestRank = i, r.rank
			}
		}
		if best < 0 {
			break
		}
		ids[best] = rules[best].id
		copy(ids[best+1:], ids[best+2:])
		ids = ids[:len(ids)-1]
		copy(rules[best:], rules[best+1:])
		rules = rules[:len(rules)-1]
		if best > 0 {
			rules[best-1] = m.lookup(ids[best-1], ids[best])
		}
		if best < len(rules) {
			rules[best] = m.lookup(ids[best], ids[best+1])
		}
	}
	for _, id := range ids {
		dst = m.emit(dst, id)
	}
	return dst
}

// candidate is a pair in the merge heap: the symbol at pos and its right neighbour, expected to
// hold left and right.
type candidate struct {
	rank, pos, left, right int32
}

// less orders candidates by rank, then position (tokenizers' order).
func (a candidate) less(b candidate) bool {
	if a.rank != b.rank {
		return a.rank < b.rank
	}
	return a.pos < b.pos
}

// candidateHeap is a binary min-heap of candidates.
type candidateHeap []candidate

func (h *candidateHeap) push(c candidate) {
	*h = append(*h, c)
	s := *h
	for i := len(s) - 1; i > 0; {
		p := (i - 1) / 2
		if !s[i].less(s[p]) {
			break
		}
		s[i], s[p] = s[p], s[i]
		i = p
	}
}

func (h *candidateHeap) pop() candidate {
	s := *h
	top := s[0]
	last := len(s) - 1
	s[0] = s[last]
	s = s[:last]
	for i := 0; ; {
		l, r, min := 2*i+1, 2*i+2, i
		if l < len(s) && s[l].less(s[min]) {
			min = l
		}
		if r < len(s) && s[r].less(s[min]) {
			min = r
		}
		if min == i {
			break
		}
		s[i], s[min] = s[min], s[i]
		i = min
	}
	*h = s
	return top
}

// mergeHeap applies merges with a linked list of symbols and a heap of candidate pairs;
// it produces the same result as mergeScan.
func (m *bpeModel) mergeHeap(ids []int32, dst []int32) []int32 {
	n := len(ids)
	next := make([]int32, n) // -1 at the end
	prev := make([]int32, n) // -1 at the start
	for i := range n {
		next[i] = int32(i + 1)
		prev[i] = int32(i - 1)
	}
	next[n-1] = -1
	h := make(candidateHeap, 0, n)
	push := func(pos int32) {
		nx := next[pos]
		if nx < 0 {
			return
		}
		if r := m.lookup(ids[pos], ids[nx]); r.rank != noMerge {
			h.push(candidate{rank: r.rank, pos: pos, left: ids[pos], right: ids[nx]})
		}
	}
	for i := range n - 1 {
		push(int32(i))
	}
	for len(h) > 0 {
		c := h.pop()
		nx := next[c.pos]
		if ids[c.pos] != c.left || nx < 0 || ids[nx] != c.right {
			continue // stale: one side was merged since
		}
		ids[c.pos] = m.lookup(c.left, c.right).id
		ids[nx] = -2 // dead
		next[c.pos] = next[nx]
		if next[nx] >= 0 {
			prev[next[nx]] = c.pos
		}
		if p := prev[c.pos]; p >= 0 {
			push(p)
		}
		push(c.pos)
	}
	for i := int32(0); i >= 0; i = next[i] {
		dst = m.emit(dst, ids[i])
	}
	return dst
}
