package tokenizer

import (
	"flag"
	"os"
	"slices"
	"strings"
	"testing"
)

// updateBuiltinMerges regenerates builtin_merges.txt from builtin_corpus.txt (`go generate`).
var updateBuiltinMerges = flag.Bool("update-builtin-merges", false, "rewrite builtin_merges.txt from builtin_corpus.txt")

// Training parameters of the built-in tokenizer.
const (
	builtinCorpusFile = "builtin_corpus.txt"
	builtinMergesFile = "builtin_merges.txt"
	builtinMaxMerges  = 32768 // more than any built-in model needs
	builtinMinCount   = 2     // a pair must occur at least twice to be merged
)

// trainHeapEntry is a pair with the count it had when pushed (entries go stale lazily).
type trainHeapEntry struct {
	count       int
	left, right int32
}

// before orders the max-heap: higher count first, then lower left id, then lower right id.
func (a trainHeapEntry) before(b trainHeapEntry) bool {
	if a.count != b.count {
		return a.count > b.count
	}
	if a.left != b.left {
		return a.left < b.left
	}
	return a.right < b.right
}

type trainHeap []trainHeapEntry

func (h *trainHeap) push(e trainHeapEntry) {
	*h = append(*h, e)
	s := *h
	for i := len(s) - 1; i > 0; {
		p := (i - 1) / 2
		if !s[i].before(s[p]) {
			break
		}
		s[i], s[p] = s[p], s[i]
		i = p
	}
}

func (h *trainHeap) pop() trainHeapEntry {
	s := *h
	top := s[0]
	s[0] = s[len(s)-1]
	s = s[:len(s)-1]
	for i := 0; ; {
		l, r, m := 2*i+1, 2*i+2, i
		if l < len(s) && s[l].before(s[m]) {
			m = l
		}
		if r < len(s) && s[r].before(s[m]) {
			m = r
		}
		if m == i {
			break
		}
		s[i], s[m] = s[m], s[i]
		i = m
	}
	*h = s
	return top
}

// trainBPE learns byte-level BPE merges from text pre-tokenized with the Qwen2 splitter: it
// repeatedly merges the most frequent adjacent pair (ties: lowest ids), reusing the id of an
// existing token with the same bytes, until maxMerges or no pair occurs minCount times. It
// returns merges in HF merges.txt form ("left right", byte-level spelling).
func trainBPE(text string, maxMerges, minCount int) []string {
	counts := map[string]int{}
	for _, p := range splitQwen(text, 1, nil) {
		counts[p]++
	}
	pieces := make([]string, 0, len(counts))
	for p := range counts {
		pieces = append(pieces, p)
	}
	slices.Sort(pieces)

	type word struct {
		ids   []int32
		count int
	}
	words := make([]word, len(pieces))
	tokBytes := make([][]byte, 256, 256+maxMerges)
	byBytes := map[string]int32{}
	for b := range 256 {
		tokBytes[b] = []byte{byte(b)}
		byBytes[string(tokBytes[b])] = int32(b)
	}
	pairCount := map[uint64]int{}
	where := map[uint64][]int32{}
	for wi, p := range pieces {
		ids := make([]int32, len(p))
		for i := range len(p) {
			ids[i] = int32(p[i])
		}
		words[wi] = word{ids: ids, count: counts[p]}
		for i := 0; i+1 < len(ids); i++ {
			k := pairKey(ids[i], ids[i+1])
			pairCount[k] += counts[p]
			where[k] = append(where[k], int32(wi))
		}
	}
	var h trainHeap
	for k, c := range pairCount {
		h.push(trainHeapEntry{count: c, left: int32(k >> 32), right: int32(uint32(k))})
	}

	bl := newByteLevel()
	var merges []string
	stamp := make([]int, len(words)) // last merge that visited each word
	for len(merges) < maxMerges && len(h) > 0 {
		e := h.pop()
		k := pairKey(e.left, e.right)
		if cur := pairCount[k]; cur != e.count {
			if cur > 0 {
				h.push(trainHeapEntry{count: cur, left: e.left, right: e.right})
			}
			continue
		}
		if e.count < minCount {
			break
		}
		nb := append(append([]byte(nil), tokBytes[e.left]...), tokBytes[e.right]...)
		nid, ok := byBytes[string(nb)]
		if !ok {
			nid = int32(len(tokBytes))
			tokBytes = append(tokBytes, nb)
			byBytes[string(nb)] = nid
		}
		merges = append(merges, bl.encode(tokBytes[e.left])+" "+bl.encode(tokBytes[e.right]))
		touched := map[uint64]bool{}
		for _, wi := range where[k] {
			if stamp[wi] == len(merges) {
				continue
			}
			stamp[wi] = len(merges)
			w := &words[wi]
			has := false
			for i := 0; i+1 < len(w.ids); i++ {
				if w.ids[i] == e.left && w.ids[i+1] == e.right {
					has = true
					break
				}
			}
			if !has {
				continue
			}
			for i := 0; i+1 < len(w.ids); i++ {
				pairCount[pairKey(w.ids[i], w.ids[i+1])] -= w.count
			}
			out := w.ids[:0]
			for i := 0; i < len(w.ids); i++ {
				if i+1 < len(w.ids) && w.ids[i] == e.left && w.ids[i+1] == e.right {
					out = append(out, nid)
					i++
					continue
				}
				out = append(out, w.ids[i])
			}
			w.ids = out
			for i := 0; i+1 < len(w.ids); i++ {
				pk := pairKey(w.ids[i], w.ids[i+1])
				pairCount[pk] += w.count
				if w.ids[i] == nid || w.ids[i+1] == nid {
					where[pk] = append(where[pk], int32(wi))
					touched[pk] = true
				}
			}
		}
		delete(pairCount, k)
		delete(where, k)
		for pk := range touched {
			if c := pairCount[pk]; c > 0 {
				h.push(trainHeapEntry{count: c, left: int32(pk >> 32), right: int32(uint32(pk))})
			}
		}
	}
	return merges
}

// TestBuiltinMergesUpToDate checks that builtin_merges.txt is what training on
// builtin_corpus.txt produces (and rewrites it with -update-builtin-merges).
func TestBuiltinMergesUpToDate(t *testing.T) {
	corpus, err := os.ReadFile(builtinCorpusFile)
	if err != nil {
		t.Fatal(err)
	}
	merges := trainBPE(string(corpus), builtinMaxMerges, builtinMinCount)
	want := strings.Join(merges, "\n") + "\n"
	if *updateBuiltinMerges {
		if err := os.WriteFile(builtinMergesFile, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %d merges to %s", len(merges), builtinMergesFile)
		return
	}
	if builtinMerges != want {
		t.Fatalf("%s is stale: run `go generate ./model/tokenizer` (training gives %d merges)", builtinMergesFile, len(merges))
	}
}
