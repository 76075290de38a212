package kvcache

// blockState says which container, if any, holds a block.
type blockState uint8

const (
	stateFree       blockState = iota // refcount 0, no hash: in the free heap
	stateCachedFree                   // refcount 0, hashed: in the LRU list (still matchable)
	stateUsed                         // refcount > 0: in no free container
)

// noBlock marks an absent LRU link.
const noBlock int32 = -1

// blockMeta is the pool's bookkeeping for one block.
type blockMeta struct {
	ref        int32      // references held by requests and the connector
	state      blockState // which free container holds the block
	hashed     bool       // the block is registered in the prefix cache under hash
	hash       BlockHash  // valid when hashed
	ext        uint64     // the hash events carry (Event.External), valid when hashed
	gen        uint64     // bumped on every allocation; 0 = never allocated
	prev, next int32      // LRU links while state == stateCachedFree
}

// idHeap is a min-heap of free, uncached block ids. Allocating the lowest ids first keeps a
// request's blocks consecutive when the pool is not fragmented, which merges transfer descriptors.
type idHeap []int32

func (h *idHeap) push(id int32) {
	*h = append(*h, id)
	a := *h
	i := len(a) - 1
	for i > 0 {
		p := (i - 1) / 2
		if a[p] <= a[i] {
			break
		}
		a[p], a[i] = a[i], a[p]
		i = p
	}
}

func (h *idHeap) pop() int32 {
	a := *h
	top := a[0]
	last := len(a) - 1
	a[0] = a[last]
	a = a[:last]
	i := 0
	for {
		l := 2*i + 1
		if l >= len(a) {
			break
		}
		m := l
		if r := l + 1; r < len(a) && a[r] < a[l] {
			m = r
		}
		if a[i] <= a[m] {
			break
		}
		a[i], a[m] = a[m], a[i]
		i = m
	}
	*h = a
	return top
}

// lruList is an intrusive doubly linked list of cached free blocks through blockMeta.prev/next,
// least recently freed at the head.
type lruList struct {
	head, tail int32
	n          int
}

func newLRU() lruList { return lruList{head: noBlock, tail: noBlock} }

// pushBack appends id (least recently freed stays at the head).
func (l *lruList) pushBack(meta []blockMeta, id int32) {
	m := &meta[id]
	m.prev, m.next = l.tail, noBlock
	if l.tail != noBlock {
		meta[l.tail].next = id
	} else {
		l.head = id
	}
	l.tail = id
	l.n++
}

// remove unlinks id, which must be in the list.
func (l *lruList) remove(meta []blockMeta, id int32) {
	m := &meta[id]
	if m.prev != noBlock {
		meta[m.prev].next = m.next
	} else {
		l.head = m.next
	}
	if m.next != noBlock {
		meta[m.next].prev = m.prev
	} else {
		l.tail = m.prev
	}
	m.prev, m.next = noBlock, noBlock
	l.n--
}
