package engine

import (
	"slices"
	"sort"
)

// Stops is a request's stop conditions compiled for the step loop: an Aho–Corasick automaton
// over its stop strings and the sorted set of its stop token ids. It is immutable once built, so
// the sequences of one request (n, best_of) share one instead of each holding its own copy; a
// sequence keeps only its automaton state. Building it takes time and memory proportional to
// the total bytes of the strings plus the number of ids.
type Stops struct {
	ids []int32 // stop token ids, sorted, without duplicates

	// The automaton: node 0 is the root; a node is a prefix of some stop string. edges[edgeAt[v]:
	// edgeAt[v+1]] are v's children sorted by byte (edgeByte); fail[v] is the node of the longest
	// proper suffix of v's string that is a node; match[v] the length of the longest stop string
	// that is a suffix of v's string (0: none); hold[v] the length of the longest suffix of v's
	// string that is a proper prefix of a stop string (a node with children).
	edgeAt   []int32
	edgeByte []byte
	edgeTo   []int32
	fail     []int32
	match    []int32
	hold     []int32
	maxLen   int // the longest stop string, in bytes
}

// NewStops compiles stop strings (empty ones are ignored) and stop token ids.
func NewStops(strs []string, ids []int32) *Stops {
	s := &Stops{ids: slices.Compact(slices.Sorted(slices.Values(ids)))}
	// The trie, built from the strings in sorted order so that every node's children appear in
	// byte order (kept as first-child / next-sibling lists while it is built).
	sorted := slices.Compact(slices.Sorted(slices.Values(strs)))
	var (
		depth, first, next, last []int32
		label                    []byte
		full                     []bool
	)
	newNode := func(d int32, b byte) int32 {
		depth, first, next, last = append(depth, d), append(first, -1), append(next, -1), append(last, -1)
		label, full = append(label, b), append(full, false)
		return int32(len(depth) - 1)
	}
	newNode(0, 0)
	path := []int32{0} // the nodes of the previous string, by depth
	prev := ""
	for _, str := range sorted {
		if str == "" {
			continue
		}
		s.maxLen = max(s.maxLen, len(str))
		common := 0
		for common < min(len(prev), len(str)) && prev[common] == str[common] {
			common++
		}
		path = path[:common+1]
		for i := common; i < len(str); i++ {
			parent := path[i]
			c := newNode(int32(i+1), str[i])
			if last[parent] < 0 {
				first[parent] = c
			} else {
				next[last[parent]] = c
			}
			last[parent] = c
			path = append(path, c)
		}
		full[path[len(str)]] = true
		prev = str
	}
	// Renumber in breadth-first order (a node's fail target comes before it) and lay the edges
	// out in one array.
	n := len(depth)
	order := make([]int32, 1, n)
	id := make([]int32, n)
	for k := 0; k < len(order); k++ {
		for c := first[order[k]]; c >= 0; c = next[c] {
			id[c] = int32(len(order))
			order = append(order, c)
		}
	}
	s.edgeAt = make([]int32, n+1)
	s.edgeByte = make([]byte, 0, n-1)
	s.edgeTo = make([]int32, 0, n-1)
	s.fail = make([]int32, n)
	s.match = make([]int32, n)
	s.hold = make([]int32, n)
	for k, v := range order {
		s.edgeAt[k] = int32(len(s.edgeTo))
		for c := first[v]; c >= 0; c = next[c] {
			s.edgeByte = append(s.edgeByte, label[c])
			s.edgeTo = append(s.edgeTo, id[c])
		}
	}
	s.edgeAt[n] = int32(len(s.edgeTo))
	// Fail links, breadth first: a child's fail is where its parent's fail goes on the same byte.
	for k, v := range order {
		switch {
		case full[v]:
			s.match[k] = depth[v]
		case k > 0:
			s.match[k] = s.match[s.fail[k]]
		}
		switch {
		case first[v] >= 0:
			s.hold[k] = depth[v]
		case k > 0:
			s.hold[k] = s.hold[s.fail[k]]
		}
		if k == 0 {
			continue // the root's children fail to the root
		}
		for e := s.edgeAt[k]; e < s.edgeAt[k+1]; e++ {
			s.fail[s.edgeTo[e]] = s.step(s.fail[k], s.edgeByte[e])
		}
	}
	return s
}

// child returns v's child on byte b, or −1.
func (s *Stops) child(v int32, b byte) int32 {
	lo, hi := int(s.edgeAt[v]), int(s.edgeAt[v+1])
	i := lo + sort.Search(hi-lo, func(i int) bool { return s.edgeByte[lo+i] >= b })
	if i < hi && s.edgeByte[i] == b {
		return s.edgeTo[i]
	}
	return -1
}

// step returns the state after reading byte b in state v. Over a text it costs amortized O(1)
// per byte: every fail link taken shortens the matched suffix, which grows by one byte at most.
func (s *Stops) step(v int32, b byte) int32 {
	for {
		if c := s.child(v, b); c >= 0 {
			return c
		}
		if v == 0 {
			return 0
		}
		v = s.fail[v]
	}
}

// hasStrings reports whether there is any stop string.
func (s *Stops) hasStrings() bool { return s != nil && s.maxLen > 0 }

// isStopID reports whether id is a stop token id.
func (s *Stops) isStopID(id int32) bool {
	if s == nil {
		return false
	}
	_, ok := slices.BinarySearch(s.ids, id)
	return ok
}
